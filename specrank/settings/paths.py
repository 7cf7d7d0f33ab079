"""Project paths: every relative path in a config resolves against the project root.

One definition, so a command gives the same result from any working directory.
"""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = PROJECT_ROOT / "conf"  # Hydra's config folder (entry points name it relatively)


def project_path(path: str | Path) -> Path:
    """`path` itself when absolute, else `PROJECT_ROOT / path` (not the shell's cwd)."""
    p = Path(path)
    return p if p.is_absolute() else PROJECT_ROOT / p

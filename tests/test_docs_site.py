"""The docs site: it builds without a warning, its settings reference equals the schema,
and its Python examples compile against names that exist.

Command lines of the docs pages are run by tests/test_readme_commands.py (`DOCS`).
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specrank.settings import settings_doc

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# Sections whose every field carries its meaning in the schema's metadata
# (specrank.settings.fields.setting), checked section by section.
DESCRIBED = (
    "paths", "mlflow", "trace", "run", "features", "head", "model", "data", "parallel",
    "pocket", "pocket_eagle3", "pocket_block", "rerank", "transfer", "synth", "synth_job",
    "pool", "select", "decode", "pocket_dspark", "pocket_domino",
)  # fmt: skip


def test_the_settings_page_equals_the_schema():
    assert settings_doc.PAGE.read_text() == settings_doc.reference(), (
        "docs/settings.md is stale: run `python -m specrank.settings.settings_doc --write`"
    )


def test_the_settings_page_lists_every_setting_with_its_readers():
    text = settings_doc.reference()
    for name in ("select.budget", "rerank.booster.kind", "run.rule", "seed", "paths.traces"):
        assert f"| `{name}` |" in text
    assert "Read by: `decode.record`, `decode.run`, `decode.synth_traces`." in text  # pool


@pytest.mark.parametrize("section", DESCRIBED)
def test_described_sections_carry_a_meaning_per_setting(section):
    rows = [r for r in settings_doc.reference().splitlines() if r.startswith(f"| `{section}.")]
    assert rows and all(not r.endswith("| — |") for r in rows), rows


def test_every_setting_carries_a_meaning():
    """Sections beyond DESCRIBED included: a new section or field brings its meaning."""
    text = settings_doc.reference()
    assert not [r for r in text.splitlines() if r.startswith("| `") and r.endswith("| — |")]


def test_the_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is not installed: `pip install -e '.[dev]'`"
    done = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)},
    )  # fmt: skip
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "WARNING" not in log, log[-3000:]
    assert (tmp_path / "site" / "method" / "index.html").is_file()


def test_the_changelog_has_one_source():
    """CHANGELOG.md at the root is the changelog; the site's page is a link to it, not a copy."""
    page, source = DOCS / "changelog.md", ROOT / "CHANGELOG.md"
    assert page.is_symlink() and page.resolve() == source.resolve()
    lines = source.read_text().splitlines()
    assert len(lines) < 80 and lines[0] == "# Changelog"
    headings = {line for line in lines if line.startswith("## ")}
    others = [p for p in DOCS.rglob("*.md") if not p.is_symlink()]
    assert headings and not [p for p in others if headings & set(p.read_text().splitlines())]


def _python_blocks() -> list[tuple[str, str]]:
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M):
            found.append((str(page.relative_to(ROOT)), block))
    return found


@pytest.mark.parametrize(("page", "block"), _python_blocks())
def test_python_examples_compile_and_name_real_objects(page, block):
    tree = ast.parse(block, filename=page)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{page}: {node.module}.{alias.name}"

"""specrank.runtime.jit: a cached kernel recompiles when a kernel or constant of another file it was
compiled from changes; numba's own cache=True keeps the old machine code (shown alongside,
so the test would fail if the two did not differ)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from specrank.settings.paths import PROJECT_ROOT

CALLEE = """\
{decorator_import}
STEP = {step}

@{decorator}(inline="always")
def bump(x):
    return x + {inc}
"""
CALLER = """\
{decorator_import}
import callee
from callee import STEP, bump

@{decorator}(nogil=True)
def caller(x):
    return bump(x) + STEP

@{decorator}()
def through_module(x):
    return callee.bump(x)
"""
OURS = {"decorator_import": "from specrank.runtime.jit import njit", "decorator": "njit"}
NUMBAS = {"decorator_import": "import numba\n\ndef njit(**o):\n    return numba.njit(cache=True, **o)",
          "decorator": "njit"}  # fmt: skip


def _write(folder: Path, decorator: dict[str, str], step: int, inc: int) -> None:
    (folder / "callee.py").write_text(CALLEE.format(**decorator, step=step, inc=inc))
    (folder / "caller.py").write_text(CALLER.format(**decorator))


def _run(folder: Path) -> tuple[int, int]:
    """caller(1) and through_module(1) in a fresh process, and how many overloads it loaded
    from the cache (numba's per-dispatcher hit counters)."""
    code = ("import caller; print(caller.caller(1), caller.through_module(1), "
            "sum(caller.caller.stats.cache_hits.values()))")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{PROJECT_ROOT}",
           "NUMBA_CACHE_DIR": str(folder / "numba_cache")}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, check=True,
                         capture_output=True, text=True).stdout.split()  # fmt: skip
    value, via_module, hits = (int(v) for v in out)
    return value * 1000 + via_module, hits


@pytest.mark.parametrize("decorator", [OURS, NUMBAS], ids=["specrank.runtime.jit", "numba"])
def test_a_kernel_recompiles_when_what_it_inlined_changes(tmp_path: Path, decorator) -> None:
    _write(tmp_path, decorator, step=10, inc=1)
    assert _run(tmp_path) == (12002, 0)  # compiled: bump(1) + STEP = 12, bump(1) = 2
    assert _run(tmp_path) == (12002, 1)  # loaded from the cache, so caching is on
    _write(tmp_path, decorator, step=10, inc=2)  # only the callee's file changes
    first, _ = _run(tmp_path)
    _write(tmp_path, decorator, step=20, inc=2)  # only a constant of the callee's file
    second, _ = _run(tmp_path)
    if decorator is OURS:
        assert (first, second) == (13003, 23003)
    else:  # numba's own key: the stale values, the hazard specrank.runtime.jit removes
        assert (first, second) == (12002, 12002)


def test_every_cached_kernel_of_the_project_goes_through_specrank_jit() -> None:
    """calibrate may not import specrank (its layer is independent); its kernels read nothing
    of another file, so numba's own key is the whole of their source."""
    offenders = []
    config = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())
    packages = config["tool"]["importlinter"]["root_packages"]
    assert {"selection", "features", "rerank", "calibrate"} <= set(packages)
    for path in sorted(p for d in packages if d != "calibrate"
                       for p in (PROJECT_ROOT / d).rglob("*.py")):  # fmt: skip
        if re.search(r"^\s*@\S*njit\([^)]*cache=True", path.read_text(), re.MULTILINE):
            offenders.append(str(path.relative_to(PROJECT_ROOT)))
    assert offenders == []

"""The old entry-point names (`specrank.settings.renames`): `python -m decode.pocket[.eagle3|.block|
.dspark|.domino]` and `python -m decode.synth` print their new name on stderr, then run the
new command with the same arguments (its config, its refusals and its exit status)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from specrank.settings.cli import ROUTED_ENV
from specrank.settings.renames import NEW_NAMES, notice

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k != ROUTED_ENV}


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_every_old_name_is_a_module_that_runs_its_new_one() -> None:
    for old, new in NEW_NAMES.items():
        spec = importlib.util.find_spec(old)
        assert spec is not None and importlib.util.find_spec(new) is not None, old
        path = Path(spec.origin)
        main = path.with_name("__main__.py") if path.name == "__init__.py" else path
        assert f'run_renamed("{old}")' in main.read_text(), main


def test_an_old_name_prints_the_notice_then_runs_the_new_command() -> None:
    done = _run("decode.synth", "debug=default", "--cfg", "job")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[0] == (
        "python -m decode.synth is now python -m decode.synth_traces; the old name will be removed"
    )
    assert notice("decode.synth") in done.stderr
    assert "synth_job:" in done.stdout  # the job's config, printed by --cfg job


def test_an_old_sub_command_passes_its_arguments_and_exit_status_on() -> None:
    done = _run("decode.pocket.dspark", "select.budget=3", "--cfg", "job")
    assert done.returncode == 2, done.stderr
    assert notice("decode.pocket.dspark") in done.stderr
    assert "python -m decode.train_pocket.dspark does not read the 'select' section" in done.stderr

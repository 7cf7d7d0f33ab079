"""A README command typed with another `python` runs in the project's .venv, or fails saying
what is missing and how to get it (specrank.runtime.interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specrank.runtime import interpreter
from specrank.settings.paths import PROJECT_ROOT


def test_the_module_command_is_what_follows_the_interpreter_s_options():
    argv = ["python", "-S", "-X", "dev", "-m", "decode.record", "--cfg", "job"]
    assert interpreter.module_command(argv) == ["-m", "decode.record", "--cfg", "job"]
    assert interpreter.module_command(["python", "-m", "decode.record", "-m", "seed=1"]) == [
        "-m",
        "decode.record",
        "-m",
        "seed=1",
    ]  # Hydra's own -m (a sweep) stays the module's argument
    assert interpreter.module_command(["python", "script.py", "-m", "x"]) is None
    assert interpreter.module_command(["python", "-m"]) is None
    assert interpreter.module_command(["python", "-c", "import decode"]) is None


@pytest.mark.skipif(
    Path(sys.prefix).resolve() != interpreter.VENV.resolve(),
    reason="the tests run outside the project's .venv",
)
def test_an_interpreter_without_the_dependencies_reruns_the_command_in_the_venv():
    # -S: no site-packages, so this interpreter lacks every dependency, as a bare python does
    proc = subprocess.run(
        [sys.executable, "-S", "-m", "decode.record", "--cfg", "job"],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "lacks hydra" in proc.stderr and str(interpreter.VENV / "bin" / "python") in proc.stderr
    assert "select:" in proc.stdout  # decode.record's composed config


def test_without_a_venv_the_import_fails_naming_the_modules_and_the_remedy(monkeypatch, tmp_path):
    monkeypatch.setattr(interpreter, "missing_modules", lambda: ["hydra"])
    with pytest.raises(ImportError, match=r"lacks hydra\. Run `make setup`"):
        interpreter.use_project_interpreter(tmp_path / "no-venv")
    monkeypatch.setattr(interpreter, "missing_modules", lambda: [])
    assert interpreter.use_project_interpreter(tmp_path / "no-venv") is None

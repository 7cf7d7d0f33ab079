"""A refused setting or input (`specrank.settings.errors.Refusal`) ends a command with `error:
<message>` and status 2, no stack trace; any other exception keeps its trace."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from specrank.runtime.faults import FAULTS_ENV
from specrank.settings.checks import check_choice
from specrank.settings.cli import REFUSED, exits_on_refusal, run_entry_point
from specrank.settings.errors import Refusal


def _run(tmp_path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv, f"hydra.run.dir={tmp_path}/h"],
                          cwd=tmp_path, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_a_refusal_is_a_value_error_with_its_message():
    with pytest.raises(Refusal, match=r"The 'rerank.halves' must be one of \['a'\]"):
        check_choice("rerank.halves", "bogus", ["a"])
    assert issubclass(Refusal, ValueError)  # callers that catch a bad value keep working


def test_the_task_wrapper_exits_2_on_a_refusal_and_lets_a_fault_through(capsys):
    @exits_on_refusal
    def refuses(cfg: object) -> None:
        raise Refusal(f"The 'x' must be 1. Got {cfg!r} instead.")

    @exits_on_refusal
    def faults(cfg: object) -> None:
        raise RuntimeError("a fault in the code")

    with pytest.raises(SystemExit) as exited:
        refuses(2)
    assert exited.value.code == REFUSED == 2
    assert capsys.readouterr().err == "error: The 'x' must be 1. Got 2 instead.\n"
    with pytest.raises(RuntimeError, match="a fault in the code"):
        faults(2)
    assert refuses.__name__ == "refuses"  # Hydra names the job after the task function


def test_run_entry_point_exits_2_on_its_own_refusals_and_mains(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["rerank.train", "rerank.budgest=[8]"])
    with pytest.raises(SystemExit) as exited:
        run_entry_point(lambda: None, stage="rerank.train")
    assert exited.value.code == 2
    assert "error: Key 'budgest' is not in 'rerank'" in capsys.readouterr().err

    def main() -> None:
        raise Refusal("refused")

    monkeypatch.setattr(sys, "argv", ["rerank.train"])
    with pytest.raises(SystemExit) as exited:
        run_entry_point(main, stage="rerank.train")
    assert (exited.value.code, capsys.readouterr().err) == (2, "error: refused\n")


def test_a_bad_setting_exits_2_with_its_message_and_no_trace(tmp_path):
    done = _run(tmp_path, "rerank.train", "rerank.halves=bogus", f"paths.traces={tmp_path}/t",
                f"paths.features={tmp_path}/f", f"mlflow.tracking_uri=sqlite:///{tmp_path}/m.db")  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "error: The 'rerank.halves' must be one of ['even_odd', 'seeded']" in done.stderr
    assert "Traceback" not in done.stderr and "HYDRA_FULL_ERROR" not in done.stderr


def test_a_fault_keeps_its_trace_and_hydras_status(tmp_path):
    """A full disk while a shard is written (injected): not the user's setting, so a trace."""
    done = _run(tmp_path, "decode.synth_traces", "debug=default", f"paths.synthetic={tmp_path}/s",
                env={FAULTS_ENV: "shard_write@1=enospc"})  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" in done.stderr and "No space left on device (injected)" in done.stderr
    assert "error: " not in done.stderr


def test_every_hydra_entry_point_turns_refusals_into_messages() -> None:
    """Each `@hydra.main` task function is wrapped by `exits_on_refusal` (Hydra would print a
    refusal's stack otherwise)."""
    import re

    from specrank.settings.paths import PROJECT_ROOT

    bare = []
    for path in PROJECT_ROOT.glob("*/**/*.py"):
        if ".venv" in path.parts or "tests" in path.parts:
            continue
        text = path.read_text()
        for m in re.finditer(r"@hydra\.main\([^\n]*\)\n(?!@exits_on_refusal\n)", text):
            bare.append(f"{path.relative_to(PROJECT_ROOT)}:{text[: m.start()].count(chr(10)) + 1}")
    assert not bare, f"@hydra.main without @exits_on_refusal: {bare}"


def test_modules_refuse_a_bad_setting_or_file_by_name(tmp_path, monkeypatch):
    """A handful of refusals from different layers: each a `Refusal` naming its setting or
    file (so the entry points print it without a trace), not a bare ValueError or OSError."""
    from decode.compare import rule_specs
    from decode.predicted import offline_values
    from pairs.config import PromptSource
    from pairs.prompts import load_source
    from rerank.fit.folds import prompt_subsample
    from rerank.fit.halves import prompt_halves
    from rerank.serving import reranker_folder, unseen_prompts
    from specrank.runtime import faults
    from tree.config import PoolConfig
    from tree.pool import check_pool_config

    refused = [
        (lambda: load_source(PromptSource(kind="csv", path="p.csv")), r"data source 'kind'"),
        (lambda: load_source(PromptSource(kind="jsonl", path=str(tmp_path / "none.jsonl"))),
         r"'jsonl' 'path' must name a prompt file.*no such file"),
        (lambda: check_pool_config(PoolConfig(top_k=0)), r"'pool.top_k' must be an int >= 1"),
        (lambda: rule_specs(["draft", "bogus"], "draft", None), r"'run.rules\[1\]' must be one"),
        (lambda: rule_specs(["draft", "draft"], "draft", None), r"'run.rules' must not repeat"),
        (lambda: offline_values(str(tmp_path / "none"), "unused"), r"run.offline: no such file"),
        (lambda: reranker_folder(str(tmp_path / "none"), "unused", "transfer.rerankers"),
         r"transfer.rerankers: no such folder"),
        (lambda: unseen_prompts(None, [], "bogus"), r"'run.seen_prompts' must be one of"),
        (lambda: prompt_subsample(np.array(["a-1", "b-2"]), 1.5), r"'rerank.train_share'"),
        (lambda: prompt_halves(np.array(["a", "b-2"]), "even_odd"),
         r"'rerank.halves' scheme 'even_odd' needs prompt ids ending in an integer"),
    ]  # fmt: skip
    for call, message in refused:
        with pytest.raises(Refusal, match=message):
            call()
    faults._hits.clear()
    monkeypatch.setenv(FAULTS_ENV, "shard_write@0=kill")
    with pytest.raises(Refusal, match=rf"{FAULTS_ENV}: expected entries 'point@n=action'"):
        faults.point("shard_write")
    faults._hits.clear()

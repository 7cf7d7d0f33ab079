"""Decode one prompt the way `decode.record` does (rule=draft, pool scoring), for the decoder tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel

from decode.loop import decode_prompt
from decode.recording import recording_settings
from decode.stream import DecodeSettings


@dataclass
class Recorded:
    output: list[int]  # emitted tokens
    rounds: list[dict]  # trace rows (TRACE_SCHEMA); empty unless recording
    accepted: list[int]  # accepted draft tokens per round


def decode_recorded(
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    prompt: list[int],
    s: DecodeSettings,
    eos_ids: frozenset[int],
    prompt_id: str = "0",
    task: str = "",
    record: bool = False,
) -> Recorded:
    run = decode_prompt(
        target, drafter, prompt, recording_settings(s, record), eos_ids, prompt_id, task
    )
    rows = [r.fields for r in run.rounds if r.fields is not None]
    return Recorded(run.output, rows, [r.n_accepted for r in run.rounds])


def greedy_acceptance(pair, texts: list[str], s: DecodeSettings) -> tuple[int, int]:
    """(accepted drafts, rounds) over `texts` decoded greedily by `pair` (a ModelPair), each
    output checked equal to plain greedy decoding of the target."""
    from decode.baseline import autoregressive_decode
    from pairs.prompts import encode_prompt

    accepted = rounds = 0
    for text in texts:
        prompt = encode_prompt(pair.tokenizer, text)
        res = decode_recorded(pair.target, pair.drafter, prompt, s, frozenset())
        assert res.output == autoregressive_decode(pair.target, prompt, len(res.output))
        accepted, rounds = accepted + sum(res.accepted), rounds + len(res.accepted)
    return accepted, rounds


def make_run_stages(model: str, tmp_path: Path) -> None:
    """`make run RUN_ARGS="model=<model> debug=default ..."` stage by stage (record both laws on
    the default suite's first 6 + 6 prompts, extract, train), each stage as `make run` starts
    it: RUN_ARGS routed (`SPECRANK_ROUTED=1`), so a stage drops the sections others read."""
    import os
    import subprocess
    import sys

    from specrank.settings.cli import ROUTED_ENV
    from specrank.settings.paths import PROJECT_ROOT

    args = [f"model={model}", "debug=default", f"paths.traces={tmp_path}/t",
            f"paths.features={tmp_path}/f", f"hydra.run.dir={tmp_path}/h",
            f"hydra.sweep.dir={tmp_path}/m", f"mlflow.tracking_uri=sqlite:///{tmp_path}/ml.db"]  # fmt: skip
    record = ["decode.record", "-m", "data.sources.0.limit=6", "data.sources.1.limit=6"]
    for stage in (record, ["features.extract"], ["rerank.train"]):
        res = subprocess.run([sys.executable, "-m", *stage, *args], cwd=PROJECT_ROOT,
                             capture_output=True, text=True, timeout=1500,
                             env={**os.environ, ROUTED_ENV: "1"})  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]

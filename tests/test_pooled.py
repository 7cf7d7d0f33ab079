"""`data.prompt_chunks` and `python -m decode.pooled`: a run decoded in prompt chunks, pooled, reports
what the whole run reports (tau exactly, under greedy decoding), and bad chunks are refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from decode.config import RunConfig
from decode.pooled import main as pooled_main
from decode.pooled import pooled_report, read_chunks
from decode.run import run_online
from pairs.config import DataConfig, PromptSource
from pairs.prompts import chunk_prompts, load_prompts
from specrank.settings.config import MlflowConfig
from specrank.settings.errors import Refusal
from tests.online_fixtures import PROMPTS, settings
from tests.tiny_models import one_thread, tiny_model_config


def _data(tmp_path: Path, chunks: int = 1, chunk: int = 0) -> DataConfig:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": p.id, "task": p.task, "prompt": p.text}) + "\n"
                            for p in PROMPTS[:4]))  # fmt: skip
    return DataConfig(name="tiny", sources=[PromptSource(kind="jsonl", path=str(path))],
                      prompt_chunks=chunks, prompt_chunk=chunk)  # fmt: skip


def test_chunks_split_the_prompts_in_turn_and_bad_ones_are_refused(tmp_path):
    every = [p.id for p in load_prompts(_data(tmp_path))]
    parts = [[p.id for p in load_prompts(_data(tmp_path, 3, i))] for i in range(3)]
    assert parts == [every[0::3], every[1::3], every[2::3]]
    for chunks, chunk in ((2, 2), (0, 0), (2, -1)):
        with pytest.raises(Refusal, match=r"data\.prompt_chunk"):
            chunk_prompts(_data(tmp_path, chunks, chunk), [])


def _decode(tmp_path: Path, folder: Path, data: DataConfig, run: RunConfig) -> None:
    """One decode.run into `folder`, its resolved config where Hydra would write it."""
    model_cfg = tiny_model_config(tmp_path / "models", "llama")
    tracking = MlflowConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="t")
    config = {"run": dataclasses.asdict(run), "data": dataclasses.asdict(data), "seed": 0,
              "decode": {"temperature": 0.0}, "mlflow": dataclasses.asdict(tracking)}  # fmt: skip
    with one_thread():
        run_online(model_cfg, data, settings("draft", max_new_tokens=12), run, tracking, config,
                   folder)  # fmt: skip
    (folder / ".hydra").mkdir(parents=True, exist_ok=True)
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))


def test_pooled_chunks_give_the_whole_runs_tau_and_refuse_mismatches(tmp_path, capsys):
    run = RunConfig(rules=["draft", "draft@-2"], warmup_prompts=0, bootstrap_resamples=200,
                    progress=False)  # fmt: skip
    _decode(tmp_path, tmp_path / "whole", _data(tmp_path), run)
    chunks = [tmp_path / f"chunk{i}" for i in range(2)]
    for i, folder in enumerate(chunks):
        _decode(tmp_path, folder, _data(tmp_path, 2, i), run)
    prompts, rounds, _ = read_chunks(chunks)
    groups, ratios, _ = pooled_report(prompts, rounds, 200, 0)
    whole = json.loads((tmp_path / "whole" / "online_summary.json").read_text())
    # greedy decoding: every prompt's rounds are the same in a chunk as in the whole run
    assert ratios["prompts"].tolist() == [4, 4]
    assert ratios.set_index("rule")["tau"].to_dict() == pytest.approx(
        {"draft": whole["online/draft/tau"], "draft_minus2": whole["online/draft_minus2/tau"]}
    )
    every = groups[groups["group"] == "all"]
    assert (every["speedup_lo"] <= every["speedup"]).all()
    pooled_main([*map(str, chunks), "--out", str(tmp_path / "pooled")])
    assert "pooled 2 chunks, 4 prompts" in capsys.readouterr().out
    assert (tmp_path / "pooled" / "pooled_compare.csv").is_file()
    with pytest.raises(Refusal, match="more than one chunk"):
        read_chunks([chunks[0], chunks[0]])
    other = dataclasses.replace(run, bootstrap_resamples=300)
    _decode(tmp_path, tmp_path / "other", _data(tmp_path, 2, 1), other)
    with pytest.raises(Refusal, match=r"other settings .*'run'"):
        read_chunks([chunks[0], tmp_path / "other"])
    (chunks[1] / "online_prompts.csv").unlink()
    with pytest.raises(Refusal, match="not finished"):
        read_chunks(chunks)


def test_a_chunk_decoded_before_the_renames_pools_with_one_after(tmp_path):
    """Old setting names (`data.chunk`, `run.top_m`) compare under the new ones, and a section
    decode.run does not read (a model recipe's) may differ; a setting it reads may not."""
    run = RunConfig(rules=["draft"], warmup_prompts=0, bootstrap_resamples=200, progress=False)
    chunks = [tmp_path / f"chunk{i}" for i in range(2)]
    for i, folder in enumerate(chunks):
        _decode(tmp_path, folder, _data(tmp_path, 2, i), run)
    path = chunks[0] / ".hydra" / "config.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["data"]["chunks"] = cfg["data"].pop("prompt_chunks")
    cfg["data"]["chunk"] = cfg["data"].pop("prompt_chunk")
    cfg["run"]["top_m"] = cfg["run"].pop("score_top_m")
    cfg["pocket_recipe_of_then"] = {"steps": 1}
    path.write_text(yaml.safe_dump(cfg))
    prompts, _, _ = read_chunks(chunks)
    assert prompts["chunk"].nunique() == 2
    cfg["run"]["top_m"] += 1
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(Refusal, match=r"other settings .*'run'"):
        read_chunks(chunks)


def test_a_chunk_decoded_before_a_setting_at_its_old_behaviour_pools_with_one_after(tmp_path):
    """`model.drafter_window: null` (added later; null is the behaviour from before) reads as
    absent; set otherwise, it differs."""
    run = RunConfig(rules=["draft"], warmup_prompts=0, bootstrap_resamples=200, progress=False)
    chunks = [tmp_path / f"chunk{i}" for i in range(2)]
    for i, folder in enumerate(chunks):
        _decode(tmp_path, folder, _data(tmp_path, 2, i), run)
    for folder in chunks:  # the model section as Hydra writes it
        path = folder / ".hydra" / "config.yaml"
        cfg = yaml.safe_load(path.read_text())
        cfg["model"] = dataclasses.asdict(tiny_model_config(tmp_path / "models", "llama"))
        path.write_text(yaml.safe_dump(cfg))
    assert cfg["model"]["drafter_window"] is None
    del cfg["model"]["drafter_window"]  # chunk 1 decoded before the setting existed
    path.write_text(yaml.safe_dump(cfg))
    prompts, _, _ = read_chunks(chunks)
    assert prompts["chunk"].nunique() == 2
    cfg["model"]["drafter_window"] = 120
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(Refusal, match=r"other settings .*'model'"):
        read_chunks(chunks)

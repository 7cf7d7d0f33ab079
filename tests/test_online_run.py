"""`python -m decode.run`: config, short overrides, the whole run on tiny models, MLflow, traces."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import specrank.settings.config  # noqa: F401  (registers the schema)
from decode.config import RunConfig
from decode.run import expand_run_overrides, run_online
from decode.settings import OnlineSettings
from features.extract import extract
from pairs.config import DataConfig, PromptSource
from specrank.settings.config import MlflowConfig
from specrank.store.tables import SchemaError
from specrank.store.trace_schema import trace_store
from tests.online_fixtures import PROMPTS, fitted_reranker, settings
from tests.tiny_models import one_thread, tiny_model_config, tiny_pair

ROOT = Path(__file__).resolve().parents[1]


def _data(tmp_path: Path, n: int = 4) -> DataConfig:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": p.id, "task": p.task, "prompt": p.text}) + "\n" for p in PROMPTS[:n]
        )
    )
    return DataConfig(name="tiny", sources=[PromptSource(kind="jsonl", path=str(path))])


def test_short_overrides_and_config(tmp_path):
    argv = [
        "rule=reranker",
        "reranker=runs:/abc/rerankers/x=y",
        "select.budget=8",
        "run.score=record",
    ]
    assert expand_run_overrides(argv) == [
        "run.rule=reranker", "run.reranker=runs:/abc/rerankers/x=y", "select.budget=8", "run.score=record",
    ]  # fmt: skip
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("run", overrides=[*expand_run_overrides(["rule=root_draw"]), "debug=default"])
    GlobalHydra.instance().clear()
    run = OmegaConf.to_object(cfg.run)
    assert isinstance(run, RunConfig) and run.rule == "root_draw" and run.warmup_prompts == 0
    assert OmegaConf.to_container(cfg.run, resolve=True)["traces_out"].endswith(
        "online_traces/root_draw"
    )


def test_whole_run_logs_metrics_values_and_traces(tmp_path):
    model_cfg = tiny_model_config(tmp_path / "models", "llama")
    with one_thread():
        saved = fitted_reranker(tmp_path / "rr", tiny_pair(tmp_path / "models", "llama"), 0.0)
    tracking = MlflowConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="online")
    # The reranker comes from MLflow, logged the way rerank.train logs its models.
    client = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri)  # no global MLflow state
    exp = client.create_experiment("train", artifact_location=(tmp_path / "artifacts").as_uri())
    train_run = client.create_run(exp).info.run_id
    client.log_artifacts(train_run, str(saved), f"rerankers/{saved.name}")
    client.set_terminated(train_run)
    uri = f"runs:/{train_run}/rerankers/{saved.name}"
    # The tiny suite has only these prompts, and the reranker was fitted on them: in-sample
    # on purpose here (run.seen_prompts=refuse, the default, would fail).
    run = RunConfig(rule="reranker", reranker=uri, score="record", record_traces=True,
                    traces_out=str(tmp_path / "traces"), warmup_prompts=1, bootstrap_resamples=200,
                    progress=False, seen_prompts="allow")  # fmt: skip
    s = settings("reranker", score="record", record=True, max_new_tokens=16)
    config = {"run": dataclasses.asdict(run), "note": "test"}
    with one_thread():
        report = run_online(model_cfg, _data(tmp_path), s, run, tracking, config, tmp_path / "out")
    m = report.metrics
    assert m["online/prompts"] == 4 and m["online/rounds"] == len(report.rounds)
    assert m["online/tau"] == pytest.approx(1 + report.rounds["accepted"].mean())
    # run.score=record scores more than the tree: the logged cost of the policy
    assert m["online/scored_prefixes"] == pytest.approx(report.rounds["scored"].mean())
    assert m["online/scored_prefixes"] > m["online/tree_size"]
    assert m["online/speedup_lo"] <= m["online/speedup"] <= m["online/speedup_hi"]
    assert m["online/greedy_output_matches_baseline"] == 1.0
    assert {"online/task/coding/tau", "online/task/writing/tau"} <= set(m)
    assert {"online/entropy/low/tau", "online/entropy/high/tau"} <= set(m)
    assert m["online/ms_per_round/features"] > 0 and 0 < m["online/features_share_of_round"] < 1
    # realized beside the offline expected value, named as rerank.train names it
    assert m["accepted/greedy/B6/reranker_rows_lgbm"] == m["realized/greedy/B6/reranker_rows_lgbm"]
    assert m["online/realized_minus_expected"] == 0.0 and m["online/rounds_equal"] == 1.0
    run_data = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri).get_run(report.run_id).data
    assert run_data.metrics["online/tau"] == m["online/tau"]
    # run.predictor=auto on a CPU: the compiled forest walk (rerank.forest.jit)
    assert run_data.tags["rule"] == "reranker_rows_lgbm"
    assert run_data.tags["predictor"] == "compiled"
    assert run_data.tags["reranker"] == uri
    assert (tmp_path / "out" / "online_groups.csv").exists()
    # the traces are a store features.extract reads
    assert sum(1 for _ in trace_store(tmp_path / "traces").done_shards()) == 1
    rep = extract(tmp_path / "traces", tmp_path / "features", log=lambda _: None)
    assert rep.rounds == len(report.rounds)


def test_root_draw_run_without_mlflow(tmp_path):
    model_cfg = tiny_model_config(tmp_path / "models", "llama")
    run = RunConfig(rule="root_draw", warmup_prompts=0, bootstrap_resamples=50, progress=False)
    s = OnlineSettings(settings("root_draw", 1.0, max_new_tokens=12).base, "root_draw")
    with one_thread():
        report = run_online(model_cfg, _data(tmp_path, 2), s, run, None, {}, tmp_path / "o")
    assert report.run_id is None and not report.values
    assert report.metrics["online/accepted"] >= 1.0  # the draw always counts
    assert report.metrics["online/ms_per_round/root_pass"] > 0


@pytest.mark.slow
def test_cli(tmp_path):
    model_cfg = tiny_model_config(tmp_path / "models", "llama")
    data = _data(tmp_path, 2)
    cmd = [
        sys.executable, "-m", "decode.run", "rule=root", "debug=default",
        f"model.target={model_cfg.target}", f"model.drafter={model_cfg.drafter}",
        "data.name=tiny", f"data.sources=[{{kind: jsonl, path: '{data.sources[0].path}'}}]",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'm.db'}", f"hydra.run.dir={tmp_path / 'h'}",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=250)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "speedup" in out.stdout and "MLflow run" in out.stdout


def test_recorded_online_run_resumes_into_its_store(tmp_path):
    """decode.run writes traces through the one shard loop: a rerun keeps finished shards,
    and a store of another config is refused by name."""
    model_cfg = tiny_model_config(tmp_path / "models", "llama")
    out = tmp_path / "traces"
    run = RunConfig(rule="draft", score="record", record_traces=True, traces_out=str(out),
                    warmup_prompts=0, baseline=False, progress=False)  # fmt: skip
    s = settings("draft", score="record", record=True, max_new_tokens=8)
    config = {"decode": {"max_new_tokens": 8}}
    with one_thread():
        run_online(model_cfg, _data(tmp_path, 2), s, run, None, config, tmp_path / "o1")
        marker = next(out.glob("shard-*.done")).read_text()
        run_online(model_cfg, _data(tmp_path, 2), s, run, None, config, tmp_path / "o2")
        assert next(out.glob("shard-*.done")).read_text() == marker  # kept, not rewritten
        other = {"decode": {"max_new_tokens": 9}}
        with pytest.raises(SchemaError, match=r"different config or models.*decode"):
            run_online(model_cfg, _data(tmp_path, 2), s, run, None, other, tmp_path / "o3")

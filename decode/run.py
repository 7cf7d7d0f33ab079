"""`python -m decode.run`: decode prompts online with a selection rule; speed, tau and values to MLflow.

    python -m decode.run rule=draft                              # EAGLE-style draft ranking
    python -m decode.run rule=reranker reranker=<saved folder>   # a fitted first-level reranker
    python -m decode.run rule=reranker reranker=runs:/<id>/rerankers/rows_T0_fold0
    python -m decode.run rule=root_draw decode.temperature=1 select.budget=8
    python -m decode.run rule=pearl run.score=pool run.record_traces=true   # + traces, offline values

`rule=` and `reranker=` are short for `run.rule=` and `run.reranker=`. Every
prompt is decoded twice in the same run, speculatively and target-only (the
speedup baseline), in an order alternating with the prompt's position, after
`run.warmup_prompts` untimed decodes. Results: tables in the Hydra run folder
and one MLflow run (metrics `online/...`; with run.score=pool also the rule's
offline expected value `accepted/<T>/B<b>/<rule>` beside the realized one
`realized/<T>/B<b>/<rule>`, as `rerank.train` names them).
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import specrank.config  # noqa: F401  (registers the Hydra schema `config_schema`)
from decode.config import DataConfig, ModelConfig
from decode.models import ModelPair, load_model_pair
from decode.online.config import RunConfig
from decode.online.loop import decode_prompt
from decode.online.metrics import (
    PromptTiming,
    expected_values,
    prompt_table,
    realized_vs_expected,
    round_table,
    run_groups,
    timed_baseline,
    tokens_to_eos,
)
from decode.online.round import OnlineSettings
from decode.online.stream import DecodeSettings
from decode.prompts import Prompt, encode_prompt
from decode.record import resolve_inputs
from decode.trace_schema import TRACE_SCHEMA, trace_store
from rerank.config import MlflowConfig
from rerank.online import OnlinePredictor, load_online_reranker, unseen_prompts
from specrank.cli import expand_short_overrides as _expand
from specrank.laws import law_name
from specrank.paths import project_path
from specrank.tracking import metric_key, parent_run

log = logging.getLogger(__name__)


@dataclass
class RunReport:
    rounds: pd.DataFrame  # one row per round (run_metrics.round_table [+ expected])
    prompts: pd.DataFrame  # one row per prompt (both decoders)
    groups: pd.DataFrame  # all / task / entropy-half metrics
    values: dict[str, float]  # realized vs expected (score=pool), else empty
    metrics: dict[str, float]  # what went to MLflow
    run_id: str | None


def rule_label(rule: str, predictor: OnlinePredictor | None) -> str:
    """Rule name in metric keys: reranker runs name their model (e.g. reranker_rows_lgbm)."""
    if rule != "reranker" or predictor is None:
        return rule
    return f"reranker_{predictor.model.feature_set}_{predictor.model.kind}"


def decode_all(
    pair: ModelPair,
    prompts: list[Prompt],
    s: OnlineSettings,
    run: RunConfig,
    predictor: OnlinePredictor | None,
) -> list[PromptTiming]:
    """Both decoders on every prompt (alternating order), after untimed warm-up decodes."""
    dec = s.base.decode
    encoded = [encode_prompt(pair.tokenizer, p.text) for p in prompts]

    def spec(i: int):
        p = prompts[i]
        return decode_prompt(
            pair.target, pair.drafter, encoded[i], s, pair.eos_ids, p.id, p.task, predictor
        )

    def base(i: int):
        return timed_baseline(
            pair.target, encoded[i], dec.max_new_tokens, pair.eos_ids, dec.temperature, dec.seed,
            prompts[i].id,
        )  # fmt: skip

    for i in range(min(run.warmup_prompts, len(prompts))):
        spec(i)
        if run.baseline:
            base(i)
    out = []
    for i in tqdm(
        range(len(prompts)), desc=f"run {s.rule}", unit="prompt", disable=not run.progress
    ):
        if run.baseline and i % 2 == 1:
            b_out, b_ms = base(i)
        r = spec(i)
        if run.baseline and i % 2 == 0:
            b_out, b_ms = base(i)
        timing = PromptTiming(prompts[i].id, prompts[i].task, r, 0, 0.0)
        if run.baseline:
            timing.baseline_tokens, timing.baseline_ms = tokens_to_eos(b_out, pair.eos_ids), b_ms
            if dec.temperature == 0:  # an online check of losslessness (bf16 may flip argmaxes)
                n = min(len(r.output), len(b_out))
                timing.greedy_match = r.output[:n] == b_out[:n]
        out.append(timing)
    return out


def write_traces(out: Path, timings: list[PromptTiming], s: OnlineSettings, manifest: dict,
                 models: dict, prompts_per_shard: int) -> int:  # fmt: skip
    """The run's rounds as a trace store (one shard per `prompts_per_shard` prompts)."""
    store = trace_store(out)
    store.open_for_writing(config=manifest, models=models)
    dec = s.base
    shards = {
        f"{s.rule}-t{float(dec.decode.temperature)}-b{dec.select.budget}-{j:05d}": timings[
            k : k + prompts_per_shard
        ]
        for j, k in enumerate(range(0, len(timings), prompts_per_shard))
    }

    def rows_of(sid: str) -> pa.Table:
        rows = [r.fields for p in shards[sid] for r in p.run.rounds]
        return pa.Table.from_pylist(rows, schema=TRACE_SCHEMA)

    # Decoding is seeded per prompt, so a finished shard of the same config holds these rows.
    run = store.write_pending(list(shards), rows_of)
    if run.skipped:
        log.info("run.traces_out: %d finished shards of %s kept (same config)", run.skipped, out)
    return run.rows


def summarize(timings: list[PromptTiming], s: OnlineSettings, run: RunConfig, pair: ModelPair,
              label: str, seed: int) -> RunReport:  # fmt: skip
    rounds = round_table(timings)
    prompts = prompt_table(timings, pair.eos_ids)
    groups = run_groups(rounds, prompts, run.bootstrap_resamples, seed)
    values: dict[str, float] = {}
    if s.score == "pool" and s.rule != "covering":
        rows = [r.fields for p in timings for r in p.run.rounds]
        firsts = [r.first_logprob for p in timings for r in p.run.rounds]
        rounds["expected"] = expected_values(rows, s.rule, s.base.select.budget, firsts)
        values = realized_vs_expected(rounds, run.bootstrap_resamples, seed)
    dec = s.base
    law, b = law_name(dec.decode.temperature), f"B{dec.select.budget}"
    metrics: dict[str, float] = {}
    for g in groups.to_dict("records"):
        prefix = "online" if g["group"] == "all" else f"online/{g['group']}"
        metrics |= {metric_key(prefix, k): v for k, v in g.items() if k != "group"}
    if values:
        metrics[metric_key("accepted", law, b, label)] = values["expected"]
        metrics[metric_key("realized", law, b, label)] = values["realized"]
        for k in (
            "realized_minus_expected",
            "realized_minus_expected_lo",
            "realized_minus_expected_hi",
            "rounds_equal",
        ):
            metrics[metric_key("online", k)] = values[k]
    if dec.decode.temperature == 0 and run.baseline:
        matches = [bool(p.greedy_match) for p in timings]
        metrics["online/greedy_output_matches_baseline"] = float(np.mean(matches))
    metrics = {k: float(v) for k, v in metrics.items() if v is not None and np.isfinite(v)}
    return RunReport(rounds, prompts, groups, values, metrics, None)


def log_to_mlflow(report: RunReport, tracking: MlflowConfig, config: dict, tags: dict,
                  out_dir: Path) -> str:  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    report.rounds.to_parquet(out_dir / "online_rounds.parquet", index=False)
    report.prompts.to_csv(out_dir / "online_prompts.csv", index=False)
    report.groups.to_csv(out_dir / "online_groups.csv", index=False)
    (out_dir / "online_summary.json").write_text(
        json.dumps(report.metrics, indent=1, sort_keys=True)
    )
    with parent_run(
        tracking.tracking_uri, tracking.experiment, tracking.run_name, config, tags
    ) as r:
        mlflow.log_metrics(report.metrics)
        for name in (
            "online_rounds.parquet",
            "online_prompts.csv",
            "online_groups.csv",
            "online_summary.json",
        ):
            mlflow.log_artifact(str(out_dir / name), "tables")
        return r.info.run_id


def run_online(model: ModelConfig, data: DataConfig, s: OnlineSettings, run: RunConfig,
               tracking: MlflowConfig | None, config: dict, out_dir: Path, seed: int = 0,
               prompts_per_shard: int = 8) -> RunReport:  # fmt: skip
    """Load models, prompts and the reranker named by the configs; decode; report; log."""
    if run.torch_threads is not None:
        torch.set_num_threads(run.torch_threads)
    model, prompts = resolve_inputs(model, data)
    s.check()
    predictor = None
    if s.rule == "reranker":
        uri = tracking.tracking_uri if tracking else "sqlite:///mlflow.db"
        fitted = load_online_reranker(run.reranker, s.base.decode.temperature, uri)
        prompts = unseen_prompts(fitted, prompts, run.seen_prompts)
    pair = load_model_pair(model)
    if s.rule == "reranker":
        predictor = OnlinePredictor(fitted, pair.device, run.predictor)
    with torch.inference_mode():
        timings = decode_all(pair, prompts, s, run, predictor)
    label = rule_label(s.rule, predictor)
    report = summarize(timings, s, run, pair, label, seed)
    if run.record_traces:
        manifest = {k: config.get(k) for k in ("model", "data", "pool", "select", "decode", "run")}
        n = write_traces(
            project_path(run.traces_out), timings, s, manifest, pair.ids, prompts_per_shard
        )
        log.info("%d trace rows written to %s", n, project_path(run.traces_out))
    if tracking is not None:
        tags = {"rule": label, "score": s.score, "device": str(pair.device)}
        if predictor is not None:
            tags |= {"reranker": str(run.reranker), "predictor": predictor.route}
        report.run_id = log_to_mlflow(report, tracking, config, tags, out_dir)
    return report


# Bare `rule=` / `reranker=` on the command line (the documented short form) mean the
# fields of the `run` section; Hydra itself only knows the long form.
_SHORT_OVERRIDES = {"rule": "run.rule", "reranker": "run.reranker"}


def expand_short_overrides(argv: list[str]) -> list[str]:
    return _expand(argv, _SHORT_OVERRIDES)


@hydra.main(version_base="1.3", config_path="../conf", config_name="run")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run: RunConfig = OmegaConf.to_object(cfg.run)
    base = DecodeSettings(
        pool=OmegaConf.to_object(cfg.pool),
        select=OmegaConf.to_object(cfg.select),
        decode=OmegaConf.to_object(cfg.decode),
    )
    s = OnlineSettings(base, run.rule, run.score, run.record_traces)
    report = run_online(
        OmegaConf.to_object(cfg.model), OmegaConf.to_object(cfg.data), s, run,
        OmegaConf.to_object(cfg.mlflow), OmegaConf.to_container(cfg, resolve=True),
        Path(HydraConfig.get().runtime.output_dir), cfg.seed, cfg.trace.prompts_per_shard,
    )  # fmt: skip
    cols = ["group", "prompts", "rounds", "tau", "tokens_per_s", "baseline_tokens_per_s", "speedup"]
    print(report.groups[[c for c in cols if c in report.groups]].to_string(index=False))
    if report.values:
        print(json.dumps(report.values, indent=1))
    print(f"MLflow run {report.run_id}")


if __name__ == "__main__":
    sys.argv = [sys.argv[0], *expand_short_overrides(sys.argv[1:])]
    main()

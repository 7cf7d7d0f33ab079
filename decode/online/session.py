"""An online run over a prompt list: both decoders per prompt, metrics, traces, MLflow.

Every prompt is decoded speculatively (`decode.online.loop`) and target-only
(the speedup baseline), in an order alternating with the prompt's position,
after untimed warm-up decodes. `decode.run` is the thin entry point over this.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
from tqdm import tqdm

from decode.models import ModelPair
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
from decode.prompts import Prompt, encode_prompt
from decode.trace_schema import TRACE_SCHEMA, trace_store
from rerank.config import MlflowConfig
from rerank.online import OnlinePredictor
from specrank.laws import law_name
from specrank.tracking import metric_key, parent_run

log = logging.getLogger(__name__)


@dataclass
class RunReport:
    rounds: pd.DataFrame  # one row per round (decode.online.metrics.round_table [+ expected])
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

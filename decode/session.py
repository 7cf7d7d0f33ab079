"""An online run over a prompt list: both decoders per prompt, metrics, traces, MLflow.

Every prompt is decoded speculatively (`decode.loop`), at select.budget and
each of run.budgets, and target-only (the speedup baseline, once), in an order
alternating with the prompt's position, after untimed warm-up decodes. The
baseline's output also gives the target's row entropy per token (untimed), which
sets the run's one low/high entropy split of the tasks. `decode.run` is the thin
entry point over this.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import pandas as pd
import pyarrow as pa
from tqdm import tqdm

from decode.baseline import row_entropies
from decode.config import RunConfig
from decode.elasticity import budget_elasticity
from decode.loop import decode_prompt
from decode.metrics import (
    PromptTiming,
    entropy_halves,
    expected_values,
    prompt_table,
    realized_vs_expected,
    round_table,
    run_groups,
    task_entropy,
    timed_baseline,
    tokens_to_eos,
)
from decode.round import STAGES
from decode.settings import OnlineSettings
from pairs.models import ModelPair
from pairs.prompts import Prompt, encode_prompt
from rerank.fit.models import FittedReranker
from rerank.serving import OnlinePredictor
from selection.policies import EDGE_MODES
from selection.rules import learned
from selection.rules import rule as rule_entry
from specrank.settings.config import MlflowConfig
from specrank.statistics.laws import law_name
from specrank.store.files import atomic_write
from specrank.store.trace_schema import TRACE_SCHEMA, trace_store
from specrank.tracking.run_record import RunRecord, log_or_explain, write_record
from specrank.tracking.train_runs import metric_key

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class RunReport:
    rounds: pd.DataFrame  # one row per round and budget (round_table [+ expected], + budget)
    prompts: pd.DataFrame  # one row per prompt and budget (both decoders, + budget)
    groups: pd.DataFrame  # all / task / entropy-half metrics per budget (+ budget)
    values: dict[str, float]  # realized vs expected at select.budget (score=record), else empty
    metrics: dict[str, float]  # what went to MLflow
    run_id: str | None
    elasticity: pd.DataFrame = field(default_factory=pd.DataFrame)  # consecutive budget pairs
    entropy: pd.DataFrame = field(default_factory=pd.DataFrame)  # task, entropy, half, source
    # several rules (run.rules): tau and tokens/s ratios to the first (decode.compare)
    compare: pd.DataFrame = field(default_factory=pd.DataFrame)
    # run.offline: realized tau beside the offline prediction (decode.compare)
    offline: pd.DataFrame = field(default_factory=pd.DataFrame)
    offline_source: str = ""


def run_budgets(s: OnlineSettings, run: RunConfig) -> list[int]:
    """select.budget first, then run.budgets' others in their order (each once)."""
    return list(dict.fromkeys([s.base.select.budget, *run.budgets]))


def at_budget(s: OnlineSettings, budget: int) -> OnlineSettings:
    sel = dataclasses.replace(s.base.select, budget=budget)
    return dataclasses.replace(s, base=dataclasses.replace(s.base, select=sel))


def rule_label(rule: str, fitted: FittedReranker | None) -> str:
    """Rule name in metric keys: reranker runs name their model (e.g. reranker_rows_lgbm)."""
    if not rule_entry(rule).predictor or fitted is None:
        return rule
    return f"{rule}_{offline_name(rule, fitted)}"


def offline_name(rule: str, fitted: FittedReranker | None) -> str | None:
    """The rule's name in offline values (`rows_lgbm` for a fitted reranker); None when it
    has no offline value."""
    entry = rule_entry(rule)
    if entry.predictor:
        return None if fitted is None else learned(fitted.feature_set, fitted.kind).name
    return rule if entry.offline is not None else None


@dataclass(frozen=True)
class Arm:
    """One rule of an online run: its label in tables and metrics, its settings, the source
    of its reranker (rule=reranker) and, once loaded next to the models, its predictor."""

    label: str
    s: OnlineSettings
    reranker: str | None = None
    fitted: FittedReranker | None = None  # its reranker, loaded and checked
    predictor: OnlinePredictor | None = None
    extra_budget: int = 0  # decoded at each run budget + this (`<rule>@+N`, decode.compare)


def arm_order(arms: list[T], position: int) -> list[T]:
    """The rules' order at a prompt's run position: rotated by one each position, so two
    rules alternate which goes first and each of n rules leads every n-th prompt."""
    k = position % len(arms)
    return arms[k:] + arms[:k]


def decode_all(
    pair: ModelPair,
    prompts: list[Prompt],
    arms: list[Arm],
    run: RunConfig,
    on_prompt: Callable[[int, dict[int, PromptTiming]], None] | None = None,
    start: int = 0,
) -> dict[str, dict[int, list[PromptTiming]]]:
    """Every rule's decode at every budget and the baseline of every prompt, after untimed
    warm-ups of each.

    Prompt by prompt: the baseline before (odd positions) or after (even) the speculative
    decodes; the rules in an order rotating with the position (`arm_order`),
    each at every budget, the budget order reversed on odd positions. A prompt's position is
    `start` + its index (a Ray shard passes its first prompt's run position, so the orders
    are a single process's). The arms share the decode settings (`arms[0].s.base.decode`).
    Returns label -> budget -> timings. `on_prompt(i, {budget: timing})` runs as each prompt
    is done, with the first arm's timings (traces, partial results).
    """
    dec = arms[0].s.base.decode
    budgets = run_budgets(arms[0].s, run)
    settings = {(a.label, b): at_budget(a.s, b + a.extra_budget) for a in arms for b in budgets}
    encoded = [encode_prompt(pair.tokenizer, p.text) for p in prompts]

    def spec(i: int, arm: Arm, b: int):
        p = prompts[i]
        return decode_prompt(
            pair.target, pair.drafter, encoded[i], settings[arm.label, b], pair.eos_ids, p.id,
            p.task, arm.predictor, category=p.category,
        )  # fmt: skip

    def base(i: int):
        return timed_baseline(
            pair.target, encoded[i], dec.max_new_tokens, pair.eos_ids, dec.temperature, dec.seed,
            prompts[i].id,
        )  # fmt: skip

    for i in range(min(run.warmup_prompts, len(prompts))):
        for arm in arms:
            for b in budgets:
                spec(i, arm, b)
        if run.baseline:
            base(i)
    out: dict[str, dict[int, list[PromptTiming]]] = {
        a.label: {b: [] for b in budgets} for a in arms
    }
    desc = f"run {'+'.join(a.label for a in arms)}"
    for i in tqdm(range(len(prompts)), desc=desc, unit="prompt", disable=not run.progress):
        pos = start + i
        if run.baseline and pos % 2 == 1:
            b_out, b_ms = base(i)
        runs = {(a.label, b): spec(i, a, b) for a in arm_order(arms, pos)
                for b in (budgets if pos % 2 == 0 else budgets[::-1])}  # fmt: skip
        if run.baseline and pos % 2 == 0:
            b_out, b_ms = base(i)
        if run.baseline:  # untimed: the target's row entropy at each baseline token
            n_eos = tokens_to_eos(b_out, pair.eos_ids)
            entropy = row_entropies(pair.target, encoded[i], b_out[:n_eos], dec.temperature)
        for (label, b), r in runs.items():
            timing = PromptTiming(prompts[i].id, prompts[i].task, r, 0, 0.0)
            if run.baseline:
                timing.baseline_tokens, timing.baseline_ms = n_eos, b_ms
                timing.baseline_entropy = entropy
                if dec.temperature == 0:  # an online check of losslessness (bf16 may flip argmaxes)
                    n = min(len(r.output), len(b_out))
                    timing.greedy_match = r.output[:n] == b_out[:n]
            out[label][b].append(timing)
        if on_prompt is not None:
            on_prompt(i, {b: t[-1] for b, t in out[arms[0].label].items()})
    return out


class TraceShards:
    """The run's rounds as a trace store: a shard of `prompts_per_shard` consecutive prompts
    is written as soon as its last prompt is decoded, so a killed run keeps it.

    Decoding is seeded per prompt, so a rerun's shard holds the same rounds (timing columns
    aside): a finished shard of the same config is kept, never written twice.
    """

    def __init__(self, out: Path, s: OnlineSettings, manifest: dict, models: dict,
                 prompts_per_shard: int, n_prompts: int) -> None:  # fmt: skip
        self.store = trace_store(out)
        self.store.open_for_writing(config=manifest, models=models)
        dec = s.base
        stem = f"{s.rule}-t{float(dec.decode.temperature)}-b{dec.select.budget}"
        self.size, self.n_prompts = prompts_per_shard, n_prompts
        self.ids = [f"{stem}-{j:05d}" for j in range(-(-n_prompts // prompts_per_shard))]
        self.waiting: dict[int, dict[int, PromptTiming]] = {}
        self.rows = self.kept = 0

    def add(self, i: int, timing: PromptTiming) -> None:
        """Prompt `i` (its position in the run) is decoded; write its shard once complete."""
        j = i // self.size
        part = self.waiting.setdefault(j, {})
        part[i] = timing
        if len(part) < min(self.size, self.n_prompts - j * self.size):
            return
        del self.waiting[j]
        rows = [r.fields for k in sorted(part) for r in part[k].run.rounds]
        run = self.store.write_pending(
            [self.ids[j]], lambda _: pa.Table.from_pylist(rows, schema=TRACE_SCHEMA)
        )
        self.rows += run.rows
        self.kept += run.skipped


def _group_metrics(groups: pd.DataFrame, prefix: str) -> dict[str, float]:
    out = {}
    for g in groups.to_dict("records"):
        p = prefix if g["group"] == "all" else f"{prefix}/{g['group']}"
        out |= {metric_key(p, k): v for k, v in g.items() if k not in ("group", "budget")}
    return out


def summarize(timings: dict[int, list[PromptTiming]], s: OnlineSettings, run: RunConfig,
              pair: ModelPair, label: str, seed: int) -> RunReport:  # fmt: skip
    """Tables and metrics of every budget; the entropy split; the budget elasticity.

    The primary budget (select.budget) keeps the plain `online/...` keys; with several
    budgets each also gets `online/B<b>/...`. The entropy split comes from the baseline
    (else from the primary budget's rounds) and is the same for every budget.
    """
    primary = s.base.select.budget
    rounds = {b: round_table(t) for b, t in timings.items()}
    prompts = {b: prompt_table(t, pair.eos_ids) for b, t in timings.items()}
    means, source = task_entropy(rounds[primary], prompts[primary])
    halves = entropy_halves(means)
    entropy = pd.DataFrame(
        {"task": means.index, "entropy": means.to_numpy(), "source": source}
    ).assign(half=lambda f: f["task"].map(halves))
    groups = {
        b: run_groups(rounds[b], prompts[b], run.bootstrap_resamples, seed, halves) for b in timings
    }
    values: dict[str, float] = {}
    if s.score in EDGE_MODES and s.entry.has_offline_value:
        rows = [r.fields for p in timings[primary] for r in p.run.rounds]
        firsts = [r.first_logprob for p in timings[primary] for r in p.run.rounds]
        rounds[primary]["expected"] = expected_values(rows, s.rule, primary, firsts)
        values = realized_vs_expected(rounds[primary], run.bootstrap_resamples, seed)
    dec = s.base
    law, b = law_name(dec.decode.temperature), f"B{primary}"
    metrics = _group_metrics(groups[primary], "online")
    if len(timings) > 1:
        for bud, g in groups.items():
            metrics |= _group_metrics(g, f"online/B{bud}")
    elasticity = budget_elasticity(prompts, run.bootstrap_resamples, seed)
    for e in elasticity.to_dict("records"):
        pair_key = f"online/elasticity/B{e['from_budget']}_B{e['to_budget']}"
        metrics |= {
            metric_key(pair_key, k): v
            for k, v in e.items()
            if k not in ("from_budget", "to_budget")
        }
    for e in entropy.to_dict("records"):
        metrics[metric_key("online/task", e["task"], "split_entropy")] = e["entropy"]
    metrics["online/entropy_split_from_baseline"] = float(source == "baseline")
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
        matches = [bool(p.greedy_match) for t in timings.values() for p in t]
        metrics["online/greedy_output_matches_baseline"] = float(np.mean(matches))
    # numbers only (an interval's `_note` is text; MLflow metrics are floats)
    metrics = {k: float(v) for k, v in metrics.items()
               if isinstance(v, int | float | np.number) and np.isfinite(v)}  # fmt: skip

    def stacked(tables: dict[int, pd.DataFrame]) -> pd.DataFrame:
        return pd.concat([t.assign(budget=bud) for bud, t in tables.items()], ignore_index=True)

    return RunReport(stacked(rounds), stacked(prompts), stacked(groups), values, metrics, None,
                     elasticity, entropy)  # fmt: skip


def log_to_mlflow(report: RunReport, tracking: MlflowConfig, config: dict, tags: dict,
                  out_dir: Path, plots: tuple[str, ...] = ()) -> str:  # fmt: skip
    """The run's tables to `out_dir`, its record beside them, then the record to MLflow.
    `plots`: files already in `out_dir`, logged under `plots`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = {
        "online_rounds.parquet": lambda tmp: report.rounds.to_parquet(tmp, index=False),
        "online_prompts.csv": lambda tmp: report.prompts.to_csv(tmp, index=False),
        "online_groups.csv": lambda tmp: report.groups.to_csv(tmp, index=False),
        "online_elasticity.csv": lambda tmp: report.elasticity.to_csv(tmp, index=False),
        "online_entropy_split.csv": lambda tmp: report.entropy.to_csv(tmp, index=False),
        "online_summary.json": lambda tmp: tmp.write_text(
            json.dumps(report.metrics, indent=1, sort_keys=True)
        ),
    }
    for name, frame in (("online_compare.csv", report.compare),
                        ("online_offline.csv", report.offline)):  # fmt: skip
        if not frame.empty:
            tables[name] = lambda tmp, f=frame: f.to_csv(tmp, index=False)
    for name, write in tables.items():
        atomic_write(out_dir / name, write)
    artifacts = [(n, "tables") for n in tables] + [(n, "plots") for n in plots]
    record = RunRecord(tracking.tracking_uri, tracking.experiment, tracking.run_name, config,
                       tags, report.metrics, artifacts)  # fmt: skip
    write_record(out_dir, record)
    return log_or_explain(out_dir, tracking.tracking_uri)


def print_report(report: RunReport) -> None:
    """The groups table, then per-stage medians and means, the elasticity, the entropy split;
    with several rules each row names its rule and the paired ratios follow."""
    cols = ["rule", "budget", "group", "prompts", "rounds", "tau", "tokens_per_s",
            "baseline_tokens_per_s", "speedup", "break_even_tau"]  # fmt: skip
    print(report.groups[[c for c in cols if c in report.groups]].to_string(index=False))
    every = report.groups[report.groups["group"] == "all"]
    stages = [*STAGES, "total"]
    rows = []
    for _, g in every.iterrows():
        for stat, key in (("median", "ms_per_round_median"), ("mean", "ms_per_round")):
            rows.append({**({"rule": g["rule"]} if "rule" in g else {}), "budget": g["budget"],
                         "ms per round": stat, **{st: g[f"{key}/{st}"] for st in stages}})  # fmt: skip
    ms = pd.DataFrame(rows)
    print(ms.to_string(index=False, float_format="%.3f"))
    if not report.elasticity.empty:
        cols = ["rule", "from_budget", "to_budget"] + [
            f"d_ln_{q}{x}" for q in ("tps", "tau", "eta") for x in ("", "_lo", "_hi")
        ]
        print("budget elasticity: d ln TPS = d ln tau + d ln eta (eta = TPS / tau)")
        cols = [c for c in cols if c in report.elasticity]
        print(report.elasticity[cols].to_string(index=False, float_format="%.4f"))
    if not report.entropy.empty:
        print(f"entropy split (from the {report.entropy['source'].iloc[0]}):")
        print(report.entropy[["task", "entropy", "half"]].to_string(index=False))
    if report.values:
        print(json.dumps(report.values, indent=1))

"""The job's evaluation stage: every rule on the recorded pools, out of fold, with paired
bootstrap intervals, the report tables from the same pass (docs/method.md#reporting)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.dataset as ds

from rerank.config import RerankConfig
from rerank.evaluate.curves import PromptCurves
from rerank.evaluate.policy import PolicyRounds, policy_text
from rerank.evaluate.recorded import labelled_table, recorded_budgets, store_draft_temperature
from rerank.evaluate.reports import ReportAccumulators
from rerank.evaluate.values import EvalPlan, LearnedFactors, evaluate_traces
from rerank.fit.halves import halves_table
from rerank.fit.per_depth import per_depth_extra
from rerank.job.fitting import Fitted
from rerank.report.breakdowns import breakdown_gains, breakdowns
from rerank.report.comparisons import compare, comparisons_table
from rerank.report.summary import choose_mixture_weights, law_draws, results_table, summarise_draws
from rerank.report.variants import variant_table, variants_text
from rerank.settings import CheckedSettings, derived_settings
from specrank.runtime import faults
from specrank.runtime.memory import heap_retained, release_freed_heap
from specrank.runtime.parallel import ParallelConfig
from specrank.store.trace_schema import trace_store


@dataclass
class Evaluation:
    per_round: pd.DataFrame
    summary: pd.DataFrame
    comparisons: pd.DataFrame  # paired gains between two rules (rerank.report.comparisons)
    breakdowns: pd.DataFrame  # mean values per group
    breakdown_gains: pd.DataFrame  # gains over draft per group, with intervals
    mixture_weights: pd.DataFrame
    table: str  # the results table, then the paired comparisons
    reports: dict[str, pd.DataFrame]  # rerank.evaluate.reports tables, the halves split
    seconds: dict[str, float] = field(default_factory=dict)  # time/<stage>_s metrics


@dataclass(frozen=True)
class EvalInputs:
    """What the evaluation stage reads, from settings checked once (`rerank.settings`)."""

    traces: Path  # the trace store
    traces_setting: str  # rerank.traces as given, named by the policy's report
    budgets: list[int]  # evaluated (`rerank.settings.evaluated_budgets`)
    reported_budgets: list[int]  # rerank.budgets: the variants' table, the first one's policy
    rerankers: list[str]  # the learned rules fitted
    simulated: list[str]  # of them, those simulated on their own trees
    comparisons: list[tuple[str, str]]
    substitutions: list[str]
    mixture_weights: list[float]
    draft_top_m: int
    score: str
    score_top_m: int
    reports: bool
    per_depth: bool  # a per-depth calibration control is evaluated
    calibration_edges: int
    chunk_rounds: int
    eval_threads: int | None
    n_resamples: int


def eval_inputs(rerank: RerankConfig, checked: CheckedSettings, budgets: list[int]) -> EvalInputs:
    """The evaluation stage's share of the settings and of what checking them decided,
    at `budgets`."""
    rule_of = dict(zip(rerank.feature_sets, checked.rerankers, strict=True))
    return EvalInputs(
        checked.traces, rerank.traces, budgets, list(rerank.budgets), checked.rerankers,
        [rule_of[fs] for fs in checked.simulated], checked.comparisons,
        list(rerank.substitutions), list(rerank.mixture_weights), rerank.draft_top_m,
        rerank.score, rerank.score_top_m, rerank.reports, "per_depth" in rerank.calibrators,
        rerank.calibration_edges, rerank.chunk_rounds, rerank.eval_threads, rerank.n_resamples,
    )  # fmt: skip


def evaluate(rerank: RerankConfig, fitted: Fitted, seed: int, budgets: list[int],
             dataset: ds.Dataset | None = None,
             parallel: ParallelConfig | None = None) -> Evaluation:  # fmt: skip
    """`evaluate_rules` on the settings `rerank` (rerank.transfer's and the benches' entry:
    the job checks its settings once, `rerank.settings.check_train`)."""
    inputs = eval_inputs(rerank, derived_settings(rerank), budgets)
    return evaluate_rules(inputs, fitted, seed, dataset, parallel)


def evaluate_rules(inputs: EvalInputs, fitted: Fitted, seed: int,
                   dataset: ds.Dataset | None = None,
                   parallel: ParallelConfig | None = None) -> Evaluation:  # fmt: skip
    """Every rule on the recorded pools at `inputs.budgets`, out of fold, with paired
    bootstrap intervals (docs/method.md#reporting).

    `dataset`: the rounds to evaluate (default: the whole store `inputs.traces`).
    `parallel.backend=ray`: the pass over the pools as Ray tasks, one per trace file
    (`rerank.on_ray.chunks_on_ray`); the per-depth maps are fitted here either way.
    """
    faults.phase("evaluating")
    folds, preds = fitted.folds, fitted.preds
    budgets = inputs.budgets
    if dataset is None:
        dataset = trace_store(inputs.traces).dataset()
    policy = _policy_rounds(inputs, fitted)
    extra = (per_depth_extra(dataset, folds, inputs.calibration_edges, seed, inputs.chunk_rounds)
             if inputs.per_depth else None)  # fmt: skip
    plan = EvalPlan(budgets, substitutions=list(inputs.substitutions),
                    mixture_weights=list(inputs.mixture_weights), top_m=inputs.draft_top_m,
                    curve_rules=["root", *(r for r in inputs.rerankers if r not in policy.simulated)])  # fmt: skip
    curves = PromptCurves()  # per-prompt curves: matched-size PEARL, node-equivalent budgets
    # retained rows, coverage, draw-rule sizes: fed by the same pass over the traces
    acc = ReportAccumulators(budgets) if inputs.reports else None
    chunk_map = None
    if parallel is not None and parallel.backend == "ray":
        from rerank.on_ray import chunks_on_ray  # Ray is imported only by a run that uses it

        chunk_map = chunks_on_ray(parallel)
    t0 = time.perf_counter()
    with heap_retained():  # the chunks' blocks are reused while the pass runs, not after it
        per_round = evaluate_traces(
            dataset, plan, preds.frame, preds.rules, extra, inputs.chunk_rounds, curves=curves,
            consumers=[policy, *([acc] if acc else [])],
            workers=inputs.eval_threads or len(os.sched_getaffinity(0)) + 1, chunk_map=chunk_map,
        )  # fmt: skip
    pass_s = time.perf_counter() - t0  # the pass over the pools, consumers included
    per_round = policy.apply(per_round)
    # the report tables first: their per-round accumulators are then freed (0.9 GiB at 3x
    # measured while their TVs were float64)
    reports = acc.tables(per_round, inputs.n_resamples, seed) if acc else {}
    del acc
    release_freed_heap()  # the accumulators' chunk arrays, scattered over the pass's heap
    per_round["fold"] = per_round["prompt_id"].map(folds).astype(np.int8)
    per_round, mix_weights = choose_mixture_weights(per_round)
    draws = law_draws(per_round, inputs.n_resamples, seed, curves=curves)  # one set of resamples
    del curves  # per-prompt curves, read by the draws alone (0.16 GiB at 3x the paper)
    # Freed blocks of the tail's stages are not all reused by the next stage, so without a
    # trim after each the resident memory climbs stage by stage: at 1x the paper it rose
    # from 1.7 to 2.6 GiB over the tail; trimmed after every stage it stayed at 1.4-1.9.
    release_freed_heap()
    draft_t = store_draft_temperature(trace_store(inputs.traces).manifest())
    labelled = partial(labelled_table, recorded=recorded_budgets(dataset), per_round=per_round,
                       draft_temperature=draft_t)  # fmt: skip
    summary = labelled(summarise_draws(draws))
    comparisons = labelled(compare(draws, inputs.comparisons))
    variants = variant_table(summary, comparisons, fitted.quality, preds.rules)
    variants = variants[variants["budget"].isin(inputs.reported_budgets)]
    table = "\n".join([results_table(summary), policy_text(summary, inputs.score,
                       inputs.score_top_m, policy.simulable_share, policy.simulated,
                       inputs.reported_budgets[0]), comparisons_table(comparisons),
                       variants_text(variants)])  # fmt: skip
    groups = labelled(breakdown_gains(per_round, inputs.n_resamples, seed))
    release_freed_heap()  # its groups' copies (as after the draws)
    reports = {k: labelled(v) for k, v in reports.items()}
    halves = fitted.halves if fitted.halves is not None else halves_table(fitted.candidates, folds)
    reports["halves"] = halves.reset_index()  # keeps `task`
    reports["variants"] = variants
    by_group = labelled(breakdowns(per_round))
    return Evaluation(per_round, summary, comparisons, by_group, groups, mix_weights, table,
                      reports, {"pool_pass": pass_s})  # fmt: skip


def _policy_rounds(inputs: EvalInputs, fitted: Fitted) -> PolicyRounds:
    """The scored-set policy's consumer of the pass: App. D.10's decoder without a root pass
    and draft at the scored count, from draft's and root's own trees (rerank.evaluate.policy),
    and the rules whose matched row follows their own trees, simulated on them from their
    phat with and without the row (rerank.evaluate.matched; their curves would be of neither
    tree, so the pass computes none)."""
    simulated = inputs.simulated
    names = [f"{v}/{r}" for r in simulated for v in ("with", "without")]
    factors = LearnedFactors.from_predictions(fitted.preds.frame, names) if simulated else None
    return PolicyRounds(inputs.budgets, inputs.score, inputs.score_top_m,
                        f"rerank.traces={inputs.traces_setting}", simulated=simulated,
                        factors=factors)  # fmt: skip

"""`python -m rerank.train`: the main job.

Cross-fits the rerankers and calibration controls on the candidate table,
evaluates every selection rule on the recorded pools, bootstraps gains over
draft selection, logs everything to MLflow and prints the results table.

    python -m rerank.train                                   # embedded default traces
    python -m rerank.train rerank_model=hgb                  # HistGradientBoosting, not LightGBM
    python -m rerank.train -m rerank_model=hgb,lgbm          # both, as a Hydra multirun
    python -m rerank.train rerank.sweep=true                 # the SPEC budget sweep
    python -m rerank.train experiment=paper                  # the paper's settings
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import hydra
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from features.schema import candidate_store
from rerank.config import RerankConfig
from rerank.evaluate.policy import PolicyRounds, for_policy, policy_text
from rerank.evaluate.pool_chunks import ROUND_KEYS
from rerank.evaluate.recorded import labelled_table, recorded_budgets
from rerank.evaluate.reports import ReportAccumulators
from rerank.evaluate.values import EvalPlan, PromptCurves, evaluate_traces
from rerank.fit.models import LABEL_OF_LAW
from rerank.fit.persist import save_reranker
from rerank.fit.predict import (
    FirstFactorPredictions,
    fit_per_depth_maps,
    fold_map,
    halves_table,
    per_depth_scores,
    predict_first_factors,
)
from rerank.fit.quality import prediction_quality
from rerank.fit.resume import FitFolder
from rerank.report.breakdowns import breakdown_gains, breakdowns
from rerank.report.comparisons import compare, comparisons_table
from rerank.report.plots import write_plots
from rerank.report.plots_reliability import reliability_table
from rerank.report.summary import (
    choose_mixture_weights,
    law_draws,
    results_table,
    summarise_draws,
)
from rerank.report.variants import variant_table, variants_text
from rerank.settings import (
    check_settings,
    comparison_pairs,
    model_capacity,
    store_budgets,
)
from selection.rules import learned
from specrank import config as _schema  # noqa: F401  (registers the Hydra schema)
from specrank import faults
from specrank.cli import run_entry_point
from specrank.config import MlflowConfig
from specrank.files import atomic_write
from specrank.laws import law_kind, law_name
from specrank.memory import release_freed_heap, retain_freed_heap
from specrank.paths import CONF_DIR, project_path
from specrank.run_record import ChildRun, RunRecord, TrackingError, log_or_explain, write_record
from specrank.tables import SchemaError
from specrank.trace_schema import trace_store
from specrank.tracking import metric_key

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    summary: pd.DataFrame
    breakdowns: pd.DataFrame
    per_round: pd.DataFrame
    quality: pd.DataFrame
    table: str
    run_id: str
    comparisons: pd.DataFrame  # paired gains between two rules


def check_same_traces(features_dir: Path, traces_dir: Path) -> str:
    """The candidate table must come from exactly these traces; returns their fingerprint."""
    traces_fp = trace_store(traces_dir).fingerprint()
    manifest = candidate_store(features_dir).manifest()
    found = manifest.get("config", {}).get("source_fingerprint")
    if found != traces_fp:
        raise SchemaError(
            f"the candidate table in {features_dir} was extracted from traces with fingerprint "
            f"{str(found)[:12]}, but {traces_dir} has fingerprint {traces_fp[:12]}: "
            f"re-run `python -m features.extract` on these traces"
        )
    return traces_fp


# The candidate table's columns the job keeps for every row once the rerankers are fitted:
# keys, the halves' tasks, and what the prediction quality and reliability tables join.
FITTED_COLUMNS = [*ROUND_KEYS, "cand_index", "task", "draft_prob", *LABEL_OF_LAW.values()]


@dataclass
class Fitted:
    """Cross-fitted first-level predictions and their held-out quality.

    `candidates` holds FITTED_COLUMNS of every row of the candidate table.
    """

    candidates: pd.DataFrame
    folds: dict[str, int]  # prompt id -> half
    preds: FirstFactorPredictions
    quality: pd.DataFrame
    seconds: float


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


def fit(rerank: RerankConfig, seed: int) -> Fitted:
    """Cross-fit the rerankers and the q1 calibration on the candidate table (SPEC §8)."""
    faults.phase("fitting")
    t0 = time.perf_counter()
    dataset = candidate_store(project_path(rerank.features)).dataset()
    # Every row's keys and what the evaluation joins; the features of one law at a time.
    candidates = dataset.to_table(columns=FITTED_COLUMNS).to_pandas()

    def law_frame(temperature: float) -> pd.DataFrame:
        rows = dataset.to_table(
            filter=pc.field("temperature") == pa.scalar(temperature, pa.float32())
        )
        frame = for_policy(rows.to_pandas(), rerank.score)  # the rows the decoder would hold
        del rows
        release_freed_heap()  # the Arrow table's buffers, now converted
        return frame

    folds = fold_map(
        candidates["prompt_id"].to_numpy(), rerank.halves, seed, candidates["task"].to_numpy()
    )
    log.info("halves=%s:\n%s", rerank.halves, halves_table(candidates, folds).to_string())
    preds = predict_first_factors(
        candidates,
        folds,
        rerank.model.kind,
        rerank.feature_sets,
        rerank.calibrators,
        seed,
        rerank.model.n_threads,
        rerank.rank_q_bins,
        capacity=model_capacity(rerank.model),
        law_frame=law_frame,
        prior_split=rerank.prior_split,
        fits=None if rerank.fits is None else FitFolder(project_path(rerank.fits)),
        train_share=rerank.train_share,
    )
    seconds = time.perf_counter() - t0
    return Fitted(candidates, folds, preds, prediction_quality(candidates, preds), seconds)


def evaluate(rerank: RerankConfig, fitted: Fitted, seed: int, budgets: list[int],
             dataset: ds.Dataset | None = None) -> Evaluation:  # fmt: skip
    """Every rule on the recorded pools at `budgets` (`rerank.settings.evaluated_budgets`),
    out of fold, with paired bootstrap intervals (SPEC §9).

    `dataset`: the rounds to evaluate (default: the whole store `rerank.traces`).
    """
    faults.phase("evaluating")
    folds, preds = fitted.folds, fitted.preds
    if dataset is None:
        dataset = trace_store(project_path(rerank.traces)).dataset()
    # The scored-set policy: App. D.10's decoder without a root pass and draft at the scored
    # count, from draft's and root's own trees (rerank.evaluate.policy); the per-depth
    # calibration, as whole candidate scores.
    policy = PolicyRounds(
        budgets, rerank.score, rerank.score_top_m, f"rerank.traces={rerank.traces}"
    )
    extra = None
    if "per_depth" in rerank.calibrators:
        maps = fit_per_depth_maps(
            dataset, folds, rerank.calibration_edges, seed, rerank.chunk_rounds
        )
        release_freed_heap()

        def extra(pool, table):
            ids = table["prompt_id"].to_numpy(zero_copy_only=False)
            return {"per_depth": per_depth_scores(pool, ids, folds, maps)}

    rerankers = [learned(fs, rerank.model.kind).name for fs in rerank.feature_sets]
    plan = EvalPlan(budgets, substitutions=list(rerank.substitutions),
                    mixture_weights=list(rerank.mixture_weights), top_m=rerank.top_m,
                    curve_rules=["root", *rerankers])  # fmt: skip
    curves = PromptCurves()  # per-prompt curves: matched-size PEARL, node-equivalent budgets
    # retained rows, coverage, draw-rule sizes: fed by the same pass over the traces
    acc = ReportAccumulators(budgets) if rerank.reports else None
    t0 = time.perf_counter()
    per_round = evaluate_traces(
        dataset, plan, preds.frame, preds.rules, extra, rerank.chunk_rounds, curves=curves,
        consumers=[policy, *([acc] if acc else [])],
        workers=rerank.workers or len(os.sched_getaffinity(0)),
    )  # fmt: skip
    pass_s = time.perf_counter() - t0  # the pass over the pools, consumers included
    per_round = policy.apply(per_round)
    release_freed_heap()  # the chunks' blocks, kept for reuse while the pass ran
    per_round["fold"] = per_round["prompt_id"].map(folds).astype(np.int8)
    per_round, mix_weights = choose_mixture_weights(per_round)
    draws = law_draws(per_round, rerank.n_resamples, seed, curves=curves)  # one set of resamples
    labelled = partial(labelled_table, recorded=recorded_budgets(dataset), per_round=per_round)
    summary = labelled(summarise_draws(draws))
    comparisons = labelled(compare(draws, comparison_pairs(rerank)))
    variants = variant_table(summary, comparisons, fitted.quality, preds.rules)
    variants = variants[variants["budget"].isin(rerank.budgets)]
    table = "\n".join([results_table(summary), policy_text(summary, rerank.score,
                       rerank.score_top_m, policy.simulable_share), comparisons_table(comparisons),
                       variants_text(variants)])  # fmt: skip
    groups = labelled(breakdown_gains(per_round, rerank.n_resamples, seed))
    reports = acc.tables(per_round, rerank.n_resamples, seed) if acc else {}
    reports = {k: labelled(v) for k, v in reports.items()}
    reports["halves"] = halves_table(fitted.candidates, folds).reset_index()  # keeps `task`
    reports["variants"] = variants
    by_group = labelled(breakdowns(per_round))
    return Evaluation(per_round, summary, comparisons, by_group, groups, mix_weights, table,
                      reports, {"pool_pass": pass_s})  # fmt: skip


def _csv(frame: pd.DataFrame) -> Callable[[Path], object]:
    return lambda tmp: frame.to_csv(tmp, index=False)


def _parquet(frame: pd.DataFrame) -> Callable[[Path], object]:
    return lambda tmp: frame.to_parquet(tmp, index=False)


def write_tables(out_dir: Path, fitted: Fitted, ev: Evaluation) -> tuple[list[str], list[Path]]:
    """Tables, plots and saved rerankers of the run under `out_dir`; returns the table files
    and the plots.

    Every table is written whole or not at all (`atomic_write`); a full disk names the file.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    faults.phase("writing tables")
    tables = {"summary": ev.summary, "comparisons": ev.comparisons, "breakdowns": ev.breakdowns,
              "breakdown_gains": ev.breakdown_gains, **ev.reports,
              "prediction_quality": fitted.quality, "mixture_weights": ev.mixture_weights}  # fmt: skip
    for name, frame in tables.items():
        atomic_write(out_dir / f"{name}.csv", _csv(frame))
    atomic_write(out_dir / "per_round_values.parquet", _parquet(ev.per_round))
    atomic_write(out_dir / "oof_predictions.parquet", _parquet(fitted.preds.frame))
    atomic_write(out_dir / "results.txt", lambda tmp: tmp.write_text(ev.table + "\n"))
    files = [*(f"{n}.csv" for n in [*tables, "reliability"]), "per_round_values.parquet",
             "oof_predictions.parquet", "results.txt"]  # fmt: skip
    merged = fitted.preds.joined(fitted.candidates, [*LABEL_OF_LAW.values(), "draft_prob"])
    parts = []
    for temperature, part in merged.groupby("temperature"):
        label = part[LABEL_OF_LAW[law_kind(float(temperature))]].to_numpy(np.float64)
        cols = ["draft_prob", *fitted.preds.rules]
        preds = {c: part[c].to_numpy(np.float64) for c in cols}
        parts.append(reliability_table(preds, label, law_name(temperature)))
    # logged as a table too, so the notebook redraws the reliability figure from artifacts
    reliability = pd.concat(parts, ignore_index=True)
    atomic_write(out_dir / "reliability.csv", _csv(reliability))
    plots = write_plots(out_dir, ev.summary, ev.comparisons, reliability)
    for name, pair in fitted.preds.models.items():
        for fold, model in enumerate(pair):
            folder = out_dir / "rerankers" / f"{name.replace('/', '_')}_fold{fold}"
            save_reranker(model, folder)
    return files, plots


def _quality_metrics(quality: pd.DataFrame, fold: object) -> dict[str, float]:
    out = {}
    for q in quality[quality["fold"] == fold].itertuples():
        out[metric_key("sq_error", law_name(q.temperature), q.predictor)] = q.squared_error
        out[metric_key("top1", law_name(q.temperature), q.predictor)] = q.top1_agreement
    return out


def run_record(
    tracking: MlflowConfig,
    resolved_config: dict,
    tags: dict[str, str],
    fitted: Fitted,
    ev: Evaluation,
    written: tuple[list[str], list[Path]],
    total_seconds: float,
) -> RunRecord:
    """What the run logs: one parent run (params = `resolved_config`, logged verbatim) and a
    child run per fold (`specrank.run_record` logs it)."""
    metrics = {"time/total_s": total_seconds, "time/fit_s": fitted.seconds}
    metrics |= {f"time/{stage}_s": secs for stage, secs in ev.seconds.items()}
    metrics |= evaluation_metrics(ev, fitted.quality)
    tables, plots = written
    return RunRecord(
        tracking.tracking_uri, tracking.experiment, tracking.run_name, resolved_config, tags,
        metrics, [*((t, "tables") for t in tables), *((p.name, "plots") for p in plots),
                  ("rerankers", "rerankers")],
        _run_children(fitted),
    )  # fmt: skip


def evaluation_metrics(ev: Evaluation, quality: pd.DataFrame) -> dict[str, float]:
    """The values, gains and paired comparisons (round weighting) and the prediction
    quality of every rule, as metric keys (`accepted/<law>/B<b>/<rule>`, ...)."""
    metrics = {"rounds": float(len(ev.per_round))}
    for r in ev.summary[ev.summary["weighting"] == "round"].itertuples():
        for name in ("accepted", "gain", "gain_lo", "gain_hi", "node_budget"):
            if hasattr(r, name):  # node_budget: the draft budget reaching the rule's value
                metrics[metric_key(name, r.law, f"B{r.budget}", r.rule)] = getattr(r, name)
    for r in ev.comparisons[ev.comparisons["weighting"] == "round"].itertuples():
        pair = f"{r.a}__{r.b}"
        metrics[metric_key("compare", r.law, f"B{r.budget}", pair)] = r.gain
        metrics[metric_key("compare_lo", r.law, f"B{r.budget}", pair)] = r.gain_lo
        metrics[metric_key("compare_hi", r.law, f"B{r.budget}", pair)] = r.gain_hi
    return metrics | _quality_metrics(quality, "all")


def _run_children(fitted: Fitted) -> list[ChildRun]:
    """One child run per fold: its fit times, iteration counts and held-out quality."""
    children = []
    for fold in (0, 1):
        fold_metrics = {
            metric_key("fit_s", name): secs[fold] for name, secs in fitted.preds.fit_seconds.items()
        }
        # the iterations each model holds (early stopping: the count it chose)
        params = {"trained_on_half": 1 - fold} | {
            metric_key("n_iter", name): pair[fold].n_iter
            for name, pair in fitted.preds.models.items()
        }
        children.append(ChildRun(f"fold-{fold}", {"fold": str(fold)}, params,
                                 fold_metrics | _quality_metrics(fitted.quality, fold)))  # fmt: skip
    return children


def train_and_evaluate(
    rerank: RerankConfig, tracking: MlflowConfig, resolved_config: dict, seed: int, out_dir: Path
) -> TrainResult:
    """The whole job on typed settings: fit, evaluate, write tables, log the run.

    `resolved_config` is only logged (MLflow params and artifact), never read.
    """
    check_settings(rerank)
    fingerprint = check_same_traces(project_path(rerank.features), project_path(rerank.traces))
    budgets = store_budgets(rerank)
    t0 = time.perf_counter()
    fitted = fit(rerank, seed)
    ev = evaluate(rerank, fitted, seed, budgets)
    total = time.perf_counter() - t0
    written = write_tables(out_dir, fitted, ev)
    tags = {"trace_fingerprint": fingerprint, "rerank_model": rerank.model.kind}
    write_record(out_dir, run_record(tracking, resolved_config, tags, fitted, ev, written, total))
    faults.phase("logging")
    run_id = log_or_explain(out_dir, tracking.tracking_uri)
    return TrainResult(
        ev.summary, ev.breakdowns, ev.per_round, fitted.quality, ev.table, run_id, ev.comparisons
    )


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> None:
    retain_freed_heap()  # chunked evaluation reuses the same large blocks (specrank.memory)
    rerank: RerankConfig = OmegaConf.to_object(cfg.rerank)
    tracking: MlflowConfig = OmegaConf.to_object(cfg.mlflow)
    config = OmegaConf.to_container(cfg, resolve=True)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        result = train_and_evaluate(rerank, tracking, config, cfg.seed, out_dir)
    except TrackingError as err:  # the outputs are complete: say how to log them later
        sys.exit(f"error: {err}")
    print(result.table)
    print(f"\nMLflow run {result.run_id}; tables, plots and rerankers in {out_dir}")
    log.info("settings: %s", json.dumps(asdict(rerank), default=str))


if __name__ == "__main__":
    run_entry_point(main, stage="rerank.train")

"""What `rerank.train` logs to MLflow: the parent run's metrics (values, gains, paired
comparisons, prediction quality, stage times) and one child run per fold."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from rerank.job.evaluation import Evaluation
from rerank.job.fitting import Fitted
from specrank.settings.config import MlflowConfig
from specrank.statistics.laws import law_name, pair_key
from specrank.tracking.run_record import ChildRun, RunRecord
from specrank.tracking.train_runs import metric_key


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
    child run per fold (`specrank.tracking.run_record` logs it)."""
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


def pair_tags(summary: pd.DataFrame) -> dict[str, str]:
    """`pair_<law>`: each law's temperature pair T_t|T_d in MLflow's key form ("t1_d0")."""
    if "pair" not in summary:
        return {}
    firsts = summary.drop_duplicates("law")
    return {f"pair_{r.law}": pair_key(*map(float, r.pair.split("|"))) for r in firsts.itertuples()}


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

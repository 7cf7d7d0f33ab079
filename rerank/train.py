"""`python -m rerank.train`: the main job.

Cross-fits the rerankers and calibration controls on the candidate table,
evaluates every selection rule on the recorded pools, bootstraps gains over
draft selection, logs everything to MLflow and prints the results table.

    python -m rerank.train                                   # embedded default traces
    python -m rerank.train rerank_model=lgbm                 # LightGBM instead of HGB
    python -m rerank.train -m rerank_model=hgb,lgbm          # both, as a Hydra multirun
    python -m rerank.train rerank.sweep=true                 # the SPEC budget sweep
    python -m rerank.train experiment=paper                  # the paper's settings
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import hydra
import mlflow
import numpy as np
import pandas as pd
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from decode.trace_schema import trace_store
from features.schema import candidate_store
from rerank.config import SWEEP_BUDGETS, MlflowConfig, RerankConfig
from rerank.evaluate import ROUND_KEYS, EvalPlan, PromptCurves, evaluate_traces
from rerank.models import LABEL_OF_LAW
from rerank.persist import save_reranker
from rerank.plots import gain_vs_budget, reliability
from rerank.predict import (
    FirstFactorPredictions,
    fit_per_depth_maps,
    fold_map,
    per_depth_scores,
    predict_first_factors,
)
from rerank.summary import breakdowns, choose_mixture_weights, results_table, summarise
from specrank import config as _schema  # noqa: F401  (registers the Hydra schema)
from specrank.laws import law_kind, law_name
from specrank.memory import retain_freed_heap
from specrank.paths import project_path
from specrank.shard_store import SchemaError
from specrank.tracking import metric_key, parent_run

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    summary: pd.DataFrame
    breakdowns: pd.DataFrame
    per_round: pd.DataFrame
    quality: pd.DataFrame
    table: str
    run_id: str


def prediction_quality(candidates: pd.DataFrame, preds: FirstFactorPredictions) -> pd.DataFrame:
    """Held-out squared error and top-1 agreement of first-level predictions vs draft probs."""
    frame = candidates.merge(preds.frame, on=[*ROUND_KEYS, "cand_index"], how="inner")
    rows = []
    for temperature, part in frame.groupby("temperature"):
        label = part[LABEL_OF_LAW[law_kind(float(temperature))]].to_numpy(np.float64)
        round_id = part.groupby(["prompt_id", "round_index"]).ngroup().to_numpy()
        for name in ["draft_prob", *preds.rules]:
            pred = part[name].to_numpy(np.float64)
            # top-1: the round's highest predicted candidate is the target's argmax
            order = np.lexsort((-pred, round_id))
            first = order[np.r_[True, round_id[order][1:] != round_id[order][:-1]]]
            for fold in (None, 0, 1):
                m = slice(None) if fold is None else (part["fold"].to_numpy() == fold)
                sel = first if fold is None else first[part["fold"].to_numpy()[first] == fold]
                rows.append(
                    {
                        "temperature": float(temperature),
                        "predictor": name,
                        "fold": "all" if fold is None else fold,
                        "squared_error": float(np.mean((pred[m] - label[m]) ** 2)),
                        "top1_agreement": float(part["label_is_argmax"].to_numpy()[sel].mean()),
                        "candidates": int(np.size(pred[m])),
                    }
                )
    return pd.DataFrame(rows)


def _check_same_traces(features_dir: Path, traces_dir: Path) -> str:
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


def train_and_evaluate(
    rerank: RerankConfig, tracking: MlflowConfig, config: dict, seed: int, out_dir: Path
) -> TrainResult:
    """The whole job on resolved, typed settings. Writes tables and models under `out_dir`."""
    traces_dir, features_dir = project_path(rerank.traces), project_path(rerank.features)
    fingerprint = _check_same_traces(features_dir, traces_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    candidates = candidate_store(features_dir).read().to_pandas()
    folds = fold_map(candidates["prompt_id"].to_numpy(), rerank.halves, seed)
    kind = rerank.model.kind
    preds = predict_first_factors(
        candidates,
        folds,
        kind,
        rerank.feature_sets,
        rerank.calibrators,
        seed,
        rerank.model.n_threads,
    )
    t_fit = time.perf_counter() - t0
    quality = prediction_quality(candidates, preds)
    dataset = trace_store(traces_dir).dataset()
    extra = None
    if "per_depth" in rerank.calibrators:
        maps = fit_per_depth_maps(
            dataset, folds, rerank.calibration_edges, seed, rerank.chunk_rounds
        )

        def extra(pool, table):
            ids = table["prompt_id"].to_numpy(zero_copy_only=False)
            return {"per_depth": per_depth_scores(pool, ids, folds, maps)}

    budgets = sorted(set(rerank.budgets) | (set(SWEEP_BUDGETS) if rerank.sweep else set()))
    plan = EvalPlan(budgets, substitutions=list(rerank.substitutions),
                    mixture_weights=list(rerank.mixture_weights), top_m=rerank.top_m)  # fmt: skip
    curves = PromptCurves()  # per-prompt curves: matched-size PEARL, node-equivalent budgets
    per_round = evaluate_traces(
        dataset, plan, preds.frame, preds.rules, extra, rerank.chunk_rounds, curves=curves
    )
    per_round["fold"] = per_round["prompt_id"].map(folds).astype(np.int8)
    per_round, mix_weights = choose_mixture_weights(per_round)
    summary = summarise(per_round, rerank.n_resamples, seed, curves=curves)
    bd = breakdowns(per_round)
    t_total = time.perf_counter() - t0
    table = results_table(summary)

    # -- files of this run ------------------------------------------------------------
    summary.to_csv(out_dir / "summary.csv", index=False)
    bd.to_csv(out_dir / "breakdowns.csv", index=False)
    quality.to_csv(out_dir / "prediction_quality.csv", index=False)
    mix_weights.to_csv(out_dir / "mixture_weights.csv", index=False)
    per_round.to_parquet(out_dir / "per_round_values.parquet", index=False)
    preds.frame.to_parquet(out_dir / "oof_predictions.parquet", index=False)
    (out_dir / "results.txt").write_text(table + "\n")
    plots = gain_vs_budget(summary, out_dir)
    merged = candidates.merge(preds.frame, on=[*ROUND_KEYS, "cand_index"])
    for temperature, part in merged.groupby("temperature"):
        label = part[LABEL_OF_LAW[law_kind(float(temperature))]].to_numpy(np.float64)
        cols = ["draft_prob", *preds.rules]
        plots.append(
            reliability(
                {c: part[c].to_numpy(np.float64) for c in cols},
                label,
                f"{law_name(temperature)}: out-of-fold reliability",
                out_dir / f"reliability_{law_name(temperature)}.png",
            )
        )
    model_dir = out_dir / "rerankers"
    for name, pair in preds.models.items():
        for fold, model in enumerate(pair):
            save_reranker(model, model_dir / f"{name.replace('/', '_')}_fold{fold}")

    # -- MLflow -------------------------------------------------------------------------
    tags = {"trace_fingerprint": fingerprint, "rerank_model": kind}
    with parent_run(
        tracking.tracking_uri, tracking.experiment, tracking.run_name, config, tags
    ) as run:
        metrics = {"time/total_s": t_total, "time/fit_s": t_fit, "rounds": float(len(per_round))}
        for r in summary[summary["weighting"] == "round"].itertuples():
            law = r.law
            metrics[metric_key("accepted", law, f"B{r.budget}", r.rule)] = r.accepted
            metrics[metric_key("gain", law, f"B{r.budget}", r.rule)] = r.gain
            metrics[metric_key("gain_lo", law, f"B{r.budget}", r.rule)] = r.gain_lo
            metrics[metric_key("gain_hi", law, f"B{r.budget}", r.rule)] = r.gain_hi
            if "node_budget" in summary:  # the draft budget reaching the rule's value
                metrics[metric_key("node_budget", law, f"B{r.budget}", r.rule)] = r.node_budget
        for q in quality[quality["fold"] == "all"].itertuples():
            metrics[metric_key("sq_error", law_name(q.temperature), q.predictor)] = q.squared_error
            metrics[metric_key("top1", law_name(q.temperature), q.predictor)] = q.top1_agreement
        mlflow.log_metrics({k: float(v) for k, v in metrics.items() if np.isfinite(v)})
        for path in [*out_dir.glob("*.csv"), *out_dir.glob("*.parquet"), out_dir / "results.txt"]:
            mlflow.log_artifact(str(path), "tables")
        for path in plots:
            mlflow.log_artifact(str(path), "plots")
        mlflow.log_artifacts(str(model_dir), "rerankers")
        for fold in (0, 1):
            with mlflow.start_run(run_name=f"fold-{fold}", nested=True):
                mlflow.set_tag("fold", str(fold))
                mlflow.log_param("trained_on_half", 1 - fold)
                fold_metrics = {
                    metric_key("fit_s", name): secs[fold]
                    for name, secs in preds.fit_seconds.items()
                }
                for q in quality[quality["fold"] == fold].itertuples():
                    fold_metrics[metric_key("sq_error", law_name(q.temperature), q.predictor)] = (
                        q.squared_error
                    )
                    fold_metrics[metric_key("top1", law_name(q.temperature), q.predictor)] = (
                        q.top1_agreement
                    )
                mlflow.log_metrics(fold_metrics)
        run_id = run.info.run_id
    return TrainResult(summary, bd, per_round, quality, table, run_id)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    retain_freed_heap()  # chunked evaluation reuses the same large blocks (specrank.memory)
    rerank: RerankConfig = OmegaConf.to_object(cfg.rerank)
    tracking: MlflowConfig = OmegaConf.to_object(cfg.mlflow)
    config = OmegaConf.to_container(cfg, resolve=True)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    result = train_and_evaluate(rerank, tracking, config, cfg.seed, out_dir)
    print(result.table)
    print(f"\nMLflow run {result.run_id}; tables, plots and rerankers in {out_dir}")
    log.info("settings: %s", json.dumps(asdict(rerank), default=str))


if __name__ == "__main__":
    main()

"""`python -m rerank.train`: the main job.

Cross-fits the rerankers and calibration controls on the candidate table,
evaluates every selection rule on the recorded pools, bootstraps gains over
draft selection, logs everything to MLflow and prints the results table, then the
acceptance-estimator report (`rerank.job.acceptance`, docs/acceptance.md).

    python -m rerank.train                                   # embedded default traces
    python -m rerank.train booster=hgb                       # HistGradientBoosting, not LightGBM
    python -m rerank.train -m booster=hgb,lgbm               # both, as a Hydra multirun
    python -m rerank.train rerank.sweep=true                 # the SPEC budget sweep
    python -m rerank.train experiment=paper                  # the paper's settings
    python -m rerank.train launcher=ray parallel.workers=4   # fits and evaluation on Ray

The stages live in `rerank.job` (fitting, evaluation, what is logged); on Ray they run as
`rerank.on_ray` says, with the results of one process.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import hydra
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from rerank.config import RerankConfig
from rerank.fit.models import LABEL_OF_LAW
from rerank.fit.persist import save_reranker
from rerank.job.acceptance import AcceptanceReport, report_of, write_acceptance
from rerank.job.evaluation import Evaluation, eval_inputs, evaluate_rules
from rerank.job.fitting import Fitted, fit_inputs, fit_rerankers
from rerank.job.tracked import pair_tags, run_record
from rerank.report.plots import write_plots
from rerank.report.plots_reliability import reliability_table
from rerank.settings import check_stores, check_train
from specrank.runtime import faults
from specrank.runtime.memory import release_freed_heap, retain_freed_heap
from specrank.runtime.parallel import ParallelConfig
from specrank.settings import config as _schema  # noqa: F401  (registers the Hydra schema)
from specrank.settings.cli import exits_on_refusal, run_entry_point
from specrank.settings.config import MlflowConfig
from specrank.settings.paths import CONF_DIR
from specrank.statistics.laws import law_kind, law_name
from specrank.store.files import atomic_write
from specrank.store.trace_schema import trace_store
from specrank.tracking.run_record import TrackingError, log_or_explain, write_record

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
    acceptance: AcceptanceReport | None = None  # rerank.acceptance's report


def _csv(frame: pd.DataFrame) -> Callable[[Path], object]:
    return lambda tmp: frame.to_csv(tmp, index=False)


_PARQUET_BLOCK = 1 << 20  # rows converted to Arrow and written at once


def _parquet(frame: pd.DataFrame) -> Callable[[Path], object]:
    """`frame.to_parquet(tmp, index=False)`, a block of rows at a time: the whole frame's
    Arrow copy is what it spares."""

    def write(tmp: Path) -> None:
        schema = pa.Schema.from_pandas(frame, preserve_index=False)
        with pq.ParquetWriter(tmp, schema) as out:
            for lo in range(0, max(len(frame), 1), _PARQUET_BLOCK):
                block = frame.iloc[lo : lo + _PARQUET_BLOCK]
                out.write_table(pa.Table.from_pandas(block, schema=schema, preserve_index=False))

    return write


def write_tables(out_dir: Path, fitted: Fitted, ev: Evaluation,
                 acceptance: AcceptanceReport | None = None) -> tuple[list[str], list[Path]]:  # fmt: skip
    """Tables, plots and saved rerankers of the run under `out_dir` (with the acceptance
    report's, when given); returns the table files and the plots.

    Every table is written whole or not at all (`atomic_write`); a full disk names the file.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    faults.phase("writing tables")
    tables = {"summary": ev.summary, "comparisons": ev.comparisons, "breakdowns": ev.breakdowns,
              "breakdown_gains": ev.breakdown_gains, **ev.reports,
              "prediction_quality": fitted.quality, "mixture_weights": ev.mixture_weights}  # fmt: skip
    parquets = {"per_round_values": _parquet(ev.per_round),
                "oof_predictions": _parquet(fitted.preds.frame)}  # fmt: skip
    for name, frame in tables.items():
        atomic_write(out_dir / f"{name}.csv", _csv(frame))
    for name, write in parquets.items():
        atomic_write(out_dir / f"{name}.parquet", write)
    text = ev.table + (acceptance.text if acceptance is not None else "")
    atomic_write(out_dir / "results.txt", lambda tmp: tmp.write_text(text + "\n"))
    files = [*(f"{n}.csv" for n in [*tables, "reliability"]), "per_round_values.parquet",
             "oof_predictions.parquet", "results.txt"]  # fmt: skip
    parts, cols = [], ["draft_prob", *fitted.preds.rules]
    laws = fitted.preds.law_columns(fitted.candidates, [*LABEL_OF_LAW.values(), *cols])
    for temperature, part in laws:
        # asarray, not astype: the float64 prediction columns are not copied again
        label = np.asarray(part[LABEL_OF_LAW[law_kind(temperature)]], np.float64)
        preds = {c: np.asarray(part[c], np.float64) for c in cols}
        parts.append(reliability_table(preds, label, law_name(temperature)))
    # logged as a table too, so the notebook redraws the reliability figure from artifacts
    reliability = pd.concat(parts, ignore_index=True)
    atomic_write(out_dir / "reliability.csv", _csv(reliability))
    plots = write_plots(out_dir, ev.summary, ev.comparisons, reliability)
    if acceptance is not None:
        more_files, more_plots = write_acceptance(out_dir, acceptance)
        files, plots = [*files, *more_files], [*plots, *more_plots]
    for name, pair in fitted.preds.models.items():
        for fold, model in enumerate(pair):
            folder = out_dir / "rerankers" / f"{name.replace('/', '_')}_fold{fold}"
            save_reranker(model, folder)
    return files, plots


def train_and_evaluate(
    rerank: RerankConfig,
    tracking: MlflowConfig,
    resolved_config: dict,
    seed: int,
    out_dir: Path,
    parallel: ParallelConfig | None = None,
) -> TrainResult:
    """The whole job on typed settings, stage by stage: check every setting and the stores'
    manifests once, fit, evaluate, report, write tables, log the run. Each stage reads its share of the checked
    settings (`fit_inputs`, `eval_inputs`), not `rerank` itself.

    `resolved_config` is only logged (MLflow params and artifact), never read.
    `parallel.backend=ray`: the fits and the evaluation pass as Ray tasks (`rerank.on_ray`).
    """
    parallel = parallel or ParallelConfig()
    checked = check_train(rerank, parallel)
    stores = check_stores(rerank, checked.features, checked.traces)
    kind = rerank.booster.kind
    t0 = time.perf_counter()
    fitting = fit_inputs(rerank, checked)
    fitted = fit_rerankers(fitting, seed, parallel)
    dataset = trace_store(checked.traces).dataset()
    evaluation = eval_inputs(rerank, checked, stores.budgets)
    ev = evaluate_rules(evaluation, fitted, seed, dataset=dataset, parallel=parallel)
    release_freed_heap()  # the evaluation's freed blocks, before the tables' (as in its tail)
    acceptance = (report_of(checked.features, checked.learned, kind, rerank.n_resamples, fitted, seed,
                            dataset) if rerank.acceptance else None)  # fmt: skip
    total = time.perf_counter() - t0
    written = write_tables(out_dir, fitted, ev, acceptance)
    tags = {"trace_fingerprint": stores.fingerprint, "rerank_model": kind}
    tags |= pair_tags(ev.summary)  # the temperature pairs T_t|T_d, as t1_d0
    record = run_record(tracking, resolved_config, tags, fitted, ev, written, total)
    if acceptance is not None:
        record.metrics |= acceptance.metrics()
    write_record(out_dir, record)
    faults.phase("logging")
    run_id = log_or_explain(out_dir, tracking.tracking_uri)
    table = ev.table + (acceptance.text if acceptance is not None else "")
    return TrainResult(ev.summary, ev.breakdowns, ev.per_round, fitted.quality, table, run_id,
                       ev.comparisons, acceptance)  # fmt: skip


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
@exits_on_refusal
def main(cfg: DictConfig) -> None:
    retain_freed_heap()  # chunked evaluation reuses the same large blocks (specrank.runtime.memory)
    rerank: RerankConfig = OmegaConf.to_object(cfg.rerank)
    tracking: MlflowConfig = OmegaConf.to_object(cfg.mlflow)
    parallel: ParallelConfig = OmegaConf.to_object(cfg.parallel)
    config = OmegaConf.to_container(cfg, resolve=True)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        result = train_and_evaluate(rerank, tracking, config, cfg.seed, out_dir, parallel)
    except TrackingError as err:  # the outputs are complete: say how to log them later
        sys.exit(f"error: {err}")
    print(result.table)
    print(f"\nMLflow run {result.run_id}; tables, plots and rerankers in {out_dir}")
    log.info("settings: %s", json.dumps(asdict(rerank), default=str))


if __name__ == "__main__":
    run_entry_point(main, stage="rerank.train")

"""The job's acceptance-estimator report (`rerank.report.acceptance`): its inputs gathered from
the fitted predictions, the candidate table and the traces; its tables, figures and dump.

`rerank.train` and `rerank.transfer` run it after the evaluation (`rerank.acceptance=false`
leaves it out); `python -m bench.bench_acceptance <run folder>` recomputes its figures from
a saved run's dump.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from features.schema import candidate_store
from rerank.config import RerankConfig
from rerank.evaluate.acceptance_events import (
    candidate_events,
    candidate_positions,
    round_events,
    round_positions,
)
from rerank.evaluate.pool_chunks import ROUND_KEYS
from rerank.fit.models import FEATURE_SETS, LABEL_OF_LAW
from rerank.job.fitting import Fitted
from rerank.report.acceptance import (
    ACCEPTANCE_ROW_COLUMNS,
    acceptance_metrics,
    acceptance_table,
    acceptance_text,
    law_sets,
)
from rerank.report.acceptance_dump import CONTROLS, dump_table, write_dump
from rerank.report.acceptance_plots import (
    acceptance_reliability,
    acceptance_reliability_figure,
    advantage_figure,
    save_figure,
)
from rerank.settings import derived_settings
from specrank.store.files import atomic_write

log = logging.getLogger(__name__)
CANDIDATE_EXTRA = ["token", "draft_rank", "margin_top_sibling"]  # read again from the table
DUMP_FILE = "acceptance_dump.parquet"


@dataclass
class AcceptanceReport:
    table: pd.DataFrame  # rerank.report.acceptance.TABLE_COLUMNS
    reliability: pd.DataFrame  # rerank.report.acceptance_plots.ACCEPTANCE_RELIABILITY_COLUMNS
    dump: pa.Table  # rerank.report.acceptance_dump.DUMP_SPEC
    text: str
    reference: str
    seconds: float  # computing the report
    write_seconds: float = 0.0  # writing its tables, dump and figures (`write_acceptance`)

    def metrics(self) -> dict[str, float]:
        return acceptance_metrics(self.table) | {"time/acceptance_s": self.seconds,
                                                 "time/acceptance_write_s": self.write_seconds}  # fmt: skip


def report_rows(features: Path, fitted: Fitted, dataset: ds.Dataset) -> pd.DataFrame:
    """Every predicted first-level candidate with what the report reads
    (`ACCEPTANCE_ROW_COLUMNS`) and the run's predictions (a column per rule of the run);
    `features`: the candidate table, read again for `CANDIDATE_EXTRA`."""
    frame = fitted.preds.joined(fitted.candidates, ["task", "draft_prob", *LABEL_OF_LAW.values()])
    prompts = pc.field("prompt_id").isin(list(fitted.folds))
    extra = (candidate_store(features).dataset()
             .to_table(columns=[*ROUND_KEYS, "cand_index", *CANDIDATE_EXTRA], filter=prompts)
             .to_pandas())  # fmt: skip
    at = candidate_positions(extra, frame)
    if (at < 0).any():
        raise ValueError(f"{int((at < 0).sum())} predicted candidates are not in the table "
                         f"{features}")  # fmt: skip
    for c in CANDIDATE_EXTRA:
        frame[c] = extra[c].to_numpy()[at]
    rounds = round_events(dataset)
    at = round_positions(rounds, frame)
    for c in ("root_entropy", "order", "draft_confidence"):
        frame[c] = rounds[c].to_numpy()[at]
    frame["event"] = candidate_events(frame["cand_index"].to_numpy(np.int64),
                                      frame["token"].to_numpy(np.int64),
                                      rounds["x1_index"].to_numpy()[at],
                                      rounds["continuation_token"].to_numpy()[at])  # fmt: skip
    greedy = frame["temperature"].to_numpy() == 0
    wrong = int(
        (frame["event"].to_numpy()[greedy] != frame["label_is_argmax"].to_numpy()[greedy]).sum()
    )
    if wrong:  # at T=0 the first token is the argmax: a recording that says otherwise is named
        log.warning("acceptance: %d greedy candidates whose recorded X1 = c disagrees with the "
                    "argmax label", wrong)  # fmt: skip
    return frame[[*ACCEPTANCE_ROW_COLUMNS, *fitted.preds.rules]]


def _reference(rules: list[str], learned: dict[str, str]) -> str:
    """The learned reranker every estimator is paired with: `rows`' when fitted, else the
    first learned rule (the draft probability in a run without one)."""
    names = [learned[fs] for fs in FEATURE_SETS]
    mine = [r for r in rules if r in names]
    rows = learned["rows"]
    return rows if rows in mine else mine[0] if mine else "draft_prob"


def acceptance_report(rerank: RerankConfig, fitted: Fitted, seed: int, dataset: ds.Dataset,
                      crossfit: bool = True) -> AcceptanceReport:  # fmt: skip
    """`report_of` on the settings `rerank` (rerank.transfer's entry)."""
    checked = derived_settings(rerank)
    return report_of(checked.features, checked.learned, rerank.booster.kind, rerank.n_resamples,
                     fitted, seed, dataset, crossfit)  # fmt: skip


def report_of(features: Path, learned: dict[str, str], kind: str, n_resamples: int,
              fitted: Fitted, seed: int, dataset: ds.Dataset,
              crossfit: bool = True) -> AcceptanceReport:  # fmt: skip
    """The report of the run's held-out predictions on the rounds of `dataset`: the candidate
    table `features`, every feature set's `learned` rule under booster `kind`, intervals of
    `n_resamples` draws. `crossfit`: fit vLLM's logistic model on the training half too (both
    halves must be there; not under `rerank.transfer`, whose store holds the evaluated half
    only)."""
    t0 = time.perf_counter()
    rules = list(fitted.preds.rules)
    reference = _reference(rules, learned)
    frame = report_rows(features, fitted, dataset)
    sets = law_sets(frame, rules, crossfit)
    table = acceptance_table(frame, sets, reference, n_resamples, seed)
    reliability = acceptance_reliability(frame, sets)
    columns = {f"reranker_{fs}": learned[fs] for fs in FEATURE_SETS} | {
        c: c for c in CONTROLS}  # fmt: skip
    dump = dump_table(
        frame, sets, {k: v for k, v in columns.items() if v in rules}, kind, reference
    )
    notes = [] if crossfit else [
        "vllm_logit_q / vllm_margin: not fitted here (the store holds the evaluated half "
        "only: no training half to fit on)"]  # fmt: skip
    text = acceptance_text(table, notes)
    return AcceptanceReport(table, reliability, dump, text, reference, time.perf_counter() - t0)


def write_acceptance(out_dir: Path, report: AcceptanceReport) -> tuple[list[str], list[Path]]:
    """`acceptance.csv`, `acceptance_reliability.csv`, the dump and the figures under
    `out_dir`: (the table files, the plots); the time it took goes to `report.write_seconds`."""
    t0 = time.perf_counter()
    for name, frame in (("acceptance", report.table),
                        ("acceptance_reliability", report.reliability)):  # fmt: skip
        atomic_write(out_dir / f"{name}.csv", lambda tmp, f=frame: f.to_csv(tmp, index=False))
    write_dump(out_dir / DUMP_FILE, report.dump)
    plots = []
    if not report.reliability.empty:
        plots.append(out_dir / "acceptance_reliability.png")
        save_figure(acceptance_reliability_figure(report.reliability, report.reference), plots[-1])
    if not report.table.empty:
        plots.append(out_dir / "acceptance_advantage.png")
        save_figure(advantage_figure(report.table), plots[-1])
    report.write_seconds = time.perf_counter() - t0
    return ["acceptance.csv", "acceptance_reliability.csv", DUMP_FILE], plots

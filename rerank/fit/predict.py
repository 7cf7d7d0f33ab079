"""Out-of-fold first-factor predictions of every learned rule (docs/method.md#features-8).

For each decoding law separately (greedy rows are never mixed with sampled rows), cross-fitted
rerankers (one per feature set: Base, Rows and those beyond the paper), the isotonic control of
the first draft factor and the draft-rank control give phat for every first-level candidate
(the per-depth maps of every draft factor: `rerank.fit.per_depth`). Every prediction of a
prompt comes from a model fitted on the other half (`rerank.fit.halves`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from rerank.evaluate.matched import SimulatedPredictions
from rerank.evaluate.pool_chunks import ROUND_KEYS
from rerank.fit.binned import BinnedRuns
from rerank.fit.boosting import PAPER_CAPACITY, Capacity
from rerank.fit.design import same_values
from rerank.fit.folds import add_controls
from rerank.fit.halves import frame_folds
from rerank.fit.law_memo import LawMemo
from rerank.fit.models import LABEL_OF_LAW, FittedReranker
from rerank.fit.out_of_fold import CrossfitResult, FitStore, LawFits
from selection.rules import learned
from specrank.runtime.memory import release_freed_heap
from specrank.statistics.laws import law_kind

log = logging.getLogger(__name__)
# Cross-fits every (temperature, feature set) job elsewhere: (settings, jobs, folds) -> results
Prefit = Callable[
    [LawFits, list[tuple[float, str]], dict[str, int]], Mapping[tuple[float, str], CrossfitResult]
]


@dataclass
class FirstFactorPredictions:
    """ROUND_KEYS + cand_index + fold + one phat column per learned rule, and fitted models."""

    frame: pd.DataFrame
    rules: list[str]
    models: dict[str, tuple[FittedReranker, FittedReranker]] = field(default_factory=dict)
    fit_seconds: dict[str, tuple[float, float]] = field(default_factory=dict)
    # The candidate-table row (position) of each row of `frame`, when made from that table.
    rows: np.ndarray | None = None

    def law_columns(self, candidates: pd.DataFrame, columns: list[str]
                    ) -> Iterator[tuple[float, dict[str, np.ndarray]]]:  # fmt: skip
        """Per temperature (ascending), `columns` of its predictions' rows (of the prediction
        frame or of each one's candidate), as the rows of `joined` give them, without its
        copy of the whole prediction frame."""
        if self.rows is None:  # a frame not made from the candidate table: joined by keys
            merged = self.joined(candidates, [c for c in columns if c not in self.frame])
            for t, part in merged.groupby("temperature"):
                yield float(t), {c: part[c].to_numpy() for c in columns}
            return
        temps = self.frame["temperature"].to_numpy()
        for t in np.unique(temps):
            at = np.flatnonzero(temps == t)
            yield float(t), {c: self.frame[c].to_numpy()[at] if c in self.frame
                             else candidates[c].to_numpy()[self.rows[at]] for c in columns}  # fmt: skip

    def joined(self, candidates: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
        """`columns` of each prediction's candidate beside the prediction frame.

        What `candidates.merge(frame, on=ROUND_KEYS + cand_index)` gives, in the same
        order within each temperature, without a join of the whole candidate table.
        """
        keys = [*ROUND_KEYS, "cand_index"]
        if self.rows is None:
            return candidates[list(dict.fromkeys([*keys, *columns]))].merge(self.frame, on=keys)
        extra = [c for c in columns if c not in self.frame.columns]
        part = candidates[extra].take(self.rows).reset_index(drop=True)
        return pd.concat([self.frame.reset_index(drop=True), part], axis=1)


def predict_first_factors(
    candidates: pd.DataFrame,
    folds: dict[str, int],
    kind: str,
    feature_sets: list[str],
    calibrators: list[str],
    seed: int = 0,
    n_threads: int | None = None,
    rank_q_bins: int = 1,
    capacity: Capacity = PAPER_CAPACITY,
    law_frame: Callable[[float], pd.DataFrame] | None = None,
    prior_split: str = "prompt",
    fits: FitStore | None = None,
    train_share: float = 1.0,
    prefit: Prefit | None = None,
    simulated: SimulatedPredictions | None = None,
) -> FirstFactorPredictions:
    """Cross-fitted phat of every learned first-factor rule, per law (rerankers of ``capacity``).

    ``rank_q_bins``: draft-probability bins within each draft rank of the rank control.
    ``prior_split``: how the token prior alternates the training rows (`rerank.fit.token_prior`).
    ``law_frame(temperature)``, when given, returns every column of that temperature's
    rows, in the order they have in ``candidates``, which then needs only the keys,
    `task` and `temperature` (the job reads one law's features at a time that way); by
    default each law's rows are taken from ``candidates``. ``fits``: where finished fits are
    kept and taken from (`rerank.fit.resume`). ``train_share``: the share of each training
    half's prompts a model is fitted on (`rerank.fit.folds.prompt_subsample`).
    ``prefit(settings, jobs, folds)``, when given, cross-fits every (temperature, feature
    set) of ``jobs`` elsewhere first (Ray workers: `rerank.on_ray`), each as
    ``settings.crossfit`` would here. ``simulated``: its sets' held-out phat with and without
    the matched row too (`with/<rule>`, `without/<rule>`: `rerank.evaluate.matched`).
    """
    parts, rules = [], []
    models: dict[str, tuple[FittedReranker, FittedReranker]] = {}
    seconds: dict[str, tuple[float, float]] = {}
    temperatures = candidates["temperature"].to_numpy()
    settings = LawFits(kind, seed, n_threads, tuple(sorted(candidates["task"].unique())),
                       capacity, prior_split, fits, train_share)  # fmt: skip
    jobs = [(float(t), fs) for t in np.unique(temperatures) for fs in feature_sets]
    done, positions = (prefit(settings, jobs, folds) if prefit is not None else {}), []
    for temperature in np.unique(temperatures):  # a half's rows at a time, not a sorted copy
        law = law_kind(float(temperature))
        rows = np.flatnonzero(temperatures == temperature)
        positions.append(rows)
        frame = _law_rows(candidates, rows, float(temperature), law_frame)
        fold = frame_folds(frame, folds)
        # the keys in the candidate table's own dtypes (categories of the job's strings:
        # 3 bytes a row where two strings take 33), the rows checked equal to the frame's
        out = candidates[[*ROUND_KEYS, "cand_index"]].take(rows).reset_index(drop=True)
        out["fold"] = fold
        runs, memo = BinnedRuns(), LawMemo()  # what the law's feature sets' fits share
        for feature_set in feature_sets:
            name, key = learned(feature_set, kind).name, (float(temperature), feature_set)
            runs.keep = feature_set != feature_sets[-1]  # the last set takes the kept runs
            res = done[key] if key in done else settings.crossfit(frame, *key, folds, runs, memo)
            out[name] = res.phat
            if simulated is not None:
                simulated.add_to(out, name, feature_set, res.models, fold, key[0])
            release_freed_heap()  # the fits' transient matrices
            models[f"{name}/T{temperature:g}"] = res.models
            seconds[f"{name}/T{temperature:g}"] = res.fit_seconds
            if name not in rules:
                rules.append(name)
            log.info("%s at T=%g: fitted in %.1f s + %.1f s, %d + %d iterations", name,
                     temperature, *res.fit_seconds, *(m.n_iter for m in res.models))  # fmt: skip
        controls = add_controls(out, frame, LABEL_OF_LAW[law], fold, calibrators, rank_q_bins)
        for name in controls:
            if name not in rules:
                rules.append(name)
        parts.append(out)
        del frame, runs, memo  # the next law's rows take their place
        release_freed_heap()
    return FirstFactorPredictions(
        pd.concat(parts, ignore_index=True), rules, models, seconds, np.concatenate(positions)
    )


def _law_rows(
    candidates: pd.DataFrame,
    rows: np.ndarray,
    temperature: float,
    law_frame: Callable[[float], pd.DataFrame] | None,
) -> pd.DataFrame:
    """One law's candidate rows `rows`: from ``law_frame`` (checked) or from ``candidates``."""
    if law_frame is None:
        return candidates.take(rows).reset_index(drop=True)
    frame = law_frame(temperature)
    _check_same_rows(frame, candidates, rows, temperature)
    return frame


def _check_same_rows(
    frame: pd.DataFrame, candidates: pd.DataFrame, rows: np.ndarray, temperature: float
) -> None:
    """A law's rows as `law_frame` gave them must be `candidates`' rows `rows`, in order."""
    keys = [*ROUND_KEYS, "cand_index"]
    if len(frame) != rows.size:
        raise ValueError(
            f"law_frame({temperature:g}) gave {len(frame)} rows; the candidate table has "
            f"{rows.size} at T={temperature:g}"
        )
    for key in keys:  # Series compared as Series: no Python string per row
        got = frame[key].reset_index(drop=True)
        want = candidates[key].iloc[rows].reset_index(drop=True)
        bad = np.flatnonzero(~same_values(got, want))
        if bad.size:
            raise ValueError(
                f"law_frame({temperature:g}) gave its rows in another order than the candidate "
                f"table: row {bad[0]} has {key}={got[bad[0]]!r}, the table {want[bad[0]]!r}"
            )

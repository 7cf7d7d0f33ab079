"""Out-of-fold prediction over the two prompt halves (cross-fitting, docs/method.md#cross-fitting): each half's
model is fitted on the other half and predicts its own rows, the two fits at once; a fit
kept by an earlier run is taken instead of refitted (`rerank.fit.resume`)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pandas as pd

from rerank.fit.binned import BinnedRuns
from rerank.fit.boosting import PAPER_CAPACITY, Capacity, fit_estimator
from rerank.fit.design import DesignRows, fold_design, task_categories
from rerank.fit.fingerprints import fold_fit_keys, hash_rows
from rerank.fit.halves import frame_folds
from rerank.fit.law_memo import LawMemo
from rerank.fit.law_split import shared_split
from rerank.fit.models import (
    BATCH_ROUTE,
    FittedReranker,
    check_law_frame,
    feature_list,
    fingerprint_columns,
)
from rerank.fit.token_prior import DEFAULT_PSEUDO_COUNT
from specrank.statistics.laws import law_kind

log = logging.getLogger(__name__)


def fold_workers(n_threads: int | None, n_fits: int) -> tuple[int, int]:
    """(fits at once, threads per fit) for `n_threads` in all (None: every core)."""
    total = n_threads or len(os.sched_getaffinity(0))
    workers = max(1, min(n_fits, total))
    return workers, max(1, total // workers)


@dataclass
class CrossfitResult:
    """Out-of-fold predictions: ``phat[i]`` comes from ``models[folds[i]]``.

    ``models[f]`` was trained on the rows with fold ``1 - f`` and predicted
    the rows with fold ``f``; ``fit_seconds[f]`` is its fitting wall time.
    """

    phat: np.ndarray
    folds: np.ndarray
    models: tuple[FittedReranker, FittedReranker]
    fit_seconds: tuple[float, float]


def crossfit_predict(
    frame: pd.DataFrame,
    feature_set: str,
    kind: str,
    law: str,
    folds: np.ndarray,
    seed: int = 0,
    n_threads: int | None = None,
    categories: Sequence[str] | None = None,
    capacity: Capacity = PAPER_CAPACITY,
    pseudo_count: float = DEFAULT_PSEUDO_COUNT,
    sample_weight: np.ndarray | None = None,
    route: str | None = None,
    prior_split: str = "prompt",
    fits: FitStore | None = None,
    train_share: float = 1.0,
    runs: BinnedRuns | None = None,
    memo: LawMemo | None = None,
) -> CrossfitResult:
    """Out-of-fold phat (float64 in [PROB_FLOOR, 1]) for every row of one law's frame.

    ``folds`` come from `rerank.fit.halves.prompt_halves` (checked constant
    within each prompt). Task categories are fixed from the whole frame
    unless declared. The token prior is computed inside each fold, and so is
    early stopping's inner split (`rerank.fit.boosting`): neither reads the
    predicted half. ``sample_weight`` (one per row) weighs the training rows' loss.
    ``route`` predicts the held-out half (`FittedReranker.predict_matrix`; None: the
    faster one for ``kind``, `BATCH_ROUTE`). ``fits``: finished fits are kept there and a
    fit found there is taken instead of refitted (`rerank.fit.resume`). ``train_share``: each
    half's model is fitted on that share of its training prompts (`prompt_subsample`) and
    still predicts the whole other half. ``runs``: LightGBM's binned columns of ``frame``,
    shared with the cross-fits of its other feature sets (`rerank.fit.binned`). ``memo``: what
    those cross-fits compute alike (`rerank.fit.law_memo`; None: this cross-fit's own).
    """
    sample_weight = _checked_weights(sample_weight, len(frame))
    check_law_frame(frame, kind, law)
    features = feature_list(feature_set)
    fp_cols = fingerprint_columns(frame, features, law)
    folds = np.asarray(folds)
    prompt_ids, tasks, masks, y, priors, trained = shared_split(
        memo, frame, law, folds, train_share, seed, pseudo_count, prior_split)  # fmt: skip
    cats = task_categories(frame, categories)
    design, column = fold_design(frame, features, cats, masks, priors, pseudo_count,
                                 prior_split == "prompt")  # fmt: skip
    phat = np.full(len(frame), np.nan, dtype=np.float64)
    route = BATCH_ROUTE[kind] if route is None else route
    workers, fit_threads = fold_workers(n_threads, len(masks))
    keys, prints = fold_fit_keys(fp_cols, hash_rows(frame, fp_cols), masks, sample_weight,
                                 kind=kind, law=law, feature_set=feature_set, features=features,
                                 categories=list(cats), capacity=vars(capacity), seed=seed,
                                 prior_split=prior_split, pseudo_count=pseudo_count, route=route)  # fmt: skip
    saved = _taken(fits, keys, [int(p.sum()) for _, _, p in masks], features, prints,
                   f"{feature_set} {law}")  # fmt: skip

    def fit_fold(train: np.ndarray) -> Any:
        return fit_estimator(
            design, y, features, kind, law, capacity, seed, fit_threads, sample_weight=sample_weight,
            groups=prompt_ids, tasks=tasks, rows=np.flatnonzero(train), prior=column, runs=runs,
            memo=memo,
        )  # fmt: skip

    todo = [i for i, s in enumerate(saved) if s is None]
    fitted = dict(zip(todo, _fit_folds(fit_fold, [masks[i][1] for i in todo], workers),
                      strict=True))  # fmt: skip
    # No return of the heap here: the job keeps it (`retain_freed_heap` at the entry point),
    # so the held-out blocks reuse the fits' freed copies rather than mapping and zeroing
    # fresh pages; the caller returns it after each cross-fit. experiment=paper's job took
    # 14.1 system s through its first three pairs of fits against 19.6 with a return here (one
    # job each; bench/SCALING.md).
    for i, ((_, _, predict), (prior, full)) in enumerate(zip(masks, priors, strict=True)):
        if saved[i] is None:
            est, secs = fitted[i]
            model = FittedReranker(kind=kind, law=law, feature_set=feature_set, features=features,
                categories=cats, estimator=est, token_prior=full, train_fingerprint=prints[i][0],
                seed=seed, capacity=capacity, train_prompts=trained[i])  # fmt: skip
            # the other fold's rows, with this fold's prior
            rows = DesignRows(design, np.flatnonzero(predict), prior[predict], column.column)
            saved[i] = SavedFit(model, predict_blocks(model, rows, n_threads, route), secs)
            if fits is not None:
                fits.save(keys[i], saved[i])
        phat[predict] = saved[i].phat
    models, seconds = zip(*((f.model, f.seconds) for f in saved), strict=True)
    return CrossfitResult(phat, folds.astype(np.int8), models, seconds)


@dataclass(frozen=True)
class LawFits:
    """What every (law, feature set) cross-fit of a job shares beyond its rows: one place, so
    a fit run here and one run by a Ray worker (`rerank.on_ray`) are the same call."""

    kind: str
    seed: int
    n_threads: int | None
    categories: tuple[str, ...]  # every task of the store, for the one-hot columns
    capacity: Capacity
    prior_split: str
    fits: FitStore | None
    train_share: float

    def crossfit(self, frame: pd.DataFrame, temperature: float, feature_set: str,
                 folds: dict[str, int], runs: BinnedRuns | None = None,
                 memo: LawMemo | None = None) -> CrossfitResult:  # fmt: skip
        """`crossfit_predict` of one law's rows `frame` with these settings (``runs``: the binned
        columns of ``frame``'s other feature sets' fits; ``memo``: what they compute alike)."""
        return crossfit_predict(
            frame, feature_set, self.kind, law_kind(temperature), frame_folds(frame, folds),
            seed=self.seed, n_threads=self.n_threads, categories=self.categories,
            capacity=self.capacity, prior_split=self.prior_split, fits=self.fits,
            train_share=self.train_share, runs=runs, memo=memo,
        )  # fmt: skip


_PREDICT_BLOCK = 1 << 19  # held-out rows predicted at once (about 120 MB of 57 floats)


def predict_blocks(model: FittedReranker, rows: DesignRows, n_threads: int | None,
                   route: str) -> np.ndarray:  # fmt: skip
    """`model.predict_matrix` of ``rows``, a block of rows at a time (each row's phat
    depends on that row alone): a fit at 10x the paper never copies a half's matrix."""
    parts = [model.predict_matrix(rows.matrix(slice(lo, lo + _PREDICT_BLOCK)), n_threads, route)
             for lo in range(0, len(rows), _PREDICT_BLOCK)]  # fmt: skip
    return np.concatenate(parts) if parts else np.empty(0, np.float64)


def _taken(fits: FitStore | None, keys: list[str], n_predicted: list[int],
           features: list[str], prints: list[tuple[str, str]], what: str,
           ) -> list[SavedFit | None]:  # fmt: skip
    """Per half, the fit an earlier run kept under its key (None: to be fitted)."""
    if fits is None:
        return [None] * len(keys)
    saved = [fits.load(k, n, features, t) for k, n, (t, _) in zip(keys, n_predicted, prints,
                                                                 strict=True)]  # fmt: skip
    if taken := sum(s is not None for s in saved):
        log.info("%s: %d of %d halves' fits taken from %s, not refitted", what, taken,
                 len(keys), fits)  # fmt: skip
    return saved


@dataclass(frozen=True)
class SavedFit:
    """One half's finished fit: what a rerun takes instead of refitting (`rerank.fit.resume`)."""

    model: FittedReranker
    phat: np.ndarray  # [n predicted rows] float64, the held-out half's
    seconds: float  # the fitting wall time of the run that fitted it


class FitStore(Protocol):
    """Where finished fits are kept (`rerank.fit.resume.FitStore`)."""

    def load(
        self, key: str, n_rows: int, features: list[str], fingerprint: str
    ) -> SavedFit | None: ...

    def save(self, key: str, fit: SavedFit) -> None: ...


def _checked_weights(sample_weight: np.ndarray | None, n_rows: int) -> np.ndarray | None:
    """``sample_weight`` as float64, refused unless it holds one weight per row."""
    if sample_weight is None:
        return None
    sample_weight = np.asarray(sample_weight, dtype=np.float64)
    if sample_weight.shape != (n_rows,):
        raise ValueError(f"sample_weight has shape {sample_weight.shape}; expected ({n_rows},)")
    return sample_weight


def _fit_folds(
    fit: Callable[[np.ndarray], Any], trains: list[np.ndarray], workers: int
) -> list[tuple[Any, float]]:
    """(estimator, fitting wall time) of ``fit(train)`` for each fold's training mask."""

    def timed(train: np.ndarray) -> tuple[Any, float]:
        t0 = time.perf_counter()
        est = fit(train)
        return est, time.perf_counter() - t0

    # The two folds fit at once, one thread each on two cores: OpenMP's barriers inside
    # one multi-threaded fit wait on a descheduled thread whenever the machine is busy
    # (fits several times slower than one thread; bench/bench_online.py --small-fit).
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(timed, trains))

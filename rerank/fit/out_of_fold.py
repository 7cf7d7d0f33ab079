"""Out-of-fold prediction over the two prompt halves (cross-fitting, docs/method.md#cross-fitting): each half's
model is fitted on the other half and predicts its own rows, the two fits at once; a fit
kept by an earlier run is taken instead of refitted (`rerank.fit.resume`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import pandas as pd

from rerank.fit.binned import BinnedRuns
from rerank.fit.boosting import PAPER_CAPACITY, Capacity, fit_estimator
from rerank.fit.design import (
    TOKEN_PRIOR,
    DesignColumns,
    DesignRows,
    digest_rows,
    hash_rows,
    per_value,
    shared_strings,
    task_categories,
)
from rerank.fit.folds import check_grouped, fold_masks, prompt_subsample
from rerank.fit.law_memo import LawMemo, rows_key
from rerank.fit.models import (
    BATCH_ROUTE,
    FittedReranker,
    _check_args,
    _fingerprint_columns,
    _labels,
    _prior_groups,
    _prompts,
    feature_list,
)
from rerank.fit.token_prior import DEFAULT_PSEUDO_COUNT, PriorColumn, token_prior_features
from specrank.laws import law_kind

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

    ``folds`` come from `rerank.fit.folds.prompt_halves` (checked constant
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
    _check_args(frame, kind, law)
    folds = _checked_folds(folds, len(frame))
    prompt_ids, tasks, masks, y, priors, trained = _shared_split(
        memo, frame, law, folds, train_share, seed, pseudo_count, prior_split)  # fmt: skip
    features = feature_list(feature_set)
    cats = task_categories(frame, categories)
    design, column = _design(frame, features, cats, masks, priors, pseudo_count,
                             prior_split == "prompt")  # fmt: skip
    fp_cols = _fingerprint_columns(frame, features, law)
    sample_weight = _checked_weights(sample_weight, len(frame))
    phat = np.full(len(frame), np.nan, dtype=np.float64)
    route = BATCH_ROUTE[kind] if route is None else route
    workers, fit_threads = fold_workers(n_threads, len(masks))

    def fit_fold(train: np.ndarray) -> Any:
        return fit_estimator(
            design, y, features, kind, law, capacity, seed, fit_threads, sample_weight=sample_weight,
            groups=prompt_ids, tasks=tasks, rows=np.flatnonzero(train), prior=column, runs=runs,
            memo=memo,
        )  # fmt: skip

    keys, prints = _fit_keys(fp_cols, hash_rows(frame, fp_cols), masks, sample_weight, kind=kind, law=law,
                             feature_set=feature_set, features=features, categories=list(cats),
                             capacity=vars(capacity), seed=seed, prior_split=prior_split,
                             pseudo_count=pseudo_count, route=route)  # fmt: skip
    saved = _taken(fits, keys, [int(p.sum()) for _, _, p in masks], features, prints,
                   f"{feature_set} {law}")  # fmt: skip
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


def prompt_folds(prompt_id: pd.Series, folds: dict[str, int]) -> np.ndarray:
    """Each row's fold (-1: a prompt outside the fold map), looked up once per distinct
    prompt (`per_value`; a dictionary-encoded Arrow column converts to a categorical one
    without a string per row): a per-row map of the strings slowed the per-depth maps' fit
    at paper scale."""
    return per_value(prompt_id, lambda ids: np.array([folds.get(p, -1) for p in ids], np.int64), -1)


def frame_folds(frame: pd.DataFrame, folds: dict[str, int]) -> np.ndarray:
    """The fold (int8) of each row's prompt; refuses prompts outside the fold map."""
    fold = prompt_folds(frame["prompt_id"], folds)
    if (fold < 0).any():
        raise ValueError("candidate rows with prompts outside the fold map")
    return fold.astype(np.int8)


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


def _training_masks(folds: np.ndarray, prompt_ids: np.ndarray, tasks: np.ndarray,
                    share: float, seed: int) -> list[tuple[int, np.ndarray, np.ndarray]]:  # fmt: skip
    """`fold_masks`, each training mask cut to `share` of its prompts (by task)."""
    out = []
    for f, train, predict in fold_masks(folds):
        if share < 1.0:
            train = train.copy()
            train[train] = prompt_subsample(prompt_ids[train], share, seed, tasks[train])
        out.append((f, train, predict))
    return out


def _checked_folds(folds: np.ndarray, n_rows: int) -> np.ndarray:
    folds = np.asarray(folds)
    if folds.shape != (n_rows,):
        raise ValueError(f"folds has shape {folds.shape}; expected ({n_rows},)")
    return folds


def _fit_keys(fp_cols: list[str], row_hashes: np.ndarray, masks: list,
              sample_weight: np.ndarray | None, **fields: Any,
              ) -> tuple[list[str], list[tuple[str, str]]]:  # fmt: skip
    """Per half, the key of its fit (`fit_key` of `fields`, the sample weights' digest and the
    training and predicted rows' fingerprints) and those two fingerprints."""
    weights = None if sample_weight is None else hashlib.sha256(sample_weight).hexdigest()
    prints = [(digest_rows(fp_cols, row_hashes[t]), digest_rows(fp_cols, row_hashes[p]))
              for _, t, p in masks]  # fmt: skip
    keys = [fit_key({**fields, "weights": weights, "train": t, "predict": p}) for t, p in prints]
    return keys, prints


class LawSplit(NamedTuple):
    """What a law's cross-fits share whatever the feature set (`_law_split`)."""

    prompt_ids: np.ndarray  # object arrays whose rows share one string per distinct id
    tasks: np.ndarray
    masks: list  # (fold, training rows, predicted rows) of each half
    y: np.ndarray
    priors: list  # each fold's (token prior of every row, the prior fitted on its half)
    trained: list  # each fold's training prompts (`FittedReranker.train_prompts`)


def _shared_split(memo: LawMemo | None, frame: pd.DataFrame, law: str, folds: np.ndarray,
                  *settings: Any) -> LawSplit:  # fmt: skip
    """`_law_split` of these settings (train_share, seed, pseudo_count, prior_split), from
    ``memo`` when an earlier feature set computed it."""
    key = ("split", law, rows_key(folds), *settings)
    return (LawMemo() if memo is None else memo).get(
        key, lambda: _law_split(frame, law, folds, *settings)
    )


def _law_split(frame: pd.DataFrame, law: str, folds: np.ndarray, train_share: float, seed: int,
               pseudo_count: float, prior_split: str) -> LawSplit:  # fmt: skip
    """The folds' rows (checked grouped by prompt), the labels, each fold's token prior and
    training prompts."""
    # Object arrays whose rows share one string per distinct id (8 bytes a row): a string
    # per row, Python's or numpy's, would cost 50-100 bytes a row at every fit.
    prompt_ids, tasks = (shared_strings(frame[c]) for c in ("prompt_id", "task"))
    check_grouped(prompt_ids, folds)
    masks = _training_masks(folds, prompt_ids, tasks, train_share, seed)
    y = _labels(frame, law)
    tokens, by_prompt = frame["token"].to_numpy(), _prior_groups(prior_split, prompt_ids)
    priors = [token_prior_features(tokens, y, train, pseudo_count, by_prompt)
              for _, train, _ in masks]  # fmt: skip
    trained = [_prompts(prompt_ids[train]) for _, train, _ in masks]
    return LawSplit(prompt_ids, tasks, masks, y, priors, trained)


def _design(frame: pd.DataFrame, features: list[str], cats: list[str], masks: list,
            priors: list, pseudo_count: float, by_prompt: bool) -> tuple:  # fmt: skip
    """(the design's columns, the prior column) for both folds' fits."""
    # One design for both folds, its rows read in blocks by each fit. The folds' training
    # halves are disjoint, so each sets its own training rows' prior column in place.
    design = DesignColumns(frame, features, cats, np.zeros(len(frame), np.float32))
    for (_, train, _), (prior, _) in zip(masks, priors, strict=True):
        design.prior[train] = prior[train]
    tokens = frame["token"].to_numpy()
    return design, PriorColumn(features.index(TOKEN_PRIOR), tokens, pseudo_count, by_prompt)


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


def fit_key(fields: dict[str, Any]) -> str:
    """A stable digest of everything a fit and its held-out prediction read."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


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

"""Two-fold cross-fitting grouped by prompt (docs/method.md#cross-fitting).

Every row gets a fold id in {0, 1}, constant within a prompt. Convention used
everywhere in `rerank` and `calibrate`: rows with fold ``f`` are PREDICTED by a
model TRAINED on the rows with fold ``1 - f``. So a reported number is always
out-of-fold, and a prompt's rounds never inform their own predictions (rounds
of one prompt share context, so a row-level split would leak).

Which half each prompt is in is `rerank.fit.halves`'; here: the rows each half's fits train on
and predict (checked grouped by prompt), the inner validation split and the training
subsample within a half, and the cross-fitted calibration controls.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd

from calibrate.isotonic import DEFAULT_BINS, EqualCountIsotonic, PerDepthIsotonic
from calibrate.rank_control import DraftRankMeans
from specrank.settings.errors import Refusal


def distinct_strings(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(values.astype(str), return_inverse=True)`: sorted distinct strings, row codes.

    Hashes the rows (pandas' factorize) and converts only the distinct values: a string
    copy of every row (48 bytes per candidate at paper scale) and its sort are what this
    avoids.
    """
    codes, distinct = pd.factorize(np.asarray(values).ravel(), use_na_sentinel=False)
    names, inverse = np.unique(np.asarray(distinct).astype(str), return_inverse=True)
    return names, inverse[codes]


def prompt_tasks(
    ids: np.ndarray, tasks: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted distinct prompts, the one task of each ("" for all when `tasks` is None), and
    the index of each row's prompt among them."""
    uniq, inverse = distinct_strings(ids)
    if tasks is None:
        return uniq, np.full(uniq.size, "", dtype=object), inverse
    tasks = np.asarray(tasks)
    if tasks.shape != np.shape(ids):
        raise ValueError(f"prompt_ids shape {np.shape(ids)} != tasks shape {tasks.shape}")
    task_names, task = distinct_strings(tasks)
    _, first = np.unique(inverse, return_index=True)  # each prompt's first row
    per_prompt = task[first]
    mixed = uniq[np.bincount(inverse, weights=task != per_prompt[inverse], minlength=uniq.size) > 0]
    if mixed.size:
        raise ValueError(
            f"{mixed.size} prompt(s) carry more than one task, e.g. {mixed[:5].tolist()}; "
            f"a prompt's rows must share its task"
        )
    return uniq, task_names[per_prompt], inverse


def check_grouped(prompt_ids: np.ndarray, folds: np.ndarray) -> None:
    """Refuse fold ids that are not in {0, 1} or that split a prompt across folds.

    Run on persisted fold ids before trusting them: a prompt in both folds
    would be predicted by a model trained on some of its own rounds.
    """
    ids = np.asarray(prompt_ids)
    folds = np.asarray(folds)
    if ids.shape != folds.shape:
        raise ValueError(f"prompt_ids shape {ids.shape} != folds shape {folds.shape}")
    bad_vals = np.setdiff1d(np.unique(folds), [0, 1])
    if bad_vals.size:
        raise ValueError(f"fold ids must be 0 or 1; found {bad_vals.tolist()}")
    uniq, inverse = distinct_strings(ids)
    lo = np.full(uniq.size, 2, dtype=np.int64)
    hi = np.full(uniq.size, -1, dtype=np.int64)
    np.minimum.at(lo, inverse, folds.astype(np.int64))
    np.maximum.at(hi, inverse, folds.astype(np.int64))
    split = uniq[lo != hi]
    if split.size:
        raise ValueError(
            f"{split.size} prompt(s) have rows in both folds, e.g. {split[:5].tolist()}; "
            f"fold ids must be constant within a prompt"
        )


def train_prompts(prompt_ids: np.ndarray) -> tuple[str, ...]:
    """A model's `train_prompts`: the sorted distinct prompts it was fitted on."""
    return tuple(distinct_strings(prompt_ids)[0].tolist())


_INNER_STREAM = 1  # keeps the inner split's random stream apart from the halves' (stream 0)


def inner_validation(
    prompt_ids: np.ndarray, share: float, seed: int = 0, tasks: np.ndarray | None = None
) -> np.ndarray:
    """Rows of the prompts held out to choose capacity by early stopping (bool per row).

    Run on the rows of ONE training half: the split never sees the predicted half.
    Grouped by prompt (a prompt's rounds share context) and stratified by task:
    each task's distinct prompts (sorted, then shuffled by a stream seeded with
    (seed, task)) are spread evenly over [0, 1); the ``round(share * n)`` prompts
    with the lowest positions are held out (at least one, never all), so every
    task gives about ``share`` of its prompts. The split depends only on the set of
    prompts, their tasks and ``seed``, not on row order.
    """
    if not 0.0 < share < 1.0:
        raise Refusal(
            f"The 'rerank.booster.validation_share' must be in (0, 1). Got {share!r} instead."
        )
    uniq, per_task, inverse = prompt_tasks(np.asarray(prompt_ids), tasks)
    if uniq.size < 2:
        raise Refusal(
            f"early stopping needs >= 2 training prompts (one to hold out); the training half "
            f"has {uniq.size}. Use a fixed capacity (rerank.booster.early_stopping=false)."
        )
    position = _spread(uniq, per_task, seed, _INNER_STREAM)
    n_val = min(max(1, round(share * uniq.size)), uniq.size - 1)
    held = np.zeros(uniq.size, dtype=bool)
    held[np.argsort(position, kind="stable")[:n_val]] = True
    return held[inverse]


_SUBSAMPLE_STREAM = (
    2  # the training subsample's stream, apart from the halves' and the inner split's
)


def prompt_subsample(
    prompt_ids: np.ndarray, share: float, seed: int = 0, tasks: np.ndarray | None = None
) -> np.ndarray:
    """Rows of `share` of the prompts (bool per row; at least one prompt), stratified by task
    as `inner_validation` spreads them, on its own seeded stream (`rerank.train_share`).
    The subsample depends only on the set of prompts, their tasks and `seed`."""
    if not 0.0 < share <= 1.0:
        raise Refusal(f"The 'rerank.train_share' must be in (0, 1]. Got {share!r} instead.")
    if share == 1.0:
        return np.ones(np.shape(prompt_ids), dtype=bool)
    uniq, per_task, inverse = prompt_tasks(np.asarray(prompt_ids), tasks)
    position = _spread(uniq, per_task, seed, _SUBSAMPLE_STREAM)
    keep = np.zeros(uniq.size, dtype=bool)
    keep[np.argsort(position, kind="stable")[: max(1, round(share * uniq.size))]] = True
    return keep[inverse]


def _spread(uniq: np.ndarray, per_task: np.ndarray, seed: int, stream: int) -> np.ndarray:
    """Each prompt's position in [0, 1): within each task (its distinct prompts sorted, then
    shuffled by a stream seeded with (seed, task, stream)) spread evenly, so the lowest
    positions take about the same share of every task."""
    position = np.empty(uniq.size)
    for task in np.unique(per_task):
        members = np.flatnonzero(per_task == task)  # sorted ids: independent of row order
        rng = np.random.default_rng([seed, zlib.crc32(str(task).encode("utf-8")), stream])
        # members[perm[j]] sits at (j + u) / n: evenly spread, a seeded offset u per task
        position[members[rng.permutation(members.size)]] = (
            np.arange(members.size) + rng.random()
        ) / members.size
    return position


def fold_masks(folds: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yield ``(f, train_mask, predict_mask)`` for f = 0, 1 (train on 1-f, predict f)."""
    folds = np.asarray(folds)
    for f in (0, 1):
        predict = folds == f
        train = folds == 1 - f
        if not train.any() or not predict.any():
            raise Refusal(
                f"fold {f}: {int(train.sum())} training rows (fold {1 - f}) and "
                f"{int(predict.sum())} rows to predict; both halves must be non-empty (expected "
                f"a candidate table, rerank.features, with prompts of each temperature in both "
                f"rerank.halves halves)"
            )
        yield f, train, predict


def training_masks(folds: np.ndarray, prompt_ids: np.ndarray, tasks: np.ndarray,
                   share: float, seed: int) -> list[tuple[int, np.ndarray, np.ndarray]]:  # fmt: skip
    """`fold_masks`, each training mask cut to `share` of its prompts (by task)."""
    out = []
    for f, train, predict in fold_masks(folds):
        if share < 1.0:
            train = train.copy()
            train[train] = prompt_subsample(prompt_ids[train], share, seed, tasks[train])
        out.append((f, train, predict))
    return out


@dataclass
class CalibrationResult:
    """Out-of-fold calibrated probabilities; ``maps[f]`` was fitted on fold 1-f, applied to f."""

    prob: np.ndarray
    folds: np.ndarray
    maps: tuple[EqualCountIsotonic | PerDepthIsotonic, EqualCountIsotonic | PerDepthIsotonic]


def crossfit_calibrate(
    x: np.ndarray,
    y: np.ndarray,
    folds: np.ndarray,
    depth: np.ndarray | None = None,
    n_bins: int = DEFAULT_BINS,
) -> CalibrationResult:
    """Cross-fitted calibration: `EqualCountIsotonic`, or `PerDepthIsotonic` if ``depth`` is given.

    ``folds`` are prompt halves of the rows (`prompt_halves`);
    labels of the predicted half are never read by its map.
    """
    x = np.asarray(x, dtype=np.float64).ravel()
    y = np.asarray(y, dtype=np.float64).ravel()
    folds = np.asarray(folds)
    if not (x.shape == y.shape == folds.shape):
        raise ValueError(f"x {x.shape}, y {y.shape} and folds {folds.shape} differ in shape")
    prob = np.full(x.shape, np.nan)
    maps = []
    for _, train, predict in fold_masks(folds):
        if depth is None:
            m = EqualCountIsotonic(n_bins).fit(x[train], y[train])
            prob[predict] = m.predict(x[predict])
        else:
            d = np.asarray(depth).ravel()
            m = PerDepthIsotonic(n_bins).fit(x[train], y[train], d[train])
            prob[predict] = m.predict(x[predict], d[predict])
        maps.append(m)
    return CalibrationResult(prob, folds.astype(np.int8), (maps[0], maps[1]))


def crossfit_rank_control(
    rank: np.ndarray, q: np.ndarray, y: np.ndarray, folds: np.ndarray, q_bins: int = 1
) -> tuple[np.ndarray, tuple[DraftRankMeans, DraftRankMeans]]:
    """Cross-fitted draft-rank control (`calibrate.rank_control`): a half's values from the other."""
    rank, q, y, folds = (np.asarray(a).ravel() for a in (rank, q, y, folds))
    prob = np.full(rank.shape, np.nan)
    maps = []
    for _, train, predict in fold_masks(folds):
        m = DraftRankMeans(q_bins).fit(rank[train], q[train], y[train])
        prob[predict] = m.predict(rank[predict], q[predict])
        maps.append(m)
    return prob, (maps[0], maps[1])


def add_controls(out: pd.DataFrame, frame: pd.DataFrame, label: str, fold: np.ndarray,
                 calibrators: list[str], rank_q_bins: int) -> list[str]:  # fmt: skip
    """Add the cross-fitted controls among ``calibrators`` of one law's rows ``frame`` (its
    label column ``label``, its rows' halves ``fold``) to ``out``; their names, in order."""
    added = []
    if "rank_control" in calibrators:
        # the draft-rank control: the other half's mean label at the candidate's draft rank
        y = frame[label].to_numpy()
        out["rank_control"], _ = crossfit_rank_control(
            frame["draft_rank"].to_numpy(), frame["draft_prob"].to_numpy(), y, fold,
            rank_q_bins,
        )  # fmt: skip
        added.append("rank_control")
    if "iso_q1" in calibrators:
        # isotonic map of the first draft factor over 200 equal-count bins (docs/method.md#cross-fitting)
        x, y = frame["draft_prob"].to_numpy(), frame[label].to_numpy()
        out["iso_q1"] = crossfit_calibrate(x, y, fold).prob
        added.append("iso_q1")
    return added

"""Two-fold cross-fitting grouped by prompt (SPEC §8).

Every row gets a fold id in {0, 1}, constant within a prompt. Convention used
everywhere in `rerank` and `calibrate`: rows with fold ``f`` are PREDICTED by a
model TRAINED on the rows with fold ``1 - f``. So a reported number is always
out-of-fold, and a prompt's rounds never inform their own predictions (rounds
of one prompt share context, so a row-level split would leak).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from calibrate.isotonic import DEFAULT_BINS, EqualCountIsotonic, PerDepthIsotonic

SCHEMES = ("even_odd", "seeded")
_TRAILING_INT = re.compile(r"(\d+)$")


def prompt_halves(prompt_ids: np.ndarray, scheme: str = "even_odd", seed: int = 0) -> np.ndarray:
    """Fold id (int8, 0/1) per row, the same for every row of a prompt.

    ``even_odd`` (the paper): the trailing integer of the prompt id decides,
    even -> 0, odd -> 1 ("spec_bench-81" -> 1, "HumanEval/3" -> 1,
    "synth-000012" -> 0). Ids without a trailing number are refused: guessing a
    number for them would silently make the split depend on string details.

    ``seeded``: a random half of the distinct prompts (sorted first, so the
    split depends only on the set of prompts and ``seed``, not on row order)
    gets fold 0 (ceil(n/2) prompts), the rest fold 1.

    Raises ValueError when either half would be empty: nothing could be
    trained for the other half.
    """
    ids = np.asarray(prompt_ids).astype(str)
    if ids.ndim != 1:
        raise ValueError(f"prompt_ids must be 1-D; got shape {ids.shape}")
    if ids.size == 0:
        raise ValueError("prompt_ids is empty: nothing to split")
    uniq, inverse = np.unique(ids, return_inverse=True)
    if scheme == "even_odd":
        per_prompt = np.empty(uniq.size, dtype=np.int8)
        bad = []
        for i, pid in enumerate(uniq):
            m = _TRAILING_INT.search(pid)
            if m is None:
                bad.append(pid)
            else:
                # The last digit alone decides parity (no overflow on long ids).
                per_prompt[i] = int(m.group(1)[-1]) % 2
        if bad:
            raise ValueError(
                f"scheme='even_odd' needs prompt ids ending in an integer (e.g. 'spec_bench-81'); "
                f"{len(bad)} of {uniq.size} prompts do not, e.g. {bad[:5]}. "
                f"Use scheme='seeded' for such ids."
            )
    elif scheme == "seeded":
        rng = np.random.default_rng(seed)
        order = rng.permutation(uniq.size)
        per_prompt = np.ones(uniq.size, dtype=np.int8)
        per_prompt[order[: (uniq.size + 1) // 2]] = 0
    else:
        raise ValueError(f"scheme must be one of {SCHEMES}; got {scheme!r}")
    counts = np.bincount(per_prompt, minlength=2)
    if counts.min() == 0:
        raise ValueError(
            f"scheme={scheme!r} puts all {uniq.size} prompts in fold {int(np.argmax(counts))}; "
            f"cross-fitting needs prompts in both halves"
        )
    return per_prompt[inverse]


def check_grouped(prompt_ids: np.ndarray, folds: np.ndarray) -> None:
    """Refuse fold ids that are not in {0, 1} or that split a prompt across folds.

    Run on persisted fold ids before trusting them: a prompt in both folds
    would be predicted by a model trained on some of its own rounds.
    """
    ids = np.asarray(prompt_ids).astype(str)
    folds = np.asarray(folds)
    if ids.shape != folds.shape:
        raise ValueError(f"prompt_ids shape {ids.shape} != folds shape {folds.shape}")
    bad_vals = np.setdiff1d(np.unique(folds), [0, 1])
    if bad_vals.size:
        raise ValueError(f"fold ids must be 0 or 1; found {bad_vals.tolist()}")
    uniq, inverse = np.unique(ids, return_inverse=True)
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


def fold_masks(folds: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yield ``(f, train_mask, predict_mask)`` for f = 0, 1 (train on 1-f, predict f)."""
    folds = np.asarray(folds)
    for f in (0, 1):
        predict = folds == f
        train = folds == 1 - f
        if not train.any() or not predict.any():
            raise ValueError(
                f"fold {f}: {int(train.sum())} training rows (fold {1 - f}) and "
                f"{int(predict.sum())} rows to predict; both halves must be non-empty"
            )
        yield f, train, predict


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

"""Held-out quality of first-level predictions (docs/method.md#reporting): squared error and top-1 agreement."""

from __future__ import annotations

import numpy as np
import pandas as pd

from rerank.fit.models import LABEL_OF_LAW
from rerank.fit.predict import FirstFactorPredictions
from specrank.runtime.jit import njit
from specrank.statistics.laws import law_kind


def _mean(x: np.ndarray) -> float:
    """Mean, NaN for no values (a fold without rounds of a law)."""
    return float(np.mean(x)) if np.size(x) else float("nan")


@njit()
def round_firsts(key: np.ndarray, round_id: np.ndarray) -> np.ndarray:
    """Row index of the highest `key` in each round that holds a row, in round order (first
    row on ties; NaN below every number, a round of NaNs its first row); `round_id` >= 0,
    numbers without a row skipped.

    What sorting by (round, -key) stably and taking each round's first row gives
    (`np.lexsort`, tested against it), in one pass: the lexsort was seconds of the fitting
    stage's own thread at paper scale (docs/benchmarks.md), one sort per predictor.
    """
    best = np.full(round_id.max() + 1 if round_id.size else 0, -1, dtype=np.int64)
    for i in range(key.shape[0]):
        r = round_id[i]
        b = best[r]
        if b < 0 or key[i] > key[b] or (np.isnan(key[b]) and not np.isnan(key[i])):
            best[r] = i
    return best[best >= 0]


def prediction_quality(candidates: pd.DataFrame, preds: FirstFactorPredictions) -> pd.DataFrame:
    """Held-out squared error and top-1 agreement of first-level predictions vs draft probs.

    Top-1 agreement as the paper defines it: the round's top-ranked first-level
    candidate is the target's most probable first-level candidate. Under greedy
    decoding only rounds whose first level holds the target's token count
    (`top1_rounds` says how many rounds each figure averages).
    """
    frame = preds.joined(candidates, [*LABEL_OF_LAW.values(), "draft_prob"])
    rows = []
    for temperature, part in frame.groupby("temperature"):
        label = part[LABEL_OF_LAW[law_kind(float(temperature))]].to_numpy(np.float64)
        round_id = part.groupby(["prompt_id", "round_index"]).ngroup().to_numpy()
        best = round_firsts(label, round_id)  # the target's most probable first-level candidate
        # greedy: the first level must hold the argmax token (label 1) for the round to count
        eligible = label[best] > 0 if law_kind(float(temperature)) == "greedy" else None
        fold_of_round = part["fold"].to_numpy()[best]
        for name in ["draft_prob", *preds.rules]:
            pred = part[name].to_numpy(np.float64)
            hit = round_firsts(pred, round_id) == best  # [n_rounds]
            for fold in (None, 0, 1):
                m = slice(None) if fold is None else (part["fold"].to_numpy() == fold)
                keep = np.ones(hit.shape, bool) if fold is None else fold_of_round == fold
                if eligible is not None:
                    keep &= eligible
                rows.append(
                    {
                        "temperature": float(temperature),
                        "predictor": name,
                        "fold": "all" if fold is None else fold,
                        "squared_error": _mean((pred[m] - label[m]) ** 2),
                        "top1_agreement": _mean(hit[keep]),
                        "top1_rounds": int(keep.sum()),
                        "candidates": int(np.size(pred[m])),
                    }
                )
    return pd.DataFrame(rows)

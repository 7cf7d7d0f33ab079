"""Held-out quality of first-level predictions (SPEC §9): squared error and top-1 agreement."""

from __future__ import annotations

import numpy as np
import pandas as pd

from rerank.evaluate import ROUND_KEYS
from rerank.models import LABEL_OF_LAW
from rerank.predict import FirstFactorPredictions
from specrank.laws import law_kind


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

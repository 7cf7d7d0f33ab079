"""What identifies a fit: the fingerprints of the rows it trains on and predicts (a hash per
row, digested per half without copying the half) and the key of everything it reads, under
which a finished fit is kept and taken again (`rerank.fit.resume`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd


def frame_fingerprint(frame: pd.DataFrame, columns: Sequence[str]) -> str:
    """sha256 of the listed columns' contents and names (row order matters)."""
    return digest_rows(columns, hash_rows(frame, columns))


_HASH_BLOCK = 1 << 20  # rows hashed at once


def hash_rows(frame: pd.DataFrame, columns: Sequence[str]) -> np.ndarray:
    # One uint64 per row, independent of the other rows: a half's fingerprint is
    # the digest of its rows' hashes, without copying the half out of the frame. Hashed
    # a block of rows at a time: `frame[columns]` of every row copies the whole frame.
    parts = [pd.util.hash_pandas_object(frame.iloc[lo : lo + _HASH_BLOCK][list(columns)],
                                        index=False).to_numpy()
             for lo in range(0, len(frame), _HASH_BLOCK)]  # fmt: skip
    return np.concatenate(parts) if parts else np.empty(0, np.uint64)


def digest_rows(columns: Sequence[str], row_hashes: np.ndarray) -> str:
    h = hashlib.sha256(repr(list(columns)).encode())
    h.update(np.ascontiguousarray(row_hashes).tobytes())
    return h.hexdigest()


def fold_fit_keys(fp_cols: list[str], row_hashes: np.ndarray, masks: list,
                  sample_weight: np.ndarray | None, **fields: Any,
                  ) -> tuple[list[str], list[tuple[str, str]]]:  # fmt: skip
    """Per half, the key of its fit (`fit_key` of `fields`, the sample weights' digest and the
    training and predicted rows' fingerprints) and those two fingerprints."""
    weights = None if sample_weight is None else hashlib.sha256(sample_weight).hexdigest()
    prints = [(digest_rows(fp_cols, row_hashes[t]), digest_rows(fp_cols, row_hashes[p]))
              for _, t, p in masks]  # fmt: skip
    keys = [fit_key({**fields, "weights": weights, "train": t, "predict": p}) for t, p in prints]
    return keys, prints


def fit_key(fields: dict[str, Any]) -> str:
    """A stable digest of everything a fit and its held-out prediction read."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]

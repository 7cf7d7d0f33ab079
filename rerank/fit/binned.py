"""A fit's LightGBM Dataset joined from binned runs of its columns, each run binned once.

The default job fits nested feature sets (base, rows, rows_extra) on the same rows of
each half, and built whole each set's Dataset bins every column again: 109 columns per
half where 47 differ. LightGBM joins constructed Datasets of the same rows column-wise
(`Dataset.add_features_from`), so `BinnedRuns` bins each run of columns once, keeps it,
and gives a feature set's Dataset as a copy of its first run with the others added, in
the set's column order. The token prior's column is a run of its own, binned for each
fit (its values come from the fit's own split), and so is any column a `DesignRows`
overrides.

A column's bins depend on its values and on the rows LightGBM samples to find them
(drawn from the row count and `data_random_seed` alone), so a joined Dataset holds the
bins a whole one would. The fits from joined Datasets are the same trees as from whole
ones, and early stopping's held-out rows, binned whole by the joined Dataset's bins, give
the same held-out loss at every iteration (`tests/test_binned.py`, with mostly-zero and
missing columns in every run). Held-out rows are not joined from runs: LightGBM joins
two runs that each hold sparse columns into one group of them, in another feature order,
and then refuses held-out runs joined the same way ("different bin mappers").

One `BinnedRuns` serves the fits of one law's frame (the rows are its positions); the two
halves' fits may run in two threads at once (each with its OpenMP count set in its thread:
`rerank.fit.boosting`). Kept runs hold about a byte per row and column, up to `KEEP_BYTES`
for a law, freed with its frame.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Sequence

import lightgbm as lgb
import numpy as np

from rerank.fit.design import CATEGORICAL, TOKEN_PRIOR, BlockDataset, DesignRows
from rerank.fit.law_memo import rows_key

# What LightGBM's `add_features_from` says on every join of Datasets built from row blocks:
# the raw rows were never kept (free_raw_data), and the Python-side category list is reset
# (the categories live in the joined bins, which the fit reads).
_JOIN_NOTES = r"(?s)(Cannot add features from NoneType|Resetting categorical features)"
_JOINING = threading.Lock()  # one join at a time in the process: warnings' filters are global
# At most this many bytes of runs are kept for a law; a run beyond it is binned again by
# each set that reads it. A kept run and its copy in a fit's Dataset are both resident while
# the fit runs: at 3x the paper the fits peaked 0.18 GiB higher (4.06 GiB), and at 10x the
# job's peak was in the fits, 0.5-0.8 GiB under the 12 GiB goal. By rows x columns the kept
# runs come to about 40 MB at 1x and 120 MB at 3x; at 10x a half's first run alone is about
# 150 MB, so none is kept there.
KEEP_BYTES = 128 * 2**20


class BinnedRuns:
    """Binned runs of design columns, by their rows, columns and the Dataset parameters."""

    def __init__(self, keep: bool = True, keep_bytes: int = KEEP_BYTES) -> None:
        self._runs: dict[tuple, lgb.Dataset] = {}
        # False for the last fits that read the kept runs: they take them (joined in place,
        # no copy beside them) and keep nothing new
        self.keep, self.keep_bytes = keep, keep_bytes

    def training(self, rows: DesignRows, y: np.ndarray, params: dict) -> list[lgb.Dataset]:
        """The binned runs of ``rows`` in column order (`joined` makes their Dataset)."""
        names, fresh = rows.design.features, _fresh(rows)
        where = (rows_key(np.asarray(rows.index, np.int64)), json.dumps(params, sort_keys=True))
        known = {key[2] for key in tuple(self._runs) if key[:2] == where}  # other threads add
        return [self._run(rows, span, fresh, y, params, where)
                for span in column_runs(names, fresh, known)]  # fmt: skip

    def joined(self, runs: list[lgb.Dataset], y: np.ndarray, w: np.ndarray | None) -> lgb.Dataset:
        """One Dataset of ``runs`` (same rows), their columns in order, labelled ``y``
        and weighted ``w``; a kept run is copied, never joined into."""
        first = runs[0]
        kept = any(first is run for run in tuple(self._runs.values()))
        data = first.subset(range(first.num_data())).construct() if kept else first
        with _JOINING, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_JOIN_NOTES, category=UserWarning)
            for run in runs[1:]:
                data.add_features_from(run)
        data.set_label(y)
        if w is not None:
            data.set_weight(w)
        return data

    def _run(self, rows: DesignRows, span: tuple[int, int], fresh: set[int], y: np.ndarray,
             params: dict, where: tuple) -> lgb.Dataset:  # fmt: skip
        """Columns ``span`` of ``rows``, binned now or kept from before."""
        lo, hi = span
        if lo in fresh:
            return _bin(rows, lo, hi, y, params)
        key = (*where, tuple(rows.design.features[lo:hi]))
        run = self._runs.get(key) if self.keep else self._runs.pop(key, None)
        if run is None:
            run = _bin(rows, lo, hi, y, params)
            kept = sum(_bytes(r) for r in tuple(self._runs.values()))
            if self.keep and kept + _bytes(run) <= self.keep_bytes:
                self._runs[key] = run
        return run


def _bytes(run: lgb.Dataset) -> int:
    """A binned run's size, about a byte per row and column (up to 255 bins)."""
    return run.num_data() * run.num_feature()


def _fresh(rows: DesignRows) -> set[int]:
    """Columns binned for every fit: the token prior's, and the column ``rows`` overrides."""
    fresh = {j for j, f in enumerate(rows.design.features) if f == TOKEN_PRIOR}
    if rows.prior is not None and rows.column is not None:
        fresh.add(rows.column)
    return fresh


def column_runs(names: Sequence[str], fresh: set[int],
                known: set[tuple[str, ...]]) -> list[tuple[int, int]]:  # fmt: skip
    """Positions [0, n) cut into runs (start, stop): each fresh column alone; elsewhere the
    longest known run of names starting there, else every column up to the next fresh one."""
    runs, i, n = [], 0, len(names)
    while i < n:
        if i in fresh:
            runs.append((i, i + 1))
            i += 1
            continue
        stop = next((j for j in range(i, n) if j in fresh), n)
        fits = [len(k) for k in known if i + len(k) <= stop and tuple(names[i : i + len(k)]) == k]
        end = i + max(fits) if fits else stop
        runs.append((i, end))
        i = end
    return runs


def _bin(rows: DesignRows, lo: int, hi: int, y: np.ndarray, params: dict) -> lgb.Dataset:
    """The constructed Dataset of columns [lo, hi) of ``rows``."""
    design = rows.design
    part = design.select(range(lo, hi))
    own_prior = rows.prior is not None and rows.column == lo  # a fresh column is a run alone
    run = DesignRows(part, rows.index, rows.prior if own_prior else None,
                     0 if own_prior else None)  # fmt: skip
    names = part.features
    cats = [j for j, f in enumerate(names) if f in CATEGORICAL]
    # a Dataset needs its label to be copied (`subset`); `joined` sets the fit's own
    data = BlockDataset([run], label=y, feature_name=names, categorical_feature=cats,
                        params=params)  # fmt: skip
    return data.construct()

"""The design matrix of a feature set (model inputs as float32 columns) and row fingerprints.

One builder serves fitting, held-out prediction and the benchmarks; the online
predictor (`rerank.serving`) builds the same columns for one round and is tested
equal to it (`tests/test_online_features.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lightgbm as lgb
import numpy as np
import pandas as pd

from rerank.fit.token_prior import PriorColumn
from specrank.settings.errors import Refusal

TOKEN_PRIOR = "token_prior"  # the design column filled from rerank.fit.token_prior
CATEGORICAL = ("task",)  # the design columns the models split as categories
# HGB bins a categorical feature into at most 255 values (one kept for missing).
_MAX_CATEGORIES = 254


def task_categories(frame: pd.DataFrame, declared: Sequence[str] | None = None) -> list[str]:
    """The fixed list of task categories: ``declared`` or the sorted tasks of the WHOLE frame.

    Fixing the list before splitting keeps a task's code the same in both folds
    and in saved models (codes per fold would make "task 2" mean different tasks).
    """
    cats = sorted(set(map(str, frame["task"].unique()))) if declared is None else list(declared)
    if len(set(cats)) != len(cats):
        raise ValueError(f"task categories must be distinct; got {cats}")
    if len(cats) > _MAX_CATEGORIES:
        raise Refusal(
            f"at most {_MAX_CATEGORIES} task categories are supported; the candidate table "
            f"(rerank.features) holds {len(cats)} (the prompt sources' task labels, e.g. "
            f"{cats[:3]})"
        )
    return cats


def per_value(column: pd.Series, of_values: Callable[[pd.Index], np.ndarray],
              missing: object) -> np.ndarray:  # fmt: skip
    """``of_values`` of the column's distinct values, taken for each row by its value's code
    (``missing`` where the row is missing): work and strings once per distinct value. A
    pandas string column's `to_numpy` makes a string per row (60-70 bytes a row)."""
    cat = column.astype("category")
    at = np.append(np.asarray(of_values(cat.cat.categories)), missing)
    return at[cat.cat.codes.to_numpy()]  # code -1 (missing) takes the appended value


def shared_strings(column: pd.Series) -> np.ndarray:
    """``column`` as an object array whose rows share one string per distinct value (8
    bytes a row; NaN where missing): 0.7 GiB less for a law's prompt ids and tasks at 3x
    the paper than `to_numpy`."""
    return per_value(column, lambda values: values.to_numpy(dtype=object), np.nan)


def codes_in(column: pd.Series, categories: Sequence[str]) -> np.ndarray:
    """Each row's position in ``categories`` (-1: not among them, or missing), as
    ``pd.Index(categories).get_indexer(column.astype(str))`` gives it (`per_value`)."""
    index = pd.Index(list(categories))
    return per_value(column, lambda values: index.get_indexer(values.astype(str)), -1)


def same_values(got: pd.Series, want: pd.Series) -> np.ndarray:
    """Row by row, whether two columns hold the same value. Two categorical columns are
    compared by their codes in one category list (pandas refuses `!=` between
    categoricals whose categories differ, e.g. one law's prompts against every prompt's)."""
    if isinstance(got.dtype, pd.CategoricalDtype) and isinstance(want.dtype, pd.CategoricalDtype):
        # want's codes moved into got's categories (-1: not among them, never equal)
        moved = got.cat.categories.get_indexer(want.cat.categories)
        codes = want.cat.codes.to_numpy()
        want_codes = np.where(codes < 0, -2, moved[codes])
        return (got.cat.codes.to_numpy() == want_codes) & (want_codes >= 0)
    return (got == want).to_numpy(dtype=bool, na_value=False)


_DESIGN_BLOCK = 16_384  # rows per block of a design copy (about 4 MB of float32 rows)


class DesignColumns:
    """The design matrix of ``features`` over a frame's rows, kept as the frame's columns.

    `rows(index)` copies any rows out as the float32 matrix `design_matrix` gives, so a
    fit reads its rows in blocks (`DesignRows`) and no matrix of a law's every row is
    held beside its frame (57 float32 columns: 228 bytes a row). ``token_prior`` (one
    value per row; None: zeros) fills the prior column.
    """

    def __init__(self, frame: pd.DataFrame, features: Sequence[str], categories: Sequence[str],
                 token_prior: np.ndarray | None = None) -> None:  # fmt: skip
        missing = [f for f in features if f != TOKEN_PRIOR and f not in frame.columns]
        if missing:
            raise ValueError(f"the frame lacks feature column(s) {missing}")
        self.n_rows, self.features = len(frame), list(features)
        self.columns: list[np.ndarray] = []
        for name in features:
            if name == TOKEN_PRIOR:
                prior = np.zeros(len(frame), np.float32) if token_prior is None else token_prior
                prior = np.asarray(prior)
                if prior.shape != (len(frame),):
                    raise ValueError(
                        f"token_prior has shape {prior.shape}; expected ({len(frame)},)"
                    )
                self.columns.append(prior)
            elif name in CATEGORICAL:
                codes = codes_in(frame[name], categories)
                self.columns.append(np.where(codes < 0, np.nan, codes).astype(np.float32))
            else:
                self.columns.append(_numeric_view(frame[name]))

    @property
    def prior(self) -> np.ndarray:
        """The token prior's column (one value per row), written in place by the fits."""
        return self.columns[self.features.index(TOKEN_PRIOR)]

    @classmethod
    def of_matrix(cls, X: np.ndarray, features: Sequence[str]) -> DesignColumns:
        """A design matrix's columns (views: the prior column writes into ``X``)."""
        design = cls.__new__(cls)
        design.n_rows, design.features = X.shape[0], list(features)
        design.columns = [X[:, j] for j in range(X.shape[1])]
        return design

    def select(self, positions: Sequence[int]) -> DesignColumns:
        """The design of the columns at ``positions`` (views of these columns)."""
        design = DesignColumns.__new__(DesignColumns)
        design.n_rows = self.n_rows
        design.features = [self.features[j] for j in positions]
        design.columns = [self.columns[j] for j in positions]
        return design

    def rows(self, index: np.ndarray | None = None, prior: np.ndarray | None = None,
             column: int | None = None) -> np.ndarray:  # fmt: skip
        """Float32 matrix of the rows `index` (in that order; None: every row); ``prior`` (one
        per row taken) replaces their token-prior column (``column``; None: the
        `TOKEN_PRIOR` feature's)."""
        n = self.n_rows if index is None else len(index)
        X = np.empty((n, len(self.columns)), dtype=np.float32)
        j_prior = self._prior_at(prior, column)
        # Filled in blocks of rows that stay in cache: a whole column at a time writes one
        # float of every 57-float row, 7x slower at paper scale (1.84M rows: 2.6 s vs 0.35 s).
        for lo in range(0, n, _DESIGN_BLOCK):
            block = X[lo : lo + _DESIGN_BLOCK]
            # every row: views of the columns; an index: a gather
            at = slice(lo, lo + _DESIGN_BLOCK) if index is None else index[lo : lo + _DESIGN_BLOCK]
            for j, values in enumerate(self.columns):
                block[:, j] = prior[lo : lo + _DESIGN_BLOCK] if j == j_prior else values[at]
        return X

    def column_major(self, index: np.ndarray, prior: np.ndarray | None = None,
                     column: int | None = None) -> np.ndarray:  # fmt: skip
        """`rows`' float32 values as a column-major float64 matrix (each value the same).

        What scikit-learn's HistGradientBoosting fits on without copying: given float32
        rows with a categorical column, it copies the rows three times before binning
        (its column split, float64 conversion and restacking): 0.69-0.74 CPU s at
        1.8M x 35 against 0.28 s for this layout, warm; the same values give the same
        bins and trees (`tests/test_design_layouts.py`).
        """
        X = np.empty((len(index), len(self.columns)), dtype=np.float64, order="F")
        j_prior = self._prior_at(prior, column)
        for j, values in enumerate(self.columns):
            # through float32, as `rows` rounds a column of another dtype
            taken = prior if j == j_prior else values[index]
            X[:, j] = taken.astype(np.float32, copy=False)
        return X

    def _prior_at(self, prior: np.ndarray | None, column: int | None) -> int:
        """The column `prior` replaces (-1: none; `column`, or the TOKEN_PRIOR feature's)."""
        if prior is None:
            return -1
        return self.features.index(TOKEN_PRIOR) if column is None else column


_SAMPLE_BLOCK = 4_096  # rows copied at once to serve LightGBM's row-by-row bin sample


class DesignRows(lgb.Sequence):
    """Rows ``index`` of a design, with their own token prior where ``prior`` is given, as
    LightGBM's `Sequence`: a Dataset built from it reads the rows in blocks of `batch_size`,
    so a fit holds its binned rows and one block, never a float copy of its rows. The bins
    and the fitted model are the same bits as from the rows' matrix
    (`tests/test_design_layouts.py::test_a_fit_from_row_blocks_is_the_fit_from_the_matrix`)."""

    batch_size = 65_536  # rows per block pushed into the Dataset (about 15 MB of 57 floats)

    def __init__(self, design: DesignColumns, index: np.ndarray, prior: np.ndarray | None = None,
                 column: int | None = None) -> None:  # fmt: skip
        self.design, self.index, self.prior, self.column = design, index, prior, column
        self._block: tuple[int, np.ndarray] = (0, np.empty((0, len(design.columns)), np.float32))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: int | slice) -> np.ndarray:  # type: ignore[override]
        if isinstance(idx, slice):
            return self.matrix(idx)
        # LightGBM samples single rows in increasing order (float64, as it requires):
        # served from a block of rows read at once, not one gather per feature per row
        lo, block = self._block
        if not lo <= idx < lo + len(block):
            lo, block = idx, self.matrix(slice(idx, idx + _SAMPLE_BLOCK))
            self._block = (lo, block)
        return block[idx - lo].astype(np.float64)

    def matrix(self, part: slice | np.ndarray = slice(None)) -> np.ndarray:
        """The float32 matrix of these rows (``part`` of them: a slice or positions)."""
        prior = None if self.prior is None else self.prior[part]
        return self.design.rows(self.index[part], prior, self.column)

    def column_major(self) -> np.ndarray:
        """All these rows as `DesignColumns.column_major` (float64, column-major)."""
        return self.design.column_major(self.index, self.prior, self.column)


def _numeric_view(col: pd.Series) -> np.ndarray:
    """A numeric column as numpy (a view where its dtype is numpy's); nulls as NaN."""
    if isinstance(col.dtype, pd.CategoricalDtype) or col.dtype == object:
        col = pd.to_numeric(col)
    if isinstance(col.dtype, np.dtype):
        return col.to_numpy()
    return col.to_numpy(dtype=np.float32, na_value=np.nan)


def design_matrix(
    frame: pd.DataFrame,
    features: Sequence[str],
    categories: Sequence[str],
    token_prior: np.ndarray | None = None,
) -> np.ndarray:
    """Float32 matrix of ``features`` (column order kept); nulls become NaN, never 0.

    ``task`` becomes its index in ``categories`` (NaN for a task not listed:
    the models treat it as missing). ``token_prior`` fills the prior column.
    """
    if TOKEN_PRIOR in features and token_prior is None:
        raise ValueError(f"feature list includes {TOKEN_PRIOR!r} but no prior was given")
    return DesignColumns(frame, features, categories, token_prior).rows()


def fold_design(frame: pd.DataFrame, features: list[str], cats: list[str], masks: list,
                priors: list, pseudo_count: float, by_prompt: bool,
                ) -> tuple[DesignColumns, PriorColumn]:  # fmt: skip
    """(the design's columns, the prior column) for both folds' fits of a cross-fit
    (`rerank.fit.out_of_fold`): `masks` and `priors` are its law split's."""
    # One design for both folds, its rows read in blocks by each fit. The folds' training
    # halves are disjoint, so each sets its own training rows' prior column in place.
    design = DesignColumns(frame, features, cats, np.zeros(len(frame), np.float32))
    for (_, train, _), (prior, _) in zip(masks, priors, strict=True):
        design.prior[train] = prior[train]
    tokens = frame["token"].to_numpy()
    return design, PriorColumn(features.index(TOKEN_PRIOR), tokens, pseudo_count, by_prompt)


class BlockDataset(lgb.Dataset):
    """`lgb.Dataset` of one `DesignRows` whose bin sample is read as one matrix.

    LightGBM reads a `Sequence`'s bin sample a row at a time in Python (up to 200,000
    `__getitem__` calls and a list of rows per fit: 7 thread-s of the default job's fits at
    paper scale, docs/benchmarks.md). This replaces its private `Dataset.__sample` with one
    that takes the same rows (`_create_sample_indices`, LightGBM's own) in one gather and
    keeps what LightGBM keeps of each column (the entries beyond its ZERO_THRESHOLD, and
    NaN); the fit is the same bits as from the rows' matrix (tests/test_folds.py, which
    also fails if LightGBM renames the method).
    """

    def _Dataset__sample(self, *, seqs: list, total_nrow: int) -> tuple[list, list]:
        (rows,) = seqs  # one DesignRows, as `rerank.fit.boosting` builds it
        indices = self._create_sample_indices(total_nrow=total_nrow)
        sampled = rows.matrix(indices).astype(np.float64).T
        kept = [(np.abs(col) > lgb.basic.ZERO_THRESHOLD) | np.isnan(col) for col in sampled]
        at = np.arange(len(indices), dtype=np.int32)
        return [c[k] for c, k in zip(sampled, kept, strict=True)], [at[k] for k in kept]

"""The boosting libraries behind the rerankers: capacity, and early stopping on the training half.

Capacity (docs/method.md#cross-fitting, the paper's): 400 iterations, learning rate 0.05, <= 63
leaves, for both libraries; everything else at matching defaults (min 20 rows
per leaf, no L2, 255 bins). HGB's built-in early stopping is never used with
its own split: it holds out a random (not prompt-grouped) share of the rows,
which leaks rounds of a prompt into the loss that picks the capacity.

Early stopping (`Capacity.early_stopping`) chooses the number of iterations on
the training half alone. `rerank.fit.folds.inner_validation` holds out
`validation_share` of the half's prompts (grouped by prompt, stratified by
task, seeded); the library fits the other prompts for at most `n_iter`
iterations while following the held-out loss (log loss or squared error,
weighted by `sample_weight`) after every iteration, and stops after `patience`
iterations without a new best (LightGBM: its `early_stopping` callback; HGB:
`n_iter_no_change` with `X_val`, which compares with the loss `patience + 1`
iterations back). The chosen count is, for both, the iteration with the lowest
held-out loss (the first on ties). Then, by `Capacity.refit`:

  refit=False  the inner model cut to the chosen count. Both libraries fit
               without randomness here (no row or feature sampling; binning
               is seeded), so the cut model is exactly a fixed fit of that many
               iterations on the inner rows (`tests/test_folds.py`).
  refit=True   a fixed fit of the chosen count on the whole half.

Threads. `n_threads=None` is the library default (every core), except for fits
on fewer than `SMALL_FIT_ROWS` rows: those run on one thread. A small fit's
iteration takes milliseconds, and each holds several OpenMP barriers that wait
for a descheduled thread whenever the machine is busy; one thread is then
several times faster (`python -m bench.bench_online --small-fit 6000`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightgbm as lgb
import numpy as np
from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor
from threadpoolctl import threadpool_limits

from rerank.fit.binned import BinnedRuns
from rerank.fit.design import CATEGORICAL, DesignColumns, DesignRows
from rerank.fit.folds import inner_validation
from rerank.fit.law_memo import LawMemo, rows_key
from rerank.fit.token_prior import PriorColumn, split_priors
from specrank.settings.errors import Refusal

SMALL_FIT_ROWS = 100_000  # fits on fewer rows run on one thread (module doc)


@dataclass(frozen=True)
class Capacity:
    """Boosting capacity, the same for both libraries; `Capacity()` is the paper's fixed one."""

    n_iter: int = 400  # iterations (fixed), or the most early stopping may keep
    learning_rate: float = 0.05
    max_leaves: int = 63
    early_stopping: bool = False  # choose the iterations on an inner split of the training half
    patience: int = 10  # iterations without a new best held-out loss before stopping
    validation_share: float = 0.2  # share of the training half's prompts held out
    refit: bool = False  # refit the whole half at the chosen count (else keep the inner model)


PAPER_CAPACITY = Capacity()  # 400 x 0.05 x <= 63 leaves, fixed


def estimator_iterations(estimator: Any, kind: str) -> int:
    """Boosting iterations a fitted estimator holds (one tree per iteration for both laws)."""
    return int(estimator.num_trees() if kind == "lgbm" else estimator.n_iter_)


def _check_fit_inputs(y: np.ndarray, law: str, w: np.ndarray | None) -> None:
    if law == "greedy" and np.unique(y).size < 2:
        raise Refusal(
            f"greedy classifier: the training rows hold only label {np.unique(y).tolist()}; "
            f"both classes are needed (expected a candidate table, rerank.features, whose "
            f"greedy training rows hold both labels: record more prompts)"
        )
    if w is not None and (not np.isfinite(w).all() or (w < 0).any() or not w.sum() > 0):
        raise ValueError(
            "sample_weight must be finite and >= 0 with a positive sum; found "
            f"min {np.nanmin(w)!r}, sum {np.nansum(w)!r}, {int((~np.isfinite(w)).sum())} non-finite"
        )


def fit_estimator(
    X: np.ndarray | DesignColumns,
    y: np.ndarray,
    features: list[str],
    kind: str,
    law: str,
    capacity: Capacity,
    seed: int,
    n_threads: int | None,
    sample_weight: np.ndarray | None = None,
    groups: np.ndarray | None = None,
    tasks: np.ndarray | None = None,
    rows: np.ndarray | None = None,
    prior: PriorColumn | None = None,
    runs: BinnedRuns | None = None,
    memo: LawMemo | None = None,
) -> Any:
    """One library's estimator fitted on a design (a matrix or `DesignColumns`; columns =
    ``features``).

    ``sample_weight`` (one per row, None: equal) weighs the training loss and,
    with early stopping, the held-out loss that chooses the capacity.
    ``groups`` (the prompt of each row) and ``tasks`` (its task) form the inner
    split; early stopping needs ``groups``. ``n_threads``: see the module doc.
    ``rows`` (indices into X and into every per-row argument; None: all rows) are
    the training rows. LightGBM reads them from X in row blocks (`DesignRows`), with
    early stopping the inner and held-out rows too; HGB fits a column-major float64 copy of
    them (`DesignColumns.column_major`: the one layout it bins without copying again).
    ``prior``: the token prior's column; with early stopping it is recomputed inside the
    inner split (`rerank.fit.token_prior.split_priors`), so no prior reads a label of the
    held-out prompts. ``runs``: LightGBM's binned columns, shared with the fits of other
    feature sets on the same frame (`rerank.fit.binned`; None: this fit's own). ``memo``:
    early stopping's inner split and its priors, shared likewise (`rerank.fit.law_memo`).
    """
    design = X if isinstance(X, DesignColumns) else DesignColumns.of_matrix(X, features)
    w = None if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
    for name, per_row in (("y", y), ("sample_weight", w)):
        if per_row is not None and per_row.shape != (design.n_rows,):
            raise ValueError(f"{name} has shape {per_row.shape}; expected ({design.n_rows},)")
    every = np.arange(design.n_rows) if rows is None else np.asarray(rows, dtype=np.int64)
    if rows is not None:
        y, w = y[every], None if w is None else w[every]
        groups = None if groups is None else np.asarray(groups)[every]
        tasks = None if tasks is None else np.asarray(tasks)[every]
    _check_fit_inputs(y, law, w)
    if n_threads is None and every.size < SMALL_FIT_ROWS:
        n_threads = 1
    fit = DesignRows(design, every)
    if not capacity.early_stopping:
        return _fit(fit, y, w, features, kind, law, capacity, capacity.n_iter, seed, n_threads,
                    runs=runs)[0]  # fmt: skip
    if groups is None:
        raise ValueError(
            "early stopping needs the prompt of every training row (groups=) for its "
            "prompt-grouped inner split"
        )
    held, p_in, p_held = (LawMemo() if memo is None else memo).get(
        ("inner", law, rows_key(every), capacity.validation_share, seed,
         None if prior is None else (prior.pseudo_count, prior.by_prompt)),
        lambda: _inner_split(y, every, groups, tasks, prior, capacity.validation_share, seed),
    )  # fmt: skip
    inner = ~held
    w_in, w_held = (None, None) if w is None else (w[inner], w[held])
    _check_fit_inputs(y[inner], law, w_in)
    column = None if prior is None else prior.column
    est, loss = _fit(
        DesignRows(design, every[inner], p_in, column), y[inner], w_in, features, kind, law,
        capacity, capacity.n_iter, seed, n_threads,
        valid=(DesignRows(design, every[held], p_held, column), y[held], w_held), runs=runs,
    )  # fmt: skip
    chosen = int(np.argmin(loss)) + 1  # first iteration with the lowest held-out loss
    if capacity.refit:
        return _fit(fit, y, w, features, kind, law, capacity, chosen, seed, n_threads,
                    runs=runs)[0]  # fmt: skip
    return _cut(est, kind, chosen)


def _inner_split(y: np.ndarray, every: np.ndarray, groups: np.ndarray, tasks: np.ndarray | None,
                 prior: PriorColumn | None, share: float, seed: int) -> tuple:  # fmt: skip
    """(held-out rows of the training half, the inner rows' and the held-out rows' priors)."""
    held = inner_validation(groups, share, seed, tasks)
    # each with its own prior column where the prior is given
    p_in, p_held = (None, None) if prior is None else split_priors(prior, y, every, held, groups)
    return held, p_in, p_held


def _cut(est: Any, kind: str, n_iter: int) -> Any:
    """The first ``n_iter`` iterations of a fitted estimator, as an estimator of its own."""
    if kind == "lgbm":  # the text model round-trips doubles exactly (17 significant digits)
        return lgb.Booster(model_str=est.model_to_string(num_iteration=n_iter))
    # scikit-learn has no public way to drop iterations; these are the attributes its
    # predictors read (rerank.forest.table reads `_predictors` too). The scores keep their
    # baseline entry, as a fit that stopped at `n_iter` would hold.
    est._predictors = est._predictors[:n_iter]  # n_iter_ is len(_predictors)
    est.train_score_ = est.train_score_[: n_iter + 1]
    est.validation_score_ = est.validation_score_[: n_iter + 1]
    return est


def lgbm_params(law: str, capacity: Capacity, seed: int, n_threads: int | None) -> dict:
    """LightGBM's parameters for a fit of ``capacity`` (the iterations are lgb.train's)."""
    return {
        "objective": "binary" if law == "greedy" else "regression",
        "metric": "binary_logloss" if law == "greedy" else "l2",
        "learning_rate": capacity.learning_rate,
        "num_leaves": capacity.max_leaves,
        "min_data_in_leaf": 20,
        "min_sum_hessian_in_leaf": 1e-3,
        "lambda_l2": 0.0,
        "max_bin": 255,
        "deterministic": True,
        # Histograms built row by row: on one or two threads 1.35x faster than column by
        # column at paper scale, with the same iterations and held-out loss (a 0.92M-row
        # Rows+matched half: docs/benchmarks.md). The binned rows take twice
        # the memory of the columns (tens of MB here). Forced, so LightGBM does not time both.
        "force_row_wise": True,
        "seed": seed,
        # What LightGBM derives from `seed` for the rows its bins are built from, given
        # explicitly: a Dataset built from row blocks (`DesignRows`) reads only the Dataset
        # parameters, which leave `seed` out, and would bin another sample of the rows.
        "data_random_seed": _data_random_seed(seed),
        "num_threads": n_threads or 0,
        "verbosity": -1,
    }


def _data_random_seed(seed: int) -> int:
    """LightGBM's `data_random_seed` for `seed` (its Config::Set: one step of its LCG
    `Random(seed).NextShort(0, 32767)`; `tests/test_design_layouts.py` checks it is the one the
    library derives)."""
    x = (214013 * seed + 2531011) & 0xFFFFFFFF
    return ((x >> 16) & 0x7FFF) % 32767


def _fit(
    X: DesignRows,
    y: np.ndarray,
    w: np.ndarray | None,
    features: list[str],
    kind: str,
    law: str,
    capacity: Capacity,
    n_iter: int,
    seed: int,
    n_threads: int | None,
    valid: tuple[DesignRows, np.ndarray, np.ndarray | None] | None = None,
    runs: BinnedRuns | None = None,
) -> tuple[Any, np.ndarray | None]:
    """(estimator, held-out loss after each iteration, or None without `valid`)."""
    if kind == "hgb":  # scikit-learn fits in-memory matrices only
        cat_idx = [j for j, f in enumerate(features) if f in CATEGORICAL]
        valid = None if valid is None else (valid[0].column_major(), *valid[1:])
        return _fit_hgb(X.column_major(), y, w, features, law, capacity, n_iter, seed, n_threads,
                        cat_idx, valid)  # fmt: skip
    params = lgbm_params(law, capacity, seed, n_threads)
    # LightGBM sizes its per-thread buffers by `num_threads`, but some of its parallel
    # regions (a Dataset's subset copy among them) take the calling thread's OpenMP count,
    # every core in a fresh thread: a fit on fewer threads in a worker thread then wrote past
    # those buffers (a segfault; tests/test_binned.py). So the calling thread's count is the
    # fit's while it runs.
    with threadpool_limits(limits=n_threads, user_api="openmp"):
        return _fit_lgbm(X, y, w, params, capacity, n_iter, valid, runs)


def _fit_lgbm(X: DesignRows, y: np.ndarray, w: np.ndarray | None, params: dict,
              capacity: Capacity, n_iter: int,
              valid: tuple[DesignRows, np.ndarray, np.ndarray | None] | None,
              runs: BinnedRuns | None) -> tuple[Any, np.ndarray | None]:  # fmt: skip
    # Binned up front from the rows' blocks (`DesignRows`), by runs of columns that the
    # fits of a law's other feature sets share (`rerank.fit.binned`); the Datasets keep no
    # reference to the rows (free_raw_data), and no float copy of them is made.
    runs = BinnedRuns(keep=False) if runs is None else runs  # None: a fit of its own
    data = runs.joined(runs.training(X, y, params), y, w)
    if valid is None:
        return lgb.train(params, data, num_boost_round=n_iter), None
    Xv, yv, wv = valid
    # binned by the training Dataset's bins, with its features and categories as lgb.train
    # would set them (it cannot once the raw rows are freed)
    held = lgb.Dataset(
        [Xv], label=yv, weight=wv, feature_name=data.feature_name,
        categorical_feature=data.categorical_feature, params=params, reference=data,
    ).construct()  # fmt: skip
    record: dict = {}
    callbacks = [
        lgb.early_stopping(capacity.patience, first_metric_only=True, verbose=False),
        lgb.record_evaluation(record),
    ]
    booster = lgb.train(
        params, data, num_boost_round=n_iter, valid_sets=[held], valid_names=["held"],
        callbacks=callbacks,
    )  # fmt: skip
    return booster, np.asarray(record["held"][params["metric"]], dtype=np.float64)


def _fit_hgb(X, y, w, features, law, capacity, n_iter, seed, n_threads, cat_idx, valid):
    cls = HistGradientBoostingClassifier if law == "greedy" else HistGradientBoostingRegressor
    stop = {"early_stopping": False}
    if valid is not None:  # the held-out prompts given, never a random split of the rows
        stop = dict(early_stopping=True, scoring="loss", validation_fraction=None,
                    n_iter_no_change=capacity.patience, tol=0.0)  # fmt: skip
    est = cls(
        max_iter=n_iter,
        learning_rate=capacity.learning_rate,
        max_leaf_nodes=capacity.max_leaves,
        categorical_features=[j in cat_idx for j in range(len(features))],
        random_state=seed,
        **stop,
    )
    # scikit-learn 1.9's binning crashes on a column that is NaN in every training
    # row ("window shape cannot be larger than input array shape"), e.g. a retained
    # row never present in a small half. Such a column carries no information, so a
    # constant stands in for it while fitting; the trees never split on it, and
    # prediction (where the column may hold values) is unaffected.
    empty = np.isnan(X).all(axis=0)
    if empty.any():
        X = X.copy(order="K")
        X[:, empty] = 0.0
    target = y.astype(np.int64) if law == "greedy" else y
    fit_args: dict[str, Any] = {"sample_weight": w}
    if valid is not None:
        Xv, yv, wv = valid
        fit_args |= dict(X_val=Xv, y_val=yv.astype(np.int64) if law == "greedy" else yv,
                         sample_weight_val=wv)  # fmt: skip
    with threadpool_limits(limits=n_threads, user_api="openmp"):
        est.fit(X, target, **fit_args)
    # The column order travels inside the model file (as LightGBM's own feature names
    # do), so loading checks the sidecar against the model itself. Not
    # `feature_names_in_`: scikit-learn would then warn on every numpy predict.
    est.specrank_features_ = list(features)
    # validation_score_ is the negated loss, entry 0 before the first iteration
    loss = None if valid is None else -np.asarray(est.validation_score_[1:], dtype=np.float64)
    return est, loss

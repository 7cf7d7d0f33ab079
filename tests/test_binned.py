"""A fit's Dataset joined from binned runs of columns is the Dataset LightGBM builds whole."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import lightgbm as lgb
import numpy as np
import pytest

from rerank.fit.binned import BinnedRuns, column_runs
from rerank.fit.boosting import Capacity, fit_estimator, lgbm_params
from rerank.fit.design import TOKEN_PRIOR, DesignColumns, DesignRows

N_ROWS, N_COLUMNS = 6_000, 24
# nested feature sets, as the job's base, rows and rows_extra nest: the token prior last
SETS = {"small": 10, "middle": 16, "large": 23}


def _design(seed: int = 0) -> tuple[DesignColumns, np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((N_ROWS, N_COLUMNS)).astype(np.float32)
    X[:, 0] = rng.integers(0, 4, N_ROWS)  # the task, split as categories
    X[:, 1:4] = np.round(X[:, 1:4] * 2)  # few distinct values
    # mostly-zero columns in every run (which a whole Dataset may bundle), and missing rows
    for j in (5, 8, 12, 14, 19, 21):
        X[:, j] = np.where(rng.random(N_ROWS) < 0.93, 0.0, X[:, j])
    X[:, 10:20][rng.random((N_ROWS, 10)) < 0.3] = np.nan
    names = ["task", *(f"f{j}" for j in range(1, N_COLUMNS - 1)), TOKEN_PRIOR]
    X[:, -1] = rng.random(N_ROWS)  # the prior column
    signal = X[:, 1] + np.nan_to_num(X[:, 12]) * X[:, 6] + X[:, -1] + rng.standard_normal(N_ROWS)
    return DesignColumns.of_matrix(X, names), (signal > 0.8).astype(np.float64), names


def _columns(names: list[str], n: int) -> list[int]:
    return [*range(n), len(names) - 1]


PARAMS = {**lgbm_params("greedy", Capacity(max_leaves=15), 3, 1), "bin_construct_sample_cnt": 2_000}


def _trees(booster: lgb.Booster) -> str:
    text = booster.model_to_string()
    return text[text.index("Tree=0") : text.index("end of trees")]


def test_nested_sets_joined_from_shared_runs_fit_the_trees_of_whole_datasets() -> None:
    design, y, names = _design()
    rng = np.random.default_rng(1)
    order = rng.permutation(N_ROWS)
    train, held = np.sort(order[:4_500]), np.sort(order[4_500:])
    w = rng.uniform(0.5, 2.0, N_ROWS)
    runs = BinnedRuns()
    for n in SETS.values():
        runs.keep = n != SETS["large"]  # as the job's last set: it takes the kept runs
        cols = _columns(names, n)
        sub = design.select(cols)
        feats = [names[j] for j in cols]
        training = runs.training(DesignRows(sub, train), y[train], PARAMS)
        data = runs.joined(training, y[train], w[train])
        # as `rerank.fit.boosting` bins early stopping's held-out rows
        valid = lgb.Dataset([DesignRows(sub, held)], label=y[held], weight=w[held],
                            feature_name=data.feature_name, params=PARAMS,
                            categorical_feature=data.categorical_feature, reference=data)  # fmt: skip
        got_loss: dict = {}
        model = lgb.train(PARAMS, data, 25, valid_sets=[valid], valid_names=["held"],
                          callbacks=[lgb.record_evaluation(got_loss)])  # fmt: skip
        got = _trees(model)
        # the Datasets LightGBM builds whole from the rows' matrix
        X = sub.rows()
        whole = lgb.Dataset(X[train], label=y[train], weight=w[train], feature_name=feats,
                            categorical_feature=[0], params=PARAMS)  # fmt: skip
        whole_valid = lgb.Dataset(X[held], label=y[held], weight=w[held], reference=whole)
        want_loss: dict = {}
        ref = lgb.train(PARAMS, whole, 25, valid_sets=[whole_valid], valid_names=["held"],
                        callbacks=[lgb.record_evaluation(want_loss)])  # fmt: skip
        assert got == _trees(ref)
        assert got_loss["held"]["binary_logloss"] == want_loss["held"]["binary_logloss"]


def test_a_later_set_bins_only_its_new_columns_and_the_prior() -> None:
    design, y, names = _design()
    rows = np.arange(N_ROWS)
    runs = BinnedRuns()
    small = runs.training(DesignRows(design.select(_columns(names, 10)), rows), y, PARAMS)
    large = runs.training(DesignRows(design.select(_columns(names, 23)), rows), y, PARAMS)
    assert [len(r.feature_name) for r in small] == [10, 1]
    assert [len(r.feature_name) for r in large] == [10, 13, 1]
    assert large[0] is small[0]  # the shared run, binned once
    assert large[-1] is not small[-1]  # the prior, binned for each fit
    joined = runs.joined(large, y, None)
    assert joined.num_feature() == 24
    assert small[0].num_feature() == 10  # a kept run is never joined into
    # other rows are other runs
    fewer = runs.training(DesignRows(design.select(_columns(names, 10)), rows[:-1]), y[:-1],
                          PARAMS)  # fmt: skip
    assert fewer[0] is not small[0]
    # the last set's fits take the kept runs: joined in place, and not kept for later
    runs.keep = False
    last = runs.training(DesignRows(design.select(_columns(names, 23)), rows), y, PARAMS)
    assert last[0] is small[0] and last[1] is large[1]
    assert runs.joined(last, y, None) is last[0]
    again = runs.training(DesignRows(design.select(_columns(names, 23)), rows), y, PARAMS)
    assert again[0] is not small[0]


def test_runs_beyond_the_byte_budget_are_binned_again_not_kept() -> None:
    design, y, names = _design()
    rows = np.arange(N_ROWS)
    for budget, shared in ((10 * N_ROWS, True), (10 * N_ROWS - 1, False)):
        runs = BinnedRuns(keep_bytes=budget)  # the small set's first run: 10 columns
        small = runs.training(DesignRows(design.select(_columns(names, 10)), rows), y, PARAMS)
        large = runs.training(DesignRows(design.select(_columns(names, 23)), rows), y, PARAMS)
        assert (large[0] is small[0]) is shared
        assert [len(r.feature_name) for r in large] == ([10, 13, 1] if shared else [23, 1])


def test_the_halves_fits_in_two_threads_are_the_fits_one_thread_makes() -> None:
    # As the job fits the halves: two worker threads, one LightGBM thread each, every set
    # joined from shared runs. Without each fit's OpenMP count set in its own thread this
    # loop crashed (a segfault in LightGBM's row pushes); each thread's fits must also be
    # the ones a lone thread makes.
    design, y, names = _design()
    groups = np.array([f"p{i // 20}" for i in range(N_ROWS)], dtype=object)
    cap = Capacity(n_iter=8, learning_rate=0.3, max_leaves=15, early_stopping=True, patience=2)

    def fits(seed: int) -> list[str]:
        rng, out = np.random.default_rng(seed), []
        for _ in range(12):
            runs, rows = BinnedRuns(), np.sort(rng.permutation(N_ROWS)[:4_500])
            for n in SETS.values():
                runs.keep = n != SETS["large"]
                sub = design.select(_columns(names, n))
                est = fit_estimator(sub, y, sub.features, "lgbm", "greedy", cap, 3, 1,
                                    groups=groups, rows=rows, runs=runs)  # fmt: skip
                out.append(_trees(est))
        return out

    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(fits, (1, 2)))
    assert together == [fits(1), fits(2)]


@pytest.mark.parametrize(
    ("names", "fresh", "known", "want"),
    [
        (list("abcP"), {3}, set(), [(0, 3), (3, 4)]),
        (list("abcdP"), {4}, {("a", "b")}, [(0, 2), (2, 4), (4, 5)]),
        # the longest known run wins; a fresh column in the middle cuts the runs
        (list("abPcd"), {2}, {("a",), ("a", "b"), ("c", "d")}, [(0, 2), (2, 3), (3, 5)]),
        # a known run that would cross a fresh column is not taken
        (list("abPc"), {2}, {("a", "b", "P")}, [(0, 2), (2, 3), (3, 4)]),
    ],
)
def test_column_runs(names, fresh, known, want) -> None:
    assert column_runs(names, fresh, known) == want

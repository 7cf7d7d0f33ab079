"""`python -m bench.bench_forest`: the batch walk of a fitted forest against each library's predictor.

Fits one HGB and one LightGBM model of each law on synthetic rows (20% missing
values), then times, interleaved in one run, the library's own predictor and
`rerank.forest.jit.batch_phat` (the route `rerank.fit.models.BATCH_ROUTE` takes) on the
same held-out rows, after checking that they predict the same values bit for bit.
Prints each time and its ratio to the library's, measured in the same run.

    python -m bench.bench_forest                       # 400,000 rows, 200 trees, 2 threads
    python -m bench.bench_forest --rows 100000 --trees 50
"""

from __future__ import annotations

import argparse
import os
import time

import lightgbm as lgb
import numpy as np
from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor

from rerank.forest.jit import batch_phat, jit_forest
from rerank.forest.table import forest_of
from rerank.forest.walk import compile_forest

N_FEATURES = 36  # about a `rows` design matrix


def _rows(rng: np.random.Generator, n: int) -> np.ndarray:
    X = rng.normal(size=(n, N_FEATURES)).astype(np.float32)
    X[rng.random(X.shape) < 0.2] = np.nan
    return X


def _models(trees: int, threads: int, rng: np.random.Generator):
    """(name, kind, estimator, library predictor) of each library and law."""
    X = _rows(rng, 60_000)
    signal = np.nan_to_num(X[:, 0]) + np.nan_to_num(X[:, 1]) * np.nan_to_num(X[:, 2])
    y = signal + rng.normal(size=X.shape[0]) > 0
    hgb = {"max_iter": trees, "max_leaf_nodes": 63, "early_stopping": False, "random_state": 0}
    lgbm = {"n_estimators": trees, "num_leaves": 63, "verbose": -1, "n_jobs": threads}
    c = HistGradientBoostingClassifier(**hgb).fit(X, y)
    r = HistGradientBoostingRegressor(**hgb).fit(X, y.astype(float))
    lc = lgb.LGBMClassifier(**lgbm).fit(X, y).booster_
    lr = lgb.LGBMRegressor(**lgbm).fit(X, y.astype(float)).booster_
    return [
        ("hgb greedy", "hgb", c, lambda X: c.predict_proba(X)[:, 1]),
        ("hgb sampling", "hgb", r, r.predict),
        ("lgbm greedy", "lgbm", lc, lambda X: lc.predict(X, num_threads=threads)),
        ("lgbm sampling", "lgbm", lr, lambda X: lr.predict(X, num_threads=threads)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--trees", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    rng = np.random.default_rng(0)
    held_out = _rows(rng, args.rows)
    print(f"load {os.getloadavg()[0]:.2f}; {args.rows} rows, {args.threads} threads")
    for name, kind, estimator, library in _models(args.trees, args.threads, rng):
        walk = jit_forest(compile_forest(forest_of(estimator, kind)))
        routes = {
            "library": library,
            "batch walk": lambda X, w=walk: batch_phat(w, X, args.threads),
        }
        assert np.array_equal(routes["batch walk"](held_out), library(held_out)), name
        times: dict[str, list[float]] = {k: [] for k in routes}
        for _ in range(args.repeats):  # interleaved: both routes see the same machine state
            for k, fn in routes.items():
                t0 = time.perf_counter()
                fn(held_out)
                times[k].append(time.perf_counter() - t0)
        base = min(times["library"])
        shown = ", ".join(f"{k} {min(v):.3f} s ({base / min(v):.2f}x)" for k, v in times.items())
        print(f"{name} ({len(walk.roots)} trees, the same values bit for bit): {shown}")


if __name__ == "__main__":
    main()

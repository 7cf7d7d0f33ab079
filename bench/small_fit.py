"""Where a small reranker fit's time goes: `python -m bench.bench_online --small-fit N`.

Set-up (design matrix, token prior), binning and boosting iterations of one fit
on a few thousand candidates, on one thread and on every core.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import numpy as np

from features.schema import candidate_store
from rerank.fit.boosting import PAPER_CAPACITY
from rerank.fit.models import fit_reranker


def small_fit_frame(n: int, cache: Path):
    """The T=1 candidates `bench_online.fitted` caches under `cache`, else ~n synthetic ones."""
    for folder in sorted(cache.glob("online-*/features_T1")):
        frame = candidate_store(folder).read().to_pandas()
        return frame, str(folder.relative_to(cache))
    from tests.candidate_frames import make_candidate_frame

    return make_candidate_frame(n_prompts=max(2, n // 100), rounds=10), "synthetic"


def small_fit_profile(frame, kind: str, law: str) -> list[dict]:
    """Where a small fit's time goes: set-up (design matrix, priors), binning, iterations.

    Per thread count (1, and every core: given explicitly, since `n_threads=None`
    fits this small run on one thread, `rerank.fit.boosting`): the whole `fit_reranker`
    at the paper's capacity, and the library alone with 1 and 400 iterations
    (LightGBM: binning is `Dataset.construct`, timed on its own).
    """
    import lightgbm as lgb

    from rerank.fit.boosting import fit_estimator
    from rerank.fit.design import design_matrix, task_categories
    from rerank.fit.models import LABEL_OF_LAW, feature_list
    from rerank.fit.token_prior import token_prior_features

    features = feature_list("rows")
    y = frame[LABEL_OF_LAW[law]].to_numpy(np.float64)
    t0 = time.perf_counter()
    prior, _ = token_prior_features(frame["token"].to_numpy(), y, np.ones(len(frame), bool))
    X = design_matrix(frame, features, task_categories(frame), prior)
    setup = time.perf_counter() - t0
    rows = []
    for threads in (1, len(os.sched_getaffinity(0))):
        rec = {"kind": kind, "threads": threads, "rows": len(frame), "setup_s": setup}
        t = time.perf_counter()
        fit_reranker(frame, "rows", kind, law, n_threads=threads, capacity=PAPER_CAPACITY)
        rec["fit_reranker_s"] = time.perf_counter() - t
        for n_iter in (1, PAPER_CAPACITY.n_iter):
            cap = dataclasses.replace(PAPER_CAPACITY, n_iter=n_iter)
            t = time.perf_counter()
            fit_estimator(X, y, features, kind, law, cap, 0, threads)
            rec[f"library_{n_iter}_s"] = time.perf_counter() - t
        if kind == "lgbm":
            t = time.perf_counter()
            lgb.Dataset(X, label=y, params={"num_threads": threads, "verbosity": -1,
                                            "max_bin": 255}).construct()  # fmt: skip
            rec["binning_s"] = time.perf_counter() - t
        rec["per_iteration_ms"] = 1000 * (
            (rec[f"library_{PAPER_CAPACITY.n_iter}_s"] - rec["library_1_s"])
            / (PAPER_CAPACITY.n_iter - 1)
        )
        rows.append(rec)
    return rows

"""`python -m bench.bench_rerankers`: LightGBM vs HGB fit time at equal held-out loss (issue 6).

On paper-scale synthetic candidates (1402 prompts x 261 rounds -> 3,659,220
first-level candidates), for each law (greedy classifier at T=0, sampling
regressor at T=1) and the Rows features: fit both libraries with the paper's
capacity (400 iterations, learning rate 0.05, 63 leaves) on the odd prompts and
follow the held-out loss on the even prompts along the boosting iterations
(log loss for the classifier, squared error for the regressor).

Fit time at equal held-out loss: L* is the worse of the two final losses, so
both libraries reach it; each library's time to reach it is interpolated as
t(i) = t(1) + (t(400) - t(1)) * (i - 1) / 399 from two measured fits (1 and 400
iterations: binning and set-up are the fixed part). The ratio LightGBM / HGB
of those times is printed, with the full-fit times and final losses.

    python -m bench.bench_rerankers                  # paper scale
    python -m bench.bench_rerankers --prompts 64     # a quick look
    python -m bench.bench_rerankers --full-job       # also time `python -m rerank.train` for both
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.special import expit

from bench.bench_extract import CACHE, PAPER_PROMPTS, PAPER_ROUNDS, paper_traces
from decode.trace_schema import SCHEMA_VERSION
from features.extract import extract
from features.schema import candidate_store
from rerank.crossfit import prompt_halves
from rerank.models import (
    KINDS,
    LABEL_OF_LAW,
    Capacity,
    design_matrix,
    feature_list,
    fit_estimator,
    task_categories,
)
from rerank.token_prior import token_prior_features

FEATURE_SET = "rows"
GRID_STEP = 10  # held-out loss every 10 iterations


def paper_features(prompts: int, rounds: int) -> Path:
    """The cached candidate table of the cached synthetic traces (extracted on first use)."""
    traces = paper_traces(prompts, rounds)
    out = CACHE / f"features-v{SCHEMA_VERSION}-{prompts}x{rounds}-seed0"
    extract(traces, out, log=lambda _: None)  # resumable: finished shards are skipped
    return out


def held_out_curve(est, kind: str, law: str, X: np.ndarray, y: np.ndarray, n_iter: int) -> dict:
    """Held-out loss after every GRID_STEP iterations: {iteration: loss}."""
    grid = set(range(GRID_STEP, n_iter + 1, GRID_STEP)) | {n_iter}
    out = {}
    if kind == "lgbm":  # raw scores of consecutive blocks of trees add up to the model's
        raw, done = np.zeros(len(y)), 0
        for i in sorted(grid):
            raw += est.predict(X, start_iteration=done, num_iteration=i - done, raw_score=True)
            done = i
            out[i] = _loss(expit(raw) if law == "greedy" else raw, y, law)
        return out
    staged = est.staged_predict_proba(X) if law == "greedy" else est.staged_predict(X)
    for i, pred in enumerate(staged, start=1):
        if i in grid:
            out[i] = _loss(pred[:, 1] if law == "greedy" else pred, y, law)
    return out


def _loss(pred: np.ndarray, y: np.ndarray, law: str) -> float:
    """Log loss of predicted probabilities (greedy) or squared error (sampling)."""
    if law == "greedy":
        p = np.clip(pred, 1e-12, 1 - 1e-12)
        return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))
    return float(np.mean((pred - y) ** 2))


def iterations_to(curve: dict, target: float) -> float:
    """First (linearly interpolated) iteration whose held-out loss is <= target."""
    its = sorted(curve)
    prev_i, prev_l = 0, None
    for i in its:
        if curve[i] <= target:
            if prev_l is None or prev_l == curve[i]:
                return float(i)
            return prev_i + (i - prev_i) * (prev_l - target) / (prev_l - curve[i])
        prev_i, prev_l = i, curve[i]
    return float("nan")


def bench_law(frame: pd.DataFrame, law: str, capacity: Capacity) -> dict:
    features = feature_list(FEATURE_SET)
    cats = task_categories(frame)
    y = frame[LABEL_OF_LAW[law]].to_numpy(np.float64)
    test = prompt_halves(frame["prompt_id"].to_numpy()) == 0
    prior, _ = token_prior_features(frame["token"].to_numpy(), y, ~test)
    X = design_matrix(frame, features, cats, prior)
    Xtr, ytr, Xte, yte = X[~test], y[~test], X[test], y[test]
    res = {"rows": (len(ytr), len(yte))}
    for kind in KINDS:
        times = []
        for n_iter in (1, capacity.n_iter):
            cap = Capacity(n_iter, capacity.learning_rate, capacity.max_leaves)
            t0 = time.perf_counter()
            est = fit_estimator(Xtr, ytr, features, kind, law, cap, 0, None)
            times.append(time.perf_counter() - t0)
        res[kind] = {
            "t1": times[0],
            "t": times[1],
            "curve": held_out_curve(est, kind, law, Xte, yte, capacity.n_iter),
        }
    target = max(res[k]["curve"][capacity.n_iter] for k in KINDS)
    for kind in KINDS:
        r = res[kind]
        r["iters"] = iterations_to(r["curve"], target)
        r["t_equal"] = r["t1"] + (r["t"] - r["t1"]) * (r["iters"] - 1) / (capacity.n_iter - 1)
    res["target"] = target
    return res


def full_job(traces: Path, features: Path) -> dict[str, float]:
    """Wall seconds of the default `python -m rerank.train` with each library."""
    out = {}
    for kind in KINDS:
        with tempfile.TemporaryDirectory(prefix="rerank-", dir=CACHE) as tmp:
            cmd = [
                sys.executable, "-m", "rerank.train", f"rerank_model={kind}",
                f"rerank.traces={traces}", f"rerank.features={features}",
                f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db", f"hydra.run.dir={tmp}/run",
            ]  # fmt: skip
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            out[kind] = time.perf_counter() - t0
            print(f"  rerank.train rerank_model={kind}: {out[kind]:.0f} s wall", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=PAPER_PROMPTS)
    parser.add_argument("--rounds", type=int, default=PAPER_ROUNDS)
    parser.add_argument("--full-job", action="store_true", help="also time rerank.train for both")
    args = parser.parse_args()
    features = paper_features(args.prompts, args.rounds)
    table = candidate_store(features).read().to_pandas()
    print(f"{len(table):,} first-level candidates, {table.prompt_id.nunique():,} prompts")
    capacity = Capacity()
    for temperature, part in table.groupby("temperature"):
        law = "greedy" if temperature == 0 else "sampling"
        res = bench_law(part.reset_index(drop=True), law, capacity)
        loss = "log loss" if law == "greedy" else "squared error"
        print(
            f"\n== T={temperature:g} ({law}, {FEATURE_SET} features): "
            f"{res['rows'][0]:,} training rows, {res['rows'][1]:,} held out =="
        )
        for kind in KINDS:
            r = res[kind]
            print(
                f"  {kind:5s} fit {r['t']:6.1f} s (1 iteration: {r['t1']:4.1f} s), "
                f"held-out {loss} {r['curve'][capacity.n_iter]:.5f}; "
                f"reaches {res['target']:.5f} at iteration {r['iters']:5.1f} = {r['t_equal']:6.1f} s"
            )
        ratio = res["lgbm"]["t_equal"] / res["hgb"]["t_equal"]
        print(
            f"  LightGBM / HGB fit time at equal held-out loss: {ratio:.2f} "
            f"(full fits: {res['lgbm']['t'] / res['hgb']['t']:.2f})"
        )
    if args.full_job:
        print("\nfull default job (cross-fitting, calibration, evaluation, bootstrap, MLflow):")
        full_job(paper_traces(args.prompts, args.rounds), features)


if __name__ == "__main__":
    main()

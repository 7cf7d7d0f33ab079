"""`python -m bench.bench_rerankers`: LightGBM vs HGB fit time at equal held-out loss.

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

Full job (`--full-job`): wall and CPU seconds and peak memory of the default
`python -m rerank.train` on the same stores, for this code and, with
`--baseline DIR`, for another code tree (ratios baseline / current from the same
run; `--pairs N`: N interleaved pairs, each pair's ratio and their median and range).
Then the baseline's own fitted models (its out-of-fold predictions) are
evaluated by this code and every rule value compared with the baseline's, and
one of its saved rerankers predicts its held-out half through the library and
through the compiled forest (`rerank.forest.walk`).

    python -m bench.bench_rerankers                  # paper scale
    python -m bench.bench_rerankers --prompts 64     # a quick look
    python -m bench.bench_rerankers --full-job --skip-fits --baseline /tmp/base
        # the default job, this code vs `git archive HEAD~1 | tar -x -C /tmp/base`
    python -m bench.bench_rerankers --full-job --skip-fits --baseline /tmp/base --pairs 3
        # three interleaved pairs: each pair's ratio, their median and range
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.special import expit

from bench.bench_extract import CACHE, PAPER_PROMPTS, PAPER_ROUNDS, paper_traces
from features.extract import extract
from features.schema import candidate_store
from rerank.evaluate.pool_chunks import ROUND_KEYS
from rerank.fit.boosting import Capacity, fit_estimator
from rerank.fit.design import design_matrix, task_categories
from rerank.fit.halves import prompt_halves
from rerank.fit.models import LABEL_OF_LAW, feature_list
from rerank.fit.token_prior import token_prior_features
from selection.rules import MODEL_KINDS
from specrank.store.trace_schema import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[1]
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
    for kind in MODEL_KINDS:
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
    target = max(res[k]["curve"][capacity.n_iter] for k in MODEL_KINDS)
    for kind in MODEL_KINDS:
        r = res[kind]
        r["iters"] = iterations_to(r["curve"], target)
        r["t_equal"] = r["t1"] + (r["t"] - r["t1"]) * (r["iters"] - 1) / (capacity.n_iter - 1)
    res["target"] = target
    return res


def _rss_gb(pid: int) -> float:
    """Resident memory of a process (Linux /proc; 0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except OSError:
        return 0.0


def run_job(root: Path, overrides: list[str], tmp: Path, rss_limit_gb: float = 7.5) -> dict:
    """Wall seconds, CPU seconds and peak RSS of `python -m rerank.train` run in the code tree `root`.

    The child runs from `root` (its own packages first on sys.path), so a baseline
    checkout (e.g. `git archive <rev> | tar -x -C <dir>`) is timed on the same data.
    A child whose resident memory passes `rss_limit_gb` is stopped (a shared machine).
    """
    # a timed job fits every model: no finished fit of an earlier run is taken (a tree
    # from before resumable fits has no such setting)
    fresh = ["rerank.fits=null"] if (root / "rerank" / "fit" / "resume.py").exists() else []
    cmd = [sys.executable, "-m", "rerank.train", *overrides, *fresh,
           f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db", f"hydra.run.dir={tmp}/run"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL)
    while True:  # this child's own usage (ru_maxrss: its peak RSS, kB) once it exits
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if _rss_gb(proc.pid) > rss_limit_gb:
            proc.kill()
            raise RuntimeError(f"{' '.join(cmd)} passed {rss_limit_gb} GB resident; stopped")
        time.sleep(0.5)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} (in {root}) exited with {proc.returncode}")
    peak_gib = usage.ru_maxrss / 2**20  # ru_maxrss is in KiB
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_gib": peak_gib,
            "run": tmp / "run"}  # fmt: skip


def same_model_values(run: Path, traces: Path, features: Path, rerank=None) -> dict:
    """This code's rule values on a finished run's own out-of-fold predictions, vs that run's.

    The same fitted models (their saved predictions) evaluated by both code trees: every
    `<rule>@B<b>` value the run wrote is compared with what `rerank.job.evaluation.evaluate` gives now.
    `rerank`: the run's `RerankConfig` (default: the defaults on these stores).
    """
    from rerank.config import RerankConfig
    from rerank.fit.halves import fold_map
    from rerank.fit.predict import FirstFactorPredictions
    from rerank.fit.quality import prediction_quality
    from rerank.job.evaluation import evaluate
    from rerank.job.fitting import Fitted
    from rerank.settings import store_budgets

    if rerank is None:
        rerank = RerankConfig(traces=str(traces), features=str(features))
    cands = candidate_store(features).read().to_pandas()
    folds = fold_map(cands["prompt_id"].to_numpy(), rerank.halves, 0, cands["task"].to_numpy())
    preds = pd.read_parquet(run / "oof_predictions.parquet")
    rules = [c for c in preds.columns if c not in {*ROUND_KEYS, "cand_index", "fold"}]
    ffp = FirstFactorPredictions(preds, rules)
    fitted = Fitted(cands, folds, ffp, prediction_quality(cands, ffp), 0.0)
    t0 = time.perf_counter()
    now = evaluate(rerank, fitted, 0, store_budgets(rerank)).per_round
    seconds = time.perf_counter() - t0
    then = pd.read_parquet(run / "per_round_values.parquet")
    keys = [*ROUND_KEYS]
    now = now.set_index(keys).loc[then.set_index(keys).index]
    cols = [c for c in then.columns if "@B" in c and c in now.columns]
    same = [c for c in cols if np.array_equal(now[c].to_numpy(), then[c].to_numpy())]
    diff = max((np.abs(now[c].to_numpy() - then[c].to_numpy()).max() for c in cols), default=0.0)
    return {"columns": len(cols), "identical": len(same), "max_abs_diff": float(diff),
            "evaluate_s": seconds}  # fmt: skip


def job_rerank_config(overrides: list[str]):
    """This tree's `RerankConfig` under the job's overrides: what its `rerank.train` ran with
    (with `experiment=paper` the defaults would evaluate other rules and another policy)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import specrank.settings.config  # noqa: F401  (registers the Hydra schema)
    from specrank.settings.paths import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(compose("train", overrides=overrides).rerank)


def forest_vs_library(run: Path, features: Path) -> dict:
    """A saved reranker of a run predicting its held-out half: library vs compiled forest."""
    from rerank.fit.persist import load_reranker

    folder = sorted((run / "rerankers").glob("rows_*_T0_fold0"))[0]
    model = load_reranker(folder)
    cands = candidate_store(features).read().to_pandas()
    part = cands[(cands["temperature"] == 0) & ~cands["prompt_id"].isin(model.train_prompts)]
    prior = model.token_prior.transform(part["token"].to_numpy())
    X = design_matrix(part, model.features, model.categories, prior)
    out = {"model": folder.name, "rows": len(X), "trees": model.n_iter}
    for route in ("library", "forest"):
        t0 = time.perf_counter()
        out[route] = model.predict_matrix(X, route=route)
        out[f"{route}_s"] = time.perf_counter() - t0
    out["max_abs_diff"] = float(np.abs(out.pop("library") - out.pop("forest")).max())
    return out


def full_job(
    traces: Path,
    features: Path,
    baseline: Path | None,
    extra: list[str] | None = None,
    pairs: int = 1,
) -> dict:
    """The default `python -m rerank.train` on these stores: this code, and a baseline tree.

    `extra` overrides both runs take (e.g. the paper's two feature sets). `pairs` > 1 runs
    the two trees that many times, interleaved (the baseline first in odd pairs, this code
    first in even ones), and prints each pair's CPU ratio and their median and range
    (`pair_ratios`): one job's CPU moved by up to 19% between runs on one host
    (bench/SCALING.md), so one pair's ratio is not a figure.
    """
    overrides = [f"rerank.traces={traces}", f"rerank.features={features}", *(extra or [])]
    trees = [("current", ROOT)] if baseline is None else [("baseline", baseline), ("current", ROOT)]
    out: dict = {"pairs": []}
    with tempfile.TemporaryDirectory(prefix="rerank-", dir=CACHE) as tmp:
        for i in range(pairs):
            pair = {}
            for name, root in trees if i % 2 == 0 else trees[::-1]:
                print(f"  {name} ({root}): uptime {os.getloadavg()[0]:.2f} load", flush=True)
                pair[name] = r = run_job(root, overrides, Path(tmp) / f"{name}{i}")
                r["load_end"] = os.getloadavg()[0]
                print(f"  {name}: {r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} s CPU, "
                      f"peak {r['peak_gib']:.2f} GiB (load {r['load_end']:.2f} at its end)",
                      flush=True)  # fmt: skip
            out["pairs"].append(pair)
            if baseline is not None:
                b, c = pair["baseline"], pair["current"]
                print(f"  pair {i + 1}, baseline / current: wall {b['wall_s'] / c['wall_s']:.2f}x, "
                      f"CPU {b['cpu_s'] / c['cpu_s']:.2f}x (current / baseline "
                      f"{c['cpu_s'] / b['cpu_s']:.3f}x), peak memory "
                      f"{b['peak_gib'] / c['peak_gib']:.2f}x", flush=True)  # fmt: skip
        if baseline is not None:
            out["ratios"] = q = pair_ratios(out["pairs"])
            print(f"  current / baseline CPU over {q['n']} interleaved pair(s): median "
                  f"{q['median']:.3f}x, range {q['low']:.3f}-{q['high']:.3f}x")  # fmt: skip
            out |= _same_model_checks(out["pairs"][0]["baseline"]["run"], traces, features,
                                      overrides)  # fmt: skip
    return out


def pair_ratios(pairs: list[dict]) -> dict:
    """Current / baseline CPU seconds of each interleaved pair; their median and range."""
    r = np.array([p["current"]["cpu_s"] / p["baseline"]["cpu_s"] for p in pairs])
    return {"n": len(r), "each": r.tolist(), "median": float(np.median(r)),
            "low": float(r.min()), "high": float(r.max())}  # fmt: skip


def _same_model_checks(run: Path, traces: Path, features: Path, overrides: list[str]) -> dict:
    """A baseline run's models evaluated by this code, and its forest vs the library."""
    same = same_model_values(run, traces, features, job_rerank_config(overrides))
    print(f"  the baseline's fitted models evaluated by this code: {same['identical']} of "
          f"{same['columns']} rule-value columns identical (max |diff| "
          f"{same['max_abs_diff']:.3g}); evaluation {same['evaluate_s']:.0f} s")  # fmt: skip
    fl = forest_vs_library(run, features)
    print(f"  {fl['model']} ({fl['trees']} trees) on {fl['rows']:,} held-out rows: library "
          f"{fl['library_s']:.1f} s, forest {fl['forest_s']:.1f} s "
          f"({fl['library_s'] / fl['forest_s']:.1f}x), max |diff| {fl['max_abs_diff']:.3g}")  # fmt: skip
    return {"same_model": same, "forest": fl}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=PAPER_PROMPTS)
    parser.add_argument("--rounds", type=int, default=PAPER_ROUNDS)
    parser.add_argument(
        "--full-job", action="store_true", help="also time the default rerank.train"
    )
    parser.add_argument("--baseline", type=Path, default=None,
                        help="with --full-job: a code tree to time beside this one (ratios)")  # fmt: skip
    parser.add_argument("--skip-fits", action="store_true", help="only the full job")
    parser.add_argument("--pairs", type=int, default=1,
                        help="with --baseline: interleaved pairs of runs (ratios' median, range)")  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="with --full-job: Hydra overrides for both")
    args = parser.parse_args()
    if args.pairs < 1 or (args.pairs > 1 and args.baseline is None):
        parser.error(f"--pairs takes an int >= 1, above 1 only with --baseline; got {args.pairs}")
    features = paper_features(args.prompts, args.rounds)
    traces = paper_traces(args.prompts, args.rounds)
    if args.skip_fits:
        full_job(traces, features, args.baseline, args.overrides, args.pairs)
        return
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
        for kind in MODEL_KINDS:
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
        full_job(traces, features, args.baseline, args.overrides, args.pairs)


if __name__ == "__main__":
    main()

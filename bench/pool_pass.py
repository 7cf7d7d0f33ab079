"""`python -m bench.pool_pass`: the default job's pass over the pools, this code against a
baseline code tree, interleaved in one run.

    git worktree add /tmp/base <rev>                            # the pinned baseline
    python -m bench.pool_pass --baseline /tmp/base              # 154 prompts x 261 rounds
    python -m bench.pool_pass --baseline /tmp/base --synthetic 77 154 462

For each synthetic store (`--synthetic N`: N prompts x 261 rounds, both laws) the default
`rerank.train` runs once here with its fits kept (`bench/.cache/pool_pass/`), giving the
out-of-fold predictions both trees then evaluate: each repeat runs the job's evaluation
stage (`rerank.job.evaluation.evaluate`, the default settings) in a child process per
tree, from that tree (its packages first on sys.path), the trees' order alternating,
after one untimed pass per tree (a fresh tree compiles its numba kernels on first use). It
prints the pass's wall seconds (`time/pool_pass_s`: the pools read, every rule valued,
the report consumers fed) and the child's CPU seconds over the pass, their medians, the
ratio baseline / current, the rounds per second, and whether every `<rule>@B<b>` value of
the two trees is identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from bench.bench_extract import PAPER_ROUNDS, paper_traces
from bench.bench_rerankers import paper_features

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "bench" / ".cache" / "pool_pass"

# Run by each tree's interpreter from that tree: only APIs both trees share.
CHILD = """
import json, sys, time
import pandas as pd
from features.schema import candidate_store
from rerank.config import RerankConfig
from rerank.fit.predict import FirstFactorPredictions
try:
    from rerank.fit.halves import fold_map
except ImportError:  # a tree from before rerank/fit/halves.py
    from rerank.fit.predict import fold_map
from rerank.fit.quality import prediction_quality
try:
    from rerank.job.evaluation import evaluate
    from rerank.job.fitting import Fitted
except ImportError:  # a tree from before rerank/job/ (59e495d: the pass's first timing)
    from rerank.train import Fitted, evaluate
from rerank.settings import store_budgets
from specrank.runtime.memory import retain_freed_heap

args = json.loads(sys.argv[1])
retain_freed_heap()  # as rerank.train's entry point
rerank = RerankConfig(traces=args["traces"], features=args["features"], **args["settings"])
cands = candidate_store(args["features"]).read().to_pandas()
folds = fold_map(cands["prompt_id"].to_numpy(), rerank.halves, 0, cands["task"].to_numpy())
preds = pd.read_parquet(args["predictions"])
keys = {"prompt_id", "temperature", "rule", "budget", "round_index", "cand_index", "fold"}
ffp = FirstFactorPredictions(preds, [c for c in preds.columns if c not in keys])
fitted = Fitted(cands, folds, ffp, prediction_quality(cands, ffp), 0.0)
cpu = time.process_time()
ev = evaluate(rerank, fitted, 0, store_budgets(rerank))
cpu = time.process_time() - cpu  # the stage's CPU seconds, every thread
values = ev.per_round[[c for c in ev.per_round.columns if "@B" in c]]
values.to_parquet(args["values"])
print(json.dumps({"pass_s": ev.seconds["pool_pass"], "stage_cpu_s": cpu,
                  "rounds": len(ev.per_round)}))
"""


def reference_run(prompts: int) -> tuple[Path, Path, Path]:
    """(traces, features, out-of-fold predictions) of a store; the default job is run once
    here, its fits kept, to give the predictions both trees evaluate."""
    traces, features = paper_traces(prompts, PAPER_ROUNDS), paper_features(prompts, PAPER_ROUNDS)
    run = CACHE / f"run-{prompts}x{PAPER_ROUNDS}"
    predictions = run / "oof_predictions.parquet"
    if not predictions.exists():
        cmd = [sys.executable, "-m", "rerank.train", f"rerank.traces={traces}",
               f"rerank.features={features}", f"rerank.fits={CACHE}/fits-{prompts}",
               f"mlflow.tracking_uri=sqlite:///{CACHE}/mlflow.db", f"hydra.run.dir={run}"]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return traces, features, predictions


def child_pass(tree: Path, traces: Path, features: Path, predictions: Path, values: Path,
               settings: dict | None = None) -> dict:  # fmt: skip
    """The evaluation stage run by `tree`'s code in a fresh interpreter: its pass figures.

    `settings`: `RerankConfig` fields other than the defaults (plain values)."""
    args = {"traces": str(traces), "features": str(features), "predictions": str(predictions),
            "values": str(values), "settings": settings or {}}  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], cwd=tree, env=env,
                         capture_output=True, text=True)  # fmt: skip
    if out.returncode:
        raise RuntimeError(
            f"the evaluation in {tree} exited {out.returncode}: {out.stderr[-3000:]}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def same_values(a: Path, b: Path) -> tuple[int, int]:
    """(identical columns, columns) of two trees' per-round rule values, matched by name (the
    trees may order their columns differently); a column only one tree has counts as
    different."""
    x, y = pd.read_parquet(a), pd.read_parquet(b)
    cols = sorted({c for c in [*x.columns, *y.columns] if "@B" in c})
    if len(x) != len(y):
        return 0, len(cols)
    return sum(c in x and c in y and x[c].equals(y[c]) for c in cols), len(cols)


def bench_size(prompts: int, current: Path, baseline: Path | None, repeats: int) -> list[dict]:
    traces, features, predictions = reference_run(prompts)
    trees = {"current": current, **({"baseline": baseline} if baseline else {})}
    rows = []
    with tempfile.TemporaryDirectory(prefix="pool-pass-", dir=CACHE) as tmp:
        for tree in trees.values():  # compiles the tree's numba kernels into its cache
            child_pass(tree, traces, features, predictions, Path(tmp) / "warm-up.parquet")
        for rep in range(repeats):
            names = list(trees) if rep % 2 else list(trees)[::-1]  # alternate the order
            for name in names:
                values = Path(tmp) / f"{name}.parquet"
                got = child_pass(trees[name], traces, features, predictions, values)
                rows.append({"rounds": got["rounds"], "tree": name, "repeat": rep, **got,
                             "load": os.getloadavg()[0]})  # fmt: skip
                print(f"  {prompts} prompts, {name}, repeat {rep}: pass {got['pass_s']:.1f} s, "
                      f"stage CPU {got['stage_cpu_s']:.1f} s, load {rows[-1]['load']:.2f}",
                      flush=True)  # fmt: skip
        if baseline:
            same, cols = same_values(Path(tmp) / "current.parquet", Path(tmp) / "baseline.parquet")
            print(f"  {prompts} prompts: {same} of {cols} rule-value columns identical")
            for row in rows:
                row["identical"] = f"{same}/{cols}"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--synthetic", type=int, nargs="+", default=[154])
    parser.add_argument("--baseline", type=Path, default=None, help="a code tree to time beside")
    parser.add_argument("--current", type=Path, default=ROOT,
                        help="the code tree timed as current (default: this one)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    rows = []
    for prompts in args.synthetic:
        rows += bench_size(prompts, args.current, args.baseline, args.repeats)
    table = pd.DataFrame(rows)
    med = table.groupby(["rounds", "tree"])[["pass_s", "stage_cpu_s"]].median().unstack("tree")
    med.columns = [f"{a}_{b}" for a, b in med.columns]
    if args.baseline:
        med["pass_ratio"] = med["pass_s_baseline"] / med["pass_s_current"]
        med["cpu_ratio"] = med["stage_cpu_s_baseline"] / med["stage_cpu_s_current"]
    med["rounds_per_s_current"] = med.index / med["pass_s_current"]
    pd.set_option("display.width", 160)
    print("\nmedians over repeats (pass: wall seconds; stage_cpu: the evaluation stage's CPU s):")
    print(med.round(2).to_string())
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

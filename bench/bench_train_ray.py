"""`python -m bench.bench_train_ray`: `rerank.train` in one process against `launcher=ray`.

On cached synthetic stores (`--synthetic N`: N prompts x 261 rounds, both laws), each size
runs the default job twice in one run, interleaved: in this process's child
(`parallel.backend=local`), then on a local Ray cluster of `--workers` CPUs. Every finished
fit is refitted (`rerank.fits=null`). It prints, per run, the wall seconds and the peak
resident memory of the driver and of the largest Ray worker (sampled every 0.2 s from /proc:
Ray's workers are not the driver's children, so `wait4` cannot see them), the peak of all
the job's processes together (the node's share), and whether the two runs' summary tables
are equal. Per-worker peaks grow with the rounds of one law (a fit task) and with the
out-of-fold predictions every evaluation worker holds; the lines fitted through the sizes
give the extrapolated memory per node at 10x and 100x the paper.

    python -m bench.bench_train_ray                          # 77 and 154 prompts (20 k, 40 k rounds)
    python -m bench.bench_train_ray --synthetic 40 --workers 2   # a quick look
    python -m bench.bench_train_ray --fit-nodes 2                # and each fit on 2 nodes

`--fit-nodes N` adds a third run: `launcher=ray rerank.booster.fit_nodes=N` (each LightGBM fit
on N Ray Train workers of one thread, `rerank.on_nodes`); its summary is not the single
process's bit for bit, so the largest difference of a rule's gain over draft is printed instead.
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
import psutil

from bench.bench_extract import PAPER_PROMPTS, PAPER_ROUNDS, paper_traces
from bench.bench_rerankers import paper_features

ROOT = Path(__file__).resolve().parents[1]
PAPER = PAPER_PROMPTS * PAPER_ROUNDS  # rounds


def _tree(pid: int) -> list[psutil.Process]:
    """The driver and every Ray process started under it (raylet's workers included)."""
    try:
        top = psutil.Process(pid)
        return [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _rss(procs: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for p in procs:
        try:
            out[p.pid] = p.memory_info().rss / 2**30
        except psutil.NoSuchProcess:
            continue
    return out


def run(traces: Path, features: Path, extra: list[str], tmp: Path) -> dict:
    """Wall seconds and peak RSS (GiB) of one `python -m rerank.train` and its Ray workers."""
    cmd = [sys.executable, "-m", "rerank.train", f"paths.traces={traces}",
           f"paths.features={features}", "rerank.fits=null", *extra,
           f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db", f"hydra.run.dir={tmp}/run"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    driver = worker = total = 0.0
    while proc.poll() is None:
        rss = _rss(_tree(proc.pid))
        driver = max(driver, rss.pop(proc.pid, 0.0))
        workers = [v for pid, v in rss.items() if v > 0.05]  # Ray's own daemons are small
        worker = max([worker, *workers])
        total = max(total, driver + sum(workers))
        time.sleep(0.2)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: "
                           f"{proc.stderr.read().decode()[-2000:]}")  # fmt: skip
    return {"wall_s": time.perf_counter() - t0, "driver_gib": driver, "worker_gib": worker,
            "all_gib": total, "summary": pd.read_csv(tmp / "run" / "summary.csv")}  # fmt: skip


def _largest_gap(one: pd.DataFrame, nodes: pd.DataFrame) -> str:
    """The largest difference of a rule's gain over draft (a ratio, printed in percentage
    points) between two runs' summaries, and where."""
    gap = (nodes["gain"] - one["gain"]).abs()
    at = int(np.nanargmax(gap.to_numpy()))
    where = one.loc[at, ["law", "budget", "rule"]].to_dict()
    return f"largest gain difference {100 * gap.iat[at]:.3g} points at {where}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--synthetic", type=int, nargs="+", default=[77, 154])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--fit-nodes", type=int, default=None)
    args = parser.parse_args()
    ray = ["launcher=ray", f"parallel.workers={args.workers}"]
    modes = {"local": [], "ray": ray}
    if args.fit_nodes:
        modes["fit_nodes"] = [*ray, f"rerank.booster.fit_nodes={args.fit_nodes}",
                              "rerank.booster.n_threads=1"]  # fmt: skip
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    rows = []
    for prompts in args.synthetic:
        traces, features = (
            paper_traces(prompts, PAPER_ROUNDS),
            paper_features(prompts, PAPER_ROUNDS),
        )
        got = {}
        for mode, extra in modes.items():
            with tempfile.TemporaryDirectory() as tmp:
                got[mode] = run(traces, features, extra, Path(tmp))
            rows.append({"rounds": prompts * PAPER_ROUNDS, "mode": mode,
                         **{k: v for k, v in got[mode].items() if k != "summary"}})  # fmt: skip
        same = got["ray"]["summary"].equals(got["local"]["summary"])
        print(f"{prompts} prompts: the Ray run's summary table equals one process's: {same}")
        if "fit_nodes" in got:
            print(
                f"{prompts} prompts, fit_nodes={args.fit_nodes}: "
                f"{_largest_gap(got['local']['summary'], got['fit_nodes']['summary'])}"
            )
    table = pd.DataFrame(rows)
    pd.set_option("display.width", 160)
    print(table.round(2).to_string(index=False))
    ray = table[table["mode"] == "ray"]
    if len(ray) >= 2:  # linear in the rounds, through the measured sizes (extrapolated)
        for col in ("driver_gib", "worker_gib"):
            slope, icept = np.polyfit(ray["rounds"], ray[col], 1)
            at = {f"{k}x": icept + slope * k * PAPER for k in (1, 10, 100)}
            print(
                f"{col} per M rounds {slope * 1e6:.2f}; extrapolated: "
                + ", ".join(f"{k} {v:.1f} GiB" for k, v in at.items())
            )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

"""`python -m bench.bench_scaling`: how extraction and training grow with the study size.

For synthetic trace stores of growing size (prompts x rounds per prompt, both laws,
710-candidate pools; generated once into bench/.cache/), each stage runs in a child
process, timed inside it (wall and CPU seconds of the stage alone, start-up
excluded), with its peak resident memory from wait4 (ru_maxrss):

  * `features.extract`, one process; then two processes on the same stores, which
    split the shards through the store's claims (the wall ratio is the speedup);
  * training: load the whole candidate table, then fit one reranker (LightGBM,
    paper capacity, Rows features, greedy law, one cross-fitting half, 1 thread);
    `rerank.train` makes 2 laws x feature sets x 2 halves such fits.

A line a + b * rounds is fitted per figure and evaluated at the paper's 365,922
rounds and at ten times that (3,659,220 rounds): extrapolated from the measured
sizes, and printed as such.

    python -m bench.bench_scaling                          # 10k, 20k, 40k rounds
    python -m bench.bench_scaling --sizes 50x100,100x100   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.bench_extract import CACHE, paper_traces
from features.extract import extract
from features.schema import CANDIDATE_VERSION, candidate_store
from rerank.fit.halves import prompt_halves
from rerank.fit.models import fit_reranker
from specrank.store.trace_schema import SCHEMA_VERSION

PAPER_ROUNDS = 1402 * 261  # 365,922 (bench_extract's paper scale)
TENFOLD = 10 * PAPER_ROUNDS


def child(args: list[str]) -> dict[str, float]:
    """Run this module's `args` stage in a child; its figures plus peak RSS in GiB."""
    cmd = [sys.executable, "-m", "bench.bench_scaling", *args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed: {err.read().decode()[-2000:]}")
        out.seek(0)
        figures = json.loads(out.read().decode().strip().splitlines()[-1])
    return figures | {"gib": usage.ru_maxrss / 2**20}  # ru_maxrss: KiB on Linux


def together(runs: list[list[str]]) -> list[dict[str, float]]:
    """Several stage children started at once (the parallel extraction)."""
    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(child, runs))


def stage_extract(traces: Path, out: Path) -> None:
    """Child: `features.extract` into `out`; the stage's wall and CPU seconds, as JSON."""
    wall, cpu = time.perf_counter(), time.process_time()
    report = extract(traces, out, log=lambda _: None)
    print(json.dumps({"s": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
                      "written": report.shards_written}))  # fmt: skip


def stage_fit(features: Path) -> None:
    """Child: load the whole candidate table, fit one reranker on a cross-fitting half.

    What grows with the study in `rerank.train`: the candidate table in memory and
    each fit (LightGBM, paper capacity, Rows features, the greedy law). One thread,
    so CPU seconds do not count OpenMP threads spinning on a busy machine.
    """
    t0 = time.perf_counter()
    frame = candidate_store(features).read().to_pandas()
    load = time.perf_counter() - t0
    greedy = frame[frame["temperature"] == 0].reset_index(drop=True)
    ids, tasks = greedy["prompt_id"].to_numpy(), greedy["task"].to_numpy()
    half = greedy[prompt_halves(ids, "seeded", tasks=tasks) == 0].reset_index(drop=True)
    wall, cpu = time.perf_counter(), time.process_time()
    fit_reranker(half, "rows", "lgbm", "greedy", n_threads=1)
    print(json.dumps({"s": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
                      "load_s": load, "rows": len(half), "table_gib": frame.memory_usage(deep=True).sum() / 2**30}))  # fmt: skip


def measure(prompts: int, rounds: int, fit: bool) -> dict[str, float]:
    traces = paper_traces(prompts, rounds)
    tmp = Path(tempfile.mkdtemp(prefix="scaling-", dir=CACHE))
    try:
        row: dict[str, float] = {"rounds": prompts * rounds}
        one = child(["--stage-extract", str(traces), str(tmp / "features")])
        row |= {"extract_s": one["s"], "extract_cpu": one["cpu"], "extract_gib": one["gib"]}
        two = together([["--stage-extract", str(traces), str(tmp / "features2")]] * 2)
        assert sum(t["written"] for t in two) == one["written"]  # the claims split the shards
        row["extract2_s"] = max(t["s"] for t in two)
        row |= dict.fromkeys(("fit_s", "fit_cpu", "fit_gib", "fit_rows", "table_gib"), np.nan)
        if fit:
            f = child(["--stage-fit", str(tmp / "features")])
            row |= {"fit_s": f["s"], "fit_cpu": f["cpu"], "fit_gib": f["gib"],
                    "fit_rows": f["rows"], "table_gib": f["table_gib"]}  # fmt: skip
        return row
    finally:
        shutil.rmtree(tmp)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="100x100,200x100,400x100", help="prompts x rounds, ...")
    parser.add_argument("--fit-up-to", type=int, default=3, help="fit on the first N sizes")
    parser.add_argument("--stage-extract", nargs=2, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stage-fit", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage_extract:
        return stage_extract(*args.stage_extract)
    if args.stage_fit:
        return stage_fit(args.stage_fit)
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    print(f"trace schema v{SCHEMA_VERSION}, candidate table v{CANDIDATE_VERSION}; "
          f"load average {os.getloadavg()[0]:.2f} at start", flush=True)  # fmt: skip
    rows = []
    for k, (prompts, rounds) in enumerate(sizes):
        r = measure(prompts, rounds, fit=k < args.fit_up_to)
        rows.append(r)
        print(
            f"{r['rounds']:>8,} rounds: extract {r['extract_s']:6.1f} s wall {r['extract_cpu']:6.1f} s "
            f"CPU {r['extract_gib']:.2f} GiB | 2 processes {r['extract2_s']:6.1f} s "
            f"(x{r['extract_s'] / r['extract2_s']:.2f}) | table {r['table_gib']:.3f} GiB | one fit "
            f"({r['fit_rows']:,.0f} rows) {r['fit_s']:6.1f} s wall {r['fit_cpu']:6.1f} s CPU "
            f"{r['fit_gib']:.2f} GiB",
            flush=True,
        )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    print("extrapolated (a + b * rounds, least squares over the sizes measured):")
    for key, unit in (("extract_cpu", "s"), ("extract_gib", "GiB"), ("table_gib", "GiB"),
                      ("fit_cpu", "s"), ("fit_gib", "GiB")):  # fmt: skip
        pts = [(r["rounds"], r[key]) for r in rows if np.isfinite(r[key])]
        if len(pts) < 2:
            continue
        b, a = np.polyfit(*zip(*pts, strict=True), 1)
        print(f"  {key:12s} a={a:8.3f} b={b * 1e6:9.3f} per M rounds -> paper "
              f"{a + b * PAPER_ROUNDS:9.1f} {unit}, 10x paper {a + b * TENFOLD:9.1f} {unit}")  # fmt: skip


if __name__ == "__main__":
    main()

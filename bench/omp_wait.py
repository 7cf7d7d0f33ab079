"""`python -m bench.omp_wait`: OpenMP's wait policy for a LightGBM fit, alone and beside a
busy process (figures in bench/SCALING.md: why the project leaves libgomp's default).

    python -m bench.omp_wait                       # 200,000 rows x 30 features, 100 trees
    python -m bench.omp_wait --spincount 1000 10000 --repeats 1

Each repeat fits the same LightGBM model (2 threads, 63 leaves) in a fresh child process
under libgomp's default (a waiting thread spins first), under OMP_WAIT_POLICY=PASSIVE
(it sleeps at once) and, per --spincount N, under GOMP_SPINCOUNT=N, the settings in
alternating order; once with nothing else running and once beside a child that keeps one
core busy. It prints each setting's wall and CPU seconds (medians over the repeats, the
child's own rusage), their ratios against the default, and whether every setting fitted
the same model (its text dump). The figures are this machine's: give the load beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

FIT = """
import hashlib, json, resource, sys, time
import lightgbm as lgb
import numpy as np
rows, trees = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
X = rng.normal(size=(rows, 30)).astype(np.float32)
y = (X[:, 0] + 0.5 * X[:, 1] ** 2 + rng.normal(size=rows) > 0.5).astype(np.float64)
params = {"objective": "binary", "num_leaves": 63, "learning_rate": 0.1, "num_threads": 2,
          "verbose": -1, "seed": 0, "deterministic": True}
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
booster = lgb.train(params, lgb.Dataset(X, y), num_boost_round=trees)
wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
model = hashlib.sha256(booster.model_to_string().encode()).hexdigest()
print(json.dumps({"wall": wall, "cpu": cpu, "model": model}))
"""
BUSY = "while True: pass"
POLICIES = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
OMP_WAIT = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def fit(policy: dict[str, str], rows: int, trees: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OMP_WAIT}
    env.update(policy)
    out = subprocess.run([sys.executable, "-c", FIT, str(rows), str(trees)], env=env,
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    return json.loads(out)


def measure(policies: dict[str, dict[str, str]], rows: int, trees: int, repeats: int
            ) -> dict[str, list[dict]]:  # fmt: skip
    runs: dict[str, list[dict]] = {name: [] for name in policies}
    for r in range(repeats):
        order = list(policies) if r % 2 == 0 else list(reversed(policies))
        for name in order:
            runs[name].append(fit(policies[name], rows, trees))
    return runs


def report(label: str, runs: dict[str, list[dict]]) -> None:
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("wall", "cpu")}
           for name, rs in runs.items()}  # fmt: skip
    same = len({r["model"] for rs in runs.values() for r in rs}) == 1
    print(f"{label} (load {os.getloadavg()[0]:.2f} now):")
    for name, m in med.items():
        print(f"  {name:8s} wall {m['wall']:6.2f} s  CPU {m['cpu']:6.2f} s")
    for name in list(med)[1:]:
        wall = med[name]["wall"] / med["default"]["wall"]
        cpu = med[name]["cpu"] / med["default"]["cpu"]
        print(f"  {name} / default: wall {wall:.2f}x, CPU {cpu:.2f}x")
    print(f"  the same model under every setting: {same}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--trees", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--spincount", type=int, nargs="*", default=[],
                    help="also libgomp's default policy with GOMP_SPINCOUNT=N")  # fmt: skip
    a = ap.parse_args(argv)
    policies = {**POLICIES, **{f"spin {n}": {"GOMP_SPINCOUNT": str(n)} for n in a.spincount}}
    print(f"LightGBM, {a.rows:,} rows x 30 features, {a.trees} trees, 2 threads, "
          f"medians of {a.repeats}")  # fmt: skip
    report("alone", measure(policies, a.rows, a.trees, a.repeats))
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        report("beside one busy core", measure(policies, a.rows, a.trees, a.repeats))
    finally:
        busy.kill()
        busy.wait()


if __name__ == "__main__":
    main()

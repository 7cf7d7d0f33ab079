"""`python -m bench.tenfold`: the default job on a multiple of the paper's data, with the peak
memory of each stage from `/usr/bin/time -v` (issue 31 point 1: 10x in under 12 GiB).

    python -m bench.tenfold --scale 1                  # 365,922 rounds (paper scale)
    python -m bench.tenfold --scale 3 --scale 10       # 1.1 M and 3.66 M rounds

Synthetic traces of `--scale` x 1402 prompts x 261 rounds (both laws, 710-candidate pools,
`decode.synth`'s generator) are generated once into bench/.cache/ (about 6.4 GB per million
rounds on disk; 10x is 23 GB, and its generation runs on one core: 1,320 s at 3x, about two
hours at 10x at low priority beside other work; an interrupted generation resumes). Then two child
processes, each under `/usr/bin/time -v`: `python -m features.extract` (resumable: on a store
extracted before, its figures are those of checking the finished shards; at 10x a first
extraction took 321 s wall, 445 CPU-s, 0.94 GiB peak, 2.8 GB on disk) and the
default `python -m rerank.train` (its fits kept under bench/.cache/tenfold-fits-<scale>, so a
stopped run resumes; `--refit` starts them afresh). Extra `--set key=value` overrides go to
`rerank.train` (e.g. `--set rerank.train_share=0.5`).

It prints, per stage, the wall and CPU seconds and the peak resident memory, and whether
the job stayed under `--goal-gib` (12). The rounds per stage come from the stores. The
machine's load average is printed beside the figures: a busy machine moves the times,
not the memory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from bench.bench_extract import CACHE, PAPER_PROMPTS, PAPER_ROUNDS, paper_traces
from specrank.trace_schema import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[1]
TIME = "/usr/bin/time"
_FIELDS = {
    "wall": r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)",
    "user": r"User time \(seconds\): (\S+)",
    "sys": r"System time \(seconds\): (\S+)",
    "peak_kib": r"Maximum resident set size \(kbytes\): (\d+)",
}


def timed(cmd: list[str], log: Path) -> dict[str, float]:
    """Run `cmd` under `/usr/bin/time -v` (output to `log`); its wall and CPU seconds and peak
    resident memory (GiB). A failed child raises, naming the log."""
    if not Path(TIME).exists():
        raise RuntimeError(f"{TIME} is needed for the peak memory (Debian: apt install time)")
    report = log.with_suffix(".time")
    with log.open("w") as out:
        proc = subprocess.run([TIME, "-v", "-o", str(report), *cmd], cwd=ROOT, stdout=out,
                              stderr=subprocess.STDOUT)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")
    return parse_time(report.read_text())


def parse_time(text: str) -> dict[str, float]:
    """Wall and CPU seconds and peak GiB from `/usr/bin/time -v`'s report."""
    found = {k: re.search(p, text) for k, p in _FIELDS.items()}
    missing = [k for k, m in found.items() if m is None]
    if missing:
        raise ValueError(f"/usr/bin/time -v's report lacks {missing}: {text[:300]!r}")
    seconds = 0.0
    for part in found["wall"].group(1).split(":"):  # h:mm:ss or m:ss
        seconds = seconds * 60 + float(part)
    return {"wall_s": seconds, "cpu_s": float(found["user"].group(1)) + float(found["sys"].group(1)),
            "peak_gib": int(found["peak_kib"].group(1)) / 2**20}  # fmt: skip


def run_scale(scale: int, sets: list[str], refit: bool) -> list[dict]:
    """Traces, features and the default job at `scale` x the paper; a row per stage."""
    prompts = scale * PAPER_PROMPTS
    traces = paper_traces(prompts, PAPER_ROUNDS)
    features = CACHE / f"features-v{SCHEMA_VERSION}-{prompts}x{PAPER_ROUNDS}-seed0"
    fits, run = CACHE / f"tenfold-fits-{scale}", CACHE / f"tenfold-run-{scale}"
    if refit:
        shutil.rmtree(fits, ignore_errors=True)
    shutil.rmtree(run, ignore_errors=True)  # the last run's tables and rerankers: this run's own
    python = sys.executable
    stages = {
        "features.extract": [python, "-m", "features.extract", f"traces={traces}",
                             f"out={features}"],
        "rerank.train": [python, "-m", "rerank.train", f"rerank.traces={traces}",
                         f"rerank.features={features}", f"rerank.fits={fits}",
                         f"mlflow.tracking_uri=sqlite:///{CACHE}/tenfold-mlflow.db",
                         f"hydra.run.dir={run}", *sets],
    }  # fmt: skip
    rows = []
    for stage, cmd in stages.items():
        load = os.getloadavg()[0]
        figures = timed(cmd, CACHE / f"tenfold-{scale}-{stage}.log")
        rows.append({"scale": scale, "rounds": prompts * PAPER_ROUNDS, "stage": stage,
                     "load_at_start": load, **figures})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scale", type=int, action="append", help="x the paper (repeatable)")
    parser.add_argument("--set", action="append", default=[], help="a rerank.train override")
    parser.add_argument("--refit", action="store_true", help="drop the kept fits first")
    parser.add_argument("--goal-gib", type=float, default=12.0)
    args = parser.parse_args()
    rows = [row for scale in args.scale or [1] for row in run_scale(scale, args.set, args.refit)]
    print(f"\n{'scale':>5} {'rounds':>10} {'stage':<17} {'wall s':>8} {'CPU s':>8} "
          f"{'peak GiB':>9} {'load':>5}")  # fmt: skip
    for r in rows:
        verdict = (
            ""
            if r["stage"] != "rerank.train"
            else ("  under the goal" if r["peak_gib"] < args.goal_gib else "  OVER the goal")
        )
        print(f"{r['scale']:>5} {r['rounds']:>10,} {r['stage']:<17} {r['wall_s']:>8.0f} "
              f"{r['cpu_s']:>8.0f} {r['peak_gib']:>9.2f} {r['load_at_start']:>5.1f}{verdict}")  # fmt: skip


if __name__ == "__main__":
    main()

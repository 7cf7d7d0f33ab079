"""The acceptance-estimator report of a saved run, recomputed from its calibration dump.

    python -m bench.bench_acceptance outputs/rerank.train/<date>/<time>-<id>
    python -m bench.bench_acceptance <run folder> --resamples 2000 --seed 0

Reads `acceptance_dump.parquet` of a `rerank.train` or `rerank.transfer` run folder (checked
against its declared schema, `rerank.report.acceptance_dump`), and computes every figure of
the run's acceptance report from it alone: AUROC, Brier score, ECE and log-loss of each
estimator per law and candidate set, with the reference reranker's paired advantage
(`rerank.report.acceptance`). With the run's resamples and seed (`rerank.n_resamples`, the
job's `seed`) the figures are the run's own, to the bit. Prints the report and how long the
figures took; `--csv FILE` writes the table too.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from rerank.job.acceptance import DUMP_FILE
from rerank.report.acceptance import acceptance_table, acceptance_text
from rerank.report.acceptance_dump import dump_sets, read_dump
from specrank.statistics.bootstrap import DEFAULT_RESAMPLES


def report(run: Path, resamples: int = DEFAULT_RESAMPLES, seed: int = 0
           ) -> tuple[pd.DataFrame, str, float]:  # fmt: skip
    """(table, printed text, seconds the figures took) of the run folder's dump."""
    path = run / DUMP_FILE if run.is_dir() else run
    if not path.exists():
        raise FileNotFoundError(f"{path}: no calibration dump (a run with rerank.acceptance=true "
                                f"writes {DUMP_FILE} in its folder)")  # fmt: skip
    frame, sets, reference = dump_sets(read_dump(path))
    t0 = time.perf_counter()
    table = acceptance_table(frame, sets, reference, resamples, seed)
    seconds = time.perf_counter() - t0
    return table, acceptance_text(table), seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder (or its acceptance_dump.parquet)")
    parser.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", type=Path, help="write the table here")
    args = parser.parse_args(argv)
    table, text, seconds = report(args.run, args.resamples, args.seed)
    print(text)
    print(f"\n{len(table)} figures from {args.run} in {seconds:.2f} s "
          f"({args.resamples} resamples, seed {args.seed})")  # fmt: skip
    if args.csv is not None:
        table.to_csv(args.csv, index=False)


if __name__ == "__main__":
    main()

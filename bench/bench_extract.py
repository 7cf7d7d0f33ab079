"""`python -m bench.bench_extract`: speed of `features.extract` at paper scale.

Paper scale is 1402 prompts x 261 rounds = 365,922 rounds with 710-candidate
pools (3,659,220 first-level candidates). The synthetic traces are generated
once into `bench/.cache/` (resumable, reused by later runs); only the
extraction is timed, into a fresh folder that is removed afterwards.

    python -m bench.bench_extract                  # paper scale (target: < 120 s)
    python -m bench.bench_extract --prompts 32     # a quick look
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from features.extract import ExtractReport, extract
from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.job import write_synthetic_traces
from specrank.store.trace_schema import SCHEMA_VERSION
from tree.config import PoolConfig, SelectConfig

CACHE = Path(__file__).resolve().parent / ".cache"
PAPER_PROMPTS, PAPER_ROUNDS = 1402, 261  # 365,922 rounds
TARGET_SECONDS = 120.0


def paper_traces(prompts: int = PAPER_PROMPTS, rounds: int = PAPER_ROUNDS, seed: int = 0) -> Path:
    """The cached synthetic trace store of this size (generated on first use)."""
    # the schema version in the name: a schema bump generates a new store instead of failing
    out = CACHE / f"traces-v{SCHEMA_VERSION}-{prompts}x{rounds}-seed{seed}"
    job = SynthJobConfig(toy_prompts=prompts, rounds_per_prompt=rounds)
    start = time.perf_counter()
    report = write_synthetic_traces(out, job, PoolConfig(), SelectConfig(), SynthConfig(), seed)
    if report.shards_written:
        print(
            f"generated {report.rounds_written:,} rounds in {report.shards_written} shards ({time.perf_counter() - start:.0f} s) -> {out}"
        )
    return out


def time_extract(traces: Path) -> tuple[ExtractReport, float]:
    """Extract into a fresh folder; (report, CPU seconds of this process)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="features-", dir=CACHE))
    try:
        cpu = time.process_time()
        report = extract(traces, out / "table")
        return report, time.process_time() - cpu
    finally:
        shutil.rmtree(out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=PAPER_PROMPTS)
    parser.add_argument("--rounds", type=int, default=PAPER_ROUNDS, help="rounds per prompt")
    args = parser.parse_args()
    traces = paper_traces(args.prompts, args.rounds)
    report, cpu = time_extract(traces)
    verdict = "within" if report.seconds < TARGET_SECONDS else "OVER"
    print(
        f"bench_extract: {report.rounds:,} rounds, {report.candidates:,} candidates, {report.shards_written} shards: "
        f"{report.seconds:.1f} s wall, {cpu:.1f} s CPU (this process, all threads), "
        f"{report.rows_per_s:,.0f} rows/s; {verdict} the {TARGET_SECONDS:.0f} s paper-scale target"
    )


if __name__ == "__main__":
    main()

"""`python -m bench.stage_memory`: resident memory of `rerank.train`, stage by stage.

    python -m bench.stage_memory rerank.traces=<dir> rerank.features=<dir> rerank.fits=<dir>
    python -m bench.stage_memory --wrap rerank.evaluate.reports:agreement_tables <overrides>

Runs the job in this process with its Hydra overrides, its stages wrapped (a law's frame,
each (law, feature set) cross-fit, the pass over the pools, the report tables, the tail's
steps). A thread reads `/proc/self/statm` every 20 ms; each stage prints the resident GiB
before it, its peak and after it, and its wall seconds, and the run ends with the peak
(`ru_maxrss`). Run it under `/usr/bin/time -v` for the peak memory figure; the
sampling thread holds no arrays. A stage's peak includes what earlier stages still hold,
so the table says where the job's peak is reached and what each stage adds.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import resource
import sys
import threading
import time
from collections.abc import Callable

from specrank.runtime.memory import resident_bytes

_GIB = 2**30


def resident_gib() -> float:
    """This process's resident memory in GiB (`specrank.runtime.memory.resident_bytes`)."""
    resident = resident_bytes()
    if resident is None:
        raise RuntimeError("bench.stage_memory reads /proc/self/statm, which this system lacks")
    return resident / _GIB


class StagePeaks:
    """Resident memory sampled in a thread; `wrap` reports a function's stage.

    Stages nest: each running stage keeps its own peak, so a stage wrapped inside another
    (`--wrap`) leaves the outer stage's peak whole.
    """

    def __init__(self, every_s: float = 0.02) -> None:
        self.t0, self.rows = time.time(), []
        self.active: dict[object, float] = {}  # running stage -> its peak so far
        threading.Thread(target=self._sample, args=(every_s,), daemon=True).start()

    def _sample(self, every_s: float) -> None:
        while True:
            now = resident_gib()
            for key, peak in list(self.active.items()):
                self.active[key] = max(peak, now)
            time.sleep(every_s)

    def wrap(self, owner: object, attr: str, name: str) -> None:
        fn: Callable = getattr(owner, attr)

        @functools.wraps(fn)
        def staged(*args, **kwargs):
            before, start, key = resident_gib(), time.time(), object()
            self.active[key] = before
            try:
                return fn(*args, **kwargs)
            finally:
                after = resident_gib()
                peak = max(self.active.pop(key), after)
                row = (name, before, peak, after, time.time() - start)
                self.rows.append(row)
                print(f"[stage] {time.time() - self.t0:8.1f}s {name:<26} before {before:6.2f} "
                      f"peak {row[2]:6.2f} after {after:6.2f} GiB  {row[4]:7.1f} s",
                      flush=True)  # fmt: skip

        setattr(owner, attr, staged)


def wrap_named(peaks: StagePeaks, spec: str) -> None:
    """Wrap `module:attr` or `module:Class.attr` (where the job looks it up) as a stage."""
    module, _, path = spec.partition(":")
    if not path:
        raise ValueError(f"--wrap takes module:attr or module:Class.attr; got {spec!r}")
    owner = importlib.import_module(module)
    *classes, attr = path.split(".")
    for name in classes:
        owner = getattr(owner, name)
    if not callable(getattr(owner, attr, None)):
        raise ValueError(f"--wrap {spec}: {module} has no function {path}")
    peaks.wrap(owner, attr, path)


def wrap_stages(peaks: StagePeaks) -> None:
    """The job's stages, wrapped where the job looks them up (module attributes)."""
    import rerank.evaluate.policy as policy
    import rerank.evaluate.reports as reports
    import rerank.fit.out_of_fold as halves
    import rerank.fit.per_depth as per_depth
    import rerank.job.evaluation as evaluation
    import rerank.job.fitting as fitting
    import rerank.train as train

    for name, label in (("fit_rerankers", "fit"), ("evaluate_rules", "evaluate"),
                        ("write_tables", "write_tables")):  # fmt: skip
        peaks.wrap(train, name, label)
    peaks.wrap(fitting, "law_frame", "law frame")
    peaks.wrap(halves.LawFits, "crossfit", "cross-fit")
    peaks.wrap(per_depth, "fit_per_depth_maps", "fit_per_depth_maps")
    for name in ("evaluate_traces", "choose_mixture_weights", "law_draws", "breakdown_gains",
                 "breakdowns"):  # fmt: skip
        peaks.wrap(evaluation, name, name)
    peaks.wrap(policy.PolicyRounds, "apply", "policy rows")
    peaks.wrap(reports.ReportAccumulators, "tables", "report tables")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="rerank.train's Hydra overrides")
    parser.add_argument("--wrap", action="append", default=[], metavar="MODULE:ATTR",
                        help="one more stage, e.g. rerank.evaluate.reports:agreement_tables or "
                             "rerank.evaluate.coverage:CoverageRounds.table (repeatable)")  # fmt: skip
    args = parser.parse_args()
    peaks = StagePeaks()
    wrap_stages(peaks)
    for spec in args.wrap:
        wrap_named(peaks, spec)
    import rerank.train as train
    from specrank.settings.cli import run_entry_point

    sys.argv = ["rerank.train", *args.overrides]
    run_entry_point(train.main, stage="rerank.train")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"[stage] the job's peak resident memory (ru_maxrss): {peak:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()

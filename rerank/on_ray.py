"""`rerank.train launcher=ray`: the cross-fits and the evaluation pass as Ray workers' tasks.

    python -m rerank.train launcher=ray parallel.workers=4                      # a local cluster
    python -m rerank.train launcher=ray parallel.workers=16 parallel.address=auto  # a running one

Both stages go through `specrank.runtime.parallel.deal`, as recording does: each worker is an actor
built once, handed one task at a time, and a task whose worker dies (killed, node lost) is
dealt again to another (`parallel.max_attempts`); an exception raised by the task's own
code fails the run.

- Fits: one task per (law, feature set), both halves, by `LawFits.crossfit`, the call a
  single process makes. The worker reads that law's rows from the candidate table itself
  and keeps the finished fits under `rerank.fits` as one process does, so a stopped run
  resumes. An actor holds `rerank.booster.n_threads` CPUs (2, one per half, when null).
- Evaluation: one task per trace shard (a file of the store), its rounds in the batches a
  single process reads (a batch never spans files), each by the same chunk function; the
  driver merges the shards' parts in the store's order. Workers run one compute thread, as
  the threads of `rerank.eval_threads` do.

With the threads per task fixed, the results equal a single process's exactly
(tests/test_train_on_ray.py). Every worker reads the stores by path, so on a cluster of
several machines the stores and `rerank.fits` must sit on a shared filesystem at the same
path. Each evaluation worker holds its own copy of the out-of-fold predictions (about
100 bytes per first-level candidate) besides the shard it evaluates.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from rerank.evaluate.pool_chunks import iter_trace_chunks
from rerank.fit.out_of_fold import CrossfitResult, LawFits
from specrank.runtime import faults
from specrank.runtime.parallel import ParallelConfig, deal

TASK_THREADS = 2  # a fit task's threads when rerank.booster.n_threads is null: one per half


class CallWorker:
    """A worker that runs `fn(task)`; built in each actor, so `fn` is unpickled once there."""

    def __init__(self, fn: Callable[[str], Any], torch_threads: int | None = None) -> None:
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)
        self.fn = fn
        self.owner = f"{socket.gethostname()}-{os.getpid()}"

    def __call__(self, task: str) -> Any:
        faults.point("ray_task")
        return self.fn(task)


def _job_id(temperature: float, feature_set: str) -> str:
    return f"T{temperature:g}/{feature_set}"


@dataclasses.dataclass(frozen=True)
class _FitTask:
    """One (law, feature set) cross-fit, named by `_job_id`; picklable for the actors."""

    settings: LawFits
    jobs: dict[str, tuple[float, str]]
    folds: dict[str, int]
    frame_of: Callable[[float], Any]

    def __call__(self, task: str) -> CrossfitResult:
        temperature, feature_set = self.jobs[task]
        return self.settings.crossfit(self.frame_of(temperature), temperature, feature_set,
                                      self.folds)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RayFits:
    """`predict_first_factors`' prefit: every (law, feature set) cross-fit as a Ray task.

    `frame_of(temperature)` reads a law's rows, in the worker (`rerank.job.fitting.law_frame`).
    """

    parallel: ParallelConfig
    frame_of: Callable[[float], Any]

    def __call__(self, settings: LawFits, jobs: list[tuple[float, str]],
                 folds: dict[str, int]) -> dict[tuple[float, str], CrossfitResult]:  # fmt: skip
        threads = settings.n_threads or TASK_THREADS
        settings = dataclasses.replace(settings, n_threads=threads)
        named = {_job_id(*job): job for job in jobs}
        task = _FitTask(settings, named, folds, self.frame_of)
        # As many actors as the workers' CPUs hold at `threads` each, and no more than jobs.
        actors = max(1, min(len(jobs), self.parallel.workers // threads))
        p = dataclasses.replace(self.parallel, workers=actors)
        dealt = deal(list(named), lambda: CallWorker(task), p, gpu=False, desc="fits",
                     unit="fit", cpus_per_worker=threads)  # fmt: skip
        return {named[sid]: result for sid, result in dealt.results.items()}


def shard_files(dataset: ds.Dataset) -> list[str]:
    """The files of a store's dataset, in its reading order; refused if it has none."""
    files = getattr(dataset, "files", None)
    if not files:
        raise ValueError(
            "parallel.backend=ray evaluates a trace store file by file; the dataset given is "
            f"not a file dataset ({type(dataset).__name__})"
        )
    return list(files)


@dataclasses.dataclass(frozen=True)
class _ShardTask:
    """Every chunk of one trace file, by `one_chunk`, in the order a single process reads."""

    one_chunk: Callable[[pa.Table], tuple]
    schema: pa.Schema
    chunk_rounds: int
    columns: tuple[str, ...]

    def __call__(self, path: str) -> list[tuple]:
        shard = ds.dataset([path], schema=self.schema, format="parquet")
        return [self.one_chunk(t) for t in iter_trace_chunks(shard, self.chunk_rounds,
                                                              self.columns)]  # fmt: skip


def chunks_on_ray(parallel: ParallelConfig) -> Callable[..., Iterator[tuple]]:
    """`evaluate_traces`' chunk map: the store's files as Ray tasks, parts yielded in order."""

    def run(one_chunk: Callable[[pa.Table], tuple], dataset: ds.Dataset, chunk_rounds: int,
            columns: Sequence[str]) -> Iterator[tuple]:  # fmt: skip
        files = shard_files(dataset)
        task = _ShardTask(one_chunk, dataset.schema, chunk_rounds, tuple(columns))
        p = dataclasses.replace(parallel, workers=min(parallel.workers, len(files)))
        dealt = deal(files, lambda: CallWorker(task, torch_threads=1), p, gpu=False,
                     desc="trace shards", unit="shard")  # fmt: skip
        for path in files:
            yield from dealt.results[path]

    return run

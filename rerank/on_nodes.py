"""`rerank.booster.fit_nodes=N` (with `launcher=ray`): each LightGBM fit of a cross-fit trained
data-parallel on N Ray Train workers, by Ray's LightGBM integration (`ray.train.lightgbm`:
it starts the workers and gives each LightGBM's network parameters), each worker reading the
rows of its share of the training prompts itself (`rerank.fit.data_parallel`).

    python -m rerank.train launcher=ray parallel.workers=8 rerank.booster.fit_nodes=4 \
        rerank.booster.n_threads=2 parallel.address=auto

The fit task (this process) reads only each law's keys and labels. The (law, feature set)
cross-fits run one after another, each half's fit on N workers of `rerank.booster.n_threads`
CPUs (1 when null), every node stopping at the iteration early stopping chooses on the loss
over all their held-out rows (combined after each iteration by a small actor); the held-out
half is predicted by Ray tasks, one per share of its prompts. A worker that dies restarts its fit's worker group (Ray Train's
`FailureConfig`), a prediction task is retried by Ray, each up to `parallel.max_attempts`
times in all. Every worker reads the candidate table by path: on several machines it must
sit on a shared filesystem at the same path, as must `rerank.fits` (Ray Train keeps its run
state under `rerank.fits/.ray_train`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rerank.fit.data_parallel import (
    NodeFit,
    NodeResult,
    NodeShare,
    crossfit_on_nodes,
    key_columns,
    predict_share,
    train_share,
)
from rerank.fit.models import FittedReranker
from rerank.fit.out_of_fold import CrossfitResult, LawFits
from specrank.runtime import faults
from specrank.runtime.parallel import ParallelConfig, connect
from specrank.statistics.laws import law_kind


def _node_loop(config: dict) -> None:
    """One Ray Train worker: its share's rows read and trained on LightGBM's network."""
    import ray
    import ray.train
    from ray.train.lightgbm import get_network_params

    rank = ray.train.get_context().get_world_rank()
    share = ray.get(config["shares"][rank])
    box = config["box"]

    def combine(iteration: int, loss: float, held: float) -> float:
        faults.point("fit_node")
        return ray.get(box.combine.remote(iteration, rank, loss, held))

    result = train_share(config["read"](share.prompts), share, config["spec"],
                         get_network_params(), combine)  # fmt: skip
    ray.get(box.put.remote(rank, result))


class _Box:
    """Where a fit's nodes meet: each iteration's held-out losses combined, and the results
    (Ray Train keeps only rank 0's reports). An async actor: `combine` waits for every node.

    A worker group restarted after a death trains the same trees again and reports the same
    losses (the kill test checks it), so the losses its first attempt left count as its own."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.results: dict[int, NodeResult] = {}
        self.losses: dict[int, dict[int, tuple[float, float]]] = {}
        self.complete: dict[int, asyncio.Event] = {}

    async def combine(self, iteration: int, rank: int, loss: float, held: float) -> float:
        """The loss over every node's held-out rows at `iteration`, once every node gave its
        own (mean losses weighed by rows, summed in rank order: the same bits on every node)."""
        losses = self.losses.setdefault(iteration, {})
        losses[rank] = (loss, held)
        complete = self.complete.setdefault(iteration, asyncio.Event())
        if len(losses) == self.nodes:
            complete.set()
        await complete.wait()
        parts = [losses[r] for r in sorted(losses)]
        return sum(mean * rows for mean, rows in parts) / sum(rows for _, rows in parts)

    async def put(self, rank: int, result: NodeResult) -> None:
        self.results[rank] = result

    async def get(self) -> dict[int, NodeResult]:
        return self.results


def _predict(read: Callable[[tuple[str, ...]], pd.DataFrame], model: FittedReranker,
             share: NodeShare, n_threads: int) -> np.ndarray:  # fmt: skip
    return predict_share(read(share.prompts), share, model, n_threads)


@dataclasses.dataclass(frozen=True)
class RayNodes:
    """A `NodeRunner` on Ray: training on Ray Train workers, prediction as Ray tasks."""

    read: Callable[[tuple[str, ...]], pd.DataFrame]
    n_threads: int
    max_attempts: int
    storage: str  # Ray Train's run state

    def train(self, shares: list[NodeShare], spec: NodeFit) -> list[NodeResult]:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.lightgbm import LightGBMTrainer

        box = ray.remote(num_cpus=0)(_Box).remote(len(shares))
        config = {"shares": [ray.put(s) for s in shares], "spec": spec, "read": self.read,
                  "box": box}  # fmt: skip
        LightGBMTrainer(
            train_loop_per_worker=_node_loop, train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=len(shares),
                                         resources_per_worker={"CPU": self.n_threads}),
            run_config=RunConfig(storage_path=self.storage,
                                 failure_config=FailureConfig(max_failures=self.max_attempts - 1)),
        ).fit()  # fmt: skip
        got = ray.get(box.get.remote())
        ray.kill(box)
        return [got[rank] for rank in range(len(shares))]

    def predict(self, model: FittedReranker, shares: list[NodeShare]) -> list[np.ndarray]:
        import ray

        task = ray.remote(num_cpus=self.n_threads, max_retries=self.max_attempts - 1)(_predict)
        at = ray.put(model)
        return ray.get([task.remote(self.read, at, ray.put(s), self.n_threads) for s in shares])


@dataclasses.dataclass(frozen=True)
class NodeFits:
    """`predict_first_factors`' prefit: every (law, feature set) cross-fit on `nodes` nodes."""

    parallel: ParallelConfig
    nodes: int
    # (temperature, columns, prompts or None) -> that law's rows (`rerank.job.fitting.law_frame`)
    read: Callable[..., pd.DataFrame]
    columns: list[str]  # what a node reads of its rows
    store: str  # the candidate table's fingerprint
    fits: Path | None  # rerank.fits (Ray Train's run state goes under it)

    def __call__(self, settings: LawFits, jobs: list[tuple[float, str]],
                 folds: dict[str, int]) -> dict[tuple[float, str], CrossfitResult]:  # fmt: skip
        threads = settings.n_threads or 1
        cpus = max(self.parallel.workers, self.nodes * threads)
        connect(dataclasses.replace(self.parallel, workers=cpus), gpu=False)
        with contextlib.ExitStack() as stack:
            storage = str(self.fits / ".ray_train") if self.fits is not None else (
                stack.enter_context(tempfile.TemporaryDirectory(prefix="ray-train-")))  # fmt: skip
            out: dict[tuple[float, str], Any] = {}
            for temperature in dict.fromkeys(t for t, _ in jobs):
                keys = self.read(temperature, key_columns(law_kind(temperature)))
                read = partial(self.read, temperature, self.columns)
                runner = RayNodes(read, threads, self.parallel.max_attempts, storage)
                for t, feature_set in jobs:
                    if t == temperature:
                        out[(t, feature_set)] = crossfit_on_nodes(
                            keys, settings, t, feature_set, folds, self.nodes, runner, self.store
                        )
        return out

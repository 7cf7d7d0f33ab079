"""A toy shard worker for the Ray dealing tests: light to import (an actor imports it on start)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import ray

from specrank.store.shard_store import ShardStore
from specrank.store.tables import TableSpec

TOY = TableSpec("toy", 1, pa.schema([("shard", pa.string()), ("writer", pa.int64())]))


def toy_table(sid: str) -> pa.Table:
    return pa.table({"shard": [sid], "writer": [os.getpid()]})


class ToyWorker:
    """Writes one-row shards; dies (os._exit, as a killed process) on `die_on` the first time."""

    def __init__(self, root: str, die_on: str | None = None, raise_on: str | None = None):
        self.store = ShardStore(Path(root), TOY, claim_poll_s=0.02)
        self.owner = self.store.owner
        self.die_on, self.raise_on = die_on, raise_on

    def info(self) -> int:
        return os.getpid()

    def __call__(self, sid: str) -> int:
        def build(s: str) -> pa.Table:
            flag = self.store.root / f"died-{s}"
            if s == self.die_on and not flag.exists():
                flag.touch()
                os._exit(1)
            if s == self.raise_on:
                raise ValueError(f"shard {s} is bad")
            (self.store.root / f"built-{s}-{os.getpid()}").touch()
            return toy_table(s)

        return self.store.write_pending([sid], build).written


@contextlib.contextmanager
def lean_ray() -> Iterator[None]:
    """A local Ray cluster started lean for tests: 2 CPUs, no dashboard, quiet workers."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 2**20)  # fmt: skip
    try:
        yield
    finally:
        ray.shutdown()

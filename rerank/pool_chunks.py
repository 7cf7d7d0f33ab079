"""Chunks of recorded rounds as dense pools with their draft ranking (issue 14 reports).

The report accumulators (`rerank.coverage`, `rerank.draw_sizes`,
`rerank.row_agreement`) all need the same per-chunk quantities: the dense pool,
the path probabilities under each round's law and the full draft order. They
are built here once per chunk so one pass over the trace store feeds them all.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import torch
from torch import Tensor

from decode.select.pool_batch import POOL_COLUMNS, PoolBatch, list_matrix, pool_batch_from_table
from decode.select.ranking import rank_order, ranks_of_order
from decode.select.values import PoolContext, pool_context
from rerank.evaluate import ROUND_KEYS, iter_trace_chunks


@dataclass(eq=False)
class PoolChunk:
    """One chunk of rounds: the Arrow table, its dense pools and the draft ranking. [R, P]."""

    table: pa.Table
    pool: PoolBatch
    ctx: PoolContext
    order: Tensor  # int64 pool indices best-first under draft ranking (whole pool)
    rank: Tensor  # int64 draft rank of every candidate (0 = best; padding ranks last)

    @property
    def temperature(self) -> np.ndarray:
        return self.table["temperature"].to_numpy().astype(np.float64)

    @cached_property
    def scored(self) -> Tensor:
        """[R, P] bool: prefixes the recording pass scored (`cand_scored`; needs that column)."""
        return torch.from_numpy(
            list_matrix(self.table["cand_scored"], False, np.bool_, self.order.shape[1])[0]
        )

    @cached_property
    def path_prob_ordered(self) -> Tensor:
        """[R, P] target path probability P(u) under the law, in draft order."""
        return torch.gather(self.ctx.path_prob, -1, self.order)


def chunk_of(table: pa.Table) -> PoolChunk:
    """Dense pools, law path probabilities and the full draft order of a trace table."""
    pool = pool_batch_from_table(table)
    ctx = pool_context(pool)
    order = rank_order(ctx.draft, ctx.restrict)
    return PoolChunk(table, pool, ctx, order, ranks_of_order(order))


def iter_pool_chunks(
    dataset: ds.Dataset, chunk_rounds: int, columns: Sequence[str] = ()
) -> Iterator[PoolChunk]:
    """Read the trace store `chunk_rounds` rounds at a time (pool columns plus `columns`)."""
    if chunk_rounds < 1:
        raise ValueError(f"The 'chunk_rounds' must be an int >= 1. Got {chunk_rounds} instead.")
    wanted = sorted(set(POOL_COLUMNS) | set(ROUND_KEYS) | set(columns))
    for table in iter_trace_chunks(dataset, chunk_rounds, wanted):
        yield chunk_of(table)


def sum_by_law(temperature: np.ndarray, values: np.ndarray) -> dict[float, np.ndarray]:
    """Per-temperature sums over rounds of `values` ([R, ...]): the law-level accumulators."""
    return {float(t): values[temperature == t].sum(axis=0) for t in np.unique(temperature)}

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
import pyarrow.compute as pc
import pyarrow.dataset as ds
import torch
from torch import Tensor

from decode.select.pool_batch import POOL_COLUMNS, PoolBatch, pool_batch_from_table
from decode.select.ranking import rank_order
from decode.select.values import PoolContext, pool_context
from rerank.evaluate import ROUND_KEYS


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
            dense_list(self.table["cand_scored"], self.order.shape[1], False, np.bool_)
        )

    @cached_property
    def path_prob_ordered(self) -> Tensor:
        """[R, P] target path probability P(u) under the law, in draft order."""
        return torch.gather(self.ctx.path_prob, -1, self.order)


def dense_list(col: pa.ChunkedArray | pa.Array, width: int, fill, dtype) -> np.ndarray:
    """[R, width] matrix of a list column, padded with `fill` (entries past `width` dropped)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = arr.flatten()
    # nulls inside a list (absent retained rows) become `fill`, not 0
    values = flat.fill_null(fill).to_numpy(zero_copy_only=False).astype(dtype)
    out = np.full((len(lengths), width), fill, dtype=dtype)
    pos = np.arange(len(values)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    row = np.repeat(np.arange(len(lengths)), lengths)
    keep = pos < width
    out[row[keep], pos[keep]] = values[keep]
    return out


def chunk_of(table: pa.Table) -> PoolChunk:
    """Dense pools, law path probabilities and the full draft order of a trace table."""
    pool = pool_batch_from_table(table)
    ctx = pool_context(pool)
    order = rank_order(ctx.draft, ctx.restrict)
    positions = torch.arange(order.shape[-1]).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, positions)
    return PoolChunk(table, pool, ctx, order, rank)


def iter_pool_chunks(
    dataset: ds.Dataset, chunk_rounds: int, columns: Sequence[str] = ()
) -> Iterator[PoolChunk]:
    """Read the trace store `chunk_rounds` rounds at a time (pool columns plus `columns`)."""
    if chunk_rounds < 1:
        raise ValueError(f"The 'chunk_rounds' must be an int >= 1. Got {chunk_rounds} instead.")
    wanted = sorted(set(POOL_COLUMNS) | set(ROUND_KEYS) | set(columns))
    for batch in dataset.to_batches(columns=wanted, batch_size=chunk_rounds):
        if batch.num_rows:
            yield chunk_of(pa.Table.from_batches([batch]))


def sum_by_law(temperature: np.ndarray, values: np.ndarray) -> dict[float, np.ndarray]:
    """Per-temperature sums over rounds of `values` ([R, ...]): the law-level accumulators."""
    return {float(t): values[temperature == t].sum(axis=0) for t in np.unique(temperature)}

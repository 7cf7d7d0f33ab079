"""Chunks of recorded rounds as dense pools with their draft ranking (the retained-row, coverage and draw-size reports).

The report accumulators (`rerank.evaluate.coverage`, `rerank.evaluate.draw_sizes`,
`rerank.evaluate.row_agreement`) all need the same per-chunk quantities: the dense pool,
the path probabilities under each round's law and the full draft order. They
are built once per chunk, by `rerank.evaluate.evaluate_traces` (which needs
them for the rule values too) or by `iter_pool_chunks`, so one pass over the
trace store feeds every accumulator.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import torch
from torch import Tensor

from selection.context import PoolContext, pool_context
from selection.draws import pearl_curves
from selection.pool_batch import POOL_COLUMNS, PoolBatch, pool_batch_from_table, trace_matrix
from selection.ranking import rank_order, ranks_of_order

ROUND_KEYS = ["prompt_id", "temperature", "rule", "budget", "round_index"]
_SERIES = ROUND_KEYS[:-1]  # a prompt's rounds under one recording configuration


def _factorized(keys: pd.DataFrame, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(code of each row, the distinct values in order of appearance) of one key column.

    Factorised first, so hashing and lookups touch each distinct value once: a chunk
    holds a few prompts, and an Arrow string column is never turned into a Python
    string per row (that, and hashing every row, were 15% of the evaluation pass).
    """
    codes, distinct = pd.factorize(keys[name], use_na_sentinel=False)
    values = np.asarray(distinct)
    return codes, values.astype(np.float64) if name == "temperature" else values


class RoundCodes:
    """One int64 per round key (ROUND_KEYS): lookups hash one integer, not five columns.

    Built from a key table; `encode` gives another table's codes, -1 for a key
    whose prompt, temperature, rule or budget the table never saw (or a round
    index outside its range), so such rounds are found nowhere.
    """

    def __init__(self, keys: pd.DataFrame) -> None:
        self.levels = [pd.Index(_factorized(keys, c)[1]) for c in _SERIES]
        for level in self.levels:  # build the hash tables now: lookups may run in threads
            level.get_indexer(level[:1])
        rounds = keys["round_index"].to_numpy(np.int64)
        self.span = int(rounds.max()) + 2 if rounds.size else 2  # round -1 .. max
        if np.prod([len(lv) + 1 for lv in self.levels], dtype=np.float64) * self.span > 2**62:
            raise ValueError("too many distinct round keys for 64-bit codes")

    def encode(self, keys: pd.DataFrame, shift: int = 0) -> np.ndarray:
        """int64 code of each key with its round index moved by `shift` (-1: not in the table)."""
        code = np.zeros(len(keys), dtype=np.int64)
        ok = np.ones(len(keys), dtype=bool)
        for level, name in zip(self.levels, _SERIES, strict=True):
            codes, distinct = _factorized(keys, name)
            at = level.get_indexer(distinct)[codes]
            ok &= at >= 0
            code = code * len(level) + at
        r = keys["round_index"].to_numpy(np.int64) + shift + 1
        ok &= (r >= 0) & (r < self.span)
        return np.where(ok, code * self.span + r, -1)


def series_order(keys: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(order, follows): the rounds of `keys` (ROUND_KEYS) sorted by series (prompt,
    temperature, rule, budget) and round index, and whether each sorted round directly
    follows the one before it in its series (round index one more)."""
    codes = [_factorized(keys, c)[0] for c in _SERIES]
    r = keys["round_index"].to_numpy(np.int64)
    order = np.lexsort([r, *reversed(codes)])
    follows = np.zeros(len(keys), dtype=bool)
    follows[1:] = r[order[1:]] == r[order[:-1]] + 1
    for c in codes:
        follows[1:] &= c[order[1:]] == c[order[:-1]]
    return order, follows


def predecessors(keys: pd.DataFrame) -> np.ndarray:
    """[R] int64: the row of each round's predecessor (same series, round index one less)
    among `keys` (ROUND_KEYS), -1 where it is not there."""
    order, follows = series_order(keys)
    out = np.full(len(keys), -1, dtype=np.int64)
    out[order[1:][follows[1:]]] = order[:-1][follows[1:]]
    return out


@dataclass(eq=False)
class PoolChunk:
    """One chunk of rounds: the Arrow table, its dense pools and the draft ranking. [R, P]."""

    table: pa.Table
    pool: PoolBatch
    ctx: PoolContext
    order: Tensor  # int64 pool indices best-first under draft ranking (whole pool)
    rank: Tensor  # int64 draft rank of every candidate (0 = best; padding ranks last)
    known_keys: pd.DataFrame | None = None  # ROUND_KEYS + task, when the caller has them

    @cached_property
    def keys(self) -> pd.DataFrame:
        """ROUND_KEYS and task of each round (converted from Arrow once per chunk)."""
        if self.known_keys is not None:
            return self.known_keys
        # a copy: zero-copy columns would keep the chunk's read buffer alive wherever kept
        return self.table.select([*ROUND_KEYS, "task"]).to_pandas().copy(deep=True)

    @property
    def temperature(self) -> np.ndarray:
        return self.table["temperature"].to_numpy().astype(np.float64)

    @cached_property
    def scored(self) -> Tensor:
        """[R, P] bool: prefixes the recording pass scored (`cand_scored`; needs that column)."""
        return torch.from_numpy(
            trace_matrix(self.table, "cand_scored", False, np.bool_, self.order.shape[1])[0]
        )

    @cached_property
    def pearl(self) -> tuple[Tensor, Tensor]:
        """PEARL's value and expected tree size at every pre-draw budget 1..P. [R, P] each."""
        return pearl_curves(self.ctx, self.order)

    @cached_property
    def path_prob_ordered(self) -> Tensor:
        """[R, P] target path probability P(u) under the law, in draft order."""
        return torch.gather(self.ctx.path_prob, -1, self.order)


def chunk_of(
    table: pa.Table, pool: PoolBatch | None = None, keys: pd.DataFrame | None = None
) -> PoolChunk:
    """Dense pools, law path probabilities and the full draft order of a trace table."""
    pool = pool_batch_from_table(table) if pool is None else pool
    ctx = pool_context(pool)
    order = rank_order(ctx.draft, ctx.restrict)
    return PoolChunk(table, pool, ctx, order, ranks_of_order(order), keys)


def iter_trace_chunks(
    dataset: ds.Dataset, chunk_rounds: int, columns: Sequence[str]
) -> Iterator[pa.Table]:
    """The trace store `chunk_rounds` rounds at a time, reading only `columns`.

    Read ahead by at most one file and two batches (Arrow's defaults: 4 files, 16
    batches), so few decoded pools wait in memory while the evaluation works.
    """
    batches = dataset.to_batches(columns=list(columns), batch_size=chunk_rounds,
                                 batch_readahead=2, fragment_readahead=1)  # fmt: skip
    for batch in batches:
        if batch.num_rows:
            yield pa.Table.from_batches([batch])


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

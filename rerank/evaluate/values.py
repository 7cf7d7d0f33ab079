"""Evaluate every selection rule on the same recorded pools (docs/method.md#rule-values).

Streams a trace store in chunks of rounds; for each chunk it builds the dense
pools, turns every first-factor source into first-level log factors and asks
`selection.values` for the value of each rule at each budget (and feeds the
same pools and draft order to the report accumulators of `rerank.evaluate.reports`). The result is a
per-round table (keys, breakdown fields, `<rule>@B<b>` values) from which
`rerank.report.summary` computes gains and intervals.

First-factor sources (each replaces log q(x1) in the draft score):
  learned   out-of-fold predictions phat (rerankers, isotonic q1) joined by key
  sub_<row> direct substitution of a retained row's log-probability
  mix_<row>_w<w>  (1-w) log q(x1) + w log r(x1), for each candidate weight
A retained row that is absent in a round leaves that round's draft factor in
place: the rule then ranks exactly like draft selection there (docs/method.md#features: rows
are missing, never zero).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import torch
from torch import Tensor

from calibrate.isotonic import PROB_FLOOR
from rerank.evaluate.curves import PromptCurves
from rerank.evaluate.joined import joined_columns
from rerank.evaluate.pool_chunks import (
    ROUND_KEYS,
    PoolChunk,
    RoundCodes,
    chunk_of,
    iter_trace_chunks,
)
from selection.pool_batch import POOL_COLUMNS, PoolBatch, pool_batch_from_table, trace_matrix
from selection.ranking import pool_levels
from selection.rules import POOL_RULES, mixture, substitution, value_key
from selection.values import evaluate_pools
from specrank.runtime.memory import GrowthTrim
from specrank.settings.errors import Refusal

# resident growth between returns of the heap's free pages: the kept results fragment the
# heap the pass reuses (specrank.runtime.memory.GrowthTrim)
TRIM_GROWTH = 512 * 2**20
RETAINED_ROWS = {"cache": "fl_cache_logprob", "same": "fl_same_logprob", "prev": "fl_prev_logprob"}
VALUE_INPUTS = sorted(
    set(POOL_COLUMNS) | set(ROUND_KEYS) | set(RETAINED_ROWS.values()) | {"category"}
)


@dataclass
class EvalPlan:
    """What to evaluate on each chunk of rounds."""

    budgets: list[int]
    rules: list[str] = field(default_factory=lambda: list(POOL_RULES))
    substitutions: list[str] = field(default_factory=lambda: list(RETAINED_ROWS))
    mixture_weights: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75])
    top_m: int = 0
    curve_rules: list[str] = field(default_factory=list)  # value curves (rule budgets)


def first_level_matrix(table: pa.Table, name: str, width: int) -> np.ndarray:
    """[R, width] float32 of a trace list column over first-level candidates; NaN where absent
    (null, where the trace schema allows it)."""
    return trace_matrix(table, name, np.nan, np.float32, width)[0]


def _first_width(pool: PoolBatch, levels) -> int:
    """Leading pool columns that hold every depth-1 candidate: the first level, or the pool."""
    return levels[0][1] if levels else pool.shape[1]


@dataclass
class LearnedFactors:
    """Out-of-fold log phat of each learned rule, as dense first-level matrices by round.

    Built once from the predictions table, then looked up per chunk by round
    keys (a hash index): joining the whole table to every chunk instead cost
    minutes at paper scale.
    """

    codes: RoundCodes  # integer codes of round keys
    rounds: pd.Index  # the code of each row of the matrices (unique)
    log_phat: dict[str, np.ndarray]  # name -> [n_rounds, n_first] float32, NaN where absent

    @classmethod
    def from_predictions(cls, preds: pd.DataFrame, names: Sequence[str]) -> LearnedFactors:
        codes = RoundCodes(preds[ROUND_KEYS])
        row, rounds = pd.factorize(codes.encode(preds))
        cand = preds["cand_index"].to_numpy(np.int64)
        n_first = int(cand.max()) + 1 if len(cand) else 0
        log_phat = {}
        for name in names:
            mat = np.full((len(rounds), n_first), np.nan, dtype=np.float32)
            mat[row, cand] = np.log(np.clip(preds[name].to_numpy(np.float64), PROB_FLOOR, 1.0))
            log_phat[name] = mat
        index = pd.Index(rounds)
        index.get_indexer(index[:1])  # its hash table, built before lookups from threads
        return cls(codes, index, log_phat)

    def rows(self, keys: pd.DataFrame) -> np.ndarray:
        """Matrix row of each of a chunk's rounds (-1: no predictions for it)."""
        return self.rounds.get_indexer(self.codes.encode(keys))

    def matrix(self, row: np.ndarray, name: str, width: int) -> Tensor:
        """Dense [R, width] log phat for the rounds at `row` (NaN where a round has none)."""
        mat = self.log_phat[name]
        if mat.shape[1] > width:
            raise Refusal(
                f"predictions '{name}' name first-level candidate {mat.shape[1] - 1}, but the "
                f"pools' first level spans {width} columns: the predictions come from other "
                f"traces (expected a candidate table, rerank.features, extracted from rerank.traces)"
            )
        out = np.full((len(row), width), np.nan, dtype=np.float32)
        found = row >= 0
        out[found, : mat.shape[1]] = mat[row[found]]
        return torch.from_numpy(out)


def _factors_for_chunk(
    pool: PoolBatch,
    table: pa.Table,
    keys: pd.DataFrame,
    plan: EvalPlan,
    learned: LearnedFactors | None,
    levels,
) -> dict[str, Tensor]:
    """First-level log factors of every learned and substituted rule. [R, n] each.

    n covers the depth-1 candidates (the first level when every round shares the
    layout); NaN keeps the draft factor (`selection.values.evaluate_pools`).
    """
    width = _first_width(pool, levels)
    depth1 = pool.depth[:, :width] == 1
    factors: dict[str, Tensor] = {}
    row = learned.rows(keys) if learned else None
    for name in learned.log_phat if learned else ():
        log_phat = learned.matrix(row, name, width)
        missing = torch.isnan(log_phat) & depth1
        if missing.any():
            rows = torch.nonzero(missing.any(1)).flatten()[:3].tolist()
            raise ValueError(
                f"predictions '{name}' lack first-level candidates of {int(missing.any(1).sum())} "
                f"rounds (e.g. {keys.iloc[rows].to_dict('records')}); every round needs a prediction"
            )
        factors[name] = log_phat
    draft_first = pool.draft_logprob[:, :width]
    for row in plan.substitutions:
        r = torch.from_numpy(first_level_matrix(table, RETAINED_ROWS[row], width))
        # A row is absent when all its entries are null (NaN: keep the draft factor);
        # a null entry of a present row is a zeroed probability (the preceding
        # row's continuation token, docs/method.md#retained-rows): log 0 = -inf.
        present = ~torch.isnan(r).all(dim=-1, keepdim=True)
        r = torch.where(present & torch.isnan(r), -torch.inf, r)
        factors[substitution(row).name] = r
        for w in plan.mixture_weights:
            # nan where the row is absent -> draft factor
            factors[mixture(row, w).name] = (1 - w) * draft_first + w * r
    return factors


FIELD_COLUMNS = [*ROUND_KEYS, "task", "category", "root_entropy"]  # the table's round fields


def _round_fields(table: pa.Table, pool: PoolBatch) -> pd.DataFrame:
    """Keys and breakdown fields of each round of the chunk (converted from Arrow once).

    A deep copy: the zero-copy columns of `to_pandas` would keep the chunk's whole read
    buffer alive in every table that holds them (the report accumulators, the per-round
    table), tens of MB per chunk at paper scale.
    """
    frame = table.select(FIELD_COLUMNS).to_pandas().copy(deep=True)
    # the drafter's top first token (draft rank 0 among depth-1 candidates) vs the target's argmax
    first_draft = torch.where(pool.depth == 1, pool.draft_logprob, -torch.inf)
    # ties -> lowest pool index, the ranking tie-break (docs/method.md#ranking)
    top = torch.argmax(first_draft, dim=-1)
    root_argmax = table["root_argmax"].to_numpy()
    frame["draft_top_is_argmax"] = torch.gather(pool.token, -1, top[:, None])[:, 0].numpy() == (
        root_argmax
    )
    return frame


class ChunkConsumer(Protocol):
    """Something fed every chunk of the evaluation pass (the `rerank.evaluate.reports` accumulators).

    `part` computes a chunk's contribution (in any thread); `merge` adds it, chunk
    after chunk in the traces' order.
    """

    columns: Sequence[str]  # trace columns it reads beyond the pool's

    def part(self, chunk: PoolChunk) -> Any: ...

    def merge(self, part: Any) -> None: ...


# Runs a chunk function over a store's chunks elsewhere: (fn, dataset, chunk_rounds, columns)
# -> the chunks' results in the store's order.
ChunkMap = Callable[[Callable[[pa.Table], tuple], ds.Dataset, int, Sequence[str]], Iterator[tuple]]


def evaluate_traces(
    dataset: ds.Dataset,
    plan: EvalPlan,
    predictions: pd.DataFrame | None = None,
    learned: Sequence[str] = (),
    extra_factor: Callable[[PoolBatch, pa.Table], dict[str, Tensor]] | None = None,
    chunk_rounds: int = 8192,
    curves: PromptCurves | None = None,
    first_factor: Callable[[PoolBatch, pa.Table, int, pd.DataFrame], dict[str, Tensor]]
    | None = None,
    consumers: Sequence[ChunkConsumer] = (),
    workers: int = 1,
    chunk_map: ChunkMap | None = None,
) -> pd.DataFrame:
    """One row per round: keys, task, root entropy, first-token match, `<rule>@B<b>` values.

    `predictions` holds ROUND_KEYS + `cand_index` + one probability column per
    name in `learned` (out-of-fold). `extra_factor(pool, table)` may add rules
    given by every edge's log factor ([R, P]; e.g. per-depth calibration),
    `first_factor(pool, table, n, keys)` rules given as log factors of the leading n
    pool columns, which hold the first level ([R, n], NaN keeps the draft factor;
    e.g. root selection after covered rounds; `keys`: the chunk's ROUND_KEYS). `curves`, when given, collects
    per-prompt curves: PEARL's for the matched-size variant, draft's for
    node-equivalent budgets. Every `consumers` entry is fed each chunk's pool,
    context and draft order (`rerank.pool_chunks.PoolChunk`), built once for both.
    `workers` chunks are evaluated at once (`_in_order`); their contributions are
    merged in chunk order, so the results do not depend on `workers`. `chunk_map`, when
    given, runs the chunks instead (`rerank.on_ray.chunks_on_ray`), yielding their parts in
    the store's order.
    """
    if learned and predictions is None:
        raise ValueError(f"learned rules {list(learned)} need a predictions table")
    factors = LearnedFactors.from_predictions(predictions, learned) if learned else None
    columns = sorted(set(VALUE_INPUTS).union(*(c.columns for c in consumers)))
    want_pearl = "pearl" in plan.rules or curves is not None

    def one_chunk(table: pa.Table) -> tuple:
        """Everything a chunk contributes; pure, so chunks can run in parallel."""
        pool = pool_batch_from_table(table)
        frame = _round_fields(table, pool)
        keys = frame[[*ROUND_KEYS, "task"]]
        ctx = order = pearl = None
        reports = []
        if consumers:
            chunk = chunk_of(table, pool, keys)
            reports = [consumer.part(chunk) for consumer in consumers]
            if plan.top_m == 0:  # the values' context is the reports' (no restriction)
                ctx, order = chunk.ctx, chunk.order
                pearl = chunk.pearl if want_pearl else None  # the draw-size report's, once
        levels = ctx.levels if ctx is not None else pool_levels(pool.parent, pool.depth)
        firsts = _factors_for_chunk(pool, table, keys, plan, factors, levels)
        if first_factor is not None:
            firsts.update(first_factor(pool, table, _first_width(pool, levels), keys))
        values = evaluate_pools(
            pool,
            plan.budgets,
            plan.rules,
            plan.top_m,
            edge_factors=extra_factor(pool, table) if extra_factor is not None else None,
            curves=curves is not None,
            curve_rules=plan.curve_rules,
            first_factors=firsts,
            ctx=ctx,
            draft_order=order,
            pearl=pearl,
        )
        curve_part = _curve_part(curves, table, values) if curves is not None else None
        cols = {}
        for name, v in values.items():
            for j, b in enumerate(plan.budgets):
                cols[value_key(name, b)] = v[:, j].double().numpy()
        return (frame, cols), curve_part, reports

    if chunk_map is None:
        chunks = _in_order(one_chunk, iter_trace_chunks(dataset, chunk_rounds, columns), workers)
    else:
        chunks = chunk_map(one_chunk, dataset, chunk_rounds, columns)
    return _merge_all(chunks, curves, consumers)


def _curve_part(curves: PromptCurves, table: pa.Table, values: dict[str, Tensor]) -> list:
    """Take the `curve/<name>` entries out of a chunk's ``values`` as its per-prompt sums."""
    names = [n for n in values if n.startswith("curve/")]
    return curves.part(
        table["temperature"].to_numpy(),
        table["prompt_id"].to_numpy(zero_copy_only=False),
        {n.removeprefix("curve/"): values.pop(n) for n in names},
    )


def _merge_all(chunks: Iterator, curves: PromptCurves | None, consumers: Sequence) -> pd.DataFrame:
    """Merge every chunk's contributions in chunk order; their rounds as one table."""
    frames, values = [], []
    trim = GrowthTrim(TRIM_GROWTH)
    for (frame, cols), curve_part, reports in chunks:
        if curve_part is not None:
            curves.merge(curve_part)
        for consumer, part in zip(consumers, reports, strict=True):
            consumer.merge(part)
        frames.append(frame)
        values.append(cols)
        trim()
    if not frames:
        raise ValueError("the trace store holds no rounds")
    return pd.concat([pd.concat(frames, ignore_index=True), joined_columns(values)], axis=1)


def _in_order(fn: Callable, items: Iterator, workers: int) -> Iterator:
    """fn(item) for each item, `workers` at a time, yielded in the items' order.

    Workers are threads with one compute thread each (torch's pool set to 1 for
    the duration; the compiled kernels follow torch's count and release the GIL):
    on two cores two chunks at once beat one chunk on two threads, whose
    parallel regions wait on each other. At most `workers` chunks are in flight.
    """
    if workers <= 1:
        yield from map(fn, items)
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(workers) as pool:
            pending: deque[Future] = deque()
            for item in items:
                if len(pending) == workers:
                    yield pending.popleft().result()
                pending.append(pool.submit(fn, item))
            while pending:
                yield pending.popleft().result()
    finally:
        torch.set_num_threads(threads)

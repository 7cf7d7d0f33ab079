"""The realized first token of every recorded round, and its event at each first-level candidate.

Under verification of the whole first level, the round's first emitted token X1 is what the
target drew at the root (its argmax at T=0; a draw from p at T>0, which lossless verification
keeps exact). The trace holds it: the first node of `accepted_path` when the round accepted
one (a pool index at depth 1, so the candidate's `cand_index`), else `continuation_token`
(the target's own token when no drafted node was accepted). The event "c was accepted" of a
first-level candidate c is X1 = c; its probability is p(c) (the candidate table's label), so
the event is what an estimator of acceptance is graded against at T>0
(`rerank.report.acceptance`).

The rounds are read in the store's order, which is the recording's (shards in `decode.record`'s
prompt order, rounds in order): `order` numbers them, and the online refit of
`rerank.report.acceptance_vllm` walks them that way.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds

from rerank.evaluate.pool_chunks import ROUND_KEYS, RoundCodes
from specrank.settings.errors import Refusal

EVENT_COLUMNS = [*ROUND_KEYS, "accepted_path", "continuation_token", "root_entropy",
                 "draft_confidence"]  # fmt: skip


def _first_items(column: pa.ChunkedArray) -> np.ndarray:
    """The first item of each list of a list column, -1 for an empty list. [R] int64"""
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False).astype(np.int64)
    starts, ends = offsets[:-1], offsets[1:]
    first = values[np.minimum(starts, max(values.size - 1, 0))] if values.size else starts * 0
    return np.where(ends > starts, first, -1)


def round_events(dataset: ds.Dataset) -> pd.DataFrame:
    """One row per round of `dataset` in its order: the round keys, `x1_index` (the pool
    index of the first accepted node, -1 when none was accepted), `continuation_token`,
    `root_entropy` (nats, the target's root row), `draft_confidence` (the drafter's own
    estimate for its top candidate, NaN where the trace holds none: every kind but DSpark, a
    v3 store) and `order` (0, 1, ... in store order)."""
    table = dataset.to_table(columns=EVENT_COLUMNS)
    frame = table.select(ROUND_KEYS).to_pandas()
    frame["x1_index"] = _first_items(table["accepted_path"])
    frame["continuation_token"] = table["continuation_token"].to_numpy().astype(np.int64)
    frame["root_entropy"] = table["root_entropy"].to_numpy().astype(np.float64)
    conf = table["draft_confidence"].cast(pa.float64()).fill_null(np.nan)
    frame["draft_confidence"] = conf.to_numpy()
    frame["order"] = np.arange(len(frame), dtype=np.int64)
    return frame


def round_positions(rounds: pd.DataFrame, keys: pd.DataFrame) -> np.ndarray:
    """Row of `rounds` holding each round of `keys` (both with ROUND_KEYS); refuses a round
    the traces lack, naming it."""
    codes = RoundCodes(rounds[ROUND_KEYS])
    index = pd.Index(codes.encode(rounds))
    if not index.is_unique:
        raise ValueError("the trace store holds a round twice (same keys)")
    at = index.get_indexer(codes.encode(keys))
    if (at < 0).any():
        bad = keys.iloc[int(np.flatnonzero(at < 0)[0])]
        raise Refusal(
            f"a candidate's round is not in the trace store (rerank.traces): "
            f"{dict(bad[ROUND_KEYS])}; expected a candidate table (rerank.features) extracted "
            f"from those traces, found one from other traces"
        )
    return at


def candidate_events(
    cand_index: np.ndarray, token: np.ndarray, x1_index: np.ndarray, continuation: np.ndarray
) -> np.ndarray:
    """X1 = c for each first-level candidate (its round's `x1_index` and `continuation_token`
    given per candidate). [n] bool"""
    accepted = x1_index >= 0
    return np.where(accepted, cand_index == x1_index, token == continuation)


def candidate_positions(table: pd.DataFrame, keys: pd.DataFrame) -> np.ndarray:
    """Row of `table` holding each first-level candidate of `keys` (both with ROUND_KEYS and
    `cand_index`); -1 where `table` lacks it."""
    codes = RoundCodes(table[ROUND_KEYS])
    rounds, distinct = pd.factorize(codes.encode(table))
    width = int(table["cand_index"].max()) + 1 if len(table) else 1
    mine = pd.Index(distinct).get_indexer(codes.encode(keys))
    cand = keys["cand_index"].to_numpy(np.int64)
    wanted = np.where((mine >= 0) & (cand < width), mine * width + cand, -1)
    index = pd.Index(rounds * width + table["cand_index"].to_numpy(np.int64))
    return index.get_indexer(wanted)

"""Pools of many rounds as dense `[R, P]` tensors, read from trace tables.

The trace stores pools as Arrow list columns; the selector wants dense tensors
in pool order. Rounds whose pools are shorter than the longest one in the
batch are padded with `valid = False` entries that hang off the root, carry
zero probability and -inf draft log-probability, so they never enter a tree.
Padding is the only fill: a null inside a pool column is refused, naming the
column and the row (the trace schema declares which list items may be null).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import Tensor

from selection.kernels import greedy_edges
from specrank.store.trace_schema import TRACE_SCHEMA

# Trace columns the evaluator needs (read only these: the rest is never decoded).
POOL_COLUMNS = [
    "prompt_id",
    "task",
    "round_index",
    "temperature",
    "root_token",
    "root_argmax",
    "root_entropy",
    "cand_token",
    "cand_parent",
    "cand_depth",
    "cand_draft_logprob",
    "cand_target_prob",
    "cand_target_argmax",
]


@dataclass
class PoolBatch:
    """R rounds' pools. Every tensor is [R, P] in pool order unless noted."""

    token: Tensor  # int64
    parent: Tensor  # int64, -1 = child of the root
    depth: Tensor  # int64, 1..D (0 on padding)
    draft_logprob: Tensor  # float32, per-edge log q
    target_prob: Tensor  # float32, per-edge p at the round's temperature (T=1 softmax at T=0)
    greedy_edge: Tensor  # bool, token == target argmax at the parent's prefix
    valid: Tensor  # bool, False on padding
    temperature: Tensor  # [R] float32; 0 = greedy law

    @property
    def greedy(self) -> Tensor:
        """[R, 1] bool: rounds decoded under the greedy law."""
        return (self.temperature == 0)[:, None]

    def law_edge_prob(self) -> Tensor:
        """Per-edge target probability under each round's decoding law. [R, P] float32.

        Greedy: a point mass (1 on the argmax edge, else 0). Sampling: the row at T.
        """
        return torch.where(self.greedy, self.greedy_edge.float(), self.target_prob)

    def to(self, device: torch.device | str) -> PoolBatch:
        return PoolBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.parent.shape)  # type: ignore[return-value]


class _Refuse:
    """`null_fill` default of `list_matrix`: a null is refused, never read as a value."""

    def __repr__(self) -> str:
        return "refuse"


REFUSE = _Refuse()


def list_matrix(
    col: pa.ChunkedArray | pa.Array,
    fill,
    dtype,
    width: int | None = None,
    *,
    null_fill=REFUSE,
    name: str = "list column",
) -> tuple[np.ndarray, np.ndarray]:
    """A list column as a dense [R, width] matrix padded with `fill`, and the list lengths [R].

    width None: the longest list; a given width drops entries past it. A null list, or a
    null inside a list, is refused (ValueError naming `name` and the rows), unless
    `null_fill` is given: then null items become it (a column whose items may be null, e.g.
    an absent retained row; `trace_matrix` reads that from the trace schema). The one
    implementation of this for pools, first-level columns and report tables alike.
    """
    arr = _one_array(col)
    if arr.null_count:
        rows = np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))
        raise ValueError(
            f"{name}: {arr.null_count} null list(s), at rows {rows[:5].tolist()} of the batch; "
            f"expected a list in every row (an empty one for no entries)"
        )
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = arr.flatten()
    if flat.null_count:
        if null_fill is REFUSE:
            _refuse_null_items(flat, lengths, name)
        flat = flat.fill_null(null_fill)
    values = flat.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    if not values.flags.writeable:  # Arrow buffers are read-only; torch needs writable memory
        values = values.copy()
    n_rounds = len(lengths)
    longest = int(lengths.max(initial=0))
    width = longest if width is None else width
    if n_rounds and width == longest and (lengths == width).all():
        return values.reshape(n_rounds, width), lengths  # the common case: no copy, no scatter
    out = np.full((n_rounds, width), fill, dtype=dtype)
    row = np.repeat(np.arange(n_rounds), lengths)
    pos = np.arange(values.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    keep = pos < width
    out[row[keep], pos[keep]] = values[keep]
    return out, lengths


def _positions(flat_index: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """(row, position in the row's list) of flat list-value indices."""
    starts = np.cumsum(lengths) - lengths
    rows = np.searchsorted(starts, flat_index, side="right") - 1
    return [(int(r), int(i - starts[r])) for r, i in zip(rows, flat_index, strict=True)]


def _refuse_null_items(flat: pa.Array, lengths: np.ndarray, name: str) -> None:
    where = np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))
    shown = ", ".join(f"row {r} item {i}" for r, i in _positions(where[:5], lengths))
    raise ValueError(
        f"{name}: {len(where)} null item(s) ({shown}{', ...' if len(where) > 5 else ''}); "
        f"the trace schema declares its items non-null, so a null is not a value here "
        f"(pandas writes NaN as null: write the value itself)"
    )


def item_nullable(name: str) -> bool:
    """Whether the trace schema lets items of list column `name` be null (an absent row)."""
    return TRACE_SCHEMA.field(name).type.value_field.nullable


def _one_array(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    """The column as one array: a batch's single chunk as it is (combine_chunks copies it)."""
    if not isinstance(col, pa.ChunkedArray):
        return col
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def trace_matrix(
    table: pa.Table, name: str, fill, dtype, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """`list_matrix` of trace column `name`, nulls allowed exactly where the schema allows them."""
    null_fill = fill if item_nullable(name) else REFUSE
    return list_matrix(table[name], fill, dtype, width, null_fill=null_fill, name=name)


def trace_scalar(table: pa.Table, name: str, dtype) -> np.ndarray:
    """A non-list trace column as numpy; a null is refused where the schema declares none."""
    col = table[name]
    if col.null_count and not TRACE_SCHEMA.field(name).nullable:
        raise ValueError(f"{name}: {col.null_count} null value(s); the trace schema declares none")
    return col.to_numpy().astype(dtype)


def check_draft_logprobs(col: pa.ChunkedArray | pa.Array) -> None:
    """Refuse NaN, +inf or positive draft log-probabilities (`cand_draft_logprob`).

    The selector's precondition is a score non-increasing along every path; a
    positive or +inf log q breaks it, and top-B trees would not be ancestor-closed.
    The message shows the first offending entries (row, pool index, value).
    """
    arr = _one_array(col)
    values = arr.flatten().to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(~(values <= 0.0))  # NaN compares False: counted here
    if bad.size:
        lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
        shown = ", ".join(
            f"row {r} pool index {i}: {values[k]}"
            for (r, i), k in zip(_positions(bad[:5], lengths), bad[:5], strict=True)
        )
        raise ValueError(
            f"cand_draft_logprob: {bad.size} value(s) are NaN, +inf or positive ({shown}"
            f"{', ...' if bad.size > 5 else ''}); a draft log-probability must be <= 0 or -inf"
        )


def pool_batch_from_table(table: pa.Table) -> PoolBatch:
    """Dense pools of every round of a trace table (CPU tensors).

    Invalid draft log-probabilities are refused where scores are built
    (`selection.ranking.draft_scores`), not here a second time.
    """
    parent, lengths = trace_matrix(table, "cand_parent", -1, np.int64)
    valid = np.arange(parent.shape[1])[None, :] < lengths[:, None]
    depth, _ = trace_matrix(table, "cand_depth", 0, np.int64)
    token, _ = trace_matrix(table, "cand_token", -1, np.int64)
    draft, _ = trace_matrix(table, "cand_draft_logprob", -np.inf, np.float32)
    target, _ = trace_matrix(table, "cand_target_prob", 0.0, np.float32)
    argmax, _ = trace_matrix(table, "cand_target_argmax", -1, np.int32)  # only compared
    root_argmax = trace_scalar(table, "root_argmax", np.int64)
    # The target's argmax at each candidate's parent prefix (root row for depth 1).
    if argmax.shape != parent.shape:  # the flat take below reads rows by parent's width
        raise ValueError(
            f"cand_target_argmax: pools of {argmax.shape[1]} columns, but cand_parent's have "
            f"{parent.shape[1]}; every pool column holds one entry per candidate"
        )
    greedy_edge = greedy_edges(token, parent, argmax, root_argmax, lengths)
    return PoolBatch(
        token=torch.from_numpy(token),
        parent=torch.from_numpy(parent),
        depth=torch.from_numpy(depth),
        draft_logprob=torch.from_numpy(draft),
        target_prob=torch.from_numpy(target),
        greedy_edge=torch.from_numpy(greedy_edge),
        valid=torch.from_numpy(valid),
        temperature=torch.from_numpy(trace_scalar(table, "temperature", np.float32)),
    )

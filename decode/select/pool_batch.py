"""Pools of many rounds as dense `[R, P]` tensors, read from trace tables.

The trace stores pools as Arrow list columns; the selector wants dense tensors
in pool order. Rounds whose pools are shorter than the longest one in the
batch are padded with `valid = False` entries that hang off the root, carry
zero probability and -inf draft log-probability, so they never enter a tree.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import Tensor

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


def list_matrix(
    col: pa.ChunkedArray | pa.Array, fill, dtype, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A list column as a dense [R, width] matrix padded with `fill`, and the list lengths [R].

    width None: the longest list; a given width drops entries past it. Nulls inside a
    list (an absent retained row) become `fill` too. The one implementation of this
    for pools, first-level columns and report tables alike.
    """
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
    lengths = lengths.astype(np.int64)
    flat = arr.flatten()
    if flat.null_count:
        flat = flat.fill_null(fill)
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


def check_draft_logprobs(col: pa.ChunkedArray | pa.Array) -> None:
    """Refuse NaN, +inf or positive draft log-probabilities (`cand_draft_logprob`).

    The selector's precondition is a score non-increasing along every path; a
    positive or +inf log q breaks it, and top-B trees would not be ancestor-closed.
    """
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    values = arr.flatten()
    bad = pc.sum(pc.invert(pc.less_equal(values, 0.0))).as_py() or 0
    if bad:
        raise ValueError(
            f"cand_draft_logprob: {bad} value(s) are NaN, +inf or positive (largest "
            f"{pc.max(values).as_py()}); a draft log-probability must be <= 0 or -inf"
        )


def pool_batch_from_table(table: pa.Table) -> PoolBatch:
    """Dense pools of every round of a trace table (CPU tensors).

    Invalid draft log-probabilities are refused where scores are built
    (`decode.select.ranking.draft_scores`), not here a second time.
    """
    parent, lengths = list_matrix(table["cand_parent"], -1, np.int64)
    valid = np.arange(parent.shape[1])[None, :] < lengths[:, None]
    depth, _ = list_matrix(table["cand_depth"], 0, np.int64)
    token, _ = list_matrix(table["cand_token"], -1, np.int64)
    draft, _ = list_matrix(table["cand_draft_logprob"], -np.inf, np.float32)
    target, _ = list_matrix(table["cand_target_prob"], 0.0, np.float32)
    argmax, _ = list_matrix(table["cand_target_argmax"], -1, np.int64)
    root_argmax = table["root_argmax"].to_numpy().astype(np.int64)
    # The target's argmax at each candidate's parent prefix (root row for depth 1).
    parent_argmax = np.where(
        parent >= 0, np.take_along_axis(argmax, np.maximum(parent, 0), axis=1), root_argmax[:, None]
    )
    greedy_edge = (token == parent_argmax) & valid
    return PoolBatch(
        token=torch.from_numpy(token),
        parent=torch.from_numpy(parent),
        depth=torch.from_numpy(depth),
        draft_logprob=torch.from_numpy(draft),
        target_prob=torch.from_numpy(target),
        greedy_edge=torch.from_numpy(greedy_edge),
        valid=torch.from_numpy(valid),
        temperature=torch.from_numpy(table["temperature"].to_numpy().astype(np.float32)),
    )

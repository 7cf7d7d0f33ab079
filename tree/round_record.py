"""A round's trace columns (TRACE_SCHEMA) from the verification pass, and the rows it retains.

Runs after the round's single host sync, on host copies of the pool (`HostPool`)
plus a few gathers on the device; nothing here touches the caches or the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tree import retained as R
from tree.pool import Pool
from tree.verify import Selection, edge_logprob


@dataclass
class RoundContext:
    """What a round's features read besides the pool and the rows (every round builds one)."""

    root: int
    prompt_length: int
    round_index: int
    tokens_before: int
    prev_accepted: int | None


@dataclass
class HostPool:
    """The pool and selection as host arrays (pool order)."""

    token: np.ndarray
    parent: np.ndarray
    expanded: np.ndarray
    drafter_pos: np.ndarray
    rank: np.ndarray
    in_tree: np.ndarray
    batch_row: np.ndarray

    @classmethod
    def from_device(cls, pool: Pool, sel: Selection) -> HostPool:
        ints = (
            torch.stack([pool.token, pool.parent, pool.drafter_pos, sel.rank, sel.batch_row])
            .cpu()
            .numpy()
        )
        bools = torch.stack([pool.expanded, sel.in_tree]).cpu().numpy()
        return cls(ints[0], ints[1], bools[0], ints[2], ints[3], bools[1], ints[4])


def round_trace_fields(
    root: int,
    row_cache: R.TokenKeyedCache,
    pool: Pool,
    sel: Selection,
    host: HostPool,
    logits: Tensor,
    row_logp: Tensor,
    prow: Tensor,
    path: np.ndarray,
    cont: int,
    stats: R.RetainedStats | None,
    round_index: int,
    token_only: bool = True,
) -> tuple[dict, R.PrevRows]:
    """Pool, root-row, outcome and retained-row columns of one round, and the rows kept for the next.

    Also stores this round's verified rows in the token-keyed cache `row_cache`.
    `token_only`: keep the token-only rows (`retain_rows`).
    """
    row_argmax = logits.argmax(-1)  # [1+|Q|]
    cand_argmax = torch.where(sel.batch_row >= 0, row_argmax[sel.batch_row.clamp(min=0)], -1)  # [P]
    root_logp = row_logp[0]  # [V]
    # 0 * log 0 = 0: entries whose probability underflows contribute nothing.
    entropy = -(root_logp.exp() * root_logp).nan_to_num(0.0, 0.0, 0.0).sum()
    # Two transfers for everything on the device (each .tolist() on its own would wait once).
    ints = torch.cat([pool.depth, cand_argmax, row_argmax[:1]]).cpu()  # [2P + 1]
    floats = torch.cat(
        [
            pool.draft_logprob,
            edge_logprob(row_logp, pool, prow).exp(),
            entropy[None],
            root_logp.max().exp()[None],
            *([pool.confidence.float().reshape(1)] if pool.confidence is not None else []),
        ]
    ).cpu()  # [2P + 2 (+ 1: the drafter's confidence)]
    n = pool.size
    fields = {
        "root_token": root,
        "cand_token": host.token.tolist(),
        "cand_parent": host.parent.tolist(),
        "cand_depth": ints[:n].tolist(),
        "cand_draft_logprob": floats[:n].tolist(),
        "cand_expanded": host.expanded.tolist(),
        "cand_target_prob": floats[n : 2 * n].tolist(),
        "cand_scored": (host.batch_row >= 0).tolist(),
        "cand_in_tree": host.in_tree.tolist(),
        "cand_target_argmax": ints[n : 2 * n].tolist(),
        "root_argmax": int(ints[2 * n]),
        "root_entropy": float(floats[2 * n]),
        "root_top1_prob": float(floats[2 * n + 1]),
        "accepted_path": path.tolist(),
        "continuation_token": cont,
        "draft_confidence": float(floats[2 * n + 2]) if pool.confidence is not None else None,
    }
    rr = round_rows(root, host, path, cont)
    e = R.emitted_node(rr)
    fields["covered"] = bool(e is not None and host.batch_row[e] >= 0)
    fields.update(R.trace_fields(stats, host.token[: pool.n_first].tolist(), root))
    return fields, retain_rows(rr, logits, row_cache, round_index, token_only)


def round_rows(root: int, host: HostPool, path: np.ndarray, cont: int) -> R.RoundRows:
    """The round's addresses in the terms of `tree.retained`."""
    return R.RoundRows(
        root, host.token, host.parent, host.rank, host.in_tree, host.batch_row, path.tolist(), cont
    )


def retain_rows(
    rr: R.RoundRows, logits: Tensor, row_cache: R.TokenKeyedCache, round_index: int,
    token_only: bool = True,
) -> R.PrevRows:  # fmt: skip
    """Keep this round's rows for the next round (one gather), then update the token-keyed cache.

    logits: [1 + |Q|, V], the verification batch; token_only: keep the token-only rows.
    Returns the next round's `PrevRows`.
    """
    keep, prev = R.retained_batch_rows(rr, token_only)
    prev.rows = logits.index_select(0, torch.as_tensor(keep, device=logits.device))  # [K, V]
    toks, rows = R.cache_writes(rr)
    row_cache.store(
        toks, logits.index_select(0, torch.as_tensor(rows, device=logits.device)), round_index
    )
    return prev

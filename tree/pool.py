"""Draft pool growth (docs/method.md#pool): the drafter proposes a trie of candidates below the root.

    depth 1      : the drafter's top_k tokens at the root           (10)
    depth s + 1  : top_k children of every node expanded at depth s (10 x 10 = 100)
    expansion    : after each step but the last, the `expand` new candidates with the
                   highest cumulative draft log-probability are expanded (10 per depth)
    defaults     : 10 + 7 * 100 = 710 candidates, 10 + 6 * 10 = 70 expanded, depth <= 8

The drafter expands a whole depth level in one forward under a tree mask: an
expanded node sees the committed context, the root and its own ancestors (which
are all expanded, hence already in the drafter's cache). Everything stays on the
device; there is no host sync inside the growth (`tree.growth`: `grow_tree_pool` over any
`TreeDraft`, `grow_pool` for a standalone model; an EAGLE-3 head, whose logit columns are
a draft vocabulary mapped to target ids, in `pairs.eagle3.pool`).

Pool order: depth-major; within a depth, by parent pool index, then by the
child's rank under its parent. Parents therefore precede children, and the
first `top_k` entries are the first-level candidates (see `specrank.store.trace_schema`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from specrank.settings.errors import Refusal
from tree.config import PoolConfig


def check_pool_config(cfg: PoolConfig) -> None:
    if cfg.top_k < 1:
        raise Refusal(f"The 'pool.top_k' must be an int >= 1. Got {cfg.top_k} instead.")
    if cfg.expand_steps < 0:
        raise Refusal(
            f"The 'pool.expand_steps' must be an int >= 0. Got {cfg.expand_steps} instead."
        )
    if cfg.expand_steps > 0 and cfg.expand < 1:
        raise Refusal(
            f"The 'pool.expand' must be an int >= 1 when pool.expand_steps > 0. Got {cfg.expand} instead."
        )


def level_sizes(cfg: PoolConfig) -> list[tuple[int, int]]:
    """(candidates, expanded) per depth level. Defaults: [(10, 10), (100, 10) x 6, (100, 0)]."""
    check_pool_config(cfg)
    sizes = []
    n = cfg.top_k
    for s in range(cfg.expand_steps + 1):
        n_exp = min(cfg.expand, n) if s < cfg.expand_steps else 0
        sizes.append((n, n_exp))
        n = n_exp * cfg.top_k
    return sizes


def pool_size(cfg: PoolConfig) -> int:
    return sum(n for n, _ in level_sizes(cfg))


@dataclass
class Pool:
    """One round's pool in pool order, on the device. P = pool_size(cfg)."""

    token: Tensor  # [P] int64
    parent: Tensor  # [P] int64, -1 = child of the root
    depth: Tensor  # [P] int64, 1..expand_steps+1
    draft_logprob: Tensor  # [P] float32, per-edge log q (unit temperature)
    score: Tensor  # [P] float32, cumulative draft log-probability (the draft rule's score)
    expanded: Tensor  # [P] bool
    anc: Tensor  # [P, P] bool, anc[i, j]: j is i or an ancestor of i
    drafter_pos: Tensor  # [P] int64, position in the drafter's cache; -1 if never fed
    n_first: int  # first-level candidates: the first n_first entries
    # Sampled drafting kept for the coupling verifier (`DraftDraw.keep_rows`): the tempered
    # draft rows children were drawn from, log q [1 + expanded, V'] (the root's, then the
    # expanded nodes' in feeding order), each node's parent's row in them [P], and the
    # drafter's token ids of V' (None: the target's vocabulary).
    q_rows: Tensor | None = None
    q_parent_row: Tensor | None = None
    q_ids: Tensor | None = None
    # The drafter's own estimate of the acceptance of its top first-level candidate, a 0-d
    # float32 tensor (DSpark's calibrated confidence, `pairs.semiar.drafter`); None for a
    # drafter without one. Read only by recording (the trace's `draft_confidence`).
    confidence: Tensor | None = None

    @property
    def size(self) -> int:
        return self.token.shape[0]


def stable_topk(logprob: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k per row with ties broken by lower token id, in linear time. ([n, k], [n, k]).

    `torch.topk` does not promise which of several equal values it keeps, and
    bf16 logits tie often; a full stable sort over the vocabulary would be exact
    but O(V log V). Here: keep everything above the k-th largest value, then the
    lowest ids among values equal to it, then order the k survivors stably.
    """
    n = logprob.shape[0]
    kth = torch.topk(logprob, k, dim=-1).values[:, -1:]  # [n, 1]
    above = logprob > kth  # [n, V]
    tied = logprob == kth
    room = k - above.sum(-1, keepdim=True)  # tied slots left, >= 1
    keep = above | (tied & (tied.cumsum(-1) <= room))  # exactly k per row
    idx = torch.nonzero_static(keep, size=n * k)[:, 1].view(n, k)  # ascending ids per row
    vals = logprob.gather(-1, idx)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return vals.gather(-1, order), idx.gather(-1, order)


@dataclass(frozen=True)
class DraftDraw:
    """Sampled drafting (`decode.draft_temperature` > 0): the temperature and the generator."""

    temperature: float
    generator: torch.Generator
    keep_rows: bool = False  # keep the rows drawn from (Pool.q_rows): decode.verifier=coupling


def _children(logits: Tensor, k: int, draw: DraftDraw | None = None, flat: bool = True
              ) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
    """k children of each row and their float32 draft log-probs, flattened row-major, and
    the tempered rows they were drawn from (None without `draw`).

    Without `draw`: the top-k tokens. With it: k tokens drawn without replacement from the
    tempered distribution (Gumbel-top-k: the k largest of log q + Gumbel noise are a
    Plackett-Luce sample; k = 1 is a draw from q), their tempered log-probs as scores.
    ([n*k], [n*k], [n, V'] or None; flat=False: [n, k], [n, k], ...)
    """
    if draw is None:
        logits = logits if logits.dtype == torch.float32 else logits.float()
        logprob = logits.log_softmax(-1)  # float32: draft factors compare in float32
        vals, idx = _top_k(logprob, k)
        return (idx.reshape(-1), vals.reshape(-1), None) if flat else (idx, vals, None)
    logprob = (logits.float() / draw.temperature).log_softmax(-1)
    u = torch.rand(logprob.shape, generator=draw.generator, device=logprob.device)
    gumbel = -torch.log(-torch.log(u.clamp(min=1e-20)))
    idx = torch.topk(logprob + gumbel, k, dim=-1).indices
    vals = logprob.gather(-1, idx)
    return (idx.reshape(-1), vals.reshape(-1), logprob) if flat else (idx, vals, logprob)


# Tie-break keys, for x <= 0 (log-probs and sums of them): key_i = x_i * (1 + i * 2^-48) -
# i * 2^-1000, in float64. Two float32 values apart differ by at least 2^-24 of their size,
# more than the factors' spread (i < TIE_COLUMNS: < 2^-26), so keys keep their order; equal
# nonzero values get keys 2^-48 of their size apart, far above float64's rounding (2^-53),
# the lower index the larger; the offsets, lost in the rounding of any nonzero key, order
# equal zeros. So the k largest keys, found by `topk` in linear time, are a stable
# descending sort's first k. (-inf values tie: a k past a row's finite values is unranked.)
TIE_COLUMNS = 1 << 22


@functools.cache
def _tie_rows(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    i = torch.arange(n, dtype=torch.float64, device=device)
    return -i * 2.0**-1000, 1 + i * 2.0**-48


def tie_keys(x: Tensor) -> Tensor:
    """The float64 keys above of x [..., n] (one op: a float32 x promotes)."""
    offset, factor = _tie_rows(x.shape[-1], x.device)
    return torch.addcmul(offset, x, factor)


def _top_k(logprob: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest log-probs of each row and their columns, ties by lower column, in
    descending order: what a stable descending sort's first k columns hold."""
    if logprob.shape[-1] > TIE_COLUMNS:
        return stable_topk(logprob, k)
    idx = torch.topk(tie_keys(logprob), k, dim=-1).indices
    return logprob.gather(-1, idx), idx

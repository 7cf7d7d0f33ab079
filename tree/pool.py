"""Draft pool growth (SPEC §2): the drafter proposes a trie of candidates below the root.

    depth 1      : the drafter's top_k tokens at the root           (10)
    depth s + 1  : top_k children of every node expanded at depth s (10 x 10 = 100)
    expansion    : after each step but the last, the `expand` new candidates with the
                   highest cumulative draft log-probability are expanded (10 per depth)
    defaults     : 10 + 7 * 100 = 710 candidates, 10 + 6 * 10 = 70 expanded, depth <= 8

The drafter expands a whole depth level in one forward under a tree mask: an
expanded node sees the committed context, the root and its own ancestors (which
are all expanded, hence already in the drafter's cache). Everything stays on the
device; there is no host sync inside `grow_pool`. `grow_tree_pool` is the growth
itself over any `TreeDraft` (a standalone model here; an EAGLE-3 head, whose logit
columns are a draft vocabulary mapped to target ids, in `pairs.eagle3.pool`).

Pool order: depth-major; within a depth, by parent pool index, then by the
child's rank under its parent. Parents therefore precede children, and the
first `top_k` entries are the first-level candidates (see `specrank.trace_schema`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from tree.attention import cache_length, forward_chain, forward_tree, tree_visibility
from tree.config import PoolConfig

if TYPE_CHECKING:  # annotations only: the offline commands never load transformers
    from transformers import DynamicCache, PreTrainedModel


def check_pool_config(cfg: PoolConfig) -> None:
    if cfg.top_k < 1:
        raise ValueError(f"The 'pool.top_k' must be an int >= 1. Got {cfg.top_k} instead.")
    if cfg.steps < 0:
        raise ValueError(f"The 'pool.steps' must be an int >= 0. Got {cfg.steps} instead.")
    if cfg.steps > 0 and cfg.expand < 1:
        raise ValueError(
            f"The 'pool.expand' must be an int >= 1 when pool.steps > 0. Got {cfg.expand} instead."
        )


def level_sizes(cfg: PoolConfig) -> list[tuple[int, int]]:
    """(candidates, expanded) per depth level. Defaults: [(10, 10), (100, 10) x 6, (100, 0)]."""
    check_pool_config(cfg)
    sizes = []
    n = cfg.top_k
    for s in range(cfg.steps + 1):
        n_exp = min(cfg.expand, n) if s < cfg.steps else 0
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
    depth: Tensor  # [P] int64, 1..steps+1
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


def _children(logits: Tensor, k: int, draw: DraftDraw | None = None
              ) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
    """k children of each row and their float32 draft log-probs, flattened row-major, and
    the tempered rows they were drawn from (None without `draw`).

    Without `draw`: the top-k tokens. With it: k tokens drawn without replacement from the
    tempered distribution (Gumbel-top-k: the k largest of log q + Gumbel noise are a
    Plackett-Luce sample; k = 1 is a draw from q), their tempered log-probs as scores.
    ([n*k], [n*k], [n, V'] or None)
    """
    if draw is None:
        logprob = logits.float().log_softmax(-1)  # float32: draft factors compare in float32
        vals, idx = stable_topk(logprob, k)
        return idx.reshape(-1), vals.reshape(-1), None
    logprob = (logits.float() / draw.temperature).log_softmax(-1)
    u = torch.rand(logprob.shape, generator=draw.generator, device=logprob.device)
    gumbel = -torch.log(-torch.log(u.clamp(min=1e-20)))
    idx = torch.topk(logprob + gumbel, k, dim=-1).indices
    return idx.reshape(-1), logprob.gather(-1, idx).reshape(-1), logprob


def _pick_expanded(score: Tensor, start: int, n: int, n_exp: int) -> Tensor:
    """Pool indices of the n_exp best of the n candidates at [start, start+n), ascending."""
    order = torch.sort(score[start : start + n], descending=True, stable=True).indices[:n_exp]
    return start + order.sort().values


class TreeDraft(Protocol):
    """A drafter as pool growth drives it: `ModelDraft` here, an EAGLE-3 head in `pairs.eagle3.pool`.

    `root_logits` runs first (it feeds what the drafter has not seen of the committed
    context); its cache then holds `n_context` positions that every tree node sees, and
    each `level_logits` call appends one depth level's expanded nodes after them.
    """

    n_context: int
    token_ids: Tensor | None  # target id of each logit column (None: the columns are target ids)

    def root_logits(self) -> Tensor: ...  # [1, V'] the drafter's row at the root

    def level_logits(
        self, nodes: Tensor, token: Tensor, parent: Tensor, depth: Tensor, visible: Tensor
    ) -> Tensor: ...  # [n, V'] rows of `nodes` (pool indices; parents -1 at the root)


@dataclass
class ModelDraft:
    """A standalone drafter: a causal LM over the target's vocabulary with its own KV cache."""

    model: PreTrainedModel
    cache: DynamicCache
    pending: Tensor  # committed tokens not yet in the cache, root last
    root_position: int
    token_ids: Tensor | None = None

    @property
    def n_context(self) -> int:
        return self.root_position + 1  # the context and the root

    def root_logits(self) -> Tensor:
        # The pending chain ends with the root; its last row is q(. | c).
        return forward_chain(self.model, self.pending, self.cache, logits_to_keep=1)

    def level_logits(self, nodes, token, parent, depth, visible) -> Tensor:
        return forward_tree(self.model, token, self.root_position + depth, visible, self.cache)


@torch.inference_mode()
def grow_pool(
    drafter: PreTrainedModel,
    cache: DynamicCache,
    pending: Tensor,
    root_position: int,
    cfg: PoolConfig,
    draw: DraftDraw | None = None,
) -> Pool:
    """Grow one round's pool. `pending` = committed tokens not yet in the drafter cache, root last.

    On entry the drafter cache holds the first `root_position + 1 - len(pending)`
    tokens; on exit it holds the context, the root (at `root_position`) and every
    expanded node, at `Pool.drafter_pos`.
    """
    n_cached = cache_length(cache)
    if n_cached + pending.shape[0] != root_position + 1:
        raise ValueError(
            f"grow_pool: drafter cache holds {n_cached} tokens and {pending.shape[0]} are pending, "
            f"but the root sits at position {root_position} (expected {root_position + 1} in all)"
        )
    return grow_tree_pool(ModelDraft(drafter, cache, pending, root_position), cfg, draw)


@torch.inference_mode()
def grow_tree_pool(draft: TreeDraft, cfg: PoolConfig, draw: DraftDraw | None = None) -> Pool:
    """The pool of SPEC §2 from any `TreeDraft`; expanded nodes sit at `Pool.drafter_pos`.

    `draw`: children sampled (`_children`), not the top-k."""
    sizes = level_sizes(cfg)
    root_logits = draft.root_logits()  # [1, V']
    dev = root_logits.device
    P = sum(n for n, _ in sizes)
    token = torch.empty(P, dtype=torch.long, device=dev)
    parent = torch.empty(P, dtype=torch.long, device=dev)
    depth = torch.empty(P, dtype=torch.long, device=dev)
    logq = torch.empty(P, dtype=torch.float32, device=dev)
    score = torch.empty(P, dtype=torch.float32, device=dev)
    expanded = torch.zeros(P, dtype=torch.bool, device=dev)
    anc = torch.zeros(P, P, dtype=torch.bool, device=dev)
    drafter_pos = torch.full((P,), -1, dtype=torch.long, device=dev)

    q_rows: list[Tensor] = []  # the rows children were drawn from, kept for coupling

    def children(logits: Tensor) -> tuple[Tensor, Tensor]:
        idx, vals, rows = _children(logits, cfg.top_k, draw)
        if draw is not None and draw.keep_rows:
            q_rows.append(rows)
        return (idx if draft.token_ids is None else draft.token_ids[idx]), vals

    n1 = sizes[0][0]
    token[:n1], logq[:n1] = children(root_logits)
    parent[:n1], depth[:n1], score[:n1] = -1, 1, logq[:n1]
    ar = torch.arange(P, device=dev)
    anc[ar[:n1], ar[:n1]] = True

    start, n_level = 0, n1
    fed = torch.empty(0, dtype=torch.long, device=dev)  # pool indices in drafter-cache order
    for s, (_, n_exp) in enumerate(sizes[:-1], start=1):
        grow = _pick_expanded(score, start, n_level, n_exp)  # [n_exp] nodes expanded at depth s
        expanded[grow] = True
        # Each expanded node sees the context, its ancestors among earlier fed nodes, itself.
        vis = tree_visibility(draft.n_context, anc[grow][:, fed], anc[grow][:, grow])
        drafter_pos[grow] = draft.n_context + fed.shape[0] + torch.arange(n_exp, device=dev)
        logits = draft.level_logits(
            grow, token[grow], parent[grow], depth[grow], vis
        )  # [n_exp, V']
        fed = torch.cat([fed, grow])

        # Depth s + 1: top_k children per expanded node, parents in pool order.
        new = slice(start + n_level, start + n_level + n_exp * cfg.top_k)
        token[new], logq[new] = children(logits)
        parent[new] = grow.repeat_interleave(cfg.top_k)
        depth[new] = s + 1
        score[new] = score[parent[new]] + logq[new]
        anc[new] = anc[parent[new]]  # ancestors of a child = its parent's, plus itself
        anc[ar[new], ar[new]] = True
        start, n_level = new.start, new.stop - new.start
    pool = Pool(token, parent, depth, logq, score, expanded, anc, drafter_pos, n1)
    if q_rows:
        # row 0 is the root's; expanded node e's is 1 + its place in feeding order
        place = torch.zeros(P, dtype=torch.long, device=dev)
        place[fed] = 1 + torch.arange(fed.shape[0], device=dev)
        pool.q_rows, pool.q_ids = torch.cat(q_rows), draft.token_ids
        pool.q_parent_row = torch.where(parent >= 0, place[parent.clamp(min=0)], 0)
    return pool

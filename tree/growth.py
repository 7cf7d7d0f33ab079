"""The pool's growth loop (docs/method.md#pool) over any `TreeDraft`, in batched tensor steps, and a
standalone drafter's growth (`grow_pool`).

Each depth level keeps its own small tensors ([n, top_k] children, their scores) and the
pool is assembled once at the end, so a level costs a fixed handful of ops whatever its
width: pick the expanded nodes (the level's top scores, ties by pool order, `tree.pool`'s
tie keys), one draft forward, top_k children per row. What never depends on the drafts
(depths, parents' places in the previous level, the tree slots each level feeds) is built
once per pool setting (`_plan`).

Tree slots: the nodes expanded in a round are fed in level order, ascending pool index
within a level (the drafter's cache order, `Pool.drafter_pos`). A level's visibility over
the committed context and those slots is additive (0 seen, -inf not): a node sees the
context, its parent's slots and its own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from tree.attention import cache_length, forward_chain, forward_tree
from tree.config import PoolConfig
from tree.lean import RoundSlots, StaticKV
from tree.lean_model import lean_model
from tree.pool import DraftDraw, Pool, _children, level_sizes, tie_keys

if TYPE_CHECKING:  # annotations only: the offline commands never load transformers
    from transformers import DynamicCache, PreTrainedModel


@dataclass
class Level:
    """The nodes one draft forward feeds: those expanded at `depth`, in pool order."""

    depth: int  # 1: children of the root
    # [n] their token ids: target ids, or the drafter's logit columns where the draft
    # `feeds_columns` (the pool's tokens are mapped to target ids once, at the end)
    token: Tensor
    prev_row: Tensor | None  # [n] each parent's row in the previous level's logits; None at depth 1
    # [n, n_context + F] additive visibility over the committed context and the round's F
    # tree slots (a forward attends to the first n_context + slot + n columns)
    mask: Tensor
    slot: int  # the first of their tree slots, [slot, slot + n)


class TreeDraft(Protocol):
    """A drafter as pool growth drives it: the standalone LM (`ModelDraft`), an
    EAGLE-3 head (`pairs.eagle3.pool`), a block drafter's marginals (`pairs.block`).

    `root_logits` runs first (it feeds what the drafter has not seen of the committed
    context, and learns the round's F tree slots); each `level_logits` then feeds one
    level's expanded nodes at their tree slots after the `n_context` committed positions.
    An optional `feeds_columns` (True) has the levels fed the logit columns drafted
    rather than target ids.
    """

    n_context: int
    token_ids: Tensor | None  # target id of each logit column (None: the columns are target ids)
    # True: a level's rows are one row for every node (block marginals): [1, V'] suffices
    shared_rows: bool

    def root_logits(self, n_tree: int) -> Tensor: ...  # [1, V'] the drafter's row at the root

    def level_logits(self, level: Level) -> Tensor: ...  # [n or 1, V'] rows of level's nodes


@dataclass(frozen=True)
class _Plan:
    """What a pool setting fixes, on one device."""

    sizes: list[tuple[int, int]]
    fed: list[int]  # nodes each expanding level feeds
    depth: Tensor  # [P]
    own: Tensor  # [F, F] additive, 0 at each fed node's own slot
    first: list[Tensor | None]  # per expanding level: arange(n_exp) when it expands all
    offset: Tensor  # [F] the pool index where each fed node's level starts
    parent_slot: Tensor  # [P - n1] the tree slot of each deeper node's parent
    fed_pos: Tensor  # [F] 0 .. F - 1
    roots: Tensor  # [n1] -1: the first level's parent
    first_rows: Tensor  # [n1, P] False: the first level's ancestors (bar themselves)


@functools.cache
def _plan(top_k: int, steps: int, expand: int, device: torch.device) -> _Plan:
    sizes = level_sizes(PoolConfig(top_k=top_k, expand_steps=steps, expand=expand))
    fed = [e for _, e in sizes[:-1]]
    n_fed = sum(fed)
    depth = torch.cat([torch.full((n,), d, dtype=torch.long) for d, (n, _) in
                       enumerate(sizes, start=1)])  # fmt: skip
    own = torch.full((n_fed, n_fed), float("-inf"))
    own.fill_diagonal_(0.0)
    first, offset, parent_slot = [], [], []
    start = slot = 0
    for n, e in sizes[:-1]:
        first.append(torch.arange(e, device=device) if e == n else None)
        offset += [start] * e
        parent_slot.append(slot + torch.arange(e).repeat_interleave(top_k))
        start, slot = start + n, slot + e
    slots = torch.cat(parent_slot) if parent_slot else torch.empty(0, dtype=torch.long)
    n1, P = sizes[0][0], depth.shape[0]
    return _Plan(sizes, fed, depth.to(device), own.to(device), first,
                 torch.tensor(offset, device=device), slots.to(device),
                 torch.arange(n_fed, device=device),
                 torch.full((n1,), -1, dtype=torch.long, device=device),
                 torch.zeros(n1, P, dtype=torch.bool, device=device))  # fmt: skip


def _top(logits: Tensor, k: int, draw: DraftDraw | None, q_rows: list[Tensor]
         ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """[n, k] children and their float32 log-probs (`tree.pool._children`)."""
    idx, vals, rows = _children(logits, k, draw, flat=False)
    if draw is not None and draw.keep_rows:
        q_rows.append(rows)
    return idx, vals


@torch.inference_mode()
def grow_tree_pool(draft: TreeDraft, cfg: PoolConfig, draw: DraftDraw | None = None) -> Pool:
    """The pool of docs/method.md#pool from any `TreeDraft`; expanded nodes sit at `Pool.drafter_pos`.

    `draw`: children sampled (`tree.pool._children`), not the top-k."""
    k = cfg.top_k
    root = draft.root_logits(sum(e for _, e in level_sizes(cfg)))  # [1, V']
    plan = _plan(k, cfg.expand_steps, cfg.expand, root.device)
    # each level's own-slot rows, the context's columns (all seen) before the tree's
    own = F.pad(plan.own, (draft.n_context, 0)).split(plan.fed) if plan.fed else ()
    mapped = draft.token_ids is not None and not getattr(draft, "feeds_columns", False)
    q_rows: list[Tensor] = []
    idx, vals = _top(root, k, draw, q_rows)
    tok = draft.token_ids[idx] if mapped else idx  # [1, k]
    toks, logqs, scores, picks, masks = [tok], [vals], [vals], [], []
    flat_score, prev_mask, slot = vals.view(-1), None, 0
    for s, e in enumerate(plan.fed, start=1):
        loc = plan.first[s - 1]  # level-local indices of the expanded nodes, ascending
        if loc is None:  # the e best scores, ties by pool order (`tree.pool.tie_keys`)
            loc = torch.topk(tie_keys(flat_score), e).indices.sort().values
        prow = None if s == 1 else torch.div(loc, k, rounding_mode="floor")
        mask = own[0] if prow is None else torch.maximum(prev_mask.index_select(0, prow),
                                                         own[s - 1])  # fmt: skip
        # the fed tokens, from the previous level's [e, k] children as a flat array
        logits = draft.level_logits(Level(s, torch.take(tok, loc), prow, mask, slot))
        if draft.shared_rows and draw is None:  # one row's top-k serves every node
            idx, vals = (t.expand(e, k) for t in _top(logits, k, None, q_rows))
        else:
            idx, vals = _top(logits.expand(e, -1) if draft.shared_rows else logits, k, draw,
                             q_rows)  # fmt: skip
        tok = draft.token_ids[idx] if mapped else idx
        score = flat_score.index_select(0, loc).unsqueeze(1) + vals  # [e, k]
        toks.append(tok)
        logqs.append(vals)
        scores.append(score)
        picks.append(loc)
        masks.append(mask)
        flat_score, prev_mask, slot = score.view(-1), mask, slot + e
    return _assemble(draft, plan, toks, logqs, scores, picks, masks, q_rows)


def _assemble(draft: TreeDraft, plan: _Plan, toks: list[Tensor], logqs: list[Tensor],
              scores: list[Tensor], picks: list[Tensor], masks: list[Tensor],
              q_rows: list[Tensor]) -> Pool:  # fmt: skip
    """The pool's tensors from the levels' (pool order: level by level, then by parent)."""
    token, logq, score = (torch.cat(x).view(-1) for x in (toks, logqs, scores))
    if draft.token_ids is not None and getattr(draft, "feeds_columns", False):
        token = draft.token_ids.index_select(0, token)  # drafted columns -> target ids
    P, n1, dev = token.shape[0], plan.sizes[0][0], token.device
    expanded = torch.zeros(P, dtype=torch.bool, device=dev)
    drafter_pos = torch.full((P,), -1, dtype=torch.long, device=dev)
    if picks:
        fed = torch.cat(picks) + plan.offset  # pool indices in feeding order
        parent = torch.cat([plan.roots, fed.index_select(0, plan.parent_slot)])
        expanded.index_fill_(0, fed, True)
        drafter_pos[fed] = draft.n_context + plan.fed_pos
        # each fed node's row: the slots it sees (its fed ancestors, itself) as pool columns;
        # a deeper node's ancestors are its parent and the parent's, so it takes that row
        # (rows gathered whole: a scatter into [P, P]'s columns costs ten times more)
        rows = torch.zeros(plan.fed_pos.shape[0], P, dtype=torch.bool, device=dev)
        rows[:, fed] = torch.cat(masks)[:, draft.n_context :] == 0
        anc = torch.cat([plan.first_rows, rows.index_select(0, plan.parent_slot)])
    else:
        parent = plan.roots.clone()
        anc = torch.zeros(P, P, dtype=torch.bool, device=dev)
    anc.fill_diagonal_(True)
    pool = Pool(token, parent, plan.depth.clone(), logq, score, expanded, anc, drafter_pos, n1)
    if q_rows:
        # row 0 is the root's; expanded node e's is 1 + its place in feeding order
        place = torch.zeros(P, dtype=torch.long, device=dev)
        if picks:
            place[fed] = 1 + plan.fed_pos
        pool.q_rows, pool.q_ids = torch.cat(q_rows), draft.token_ids
        pool.q_parent_row = torch.where(parent >= 0, place[parent.clamp(min=0)], 0)
    return pool


@dataclass
class ModelDraft:
    """A standalone drafter: a causal LM over the target's vocabulary with its own KV cache
    (a `tree.lean.StaticKV` runs the lean forward, `tree.lean_model`)."""

    model: PreTrainedModel
    cache: DynamicCache | StaticKV
    pending: Tensor  # committed tokens not yet in the cache, root last
    root_position: int
    fed: list[int]  # nodes each level feeds (`level_sizes`)
    token_ids: Tensor | None = None
    shared_rows: bool = False

    @property
    def n_context(self) -> int:
        return self.root_position + 1  # the context and the root

    def root_logits(self, n_tree: int) -> Tensor:
        # The pending chain ends with the root; its last row is q(. | c).
        if not isinstance(self.cache, StaticKV):
            return forward_chain(self.model, self.pending, self.cache, logits_to_keep=1)
        self.lean = lean = lean_model(self.model)
        cache, n, past = self.cache, self.n_context, self.cache.length
        # the pending chain, then each level's nodes: the round's slots, split once
        self.round = RoundSlots(cache, past, [n - past, *self.fed])
        row = lean.chain(self.pending, self.round.segment(0, n), past, keep=1)
        cache.length = n + n_tree  # the round's tree slots; a level's mask hides unfed ones
        # the levels' RoPE rows: depth d sits at position root + d
        self.ropes = lean.rope.at(n + len(self.fed))[n : n + len(self.fed)].unbind(0)
        return row

    def level_logits(self, level: Level) -> Tensor:
        n = level.token.shape[0]
        end = self.n_context + level.slot + n
        if not isinstance(self.cache, StaticKV):
            positions = torch.full((n,), self.root_position + level.depth,
                                   device=level.token.device)  # fmt: skip
            return forward_tree(self.model, level.token, positions, level.mask[:, :end] == 0,
                                self.cache)  # fmt: skip
        rope, slots = self.ropes[level.depth - 1], self.round.segment(level.depth, end)
        return self.lean.forward(level.token, rope, slots, level.mask[:, :end])


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
    fed = [e for _, e in level_sizes(cfg)[:-1]]
    return grow_tree_pool(ModelDraft(drafter, cache, pending, root_position, fed), cfg, draw)

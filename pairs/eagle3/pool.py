"""Pool growth with an EAGLE-3 head: the same pool, order and ranking as `tree.pool` (docs/method.md#pool).

Head position j holds the pair (the target's aux hidden states at position j, token j + 1).
With the root at position r (emitted, not yet verified), one round is

    pending   the committed pairs the head has not seen, j in [n_fed, r): their fused target
              features and tokens in one causal forward; the last one, (feature r - 1, root),
              gives the depth-1 row. These pairs stay in the head's cache: their features are
              the target's own, from the passes that verified them.
    depth d   one forward per depth over the nodes expanded there, at position r - 1 + d, each
              taking its parent's pre-norm output as its hidden (the root pair's output at
              depth 1), under a tree mask over the head's own KV: the committed pairs, the
              node's ancestors, itself.
    after     `Eagle3State.commit`: the head's KV past the committed pairs is dropped (the tree
              nodes ran on the head's own outputs, not on target features), and the feature
              rows follow the target cache's compaction, so the next round's pending pairs are
              (root, first accepted), ..., (last accepted, continuation) with the verification
              pass's features.

Draft ids are mapped to target ids through the head's `token_ids` (d2t) by the shared
growth loop (`tree.growth.grow_tree_pool`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from pairs.eagle3.capture import FeatureRows
from pairs.eagle3.head import Eagle3Head
from pairs.eagle3.lean import lean_head
from tree.attention import cache_length, compact_cache, to_attention_mask, tree_visibility
from tree.config import PoolConfig
from tree.growth import Level, grow_tree_pool
from tree.lean import StaticKV, additive_mask, narrow_keys
from tree.pool import DraftDraw, Pool


@dataclass
class Eagle3State:
    """One prompt's drafting state beside the target's cache."""

    # head KV: pairs 0 .. n_fed - 1, then this round's expanded nodes (a StaticKV: the lean
    # forward, `pairs.eagle3.lean`)
    cache: DynamicCache | StaticKV
    features: FeatureRows  # aux states of the target cache's positions from n_fed on
    n_fed: int = 0  # committed pairs in `cache`

    def commit(self, keep_prefix: int, keep: list[int], target_length: int) -> None:
        """After the target cache was compacted to [0, keep_prefix) + keep (now `target_length`)."""
        self.features.compact(keep_prefix, keep)
        if self.features.end != target_length:
            raise RuntimeError(
                f"EAGLE-3 features hold positions up to {self.features.end}, the target cache "
                f"{target_length}: a target pass ran outside the capture"
            )
        compact_cache(self.cache, self.n_fed, [])  # the round's draft KV goes


@torch.inference_mode()
def run_head(
    head: Eagle3Head,
    hidden: Tensor,
    ids: Tensor,
    positions: Tensor,
    visible: Tensor,
    cache: DynamicCache,
) -> Tensor:
    """One head forward of n positions (hidden [n, H], ids, positions [n]) appending their KV.

    visible: [n, cache length + n] bool, as `tree.attention.forward_tree` takes it.
    Returns the pre-norm outputs [n, H].
    """
    n, past = ids.shape[0], cache_length(cache)
    if visible.shape != (n, past + n):
        raise ValueError(
            f"run_head: visibility must be [n, cache_length + n] = [{n}, {past + n}]; "
            f"got {tuple(visible.shape)}"
        )
    mask = to_attention_mask(visible, hidden.dtype, head.config._attn_implementation)
    return head(hidden[None], ids[None], positions[None], mask, cache)[0]


@torch.inference_mode()
def feed_pairs(head: Eagle3Head, state: Eagle3State, tokens: list[int], hi: int) -> Tensor:
    """Feed the committed pairs j in [n_fed, hi) (feature j, token j + 1). Outputs [hi - n_fed, H]."""
    lo = state.n_fed
    if cache_length(state.cache) != lo:
        raise RuntimeError(
            f"EAGLE-3 head cache holds {cache_length(state.cache)} positions, expected the "
            f"{lo} committed pairs"
        )
    feats = state.features.rows(lo, hi)
    dev = feats.device
    ids = torch.tensor(tokens[lo + 1 : hi + 1], device=dev)
    causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=dev).tril()
    vis = tree_visibility(lo, causal[:, :0], causal)
    if isinstance(state.cache, StaticKV):
        lean, cache = lean_head(head), state.cache
        g = torch.mm(feats, lean.fuse_w)  # the head's fc, as F.linear computes it
        cache.reserve(hi)
        rope = lean.rope.at(hi)[lo:hi]
        mask = additive_mask(vis, g.dtype)
        out = lean.forward(g, lean.hidden_norm(g), ids, rope, cache, lo, cache.keys(hi), mask)
        cache.length = hi
    else:
        out = run_head(head, head.fuse(feats), ids, torch.arange(lo, hi, device=dev), vis,
                       state.cache)  # fmt: skip
    state.n_fed = hi
    state.features.drop_before(hi)  # fed: the head never reads these rows again
    return out


class HeadDraft:
    """A `tree.growth.TreeDraft` over an EAGLE-3 head (see the module doc)."""

    token_ids: Tensor | None
    shared_rows = False

    def __init__(self, head: Eagle3Head, state: Eagle3State, tokens: list[int],
                 root_position: int) -> None:  # fmt: skip
        if root_position <= state.n_fed:
            raise ValueError(
                f"EAGLE-3 drafting: the root sits at position {root_position} but the head has "
                f"fed {state.n_fed} pairs; a round needs the pair (feature of the token before "
                "the root, root) still pending"
            )
        self.head, self.state, self.tokens, self.root_position = head, state, tokens, root_position
        self.n_context = root_position  # pairs 0 .. r - 1 (the root's pair is the last)
        self.token_ids = head.token_ids
        self.lean = lean_head(head) if isinstance(state.cache, StaticKV) else None
        # the previous level's pre-norm outputs and their hidden_norm (the root's at first)
        self.out: Tensor | None = None
        self.normed: Tensor | None = None

    def root_logits(self, n_tree: int) -> Tensor:
        out = feed_pairs(self.head, self.state, self.tokens, self.root_position)[-1:]
        if self.lean is None:
            self.out = out
            return self.head.logits(out)
        n, cache = self.n_context, self.state.cache
        cache.reserve(n + n_tree)
        cache.length = n + n_tree  # the round's tree slots; a level's mask hides unfed ones
        self.keys = cache.keys()
        self.ctx = torch.zeros(0, n, dtype=out.dtype, device=out.device)
        logits, self.normed = self.lean.outputs(out)
        self.out = out
        return logits

    def level_logits(self, level: Level) -> Tensor:
        n, pos = level.token.shape[0], self.root_position - 1 + level.depth
        if level.prev_row is None:
            hidden = self.out.expand(n, -1)
            normed = None if self.normed is None else self.normed.expand(n, -1)
        else:
            hidden = self.out.index_select(0, level.prev_row)
            normed = None if self.normed is None else self.normed.index_select(0, level.prev_row)
        if self.lean is None:
            m, at = level.tree_mask, level.slot
            visible = tree_visibility(self.n_context, m[:, :at] == 0, m[:, at : at + n] == 0)
            positions = torch.full((n,), pos, device=hidden.device)
            self.out = run_head(self.head, hidden, level.token, positions, visible,
                                self.state.cache)  # fmt: skip
            return self.head.logits(self.out)
        if self.ctx.shape[0] < n:
            self.ctx = self.ctx.new_zeros(n, self.n_context)
        at, fed = self.n_context + level.slot, level.slot + n
        ctx = self.ctx if self.ctx.shape[0] == n else self.ctx[:n]
        mask = torch.cat([ctx, level.tree_mask[:, :fed]], 1)
        rope = self.lean.rope.at(pos + 1)[pos]
        keys = narrow_keys(self.keys, at + n)
        self.out = self.lean.forward(hidden, normed, level.token, rope, self.state.cache, at,
                                     keys, mask)  # fmt: skip
        logits, self.normed = self.lean.outputs(self.out)
        return logits


@torch.inference_mode()
def grow_pool_eagle3(
    head: Eagle3Head,
    state: Eagle3State,
    tokens: list[int],
    root_position: int,
    cfg: PoolConfig,
    draw: DraftDraw | None = None,
) -> Pool:
    """One round's pool (`tokens`: the committed tokens, the root at `root_position` last)."""
    return grow_tree_pool(HeadDraft(head, state, tokens, root_position), cfg, draw)

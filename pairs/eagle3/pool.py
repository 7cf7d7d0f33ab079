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
growth loop (`tree.growth.grow_tree_pool`); on the lean forward (`pairs.eagle3.lean`) the
levels feed the drafted draft ids themselves, and the pool's tokens are mapped once.
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
from tree.lean import RoundSlots, Slots, StaticKV, chain_mask
from tree.pool import DraftDraw, Pool, level_sizes


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
def feed_pairs(head: Eagle3Head, state: Eagle3State, tokens: list[int], hi: int,
               slots: list[Slots] | None = None) -> Tensor:  # fmt: skip
    """Feed the committed pairs j in [n_fed, hi) (feature j, token j + 1). Outputs [hi - n_fed, H].

    slots: where a lean forward writes them (a round's first `tree.lean.RoundSlots`
    segment); None: the cache's own slots [n_fed, hi)."""
    lo = state.n_fed
    if cache_length(state.cache) != lo:
        raise RuntimeError(
            f"EAGLE-3 head cache holds {cache_length(state.cache)} positions, expected the "
            f"{lo} committed pairs"
        )
    feats = state.features.rows(lo, hi)
    dev = feats.device
    ids = torch.tensor(tokens[lo + 1 : hi + 1], device=dev)
    if isinstance(state.cache, StaticKV):
        lean, cache = lean_head(head), state.cache
        g = torch.mm(feats, lean.fuse_w)  # the head's fc, as F.linear computes it
        if slots is None:
            cache.reserve(hi)
            slots = cache.slots(lo, hi - lo)
        rope = lean.rope.at(hi)[lo:hi]
        mask = chain_mask(lo, hi - lo, g.dtype, dev)
        out = lean.forward(g, lean.hidden_norm(g), ids, rope, slots, mask)
        cache.length = hi
    else:
        causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=dev).tril()
        vis = tree_visibility(lo, causal[:, :0], causal)
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
                 root_position: int, cfg: PoolConfig) -> None:  # fmt: skip
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
        self.feeds_columns = self.lean is not None  # levels feed draft ids (`LeanHead.embeds`)
        self.fed = [e for _, e in level_sizes(cfg)[:-1]]  # nodes each level feeds
        # the previous level's pre-norm outputs (the root's at first), the root's hidden_norm
        self.out: Tensor | None = None
        self.normed: Tensor | None = None

    def root_logits(self, n_tree: int) -> Tensor:
        if self.lean is None:
            self.out = feed_pairs(self.head, self.state, self.tokens, self.root_position)[-1:]
            return self.head.logits(self.out)
        n, lo, cache = self.n_context, self.state.n_fed, self.state.cache
        # the pending pairs, then each level's nodes: the round's slots, split once
        self.round = RoundSlots(cache, lo, [n - lo, *self.fed])
        out = feed_pairs(self.head, self.state, self.tokens, n, self.round.segment(0, n))[-1:]
        cache.length = n + n_tree  # the round's tree slots; a level's mask hides unfed ones
        # the levels' RoPE rows: depth d sits at position r - 1 + d
        self.ropes = self.lean.rope.at(n + len(self.fed))[n : n + len(self.fed)].unbind(0)
        self.out, self.normed = out, self.lean.hidden_norm(out)
        return self.lean.outputs(out)

    def level_logits(self, level: Level) -> Tensor:
        n, end = level.token.shape[0], self.n_context + level.slot + level.token.shape[0]
        if level.prev_row is None:
            hidden = self.out.expand(n, -1)
        else:
            hidden = self.out.index_select(0, level.prev_row)
        if self.lean is None:
            pos = self.root_position - 1 + level.depth
            positions = torch.full((n,), pos, device=hidden.device)
            self.out = run_head(self.head, hidden, level.token, positions,
                                level.mask[:, :end] == 0, self.state.cache)  # fmt: skip
            return self.head.logits(self.out)
        normed = (self.normed.expand(n, -1) if level.prev_row is None
                  else self.lean.hidden_norm(hidden))  # fmt: skip
        self.out = self.lean.forward(hidden, normed, level.token, self.ropes[level.depth - 1],
                                     self.round.segment(level.depth, end), level.mask[:, :end],
                                     columns=True)  # fmt: skip
        return self.lean.outputs(self.out)


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
    return grow_tree_pool(HeadDraft(head, state, tokens, root_position, cfg), cfg, draw)

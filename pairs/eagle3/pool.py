"""Pool growth with an EAGLE-3 head: the same pool, order and ranking as `tree.pool` (SPEC §2).

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
growth loop (`tree.pool.grow_tree_pool`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from pairs.eagle3.capture import FeatureRows
from pairs.eagle3.head import Eagle3Head
from tree.attention import cache_length, compact_cache, to_attention_mask, tree_visibility
from tree.config import PoolConfig
from tree.pool import DraftDraw, Pool, grow_tree_pool, pool_size


@dataclass
class Eagle3State:
    """One prompt's drafting state beside the target's cache."""

    cache: DynamicCache  # head KV: pairs 0 .. n_fed - 1, then this round's expanded nodes
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
    out = run_head(head, head.fuse(feats), ids, torch.arange(lo, hi, device=dev), vis, state.cache)
    state.n_fed = hi
    state.features.drop_before(hi)  # fed: the head never reads these rows again
    return out


class HeadDraft:
    """A `tree.pool.TreeDraft` over an EAGLE-3 head (see the module doc)."""

    def __init__(
        self,
        head: Eagle3Head,
        state: Eagle3State,
        tokens: list[int],
        root_position: int,
        n_pool: int,
    ) -> None:
        if root_position <= state.n_fed:
            raise ValueError(
                f"EAGLE-3 drafting: the root sits at position {root_position} but the head has "
                f"fed {state.n_fed} pairs; a round needs the pair (feature of the token before "
                "the root, root) still pending"
            )
        self.head, self.state, self.tokens, self.root_position = head, state, tokens, root_position
        self.n_context = root_position  # pairs 0 .. r - 1 (the root's pair is the last)
        self.token_ids = head.token_ids
        self.n_pool = n_pool
        self.root_out: Tensor | None = None
        self.node_out: Tensor | None = None  # [P, H] pre-norm output of every fed node

    def root_logits(self) -> Tensor:
        out = feed_pairs(self.head, self.state, self.tokens, self.root_position)
        self.root_out = out[-1]
        self.node_out = out.new_zeros(self.n_pool, out.shape[-1])
        return self.head.logits(out[-1:])

    def level_logits(self, nodes, token, parent, depth, visible) -> Tensor:
        from_root = (parent < 0)[:, None]
        hidden = torch.where(from_root, self.root_out, self.node_out[parent.clamp(min=0)])
        out = run_head(
            self.head, hidden, token, self.root_position - 1 + depth, visible, self.state.cache
        )
        self.node_out[nodes] = out
        return self.head.logits(out)


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
    draft = HeadDraft(head, state, tokens, root_position, pool_size(cfg))
    return grow_tree_pool(draft, cfg, draw)

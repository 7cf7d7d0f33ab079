"""Root-pass decoders (docs/method.md#rule-values, paper App. D.3) and the covering decoder (App. D.10).

A root-pass round runs two target passes:

    root pass : the root token alone -> the root row p(. | c); appends the root's KV
    tree pass : the selected tree (plus extra scored prefixes), the root already cached

The first draw X1 ~ p_T(. | c) (greedy: the argmax) is taken from the root row
as soon as it exists; the rest of the traversal is the ordinary verifier's.
Rules, given the pool, the draft ranking and the root row:

    root      : rank by log p(x1|c) + log q(x2) + ...; keep the top B. If X1 labels no
                first-level tree node, X1 is the continuation and the tree pass is skipped.
    root-draw : g = the first-level node labelled X1; keep g and its B-1 best draft-ranked
                descendants. Value counts the draw: 1 + accepted descendants.
    PEARL     : keep the part of draft selection's B-tree below g (g alone if the tree
                lacks it).
    draw rules: when X1 is not a first-level candidate, the tree is X1 alone: the tree
                pass scores X1 (one batch row outside the pool, at depth 1) and the round
                emits X1 and its continuation (App. D.3).

The covering decoder runs one pass per round: draft selection's tree with the
root in the batch, except that after a covered round (the traversal's exit
draw labelled a *leaf* of the tree: that leaf is emitted as the continuation,
not accepted, and its row from the same pass is the next root row) the next
round draws X1 from that row and keeps root-draw selection's tree (X1 alone when the
first level lacks X1: X1 then labels the tree's only leaf, so it is emitted as the
continuation and its row, from this round's pass, is held in turn). Every emitted token
comes from a pass.

Every draw is from the exact target row of its address, so each decoder emits
the target's law (greedy: the target's greedy output), token for token.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from selection.ranking import Levels, first_level_ancestor, path_sum, rank_candidates, top_b
from tree.attention import forward_chain, forward_tree, tree_visibility
from tree.pool import Pool
from tree.verify import row_logprobs

DRAW_TREES = ("descendants", "draft_tree")  # selection.rules.Rule.draw_tree


@torch.inference_mode()
def root_pass(target: PreTrainedModel, cache: DynamicCache, root: int) -> Tensor:
    """One-token target pass on the root: its row [1, V] (model dtype); caches the root's KV."""
    ids = torch.tensor([root], device=target.device)
    return forward_chain(target, ids, cache, logits_to_keep=1)


def draw_root(root_logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """X1 from the root row: argmax at T=0, else one draw from p_T. [1] int64 (on the device)."""
    if temperature == 0:
        return root_logits[0].argmax(-1, keepdim=True)
    return torch.multinomial(row_logprobs(root_logits, temperature).exp(), 1, generator=generator)[
        0
    ]


def root_first_factor(root_logits: Tensor, first_tokens: Tensor, temperature: float) -> Tensor:
    """log p(x1 | c) of the first-level candidates under the law. [n1] float32.

    Greedy: the point mass (0 for the argmax, -inf else; docs/method.md#rule-values). Sampling:
    log(exp(log p)) in float32 -- the very ops by which a trace stores
    cand_target_prob and the offline evaluator takes its log, so online and
    offline root selection rank identically (not merely up to rounding).
    """
    if temperature == 0:
        hit = first_tokens == root_logits[0].argmax(-1)
        return torch.where(hit, 0.0, float("-inf"))
    return torch.log(row_logprobs(root_logits, temperature)[0, first_tokens].exp())


def factor_scores(pool: Pool, first_logprob: Tensor, levels: Levels) -> Tensor:
    """Scores with the depth-1 factor replaced: log r(x1) + log q(x2) + ... [P] float32."""
    first = torch.zeros_like(pool.draft_logprob)
    first[: pool.n_first] = first_logprob
    edge = torch.where(pool.depth == 1, first, pool.draft_logprob)
    return path_sum(edge[None], pool.parent[None], levels)[0]


def rank_of(score: Tensor) -> Tensor:
    """Rank of every candidate by the ranking tie-break (docs/method.md#ranking) (0 = kept first). [P] int64."""
    return rank_candidates(score[None])[0]


def draw_tree(
    pool: Pool,
    kind: str,
    draw: Tensor,
    draft_score: Tensor,
    draft_rank: Tensor,
    budget: int,
    levels: Levels,
) -> Tensor:
    """The pool nodes a draw rule keeps once X1 = `draw` is known. [P] bool.

    Empty when X1 is off the first level: the tree is then X1 alone, outside the pool
    (`decode.tree_pass`).

    kind (a rule's `draw_tree`, `selection.rules`):
    descendants: g and its budget-1 best draft-ranked descendants (ties as docs/method.md#pool; root-draw).
    draft_tree : draft selection's B-tree restricted to g's subtree (g alone if absent; PEARL).
    """
    is_g = torch.zeros_like(pool.expanded)
    is_g[: pool.n_first] = pool.token[: pool.n_first] == draw  # at most one (distinct siblings)
    anc = first_level_ancestor(pool.parent[None], levels)[0]  # [P] depth-1 ancestor
    under_g = is_g[anc]  # [P] g and its descendants
    if kind == "descendants":
        below = under_g & (pool.depth >= 2)
        kept = top_b(draft_score[None], max(budget - 1, 0), below[None])[0]
        return is_g | kept
    if kind == "draft_tree":
        return is_g | (under_g & (draft_rank < budget))
    raise ValueError(f"draw_tree: kind must be one of {list(DRAW_TREES)}. Got {kind!r} instead.")


@torch.inference_mode()
def cached_root_tree_pass(
    target: PreTrainedModel,
    cache: DynamicCache,
    root_position: int,
    pool: Pool,
    scored_idx: Tensor,
    alone: Tensor | None = None,
) -> Tensor:
    """Target logits at every scored prefix when the root's KV is already cached. [|Q| (+1), V].

    The cache holds the context and the root (root_position + 1 tokens); each
    node sees all of them and its own ancestors, at position root_position + depth.
    `alone` ([1], a token off the pool's first level: the draw X1 verified alone) is
    batched last at depth 1: it sees the context, the root and itself, and no scored
    prefix sees it; its row is the last one returned.
    """
    anc = pool.anc[scored_idx][:, scored_idx]  # [|Q|, |Q|]
    tokens, pos = pool.token[scored_idx], root_position + pool.depth[scored_idx]
    if alone is not None:
        n = anc.shape[0]
        grown = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=anc.device)
        grown[:n, :n] = anc
        grown[n, n] = True
        anc, tokens = grown, torch.cat([tokens, alone])
        pos = torch.cat([pos, pos.new_tensor([root_position + 1])])
    vis = tree_visibility(root_position + 1, anc[:, :0], anc)
    return forward_tree(target, tokens, pos, vis, cache)


def tree_leaves(pool: Pool, in_tree: Tensor) -> Tensor:
    """Tree nodes without a child in the tree. [P] bool."""
    kids = (in_tree & (pool.parent >= 0)).long()  # [P]
    # index_add, not boolean indexing: no host sync
    n_kids = torch.zeros_like(kids).index_add_(0, pool.parent.clamp(min=0), kids)
    return in_tree & (n_kids == 0)

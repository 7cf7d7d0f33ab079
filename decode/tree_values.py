"""Expected acceptance of selection rules on recorded pools (SPEC §6), batched.

Value of a tree: V(T) = sum over non-root u in T of P(u), with P the target
path probability under the round's law (greedy: 1 on the argmax path, else 0).
Every rule builds its tree from the same pool and is scored with the exact
target probabilities of the trace, so differences are due to selection alone.

One stable sort per rule gives the rank of every candidate; the cumulative sum
of path probabilities in rank order then gives the rule's value at *every*
budget at once (`V(B) = cumsum[B - 1]`). Root-draw and PEARL-style values are
exact expectations over the first draw, not samples:

    root-draw(B)   = 1 + sum_g sum_{u below g, among g's B-1 best-ranked} P(u)
    PEARL(B)       = 1 + sum_{u in draft tree T_B, depth(u) >= 2} P(u)
    PEARL-commit(B)= 1 + sum_{u below g*, among g*'s B-1 best-ranked} P(u)

where g runs over first-level candidates, g* is the drafter's top first-level
candidate and P(u) includes the first factor p(g|c): the draw itself counts
one accepted token whatever it is, and a draw outside the first level keeps
that token alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from decode.pool_batch import PoolBatch
from decode.select import (
    Levels,
    draft_scores,
    first_level_ancestor,
    path_product,
    path_sum,
    pool_levels,
    rank_order,
    ranking_keys,
    restrict_to_top_m,
)

# Rules scored by a replaced per-edge log factor (SPEC §6 table).
FACTOR_RULES = ("draft", "root", "root_softmax", "depth_two", "oracle")
# Rules that draw the first token from the root row before selecting.
DRAW_RULES = ("root_draw", "pearl", "pearl_commit")
RULES = FACTOR_RULES + DRAW_RULES


@dataclass
class PoolContext:
    """Per-batch quantities every rule shares, computed once. [R, P] unless noted."""

    pool: PoolBatch
    levels: Levels | None  # fast path-reduction layout, None for ragged pools
    law: Tensor  # per-edge target probability under each round's law
    log_law: Tensor  # its log (log 0 = -inf ranks last, SPEC §6)
    first_ancestor: Tensor  # int64 pool index of the depth-1 ancestor
    draft: Tensor  # cumulative draft log-probability (the draft rule's score)
    valid: Tensor  # bool: in the pool and inside the top-M restriction
    path_prob: Tensor  # P(u) under the law, 0 outside `valid`
    draft_keys: Tensor  # int64 ranking keys of the draft scores (see select.ranking_keys)


def pool_context(pool: PoolBatch, top_m: int = 0) -> PoolContext:
    levels = pool_levels(pool.parent, pool.depth)
    law = pool.law_edge_prob()
    draft = draft_scores(pool.draft_logprob, pool.parent, levels)
    valid = restrict_to_top_m(draft, top_m, pool.valid)
    return PoolContext(
        pool=pool,
        levels=levels,
        law=law,
        log_law=torch.log(law),
        first_ancestor=first_level_ancestor(pool.parent, levels),
        draft=draft,
        valid=valid,
        path_prob=path_product(law, pool.parent, levels) * valid,
        draft_keys=ranking_keys(draft, valid),
    )


def rule_scores(ctx: PoolContext, rule: str) -> Tensor:
    """Candidate scores of a factor rule: path sums of its per-edge log factors. [R, P]."""
    pool = ctx.pool
    if rule == "draft":
        return ctx.draft
    if rule == "oracle":  # log of the path probability: no second path reduction
        return torch.log(ctx.path_prob)
    if rule == "root":
        edge = torch.where(pool.depth == 1, ctx.log_law, pool.draft_logprob)
    elif rule == "root_softmax":  # greedy rounds ranked by the unit-temperature softmax
        edge = torch.where(pool.depth == 1, torch.log(pool.target_prob), pool.draft_logprob)
    elif rule == "depth_two":
        edge = torch.where(pool.depth <= 2, ctx.log_law, pool.draft_logprob)
    else:
        raise ValueError(f"The 'rule' must be one of {FACTOR_RULES}. Got {rule!r} instead.")
    return path_sum(edge, pool.parent, ctx.levels)


def values_at_budgets(order: Tensor, path_prob: Tensor, budgets: Sequence[int]) -> Tensor:
    """V(top-B) for each budget, given a rule's best-first order. [R, n_budgets].

    `order` may hold only the first k indices (k >= max budget, or the whole
    pool); budgets beyond the valid pool keep the whole pool, since padding and
    candidates outside a top-M restriction carry zero path mass.
    """
    mass = torch.cumsum(torch.gather(path_prob, -1, order), dim=-1)  # [R, k]
    idx = torch.tensor([min(b, order.shape[-1]) - 1 for b in budgets], device=order.device)
    out = mass[:, idx.clamp(min=0)]
    return torch.where(idx >= 0, out, torch.zeros_like(out))  # B = 0: the empty tree


def subtree_ranks(ctx: PoolContext) -> tuple[Tensor, Tensor, Tensor]:
    """Candidates grouped by first-level subtree, each group in draft order.

    Returns (perm, below, rank_below), each [R, P]: `perm` sorts the pool by
    (first-level ancestor, draft rank) with depth-1 and invalid entries last;
    `below` marks valid candidates of depth >= 2 (in perm order); `rank_below`
    is each entry's rank among the candidates below the same first-level
    candidate. One sort of unique composite int64 keys does all of it.
    """
    n_rounds, width = ctx.pool.shape
    index_bits = max(1, (width - 1).bit_length())
    if 32 + index_bits + width.bit_length() > 63:
        raise ValueError(f"pools of {width} candidates are too wide for 63-bit subtree keys")
    below = (ctx.pool.depth >= 2) & ctx.valid
    group = torch.where(below, ctx.first_ancestor, width)  # sentinel group `width` sorts last
    score_desc = 0x7FFFFFFF - (ctx.draft_keys >> 32)  # in [0, 2^32)
    positions = torch.arange(width, device=group.device).expand(n_rounds, width)
    key = (group << (32 + index_bits)) | (score_desc << index_bits) | positions
    # keys are unique, so numpy's fast unstable sort is exact (see select.rank_order)
    perm = (
        torch.from_numpy(np.argsort(key.numpy(), axis=-1))
        if key.device.type == "cpu"
        else torch.sort(key, dim=-1).indices
    )
    group_sorted = torch.gather(group, -1, perm)
    starts = torch.ones_like(below)
    starts[:, 1:] = group_sorted[:, 1:] != group_sorted[:, :-1]
    start_pos = torch.cummax(torch.where(starts, positions, 0), dim=-1).values
    return perm, group_sorted < width, positions - start_pos


def _mass_by_rank(values: Tensor, rank: Tensor, mask: Tensor) -> Tensor:
    """Cumulative mass of masked entries by within-subtree rank: out[:, r] = sum(rank <= r). [R, P]."""
    binned = torch.zeros_like(values).scatter_add_(-1, rank, values * mask)
    return torch.cumsum(binned, dim=-1)


def draw_values(ctx: PoolContext, top_first: Tensor, budgets: Sequence[int]) -> dict[str, Tensor]:
    """Root-draw and PEARL-commit values and expected tree sizes. [R, n_budgets] each.

    Root-draw keeps, below whichever first-level g is drawn, g's b-1 best-ranked
    descendants; PEARL-commit keeps them only below the drafter's top g*.
    """
    perm, below, rank = subtree_ranks(ctx)
    path_prob = torch.gather(ctx.path_prob, -1, perm)
    anc = torch.gather(ctx.first_ancestor, -1, perm)
    first_prob = torch.gather(ctx.law, -1, anc)  # p(g|c) of each entry's subtree root
    under_top = below & (anc == top_first[:, None])
    curves = {
        "root_draw": _mass_by_rank(path_prob, rank, below),
        "size/root_draw": _mass_by_rank(first_prob, rank, below),
        "pearl_commit": _mass_by_rank(path_prob, rank, under_top),
        "size/pearl_commit": _mass_by_rank(first_prob, rank, under_top),
    }
    for b in budgets:
        if b < 1:
            raise ValueError(f"Draw rules need a budget >= 1 (the drawn token). Got {b} instead.")
    width = ctx.pool.shape[1]
    idx = torch.tensor([min(b - 1, width) - 1 for b in budgets])  # b-1 kept below g
    out = {}
    for name, cum in curves.items():
        taken = cum[:, idx.clamp(min=0)]
        out[name] = 1 + torch.where(idx >= 0, taken, torch.zeros_like(taken))
    return out


def pearl_curves(ctx: PoolContext, draft_order: Tensor) -> tuple[Tensor, Tensor]:
    """PEARL value and expected tree size at pre-draw budgets b = 1..k. [R, k] each.

    PEARL keeps the part of the draft tree T_b below the drawn first token, so
    value(b) = 1 + sum of P(u) over depth>=2 members of T_b, and the expected
    size adds p(g|c) for each such u below g.
    """
    below = ((ctx.pool.depth >= 2) & ctx.valid).float()
    first_prob = torch.gather(ctx.law, -1, ctx.first_ancestor)
    value = 1 + torch.cumsum(torch.gather(ctx.path_prob * below, -1, draft_order), dim=-1)
    size = 1 + torch.cumsum(torch.gather(first_prob * below, -1, draft_order), dim=-1)
    return value, size


def matched_budget(mean_size_curve: Tensor, target_size: float) -> tuple[int, int, float]:
    """Fractional pre-draw budget whose mean PEARL tree size equals `target_size`.

    Returns (b_lo, b_hi, w): mix w of budget b_lo with 1 - w of b_hi (1-based).
    The size curve is non-decreasing in the budget.
    """
    curve = mean_size_curve.double()
    if target_size <= curve[0]:
        return 1, 1, 1.0
    if target_size > curve[-1]:
        raise ValueError(
            f"PEARL trees cannot reach mean size {target_size:.3f} within the pool "
            f"(largest mean size {curve[-1].item():.3f} at budget {len(curve)})"
        )
    hi = int(torch.searchsorted(curve, torch.tensor([target_size], dtype=curve.dtype)).item())
    lo = hi - 1
    span = (curve[hi] - curve[lo]).item()
    w = 1.0 if span == 0 else (curve[hi].item() - target_size) / span
    return lo + 1, hi + 1, w


def evaluate_pools(
    pool: PoolBatch,
    budgets: Sequence[int],
    rules: Sequence[str] = RULES,
    top_m: int = 0,
    extra_scores: dict[str, Tensor] | None = None,
    pearl_curve: bool = False,
) -> dict[str, Tensor]:
    """Value of every rule at every budget for each round: {rule: [R, n_budgets]}.

    `extra_scores` adds rules given directly as candidate scores (reranker,
    calibrated, substituted...), each [R, P] and non-increasing along paths.
    Draw rules also report `size/<rule>` (expected verified nodes). `top_m` > 0
    restricts every rule to the M highest-ranked candidates of the pool.
    `pearl_curve` adds `curve/pearl` and `curve/size/pearl`: PEARL's value and
    expected tree size at every pre-draw budget 1..P ([R, P] each), from which
    the matched-size variant is found (`matched_budget`).
    """
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        raise ValueError(f"Unknown rule(s) {unknown}; known rules are {list(RULES)}")
    if not budgets or min(budgets) < 0:
        raise ValueError(f"The 'budgets' must be a non-empty list of ints >= 0. Got {budgets}.")
    ctx = pool_context(pool, top_m)
    k = max(budgets)
    full = rank_order(ctx.draft, ctx.valid, keys=ctx.draft_keys) if pearl_curve else None
    draft_order = (
        full if full is not None else rank_order(ctx.draft, ctx.valid, k=k, keys=ctx.draft_keys)
    )
    out: dict[str, Tensor] = {}
    scores = {r: None for r in rules if r in FACTOR_RULES} | dict(extra_scores or {})
    for name, score in scores.items():
        order = (
            draft_order
            if name == "draft"
            else rank_order(rule_scores(ctx, name) if score is None else score, ctx.valid, k=k)
        )
        out[name] = values_at_budgets(order, ctx.path_prob, budgets)
    if "pearl" in rules or pearl_curve:
        value, size = pearl_curves(ctx, draft_order)
        idx = [min(b, value.shape[-1]) - 1 for b in budgets]
        out["pearl"], out["size/pearl"] = value[:, idx], size[:, idx]
        if pearl_curve:
            out["curve/pearl"], out["curve/size/pearl"] = value, size
    if "root_draw" in rules or "pearl_commit" in rules:
        drawn = draw_values(ctx, draft_order[:, 0], budgets)  # draft rank 0 is a depth-1 node
        out.update({name: v for name, v in drawn.items() if name.split("/")[-1] in rules})
    return out

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
    draft_scores,
    first_level_ancestor,
    path_product,
    path_sum,
    rank_order,
    ranking_keys,
    restrict_to_top_m,
)

# Rules scored by a replaced per-edge log factor (SPEC §6 table).
FACTOR_RULES = ("draft", "root", "root_softmax", "depth_two", "oracle")
# Rules that draw the first token from the root row before selecting.
DRAW_RULES = ("root_draw", "pearl", "pearl_commit")
RULES = FACTOR_RULES + DRAW_RULES


def rule_edge_logfactors(pool: PoolBatch, rule: str) -> Tensor:
    """Per-edge log factors whose path sums are the rule's scores. [R, P]."""
    log_law = torch.log(pool.law_edge_prob())  # log 0 = -inf ranks last (SPEC §6)
    if rule == "draft":
        return pool.draft_logprob
    if rule == "root":
        return torch.where(pool.depth == 1, log_law, pool.draft_logprob)
    if rule == "root_softmax":  # greedy rounds ranked by the unit-temperature softmax
        return torch.where(pool.depth == 1, torch.log(pool.target_prob), pool.draft_logprob)
    if rule == "depth_two":
        return torch.where(pool.depth <= 2, log_law, pool.draft_logprob)
    if rule == "oracle":
        return log_law
    raise ValueError(f"The 'rule' must be one of {FACTOR_RULES}. Got {rule!r} instead.")


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


@dataclass
class SubtreeTerms:
    """Candidates below each first-level candidate, grouped by subtree, [R, P] each.

    Entries are sorted by (first-level ancestor, draft rank); depth-1 and
    invalid entries come last with `below = False`.
    """

    path_prob: Tensor  # P(u), law path probability
    first_prob: Tensor  # law probability of u's first-level ancestor g: p(g|c)
    below: Tensor  # bool: a valid candidate of depth >= 2
    rank_below: Tensor  # rank of u among the candidates below g, in draft order
    under_top: Tensor  # bool: g is the drafter's top first-level candidate


def subtree_terms(
    pool: PoolBatch, draft_score: Tensor, valid: Tensor, path_prob: Tensor, top_first: Tensor
) -> SubtreeTerms:
    """Group candidates by first-level subtree with one sort of composite keys."""
    n_rounds, width = pool.shape
    index_bits = max(1, (width - 1).bit_length())
    group_bits = width.bit_length()
    if 32 + index_bits + group_bits > 63:
        raise ValueError(f"pools of {width} candidates are too wide for 63-bit subtree keys")
    anc = first_level_ancestor(pool.parent, pool.depth)  # [R, P]
    below = (pool.depth >= 2) & valid
    group = torch.where(below, anc, width)  # sentinel group `width` sorts last
    score_desc = 0x7FFFFFFF - (ranking_keys(draft_score, valid) >> 32)  # in [0, 2^32)
    positions = torch.arange(width, device=anc.device).expand(n_rounds, width)
    key = (group << (32 + index_bits)) | (score_desc << index_bits) | positions
    # keys are unique, so the fast unstable sort is exact (see select.rank_order)
    perm = (
        torch.from_numpy(np.argsort(key.numpy(), axis=-1))
        if key.device.type == "cpu"
        else torch.sort(key, dim=-1).indices
    )
    group_sorted = torch.gather(group, -1, perm)
    starts = torch.ones_like(below)
    starts[:, 1:] = group_sorted[:, 1:] != group_sorted[:, :-1]
    start_pos = torch.cummax(torch.where(starts, positions, 0), dim=-1).values
    anc_sorted = torch.gather(anc, -1, perm)
    return SubtreeTerms(
        path_prob=torch.gather(path_prob, -1, perm),
        first_prob=torch.gather(torch.gather(pool.law_edge_prob(), -1, anc), -1, perm),
        below=torch.gather(below, -1, perm),
        rank_below=positions - start_pos,
        under_top=anc_sorted == top_first[:, None],
    )


def draw_values(terms: SubtreeTerms, budgets: Sequence[int]) -> dict[str, Tensor]:
    """Root-draw and PEARL-commit values and expected tree sizes. [R, n_budgets] each."""
    mass = terms.path_prob * terms.below
    size = terms.first_prob * terms.below
    cols: dict[str, list[Tensor]] = {}
    for b in budgets:
        if b < 1:
            raise ValueError(f"Draw rules need a budget >= 1 (the drawn token). Got {b} instead.")
        kept = terms.rank_below < (b - 1)  # the b-1 best-ranked candidates below each g
        commit = kept & terms.under_top
        for name, m in (("root_draw", kept), ("pearl_commit", commit)):
            cols.setdefault(name, []).append(1 + (mass * m).sum(-1))
            cols.setdefault(f"size/{name}", []).append(1 + (size * m).sum(-1))
    return {k: torch.stack(v, dim=-1) for k, v in cols.items()}


def pearl_curves(
    pool: PoolBatch, draft_order: Tensor, path_prob: Tensor, valid: Tensor
) -> tuple[Tensor, Tensor]:
    """PEARL value and expected tree size at every pre-draw budget b = 1..k. [R, k] each.

    PEARL keeps the part of the draft tree T_b below the drawn first token, so
    value(b) = 1 + sum of P(u) over depth>=2 members of T_b, and the expected
    size adds p(g|c) for each such u below g.
    """
    anc = first_level_ancestor(pool.parent, pool.depth)
    first_prob = torch.gather(pool.law_edge_prob(), -1, anc)
    below = ((pool.depth >= 2) & valid).float()
    value = 1 + torch.cumsum(torch.gather(path_prob * below, -1, draft_order), dim=-1)
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
) -> dict[str, Tensor]:
    """Value of every rule at every budget for each round: {rule: [R, n_budgets]}.

    `extra_scores` adds rules given directly as candidate scores (reranker,
    calibrated, substituted...), each [R, P] and non-increasing along paths.
    Draw rules also report `size/<rule>` (expected verified nodes). `top_m` > 0
    restricts every rule to the M highest-ranked candidates of the pool.
    """
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        raise ValueError(f"Unknown rule(s) {unknown}; known rules are {list(RULES)}")
    if not budgets or min(budgets) < 0:
        raise ValueError(f"The 'budgets' must be a non-empty list of ints >= 0. Got {budgets}.")
    law = pool.law_edge_prob()
    draft = draft_scores(pool.draft_logprob, pool.parent, pool.depth)
    valid = restrict_to_top_m(draft, top_m, pool.valid)
    path_prob = path_product(law, pool.parent, pool.depth) * valid
    k = max(budgets)
    draft_order = rank_order(draft, valid, k=k)
    out: dict[str, Tensor] = {}
    for rule in rules:
        if rule == "draft":
            order = draft_order
        elif rule == "oracle":  # log of the path probability: one product, no extra sum
            order = rank_order(torch.log(path_prob), valid, k=k)
        elif rule in FACTOR_RULES:
            score = path_sum(rule_edge_logfactors(pool, rule), pool.parent, pool.depth)
            order = rank_order(score, valid, k=k)
        else:
            continue
        out[rule] = values_at_budgets(order, path_prob, budgets)
    for name, score in (extra_scores or {}).items():
        out[name] = values_at_budgets(rank_order(score, valid, k=k), path_prob, budgets)
    if "pearl" in rules:
        value, size = pearl_curves(pool, draft_order, path_prob, valid)
        idx = [min(b, value.shape[-1]) - 1 for b in budgets]
        out["pearl"], out["size/pearl"] = value[:, idx], size[:, idx]
    if "root_draw" in rules or "pearl_commit" in rules:
        top_first = draft_order[:, 0]  # draft rank 0 is a depth-1 candidate
        terms = subtree_terms(pool, draft, valid, path_prob, top_first)
        drawn = draw_values(terms, budgets)
        out.update({k_: v for k_, v in drawn.items() if k_.split("/")[-1] in rules})
    return out

"""Expected acceptance of selection rules on recorded pools (docs/method.md#rule-values), batched.

Value of a tree: V(T) = sum over non-root u in T of P(u), with P the target
path probability under the round's law (greedy: 1 on the argmax path, else 0).
Every rule builds its tree from the same pool and is scored with the exact
target probabilities of the trace, so differences are due to selection alone. A rule's
offline route (`selection.routes`) says how: ranked by its `scores` (on the compiled route
by its `lead` factors when it has them), or a draw rule's exact expectation
(`selection.draws`); the rules and their routes are `selection.rules`' entries.

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

import numpy as np
import torch
from torch import Tensor

from selection import fused
from selection.context import PoolContext, pool_context
from selection.draws import draw_values, pearl_curves
from selection.pool_batch import PoolBatch
from selection.ranking import (
    NAN_SCORES_MESSAGE,
    compiled_route,
    kernel_valid,
    leading_factor_edges,
    path_sum,
    rank_order,
)
from selection.routes import OfflineRoute
from selection.rules import FACTOR_RULES, PEARL, POOL_RULES
from selection.rules import rule as rule_entry


def rule_scores(ctx: PoolContext, name: str) -> Tensor:
    """Candidate scores of a factor rule: its offline route's `scores` (path sums of its
    per-edge log factors, or any scores non-increasing along paths). [R, P]."""
    route = _pool_route(name)
    if route is None or route.scores is None:
        raise ValueError(f"The 'rule' must be one of {FACTOR_RULES}. Got {name!r} instead.")
    return route.scores(ctx, rule_entry(name))


def _pool_route(name: str) -> OfflineRoute | None:
    """The offline route of a rule computed from the pool alone (a shipped one, or one added
    to `selection.rules.RULES`); None for any other name (a given factor or score)."""
    try:
        route = rule_entry(name).offline
    except ValueError:
        return None
    return route if route is not None and route.from_pool else None


def _law_twin(name: str) -> str | None:
    """The rule of the same lead route that ranks like softmax rule `name` under sampling
    (the row at T is the law there): same depths, the law's probabilities."""
    entry = rule_entry(name)
    if not entry.lead_softmax:
        return None
    return next(n for n in POOL_RULES if (e := rule_entry(n)).offline is entry.offline
                and not e.lead_softmax and e.lead_depth == entry.lead_depth)  # fmt: skip


def lead_factor_scores(ctx: PoolContext, lead: Tensor, upto: int = 1) -> Tensor:
    """Scores with the factors at depths <= upto replaced by `lead` where not NaN. [R, P].

    `lead` covers the leading pool columns ([R, n], n <= P; NaN keeps the draft factor).
    """
    pool = ctx.pool
    width = pool.shape[1]
    if lead.shape[1] < width:
        lead = torch.cat(
            [lead, lead.new_full((lead.shape[0], width - lead.shape[1]), torch.nan)], 1
        )
    edge = leading_factor_edges(pool.draft_logprob, lead, pool.depth, upto, ctx.levels)
    return path_sum(edge, pool.parent, ctx.levels)


def _fused_values(
    ctx: PoolContext,
    lead: Tensor | Sequence[Tensor],
    upto: int,
    budgets: Sequence[int],
    k: int,
    curve: bool,
    src: tuple[Tensor, Tensor | None],
    copy: Tensor | None = None,
    nan_copies: bool = False,
    scan: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`rules_lead_values` (one compiled pass: scores, top k, values) for a pool with levels.

    `src` (values [R, n_budgets], whole curve [R, P] or None) of a rule that ranks like
    this one in the rounds `copy` (and, with `nan_copies`, where `lead` is all NaN).
    Rounds whose mass sits on few candidates rank only those (`ctx.sparse_mass`).
    `scan`, the draft order of the whole pool (of `ctx.draft`) when known: the top-k heap
    scans in it, and stops where no later candidate can enter.
    `lead` a list of J rules' factors (the same `src` and `copy` for each): their values
    stacked ([J, R, n_budgets], curves [J, R, P] or None) from one pass over the rounds
    (`fused.rules_lead_values`).
    """
    leads = [lead] if isinstance(lead, Tensor) else list(lead)
    end = ctx.levels[min(upto, len(ctx.levels)) - 1][1]
    width = ctx.pool.shape[1]
    k = width if curve else min(k, width)
    valid, has_valid = kernel_valid(ctx.restrict, ctx.draft)
    at = np.asarray([min(b, k) - 1 for b in budgets], dtype=np.int64)
    n = ctx.pool.shape[0]
    src_values, src_curve = src
    if curve and src_curve is None:  # nothing to copy a curve from: compute every round
        copy, nan_copies = None, False
    values, cum, status = fused.rules_lead_values(
        ctx.pool.draft_logprob.contiguous().numpy(),
        ctx.pool.parent.contiguous().numpy(),
        _stacked([x[:, :end].float() for x in leads]),
        ctx.path_prob.contiguous().numpy(),
        valid,
        has_valid,
        k,
        at,
        curve,
        np.zeros(n, np.bool_) if copy is None else copy.contiguous().numpy(),
        nan_copies,
        src_values.float().contiguous().numpy(),
        np.zeros((0, 0), np.float32) if src_curve is None else src_curve.contiguous().numpy(),
        *ctx.sparse_mass,
        np.zeros((1, 0), np.int64) if scan is None else scan.contiguous().numpy(),
        np.zeros((1, 0), np.float32) if scan is None else ctx.draft.contiguous().numpy(),
    )
    if status == 2:
        raise ValueError(NAN_SCORES_MESSAGE)
    if status:  # levels guarantee pool order; a failure here is a bug upstream
        raise ValueError("pool layout changed between pool_levels and scoring")
    values, cum = torch.from_numpy(values), torch.from_numpy(cum) if curve else None
    if isinstance(lead, Tensor):
        return values[0], None if cum is None else cum[0]
    return values, cum


def _stacked(leads: list[Tensor]) -> np.ndarray:
    """[J, R, L] of rules' leading factors, those narrower than the widest padded with NaN
    (the draft factor: the same scores)."""
    width = max(x.shape[1] for x in leads)
    out = torch.full((len(leads), leads[0].shape[0], width), torch.nan, dtype=torch.float32)
    for j, x in enumerate(leads):
        out[j, :, : x.shape[1]] = x
    return out.numpy()


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


def evaluate_pools(
    pool: PoolBatch,
    budgets: Sequence[int],
    rules: Sequence[str] = POOL_RULES,
    top_m: int = 0,
    extra_scores: dict[str, Tensor] | None = None,
    curves: bool = False,
    curve_rules: Sequence[str] = (),
    first_factors: dict[str, Tensor] | None = None,
    ctx: PoolContext | None = None,
    draft_order: Tensor | None = None,
    pearl: tuple[Tensor, Tensor] | None = None,
    edge_factors: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """Value of every rule at every budget for each round: {rule: [R, n_budgets]}.

    `extra_scores` adds rules given directly as candidate scores (per-depth
    calibrated...), each [R, P] and non-increasing along paths; `first_factors`
    rules given by their first-level log factor (reranker, calibrated, substituted,
    root after a covered round...), each [R, n] over the leading pool columns
    (n <= P; entries at depth-1 candidates are read, NaN keeps the draft factor,
    values <= 0). On CPU pools with a shared depth layout a first-factor rule
    (and root, root_softmax, depth_two) is scored, ranked and valued in one
    compiled pass (`fused.rules_lead_values`), which gives what its scores
    would (`tests/test_select_kernels.py`). `edge_factors` adds rules given by every
    edge's log factor ([R, P], -inf outside the pool; per-depth calibrated), valued as their
    path sums (`path_sum`) would be, in that pass too. `ctx` and `draft_order` (the whole
    pool's, or at least max(budgets)) may be passed when the caller built them
    (`pool_context(pool, top_m)`, `rank_order(ctx.draft, ctx.restrict)`), and
    `pearl`, `pearl_curves(ctx, draft_order)` of that whole-pool order.
    Draw rules also report `size/<rule>` (expected verified nodes). `top_m` > 0
    restricts every rule to the M highest-ranked candidates of the pool.
    `curves` adds values at every budget 1..P ([R, P] each): `curve/pearl` and
    `curve/size/pearl`, PEARL's value and expected tree size at each pre-draw
    budget, from which the matched-size variant is found (`matched_budget`);
    and `curve/draft`, draft selection's value, from which node-equivalent
    budgets are found (docs/method.md#reporting: the smallest budget at which draft selection
    reaches a rule's value); with `curve_rules`, `curve/<rule>` for each of those
    rules too (the budget at which the rule reaches draft's value, paper Table 13).
    """
    _check_rules_and_budgets(rules, budgets)
    ctx = pool_context(pool, top_m) if ctx is None else ctx
    one_pass = compiled_route(ctx.draft) and ctx.levels is not None
    edges, extra_scores = _edge_rules(pool, one_pass, edge_factors, extra_scores)
    k = max(budgets)
    draft_order = _draft_order(ctx, pool.shape[1], k, curves, draft_order)
    whole_order = draft_order if draft_order.shape[1] == pool.shape[1] else None
    out: dict[str, Tensor] = {}
    firsts = dict(first_factors or {})
    names = [r for r in rules if _pool_route(r).scores is not None] + list(firsts) + list(edges)
    names += list(extra_scores or {})
    draft_values = values_at_budgets(draft_order, ctx.path_prob, budgets)
    draft_curve = None
    if curves:
        draft_curve = torch.cumsum(torch.gather(ctx.path_prob, -1, draft_order), dim=-1)
    batched = {}
    if one_pass:
        batched = _first_factor_passes(ctx, firsts, curve_rules if curves else (), budgets, k,
                                       (draft_values, draft_curve), whole_order)  # fmt: skip
    for name in names:  # the order of the output: factor rules, first factors, scores
        full = curves and name in curve_rules  # its whole order: a value at every budget
        route = _pool_route(name)
        if route is not None and route.draft_order:
            out[name] = draft_values
            continue
        if name in batched:
            out[name], cum = batched[name]
        elif name in edges:  # every level's factors replaced: the path sums of `path_sum`
            out[name], cum = _fused_values(ctx, edges[name], len(ctx.levels), budgets, k, full,
                                           (draft_values, draft_curve), scan=whole_order)  # fmt: skip
        elif one_pass and route is not None and route.lead is not None:
            src, copy, twin = (draft_values, None), None, _law_twin(name)
            if twin in out:  # sampling: the row at T is the law
                src, copy = (out[twin], out.get(f"curve/{twin}")), ~ctx.pool.greedy[:, 0]
            out[name], cum = _fused_values(ctx, *route.lead(ctx, rule_entry(name)), budgets, k,
                                           full, src, copy, scan=whole_order)  # fmt: skip
        else:
            out[name], cum = _ranked_values(ctx, name, firsts, extra_scores, budgets, k, full,
                                            whole_order)  # fmt: skip
        if full:
            out[f"curve/{name}"] = cum
    if curves:
        out["curve/draft"] = draft_curve
    _add_draft_tree_rules(out, ctx, draft_order, rules, budgets, curves, pearl)
    return out


def _first_factor_passes(
    ctx: PoolContext,
    firsts: dict[str, Tensor],
    curve_rules: Sequence[str],
    budgets: Sequence[int],
    k: int,
    draft: tuple[Tensor, Tensor | None],
    scan: Tensor | None,
) -> dict[str, tuple[Tensor, Tensor | None]]:
    """{rule: (values, curve or None)} of the first-factor rules, those with curves and
    those without each in one compiled pass; a round without any factor ranks like draft
    selection (`draft`: its values and curve)."""
    out = {}
    for full in (False, True):
        group = [n for n in firsts if (n in curve_rules) == full
                 and not ((r := _pool_route(n)) is not None and r.draft_order)]  # fmt: skip
        if group:
            values, cum = _fused_values(ctx, [firsts[n] for n in group], 1, budgets, k, full,
                                        draft, nan_copies=True, scan=scan)  # fmt: skip
            out |= {n: (values[j], cum[j] if full else None) for j, n in enumerate(group)}
    return out


def _edge_rules(
    pool: PoolBatch,
    one_pass: bool,
    edge_factors: dict[str, Tensor] | None,
    extra_scores: dict[str, Tensor] | None,
) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
    """(edge-factor rules for the compiled pass, score rules): off that pass an edge-factor
    rule is scored as its factors' path sums. NaN factors are refused (the kernel would
    read them as draft's factors)."""
    for name, f in (edge_factors or {}).items():
        if bool(torch.isnan(f).any()):
            raise ValueError(f"edge factors of {name}: NaN entries; every edge needs a value")
    if one_pass or not edge_factors:
        return dict(edge_factors or {}), extra_scores
    sums = {n: path_sum(f, pool.parent) for n, f in edge_factors.items()}
    return {}, {**(extra_scores or {}), **sums}


def _check_rules_and_budgets(rules: Sequence[str], budgets: Sequence[int]) -> None:
    """Refuse unknown rules and an empty or negative budget list."""
    unknown = [r for r in rules if _pool_route(r) is None]
    if unknown:
        raise ValueError(f"Unknown rule(s) {unknown}; known rules are {list(POOL_RULES)}")
    if not budgets or min(budgets) < 0:
        raise ValueError(f"The 'budgets' must be a non-empty list of ints >= 0. Got {budgets}.")


def _draft_order(
    ctx: PoolContext, width: int, k: int, curves: bool, draft_order: Tensor | None
) -> Tensor:
    """The caller's draft order if it is long enough, else draft selection's, ranked here.

    `width` is the pool's; `curves` needs the whole order, budgets only the first `k`.
    """
    # the torch route shares the draft keys with subtree_ranks; kernels build keys in-cache
    keys = None if compiled_route(ctx.draft) else ctx.draft_keys
    if draft_order is None or (curves and draft_order.shape[1] < width):
        draft_order = rank_order(ctx.draft, ctx.restrict, k=None if curves else k, keys=keys)
    elif draft_order.shape[1] < min(k, width):
        raise ValueError(f"draft_order holds {draft_order.shape[1]} entries; budgets need {k}")
    return draft_order


def _ranked_values(
    ctx: PoolContext,
    name: str,
    firsts: dict[str, Tensor],
    extra_scores: dict[str, Tensor] | None,
    budgets: Sequence[int],
    k: int,
    full: bool,
    scan: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """A rule's values from its candidate scores, ranked (and its curve if `full`); `scan`,
    the whole pool's draft order when known: the top-k heap scans in it."""
    if name in firsts:
        score = lead_factor_scores(ctx, firsts[name])
    elif name in (extra_scores or {}):
        score = extra_scores[name]
    else:
        score = rule_scores(ctx, name)
    order = rank_order(score, ctx.restrict, k=None if full else k, scan=scan)
    values = values_at_budgets(order, ctx.path_prob, budgets)
    cum = torch.cumsum(torch.gather(ctx.path_prob, -1, order), dim=-1) if full else None
    return values, cum


def _add_draft_tree_rules(
    out: dict[str, Tensor],
    ctx: PoolContext,
    draft_order: Tensor,
    rules: Sequence[str],
    budgets: Sequence[int],
    curves: bool,
    pearl: tuple[Tensor, Tensor] | None,
) -> None:
    """Add PEARL's values (and curves) and the draw rules' values, all from the draft order."""
    if PEARL in rules or curves:
        value, size = pearl_curves(ctx, draft_order) if pearl is None else pearl
        idx = [min(b, value.shape[-1]) - 1 for b in budgets]
        out[PEARL], out[f"size/{PEARL}"] = value[:, idx], size[:, idx]
        if curves:
            out[f"curve/{PEARL}"], out[f"curve/size/{PEARL}"] = value, size
    if any(_pool_route(r).draw_values for r in rules):
        drawn = draw_values(ctx, budgets, draft_order)
        out.update({name: v for name, v in drawn.items() if name.split("/")[-1] in rules})

"""Draw rules' values (docs/method.md#rule-values): root-draw, PEARL and PEARL-commit, exact over the first draw.

Root-draw keeps, below whichever first-level candidate g the root row draws,
g's B-1 best-ranked descendants; PEARL keeps the part of the draft tree T_B
below the drawn token; PEARL-commit keeps g*'s B-1 best-ranked descendants only
below the drafter's top g*. Each is a mass-by-rank curve read at the budgets
(`selection.values` has the formulas).

Two routes give the root-draw and PEARL-commit curves: one sort of the pool by
(first-level ancestor, draft rank) in torch (`_draw_curves_torch`, the
reference, and the CUDA route), and on CPU one compiled scan of the whole pool's draft
order (`draw_curves_in_order`); they add the same terms in another order and agree to
float32 rounding (`tests/test_select_kernels.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numba import prange
from torch import Tensor

from selection.context import PoolContext
from selection.kernels import heap_key
from selection.ranking import compiled_route, kernel_valid, rank_order
from specrank.runtime.jit import njit


def subtree_ranks(ctx: PoolContext) -> tuple[Tensor, Tensor, Tensor]:
    """Candidates grouped by first-level subtree, each group in draft order.

    Returns (perm, group, rank_below), each [R, P]: `perm` sorts the pool by
    (first-level ancestor, draft rank) with depth-1 and invalid entries last;
    `group` is the first-level ancestor of each sorted entry, or P for those
    trailing entries; `rank_below` is each entry's rank among the candidates
    below the same first-level candidate. One sort of unique composite int64
    keys does all of it.
    """
    width = ctx.pool.shape[1]
    index_bits = max(1, (width - 1).bit_length())
    if 32 + index_bits + width.bit_length() > 63:
        raise ValueError(f"pools of {width} candidates are too wide for 63-bit subtree keys")
    below = (ctx.pool.depth >= 2) & ctx.valid
    group = torch.where(below, ctx.first_ancestor, width)  # sentinel group `width` sorts last
    score_desc = 0x7FFFFFFF - (ctx.draft_keys >> 32)  # in [0, 2^32)
    positions = torch.arange(width, device=group.device)
    key = ((group << 32) | score_desc) << index_bits
    key |= positions
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
    return perm, group_sorted, positions - start_pos


def _mass_by_rank(values: Tensor, rank: Tensor, mask: Tensor, n_ranks: int) -> Tensor:
    """Cumulative mass of masked entries by rank: out[:, r] = sum(values[rank <= r]). [R, n_ranks].

    Ranks >= n_ranks are never asked for and share one overflow bin.
    """
    binned = torch.zeros(values.shape[0], n_ranks + 1, dtype=values.dtype, device=values.device)
    binned.scatter_add_(-1, rank.clamp(max=n_ranks), torch.where(mask, values, 0.0))
    return torch.cumsum(binned[:, :n_ranks], dim=-1)


def draw_values(
    ctx: PoolContext, budgets: Sequence[int], order: Tensor | None = None
) -> dict[str, Tensor]:
    """Root-draw and PEARL-commit values and expected tree sizes. [R, n_budgets] each.

    Root-draw keeps, below whichever first-level g is drawn, g's b-1 best-ranked
    descendants; PEARL-commit keeps them only below the drafter's top g*, the draft order's
    first entry (a depth-1 node). `order`: the draft order when the caller has it; ranked
    here otherwise (the compiled route scans the whole pool's, the torch route needs g*).
    """
    for b in budgets:
        if b < 1:
            raise ValueError(f"Draw rules need a budget >= 1 (the drawn token). Got {b} instead.")
    width = ctx.pool.shape[1]
    kept_below = [min(b - 1, width) for b in budgets]  # b-1 kept below the drawn g
    n_ranks = max(max(kept_below), 1)
    names = ("root_draw", "size/root_draw", "pearl_commit", "size/pearl_commit")
    compiled = compiled_route(ctx.draft)
    if order is None or (compiled and order.shape[1] != width):
        order = rank_order(ctx.draft, ctx.restrict, k=None if compiled else 1)
    if compiled:
        stacked, monotone = draw_curves_in_order(
            order.contiguous().numpy(), ctx.draft.contiguous().numpy(),
            *kernel_valid(ctx.restrict, ctx.draft), ctx.pool.parent.contiguous().numpy(),
            ctx.pool.depth.contiguous().numpy(), ctx.path_prob.contiguous().numpy(),
            ctx.law.contiguous().numpy(), n_ranks,
        )  # fmt: skip
        if not monotone:
            raise ValueError(
                "draw rules need pools in pool order whose draft scores never rise along a "
                "path (draft log-probabilities <= 0); this batch breaks that"
            )
        curves = dict(zip(names, torch.from_numpy(stacked).unbind(1), strict=True))
    else:
        curves = dict(zip(names, _draw_curves_torch(ctx, order[:, 0], n_ranks), strict=True))
    idx = torch.tensor([k - 1 for k in kept_below], device=order.device)
    out = {}
    for name, cum in curves.items():
        taken = cum[:, idx.clamp(min=0)]
        out[name] = 1 + torch.where(idx >= 0, taken, torch.zeros_like(taken))
    return out


def _draw_curves_torch(ctx: PoolContext, top_first: Tensor, n_ranks: int) -> list[Tensor]:
    """draw_values' four mass-by-rank curves via one sort of the pool (the torch route)."""
    width = ctx.pool.shape[1]
    perm, group, rank = subtree_ranks(ctx)
    below = group < width
    path_prob = torch.gather(ctx.path_prob, -1, perm)
    # p(g|c) of each entry's subtree root (the sentinel group reads column 0, masked out)
    first_prob = torch.gather(ctx.law, -1, torch.where(below, group, 0))
    under_top = group == top_first[:, None]
    return [
        _mass_by_rank(path_prob, rank, below, n_ranks),
        _mass_by_rank(first_prob, rank, below, n_ranks),
        _mass_by_rank(path_prob, rank, under_top, n_ranks),
        _mass_by_rank(first_prob, rank, under_top, n_ranks),
    ]


def pearl_curves(ctx: PoolContext, draft_order: Tensor) -> tuple[Tensor, Tensor]:
    """PEARL value and expected tree size at pre-draw budgets b = 1..k. [R, k] each.

    PEARL keeps the part of the draft tree T_b below the drawn first token, so
    value(b) = 1 + sum of P(u) over depth>=2 members of T_b, and the expected
    size adds p(g|c) for each such u below g.
    """
    if compiled_route(ctx.path_prob) and compiled_route(ctx.law):
        value, size = _pearl_kernel(
            draft_order.contiguous().numpy(), ctx.pool.depth.contiguous().numpy(),
            ctx.valid.contiguous().numpy(), ctx.first_ancestor.contiguous().numpy(),
            ctx.law.contiguous().numpy(), ctx.path_prob.contiguous().numpy(),
        )  # fmt: skip
        return torch.from_numpy(value), torch.from_numpy(size)
    # gather the k ordered entries first: every product below is [R, k], not [R, P]
    below = (
        (torch.gather(ctx.pool.depth, -1, draft_order) >= 2)
        & torch.gather(ctx.valid, -1, draft_order)
    ).float()
    first_prob = torch.gather(ctx.law, -1, torch.gather(ctx.first_ancestor, -1, draft_order))
    value = 1 + torch.cumsum(torch.gather(ctx.path_prob, -1, draft_order) * below, dim=-1)
    size = 1 + torch.cumsum(first_prob * below, dim=-1)
    return value, size


@njit(parallel=True, nogil=True)
def _pearl_kernel(order, depth, valid, first_ancestor, law, path_prob):
    """`pearl_curves` per round in one pass over the ordered entries, instead of six [R, k]
    gathers: the same float32 products and float64 running sums rounded to float32 per
    position (torch's CPU cumsum), then 1 + in float32 (`tests/test_select_kernels.py`)."""
    n_rounds, k = order.shape
    value = np.empty((n_rounds, k), dtype=np.float32)
    size = np.empty((n_rounds, k), dtype=np.float32)
    one = np.float32(1.0)
    for r in prange(n_rounds):
        acc_value, acc_size = 0.0, 0.0
        for j in range(k):
            i = order[r, j]
            below = np.float32(1.0 if depth[r, i] >= 2 and valid[r, i] else 0.0)
            acc_value += path_prob[r, i] * below
            acc_size += law[r, first_ancestor[r, i]] * below
            value[r, j] = one + np.float32(acc_value)
            size[r, j] = one + np.float32(acc_size)
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


@njit(nogil=True)
def _subtrees(draft_row, valid_row, has_valid, parent_row, depth_row):
    """(slot, anc, n_first, bad) of one round for `draw_curves_in_order`: each first-level
    candidate's row in its per-subtree table (-1 elsewhere) and every reached candidate's
    first-level ancestor (-1: not reached); reached = valid, on a chain of valid candidates
    from a valid depth-1 child of the root, the search's set. bad: a parent after its child,
    or a draft score rising along a reached edge."""
    width = draft_row.shape[0]
    slot = np.full(width, -1, dtype=np.int64)
    anc = np.full(width, -1, dtype=np.int64)
    keys = np.empty(width, dtype=np.int64)
    n_first, bad = 0, False
    for u in range(width):
        ok = valid_row[u] if has_valid else True
        keys[u] = heap_key(np.float32(draft_row[u]), u, width, ok)
        p = parent_row[u]
        if p >= u:
            bad = True
        elif p < 0:
            if depth_row[u] == 1 and ok:
                slot[u], anc[u] = n_first, u
                n_first += 1
        elif ok and anc[p] >= 0:
            anc[u] = anc[p]
            bad |= keys[u] > keys[p]
    return slot, anc, n_first, bad


@njit(parallel=True, nogil=True)
def draw_curves_in_order(
    order: np.ndarray,
    draft: np.ndarray,
    valid: np.ndarray,
    has_valid: bool,
    parent: np.ndarray,
    depth: np.ndarray,
    path_prob: np.ndarray,
    law: np.ndarray,
    n_ranks: int,
) -> tuple[np.ndarray, bool]:
    """Root-draw and PEARL-commit mass by within-subtree draft rank. [R, 4, n_ranks].

    Channels: root-draw value, root-draw size, PEARL-commit value, PEARL-commit size;
    entry j is the mass of candidates of rank <= j below their first-level candidate (see
    `draw_values`). With draft scores non-increasing along paths, the within-subtree draft
    order of a first-level g's descendants is the whole pool's order ([R, P],
    `rank_order`) restricted to them: one scan of it gives each g's j-th best descendant
    (it replaced a best-first search under each g: 6.6 against 22.0 ms on 2,048 sampling
    pools). Masses are added g by g in pool order. PEARL-commit's g* is the order's first
    entry. Returns ok=False when a draft score rises along an edge or a parent does not
    precede its child.
    """
    n_rounds, width = draft.shape
    out = np.zeros((n_rounds, 4, n_ranks), dtype=path_prob.dtype)
    bad = np.zeros(n_rounds, dtype=np.bool_)
    for r in prange(n_rounds):
        row_valid = valid[r] if has_valid else valid[0]
        slot, anc, n_first, bad[r] = _subtrees(draft[r], row_valid, has_valid, parent[r], depth[r])
        if bad[r]:
            continue
        mass = np.zeros((max(n_first, 1), n_ranks), dtype=path_prob.dtype)
        count = np.zeros(max(n_first, 1), dtype=np.int64)
        for j in range(width):
            u = order[r, j]
            g = anc[u]
            if g < 0 or g == u:
                continue
            s = slot[g]
            if count[s] < n_ranks:
                mass[s, count[s]] = path_prob[r, u]
                count[s] += 1
        top = order[r, 0]
        for g in range(width):
            s = slot[g]
            if s < 0:
                continue
            first = law[r, g]
            commit = g == top
            for j in range(count[s]):
                out[r, 0, j] += mass[s, j]
                out[r, 1, j] += first
                if commit:
                    out[r, 2, j] += mass[s, j]
                    out[r, 3, j] += first
        for c in range(4):
            for j in range(1, n_ranks):
                out[r, c, j] += out[r, c, j - 1]
    return out, not bad.any()

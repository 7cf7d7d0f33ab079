"""The fused kernel of first-factor rules: one compiled pass per rule and batch from the
rule's edges to its values at every budget (`selection.values._fused_values`).

A rule of `selection.values` that replaces the leading (first-level, or first two levels)
log factors of draft's path scores is scored, ranked and valued per round in one loop
that touches a round's candidates while they sit in cache. Its routes give the same
bits (`tests/test_select_kernels.py`):

- rounds whose path mass sits on few candidates (greedy rounds: the argmax path) are
  valued from those candidates' ranks alone (`_sparse_mass`);
- otherwise every score is computed and ranked (`kernels._rank_row`): for a small top k
  a heap that scans the pool in the draft order (cheaper the nearer the rule ranks to
  draft) and stops where no later candidate can enter (`_bounded_top_k`), for a large one a radix
  sort of the whole pool. This route also reports NaN/+inf scores and pools out of pool
  order.

A top-k that scored only the candidates whose parent may still enter was tried and
dropped: the pool is grown by expanding draft's best nodes, so nearly every parent may.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from selection.kernels import (
    _rank_row,
    _stop_below,
    heap_drain,
    heap_key,
    heap_offer,
    heap_takes,
)
from specrank.runtime.jit import njit


@njit(nogil=True)
def _all_nan(lead_row: np.ndarray) -> bool:
    """No leading factor given: the round ranks like draft selection."""
    for i in range(lead_row.shape[0]):  # noqa: SIM110 (a loop numba compiles; no generators)
        if not np.isnan(lead_row[i]):
            return False
    return True


@njit(nogil=True)
def _lead_scores(draft_row, lead_row, parent_row, score) -> bool:
    """Candidate scores into `score`: path sums of the draft log factors, the leading
    `lead_row` ones where not NaN (float32 sums, as `path_reduce`); False if a parent
    comes after its child (not pool order)."""
    n_lead = lead_row.shape[0]
    for i in range(draft_row.shape[0]):
        e = draft_row[i]
        if i < n_lead and not np.isnan(lead_row[i]):
            e = lead_row[i]
        p = parent_row[i]
        if p < 0:
            score[i] = e
        elif p < i:
            score[i] = score[p] + e
        else:
            return False
    return True


@njit(inline="always")
def _bounded_top_k(draft_row, lead_row, parent_row, draft_score, scan_row, valid, has_valid, k,
                   score, out) -> int:  # fmt: skip
    """`kernels._rank_row`'s top-k heap over a draft-order scan that stops early, scoring
    candidates as it reaches them; the same k indices into `out`. Returns the status.

    Below the replaced levels (the first `n_lead` columns) every factor is draft's, so no
    candidate's score exceeds its draft score by more than the lift, the most any of those
    columns exceeds it (in float64). A -inf score adds nothing (its subtree cannot enter a
    heap of finite keys); NaN or +inf: no stop. The scan in draft order (`scan_row`, of
    `draft_score`, invalid last) stops where the next draft score is below
    `kernels._stop_below`; the order reaches each parent before its children, so a
    candidate's score is its parent's plus its draft factor (the same float32 sum as
    `_lead_scores`). The draft log-probabilities must hold no NaN or +inf, as
    `selection.ranking.draft_scores` refuses (`draft_score` are its scores): then no score
    the scan did not reach is NaN or +inf, and only those it reached are checked.
    """
    width, n_lead = draft_row.shape[0], lead_row.shape[0]
    if not _lead_scores(draft_row[:n_lead], lead_row, parent_row[:n_lead], score[:n_lead]):
        return 1
    nan, lift = False, -np.inf
    for i in range(n_lead):
        nan |= not (score[i] < np.inf)
        if score[i] > -np.inf:
            d = np.float64(score[i]) - np.float64(draft_score[i])
            if not d <= lift:
                lift = d if not np.isnan(d) else np.inf
    heap, bits = np.empty(k, dtype=np.int64), np.empty(1, dtype=np.int32)
    below = -np.inf  # stop at a draft score under this (-inf: never)
    for t in range(width):
        i = scan_row[t]
        ok = valid[i] if has_valid else True
        if t >= k and below > -np.inf and (not ok or np.float64(draft_score[i]) < below):
            break  # (past an invalid candidate, only invalid ones follow)
        if i >= n_lead:
            p = parent_row[i]
            if p >= i:
                return 1
            score[i] = draft_row[i] if p < 0 else score[p] + draft_row[i]
        s = np.float32(score[i])
        nan |= not (s < np.inf)  # NaN or +inf
        if heap_offer(heap, t, k, heap_key(s, i, width, ok)):
            below = _stop_below(heap[0], lift, bits)
    heap_drain(heap, k, width, out)
    return 2 if nan else 0


@njit(inline="always")
def _cumulate(path_prob_row, order, mass) -> None:
    """The cumulative path probability in `order`, in float64 rounded per position to float32
    as torch's CPU cumsum does."""
    acc = 0.0
    for j in range(order.shape[0]):
        acc += path_prob_row[order[j]]
        mass[j] = np.float32(acc)


@njit(nogil=True)
def _sparse_mass(score, valid, has_valid, nonzero, n_nonzero, path_prob_row, k, mass) -> bool:
    """The cumulative path probability at ranks 0..k-1 into `mass` for a round whose mass
    sits on `n_nonzero` candidates (`nonzero`; a greedy round's argmax path): only their
    ranks are needed (the candidates ranked above each), and the float64 sum in rank order
    adds the same terms in the same order as the whole ranking's, whose other terms are
    exact zeros. False if a score is NaN or +inf."""
    width = score.shape[0]
    keys = np.empty(width, dtype=np.int64)
    nan = False
    for i in range(width):
        s = np.float32(score[i])
        nan |= not (s < np.inf)  # NaN or +inf
        keys[i] = heap_key(s, i, width, valid[i] if has_valid else True)
    rank = np.empty(n_nonzero, dtype=np.int64)
    for a in range(n_nonzero):
        key, above = keys[nonzero[a]], 0
        for i in range(width):
            above += keys[i] > key
        rank[a] = above
    by_rank = np.argsort(rank)
    acc, at = 0.0, 0
    for a in by_rank:
        if rank[a] >= k:
            break
        while at < rank[a]:
            mass[at] = np.float32(acc)
            at += 1
        acc += path_prob_row[nonzero[a]]
    while at < k:
        mass[at] = np.float32(acc)
        at += 1
    return not nan


@njit(parallel=True, nogil=True)
def rules_lead_values(
    draft_logprob: np.ndarray,
    parent: np.ndarray,
    lead: np.ndarray,
    path_prob: np.ndarray,
    valid: np.ndarray,
    has_valid: bool,
    k: int,
    at: np.ndarray,
    curve: bool,
    copy: np.ndarray,
    nan_copies: bool,
    src_values: np.ndarray,
    src_curve: np.ndarray,
    nonzero: np.ndarray,
    n_nonzero: np.ndarray,
    scan: np.ndarray,
    draft: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Values of J rules whose leading factors are replaced, per round in one pass.

    What `selection.values` computes from a rule's scores, fused: scores =
    path sums of per-edge log factors, `lead[j, r, i]` for the first L pool columns
    where not NaN and the draft factor elsewhere (the same float32 sums as
    `path_reduce`); the best-first top k (`_rank_row`); the cumulative path
    probability in that order, accumulated in float64 and rounded to float32 as
    torch's CPU cumsum does, read at positions `at` (-1: the empty tree, 0).
    `curve` keeps the whole cumulative curve ([J, R, k]; k must then be the pool).
    Rounds whose mass sits on few candidates (`n_nonzero[r]` >= 0 of them, listed in
    `nonzero`: `sparse_mass_rows`) rank only those (`_sparse_mass`); `scan` ([R, P], the
    draft order, or [1, 0]: pool order) is the order the others' top-k heap scans in, and
    with `draft` ([R, P], the draft scores that order ranks, from `draft_logprob` by
    `draft_scores`, which refuses NaN and +inf; [1, 0]: none) the heap stops where no later
    candidate can enter (`_bounded_top_k`).
    Rounds known to rank like a source rule are copied from its outputs
    (`src_values`, `src_curve`, the same for every rule): those with `copy[r]`, and with
    `nan_copies` those whose leading factors are all NaN (the source is then draft
    selection).
    Returns (values [J, R, len(at)] float32, curves [J, R, k or 0] float32, status):
    status 0 ok, 1 a parent after its child (not pool order), 2 a NaN/+inf score (the
    worst over the rules).

    Each rule gets the bits a pass of its own gives (`tests/test_select_kernels.py`). One
    round's pool stays in cache while every rule ranks it, where a pass per rule reads the
    batch's pools again for each: the default job took 167-168 CPU s against 173-178 with
    a pass per rule (bench/SCALING.md).
    """
    n_rules = lead.shape[0]
    n_rounds, width = draft_logprob.shape
    use_scan = scan.shape[0] == n_rounds
    bounded = use_scan and draft.shape[0] == n_rounds and heap_takes(k, width)
    values = np.zeros((n_rules, n_rounds, at.shape[0]), dtype=np.float32)
    curves = np.empty((n_rules, n_rounds, k if curve else 0), dtype=np.float32)
    status = np.zeros(n_rounds, dtype=np.int64)
    for r in prange(n_rounds):
        score = np.empty(width, dtype=np.float32)
        order = np.empty(k, dtype=np.int64)
        scratch = np.empty(0 if curve else k, dtype=np.float32)
        ok_valid = valid[r] if has_valid else valid[0]
        for j in range(n_rules):
            if copy[r] or (nan_copies and _all_nan(lead[j, r])):
                values[j, r] = src_values[r]
                if curve:
                    curves[j, r] = src_curve[r]
                continue
            mass = curves[j, r] if curve else scratch
            st = _round_mass(draft_logprob[r], lead[j, r], parent[r], path_prob[r], ok_valid,
                             has_valid, k, bounded, use_scan, scan, draft, r, nonzero[r],
                             n_nonzero[r], score, order, mass)  # fmt: skip
            if st:
                status[r] = max(status[r], st)
                continue
            for b in range(at.shape[0]):
                if at[b] >= 0:
                    values[j, r, b] = mass[at[b]]
    return values, curves, status.max()


@njit(inline="always")
def _round_mass(draft_row, lead_row, parent_row, path_prob_row, ok_valid, has_valid, k,
                bounded, use_scan, scan, draft, r, nonzero_row, n_nonzero, score, order,
                mass) -> int:  # fmt: skip
    """One rule's cumulative mass at ranks 0..k-1 of round `r` into `mass`; the status."""
    if bounded and n_nonzero < 0:
        st = _bounded_top_k(draft_row, lead_row, parent_row, draft[r], scan[r], ok_valid,
                            has_valid, k, score, order)  # fmt: skip
        if st == 0:
            _cumulate(path_prob_row, order, mass)
        return st
    if not _lead_scores(draft_row, lead_row, parent_row, score):
        return 1
    if n_nonzero >= 0:
        ok = _sparse_mass(score, ok_valid, has_valid, nonzero_row, n_nonzero, path_prob_row,
                          k, mass)  # fmt: skip
        return 0 if ok else 2
    if not _rank_row(score, ok_valid, has_valid, k, order, scan[r] if use_scan else scan[0]):
        return 2
    _cumulate(path_prob_row, order, mass)
    return 0


@njit(parallel=True, nogil=True)
def sparse_mass_rows(path_prob: np.ndarray, most: int) -> tuple[np.ndarray, np.ndarray]:
    """Per round, the candidates with nonzero path probability when there are at most
    `most` of them ([R, most] int64, in index order), and how many (-1: more)."""
    n_rounds, width = path_prob.shape
    nonzero = np.zeros((n_rounds, most), dtype=np.int64)
    count = np.zeros(n_rounds, dtype=np.int64)
    for r in prange(n_rounds):
        n = 0
        for i in range(width):
            if path_prob[r, i] != 0:
                if n == most:
                    n = -1
                    break
                nonzero[r, n] = i
                n += 1
        count[r] = n
    return nonzero, count

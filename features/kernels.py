"""The compiled per-round loops of `features.first_level` (numba).

One pass per round over its first-level candidates: the sibling and root-
distribution features, each retained row's log-prob, gap and rank, the row shapes,
the context, written into one output block per dtype at rows the caller passes
(`features.first_level.OUT_ROWS`), so this module depends on no feature list. The
pool subtree statistics are `features.subtree`'s kernel.

Bitwise contract: exponentials and logs are numpy's (the caller takes np.exp /
np.log of whole arrays between `draft_mass` and `fill`), every sum keeps numpy's
order (`pairwise_sum`), ranks are a stable argsort's, and float32 results are
rounded from the same float64 values, so the features equal those of the former
numpy implementation bit for bit (`tests/test_online_speed.py`). Each kernel calls
only kernels of this file: numba's cache is invalidated file by file.
"""

from __future__ import annotations

import numpy as np

from specrank.runtime.jit import njit


@njit(nogil=True, inline="always")
def _block_sum(a, lo, n):
    """numpy's pairwise_sum of a[lo : lo + n] for n <= 128: 8 partial sums, then the rest."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - n % 8:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit(nogil=True)
def pairwise_sum(a, lo, n):
    """sum(a[lo : lo + n]) in numpy's order: above 128 terms, the two halves' sums (n/2
    rounded down to a multiple of 8). Its recursion unrolled on a stack (numba's cache
    cannot reload a recursive function)."""
    if n <= 128:
        return _block_sum(a, lo, n)
    los = np.empty(128, dtype=np.int64)
    ns = np.empty(128, dtype=np.int64)
    split = np.zeros(128, dtype=np.bool_)
    sums = np.empty(128)
    top, k = 0, 0
    los[0], ns[0] = lo, n
    while top >= 0:
        m = ns[top]
        if m <= 128:
            sums[k] = _block_sum(a, los[top], m)
            k += 1
            top -= 1
        elif not split[top]:  # push the right half, then the left one (summed first)
            split[top] = True
            half = m // 2
            half -= half % 8
            l0 = los[top]
            los[top + 1], ns[top + 1], split[top + 1] = l0 + half, m - half, False
            los[top + 2], ns[top + 2], split[top + 2] = l0, half, False
            top += 2
        else:  # both halves summed: left + right
            sums[k - 2] = sums[k - 2] + sums[k - 1]
            k -= 1
            top -= 1
    return sums[0]


@njit(nogil=True, error_model="numpy")
def draft_mass(e, n1, width):
    """(q / sum q [R, W] (0 on padding), sum q [R], N) over each round's first level."""
    R = n1.size
    qn = np.zeros((R, width))
    mass = np.empty(R)
    n = 0
    for r in range(R):
        k = n1[r]
        n += k
        m = pairwise_sum(e[r], 0, k)
        mass[r] = m
        if m > 0:
            for i in range(k):
                qn[r, i] = e[r, i] / m
    return qn, mass, n


@njit(nogil=True, inline="always")
def _descending_ranks(v, n, rank):
    """rank[i] = position of v[i] sorted descending, ties by index (a stable argsort of -v)."""
    for i in range(n):
        k = 0
        for j in range(n):
            if v[j] > v[i] or (v[j] == v[i] and j < i):
                k += 1
        rank[i] = k


@njit(nogil=True, error_model="numpy", inline="always")
def _draft_round(lp, q, qn, log_qn, mass, n, first, o32, oi32, order, rank, plogp, f32, i32):
    """Sibling and root-distribution features of one round; returns the draft-rank-0 index."""
    _descending_ranks(lp, n, rank)
    for i in range(n):
        order[rank[i]] = i
    for i in range(n):
        plogp[i] = qn[i] * log_qn[i] if qn[i] > 0 else 0.0
    entropy = 0.0 - pairwise_sum(plogp, 0, n)  # 0.0 - x, not -x: a point mass gives +0.0
    top1 = 0.0
    for i in range(n):
        top1 = max(top1, q[i])
    for i in range(n):
        o = first + i
        k = rank[i]
        o32[f32[0], o] = lp[i]
        o32[f32[1], o] = q[i]
        o32[f32[2], o] = q[i] / mass if mass > 0 else np.nan
        if n >= 2:
            best_other = order[1] if k == 0 else order[0]  # the best sibling
            o32[f32[3], o] = q[best_other]  # = exp(its log q)
            o32[f32[4], o] = lp[i] - lp[best_other]
        else:
            o32[f32[3], o] = np.nan
            o32[f32[4], o] = np.nan
        o32[f32[5], o] = lp[order[k - 1]] - lp[i] if k > 0 else np.nan
        o32[f32[6], o] = lp[i] - lp[order[k + 1]] if k < n - 1 else np.nan
        o32[f32[7], o] = mass - q[i]
        o32[f32[8], o] = mass
        o32[f32[9], o] = entropy
        o32[f32[10], o] = top1
        oi32[i32[0], o] = k
        oi32[i32[1], o] = n
    return order[0]


@njit(nogil=True, error_model="numpy", inline="always")
def _row_round(lp, n, first, rows, o32, token, drop, v, rank):
    """A retained row's log-prob of each candidate, its gap to the row's best first-level
    log-prob and the candidate's rank under it (NaN where absent, and at token `drop`).

    The best is over the candidates the row has; a row with none (or only -inf) is absent.
    """
    best = np.float32(-np.inf)
    for i in range(n):
        x = np.float32(np.nan) if token[i] == drop else lp[i]
        v[i] = x
        if x > best:  # NaN never compares greater: fmax ignores it
            best = x
    if best == -np.inf:
        best = np.float32(np.nan)
    for i in range(n):  # ranks: NaN sorts like -inf (then NaN is written over it)
        if np.isnan(v[i]):
            v[i] = -np.inf
    _descending_ranks(v, n, rank)
    for i in range(n):
        o = first + i
        x = np.float32(np.nan) if token[i] == drop else lp[i]
        o32[rows[0], o] = x
        o32[rows[1], o] = x - best
        o32[rows[2], o] = np.nan if np.isnan(x) else rank[i]


@njit(nogil=True, error_model="numpy")
def _token_only_agreement(only_argmax, draft_top):
    """(count, share): the round's token-only rows, and the share whose argmax is the
    drafter's top first token (NaN without a row)."""
    count = 0
    agree = 0
    for j in range(only_argmax.shape[0]):
        a = only_argmax[j]
        if a >= 0:
            count += 1
            agree += a == draft_top
    return count, (agree / count if count > 0 else np.nan)


@njit(nogil=True, error_model="numpy")
def fill(n1, token, expanded, cum, e, qn, log_qn, mass, rows, scalars, ints, only_argmax,
         o32, oi32, ob, out):  # fmt: skip
    """Write every feature but the subtree statistics into the output blocks o32, oi32, ob.

    cum, e [R, P]: cumulative draft scores and np.exp of them; qn, log_qn [R, W]: the
    first level's renormalised q and np.log of it; mass [R]. rows [6, R, W]
    (features.rounds.FL_ROWS), scalars [11, R] (SCALAR_FIELDS), ints [8, R]
    (INT_FIELDS). out: the block rows each step writes (`features.first_level.OUT_ROWS`).
    """
    draft32, drafti32, row32, shape32, only32, context32, contexti32, b8 = out
    R, W = qn.shape
    order = np.empty(W, dtype=np.int64)
    rank = np.empty(W, dtype=np.int64)
    plogp = np.empty(W)
    v = np.empty(W, dtype=np.float32)
    first = 0
    for r in range(R):
        n = n1[r]
        root = ints[0, r]
        top = _draft_round(
            cum[r],
            e[r],
            qn[r],
            log_qn[r],
            mass[r],
            n,
            first,
            o32,
            oi32,
            order,
            rank,
            plogp,
            draft32,
            drafti32,
        )
        draft_top = token[r, top] if n > 0 else -1
        for k in range(4):  # cache, same, prev, matched (ROW_KINDS)
            # The preceding row's continuation entry was zeroed before use (docs/method.md#retained-rows): the
            # continuation is this round's root token, so that candidate's entry is missing.
            drop = root if k == 2 else -2  # -2: no token
            _row_round(rows[k, r], n, first, row32[k], o32, token[r], drop, v, rank)
        count, only_agree = _token_only_agreement(only_argmax[r], draft_top)
        for i in range(n):
            o = first + i
            for k in range(4):
                shape = shape32[k]
                argmax = ints[4 + k, r]
                o32[shape[0], o] = scalars[3 + k, r]  # {kind}_entropy
                o32[shape[1], o] = scalars[7 + k, r]  # {kind}_top1_prob
                o32[shape[2], o] = np.nan if argmax < 0 else np.float32(argmax == draft_top)
            o32[only32[0], o] = rows[4, r, i]
            o32[only32[1], o] = rows[5, r, i]
            o32[only32[2], o] = only_agree
            o32[context32[0], o] = scalars[0, r]  # prev_accepted
            o32[context32[1], o] = scalars[1, r]  # cache_age
            o32[context32[2], o] = scalars[2, r]  # prev_tree_root_count
            oi32[contexti32[0], o] = ints[1, r]  # prompt_length
            oi32[contexti32[1], o] = ints[2, r]  # round_index
            oi32[contexti32[2], o] = ints[3, r]  # tokens_before
            oi32[contexti32[3], o] = count
            ob[b8[0], o] = expanded[r, i]
            ob[b8[1], o] = token[r, i] == root
        first += n

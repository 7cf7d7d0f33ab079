"""Statistics of the pool subtree below each first-level candidate (docs/method.md#features).

The cumulative draft score of a prefix u = (x1, ..., xd) is
log q(x1) + ... + log q(xd), the score draft selection ranks by. "Below x1"
means the descendants of x1 in the pool, x1 itself excluded.

Compiled per-round loops (numba), the same code for one round online and for a
shard's batch offline: `pool_pass` checks the pool order and sums the cumulative
scores, `subtree_stats` the statistics. The exponentials are numpy's
(`first_level.features_of_blocks` takes np.exp of `pool_pass`'s scores between
the two): numpy's and numba's exp differ in the last bit on some inputs, and the
values must be bitwise those of the former numpy implementation. Sums keep its
order: the mass below x1 is the sum over depths 2, 3, ... of each depth's sum,
each in pool order (the former np.bincount per depth).
"""

from __future__ import annotations

import numpy as np

from specrank.runtime.jit import njit

# pool_pass error codes, in the order they are reported
NAN_LOGPROB, FIRST_NOT_LEADING, NOT_POOL_ORDER, BAD_PARENT = range(4)


def pool_error(code: int, r: int, i: int, value: int, depth: np.ndarray) -> ValueError:
    """The message of a `pool_pass` error (round r of the batch, pool index i)."""
    if code == NAN_LOGPROB:
        return ValueError(
            "RoundArrays.cand_draft_logprob: expected finite log q on every candidate, found NaN"
        )
    if code == FIRST_NOT_LEADING:
        return ValueError(
            f"RoundArrays: the depth-1 candidates of round {r} (batch position) are not the "
            f"first entries of its pool; expected pool order (depths non-decreasing)"
        )
    if code == NOT_POOL_ORDER:
        return ValueError(
            f"RoundArrays: depth layout {depth[r].tolist()[:40]}... is not in pool order "
            "(expected depths 1, .., non-decreasing, padding (0) last)"
        )
    d = int(depth[r, i])
    return ValueError(
        f"RoundArrays: a round's candidate {i} at depth {d} has parent {value}; "
        f"expected an earlier candidate at depth {d - 1}"
    )


@njit(nogil=True, inline="always")
def _note(error, code, r, i, value):
    """Keep the first occurrence of an error code."""
    if error[code, 0] < 0:
        error[code, 0] = r
        error[code, 1] = i
        error[code, 2] = value


@njit(nogil=True)
def pool_pass(depth, parent, logprob):
    """Check every round's pool order; first-level counts and cumulative draft scores.

    depth [R, P] (padding 0), parent [R, P], logprob [R, P] float32. Returns
    (n1 [R] int32, cum [R, P] float64: cumulative scores, NaN on padding,
    error [4, 3] int64: per code, (round, pool index, value) of its first
    occurrence, round -1 if none).
    """
    R, P = depth.shape
    n1 = np.zeros(R, dtype=np.int32)
    cum = np.full((R, P), np.nan)
    error = np.full((4, 3), -1, dtype=np.int64)
    for r in range(R):
        n = 0  # real entries
        prev_d = 1
        for i in range(P):
            d = depth[r, i]
            if d == 1:
                n1[r] += 1
                if n1[r] != i + 1:
                    _note(error, FIRST_NOT_LEADING, r, i, d)
            if d > 0:
                if n != i or d < prev_d or (i == 0 and d != 1):
                    _note(error, NOT_POOL_ORDER, r, i, d)
                n += 1
                prev_d = d
                if np.isnan(logprob[r, i]):
                    _note(error, NAN_LOGPROB, r, i, 0)
        for i in range(n):
            d = depth[r, i]
            x = np.float64(logprob[r, i])
            if d == 1:
                cum[r, i] = x
                continue
            p = parent[r, i]
            if p < 0 or p >= n or depth[r, p] != d - 1:
                _note(error, BAD_PARENT, r, i, p)
                continue
            cum[r, i] = x + cum[r, p]
    return n1, cum, error


@njit(nogil=True, error_model="numpy")
def subtree_stats(depth, parent, cum, e, n1, o32, oi32, f32, i32):
    """The statistics of every round's first-level candidates, written into the output blocks.

    depth, parent [R, P]; cum [R, P] cumulative scores (`pool_pass`), e = np.exp(cum);
    n1 [R]. Round r's candidates are output columns sum(n1[:r]) + 0..n1[r]-1 of o32 /
    oi32 (float32 / int32 blocks); f32 / i32: the rows of the `subtree` / `subtreei` slots there
    (features.registry: best_d2, best_deepest, mass, mass_rel | size, depth).

    subtree_size          descendants in the pool
    subtree_depth         deepest depth in the subtree (1 = no descendants)
    subtree_best_d2       best cumulative draft score at depth 2 (NaN: no children)
    subtree_best_deepest  best cumulative draft score at subtree_depth (NaN: no descendants)
    subtree_draft_mass    sum of exp(cumulative draft score) over descendants (0 if none):
                          the draft's expected accepted length below x1
    subtree_draft_mass_rel  the same divided by q(x1): that expectation given x1 is accepted
    """
    R, P = depth.shape
    W = int(n1.max()) if R else 0
    size = np.empty(W, dtype=np.int64)
    sub_depth = np.empty(W, dtype=np.int32)
    mass = np.empty(W)
    best_d2 = np.empty(W)
    best_deepest = np.empty(W)
    level_mass = np.empty(W)
    level_best = np.empty(W)
    level_count = np.empty(W, dtype=np.int64)
    anc = np.empty(P, dtype=np.int64)  # first-level ancestor of each entry
    first = 0
    for r in range(R):
        n = n1[r]
        size[:n] = 0
        sub_depth[:n] = 1
        mass[:n] = 0.0
        best_d2[:n] = np.nan
        best_deepest[:n] = np.nan
        i = n
        while i < P and depth[r, i] > 0:  # one depth block at a time (pool order)
            d = depth[r, i]
            level_mass[:n] = 0.0
            level_best[:n] = -np.inf
            level_count[:n] = 0
            while i < P and depth[r, i] == d:
                p = parent[r, i]
                g = p if d == 2 else anc[p]
                anc[i] = g
                level_count[g] += 1
                level_mass[g] += e[r, i]
                level_best[g] = max(level_best[g], cum[r, i])
                i += 1
            for g in range(n):
                mass[g] += level_mass[g]
                if level_count[g] > 0:  # depths only grow: the last one reached is the deepest
                    size[g] += level_count[g]
                    sub_depth[g] = d
                    best_deepest[g] = level_best[g]
                    if d == 2:
                        best_d2[g] = level_best[g]
        for g in range(n):
            o = first + g
            oi32[i32[0], o] = size[g]
            oi32[i32[1], o] = sub_depth[g]
            o32[f32[0], o] = best_d2[g]
            o32[f32[1], o] = best_deepest[g]
            o32[f32[2], o] = mass[g]
            # q(x1) = 0 only on a degenerate drafter: then NaN/inf, never a made-up 0
            o32[f32[3], o] = mass[g] / e[r, g]
        first += n

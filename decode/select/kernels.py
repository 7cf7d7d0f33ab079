"""Compiled CPU kernels for the selector's hot loops (numba).

In torch each primitive of `decode.select.ranking` is a chain of full-tensor passes: a
gather per pool level for a path reduction, six int64 passes to build ranking
keys, then a top-k. A compiled per-round loop touches a round's 710 candidates
while they sit in cache and is several times faster at paper scale (figures in
`bench/select_values.py`, which measures both routes in one run). numba
rather than a C++ extension because it needs no compiler at install time.

Every kernel computes what its torch counterpart computes: the same float32
operations in the same order and the same unique ranking keys, so the two
routes give identical scores and selections; the draw curves add the same
terms in another order and agree to float32 rounding (`tests/test_select_kernels.py`).
`decode.select.ranking` chooses the route; the torch one serves CUDA tensors and is
the reference.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

_INT32_MIN = -(2**31)


def use_threads(n_threads: int) -> None:
    """Run the kernels on n_threads (capped by numba's pool), e.g. torch.get_num_threads()."""
    numba.set_num_threads(max(1, min(n_threads, numba.config.NUMBA_NUM_THREADS)))


@njit(inline="always", cache=True)
def _key(score: np.float32, index: int, width: int, valid: bool) -> np.int64:
    """`decode.select.ranking.ranking_keys` of one candidate (larger = ranked first)."""
    # + 0.0 turns -0.0 into +0.0
    bits = np.int64(np.float32(score + np.float32(0.0)).view(np.int32))
    key32 = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone float -> int map (IEEE-754)
    if not valid:
        key32 = _INT32_MIN
    return (key32 << 32) | (width - 1 - index)


@njit(parallel=True, cache=True)
def layout_holds(
    depth: np.ndarray, parent: np.ndarray, layout: np.ndarray, level_start: np.ndarray
) -> bool:
    """Whether every round has depth row `layout` and each parent in an earlier level.

    `level_start[i]` is the first pool index of candidate i's level (0 at depth 1,
    whose parents must be the root, < 0).
    """
    n_rounds, width = depth.shape
    bad = np.zeros(n_rounds, dtype=np.bool_)
    for r in prange(n_rounds):
        for i in range(width):
            p = parent[r, i]
            off = p >= 0 if level_start[i] == 0 else (p < 0 or p >= level_start[i])
            if off or depth[r, i] != layout[i]:
                bad[r] = True
                break
    return not bad.any()


@njit(parallel=True, cache=True)
def path_reduce(edge: np.ndarray, parent: np.ndarray, product: bool) -> tuple[np.ndarray, bool]:
    """Path sums (or products) of per-edge values in one sweep per round.

    Needs pool order (every parent before its child); returns ok=False when a
    round breaks it, and the caller takes the general torch route.
    """
    n_rounds, width = edge.shape
    out = np.empty_like(edge)
    bad = np.zeros(n_rounds, dtype=np.bool_)
    for r in prange(n_rounds):
        for i in range(width):
            p = parent[r, i]
            if p < 0:
                out[r, i] = edge[r, i]
            elif p < i:
                out[r, i] = out[r, p] * edge[r, i] if product else out[r, p] + edge[r, i]
            else:
                bad[r] = True
                break
    return out, not bad.any()


@njit(parallel=True, cache=True)
def first_level_ancestor(parent: np.ndarray) -> tuple[np.ndarray, bool]:
    """Pool index of each candidate's depth-1 ancestor; ok=False outside pool order."""
    n_rounds, width = parent.shape
    out = np.empty((n_rounds, width), dtype=np.int64)
    bad = np.zeros(n_rounds, dtype=np.bool_)
    for r in prange(n_rounds):
        for i in range(width):
            p = parent[r, i]
            if p < 0:
                out[r, i] = i
            elif p < i:
                out[r, i] = out[r, p]
            else:
                bad[r] = True
                break
    return out, not bad.any()


@njit(inline="always", cache=True)
def _index(key: np.int64, width: int) -> int:
    """The pool index a ranking key encodes in its low 32 bits."""
    return width - 1 - (key & 0xFFFFFFFF)


# Min-heaps of the unique keys themselves (the index is decoded from the low
# bits), so comparisons need no indirection; a max-heap stores ~key, which
# reverses the order without overflow.
@njit(inline="always", cache=True)
def _sift_down(heap: np.ndarray, n: int, start: int) -> None:
    j = start
    item = heap[j]
    while True:
        c = 2 * j + 1
        if c >= n:
            break
        if c + 1 < n and heap[c + 1] < heap[c]:
            c += 1
        if heap[c] >= item:
            break
        heap[j] = heap[c]
        j = c
    heap[j] = item


@njit(inline="always", cache=True)
def _push(heap: np.ndarray, n: int, key: np.int64) -> None:
    """Push onto a heap of n entries."""
    j = n
    while j > 0:
        up = (j - 1) >> 1
        if heap[up] <= key:
            break
        heap[j] = heap[up]
        j = up
    heap[j] = key


@njit(inline="always", cache=True)
def _pop(heap: np.ndarray, n: int) -> np.int64:
    """Pop the smallest of a heap of n entries."""
    top = heap[0]
    if n > 1:
        heap[0] = heap[n - 1]
        _sift_down(heap, n - 1, 0)
    return top


@njit(parallel=True, cache=True)
def rank_order(
    score: np.ndarray, valid: np.ndarray, has_valid: bool, k: int
) -> tuple[np.ndarray, bool]:
    """The first k pool indices best-first by the SPEC tie-break. [R, k] int64.

    Small k scans the pool once with a k-entry min-heap of keys (O(P log k));
    large k sorts every key. Returns ok=False if a score is NaN or +inf (the caller raises).
    """
    n_rounds, width = score.shape
    out = np.empty((n_rounds, k), dtype=np.int64)
    nan = np.zeros(n_rounds, dtype=np.bool_)
    use_heap = 4 * k < width
    for r in prange(n_rounds):
        if not use_heap:
            keys = np.empty(width, dtype=np.int64)
            for i in range(width):
                s = np.float32(score[r, i])
                nan[r] |= not (s < np.inf)  # NaN or +inf
                keys[i] = _key(s, i, width, valid[r, i] if has_valid else True)
            keys = np.sort(keys)
            for j in range(k):
                out[r, j] = _index(keys[width - 1 - j], width)
            continue
        heap = np.empty(k, dtype=np.int64)
        for i in range(width):
            s = np.float32(score[r, i])
            nan[r] |= not (s < np.inf)  # NaN or +inf
            key = _key(s, i, width, valid[r, i] if has_valid else True)
            if i < k:
                heap[i] = key
                if i == k - 1:
                    for j in range(k // 2 - 1, -1, -1):
                        _sift_down(heap, k, j)
            elif key > heap[0]:
                heap[0] = key
                _sift_down(heap, k, 0)
        # pop the heap from its smallest key: best-first order fills from the back
        for j in range(k - 1, -1, -1):
            out[r, j] = _index(_pop(heap, j + 1), width)
    return out, not nan.any()


@njit(parallel=True, cache=True)
def draw_curves(
    draft: np.ndarray,
    valid: np.ndarray,
    has_valid: bool,
    parent: np.ndarray,
    depth: np.ndarray,
    path_prob: np.ndarray,
    law: np.ndarray,
    top_first: np.ndarray,
    n_ranks: int,
) -> tuple[np.ndarray, bool]:
    """Root-draw and PEARL-commit mass by within-subtree draft rank. [R, 4, n_ranks].

    Channels: root-draw value, root-draw size, PEARL-commit value, PEARL-commit
    size; entry j is the mass of candidates of rank <= j below their
    first-level candidate (see `decode.select.values.draw_values`). Instead of
    sorting, a best-first search from each first-level candidate pops its
    descendants in draft order: ranking keys strictly decrease along a path
    when draft scores do, so the frontier always holds the next best one.
    Returns ok=False when a draft score rises along an edge (the precondition
    fails) or a parent does not precede its child.
    """
    # One piece: the best-first search keeps its heap in the body of one prange loop; a
    # call per step from the compiled loop would cost more than the step itself.
    n_rounds, width = draft.shape
    out = np.zeros((n_rounds, 4, n_ranks), dtype=path_prob.dtype)
    bad = np.zeros(n_rounds, dtype=np.bool_)
    for r in prange(n_rounds):
        keys = np.empty(width, dtype=np.int64)
        n_children = np.zeros(width + 1, dtype=np.int64)
        for i in range(width):
            ok = valid[r, i] if has_valid else True
            keys[i] = _key(np.float32(draft[r, i]), i, width, ok)
            p = parent[r, i]
            if p >= i:
                bad[r] = True
            elif p >= 0 and ok:
                n_children[p + 1] += 1
        if bad[r]:
            continue
        for i in range(width):  # children of u: child_list[n_children[u]:n_children[u + 1]]
            n_children[i + 1] += n_children[i]
        child_list = np.empty(max(n_children[width], 1), dtype=np.int64)
        fill = n_children[:width].copy()
        for i in range(width):
            p = parent[r, i]
            if p >= 0 and (valid[r, i] if has_valid else True):
                child_list[fill[p]] = i
                fill[p] += 1
        heap = np.empty(width, dtype=np.int64)
        for g in range(width):
            if parent[r, g] >= 0 or depth[r, g] != 1 or not (valid[r, g] if has_valid else True):
                continue
            n = 0
            for c in range(n_children[g], n_children[g + 1]):
                child = keys[child_list[c]]
                bad[r] |= child > keys[g]
                _push(heap, n, ~child)  # ~key: best first
                n += 1
            first = law[r, g]
            commit = g == top_first[r]
            for j in range(n_ranks):
                if n == 0:
                    break
                key = ~_pop(heap, n)
                n -= 1
                u = _index(key, width)
                out[r, 0, j] += path_prob[r, u]
                out[r, 1, j] += first
                if commit:
                    out[r, 2, j] += path_prob[r, u]
                    out[r, 3, j] += first
                for c in range(n_children[u], n_children[u + 1]):
                    child = keys[child_list[c]]
                    bad[r] |= child > key
                    _push(heap, n, ~child)
                    n += 1
        for c in range(4):
            for j in range(1, n_ranks):
                out[r, c, j] += out[r, c, j - 1]
    return out, not bad.any()

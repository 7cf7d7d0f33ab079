"""Compiled CPU kernels for the selector's hot loops (numba).

In torch each primitive of `selection.ranking` is a chain of full-tensor passes: a
gather per pool level for a path reduction, six int64 passes to build ranking
keys, then a top-k. A compiled per-round loop touches a round's 710 candidates
while they sit in cache and is several times faster at paper scale (figures in
`bench/select_values.py`, which measures both routes in one run). numba
rather than a C++ extension because it needs no compiler at install time.

Every kernel computes what its torch counterpart computes: the same float32
operations in the same order and the same unique ranking keys, so the two
routes give identical scores and selections (`tests/test_select_kernels.py`).
`selection.ranking` chooses the route; the torch one serves CUDA tensors and is
the reference. The draw rules' kernel, whose sums agree to float32 rounding only,
lives beside its torch route in `selection.draws`; it shares the key and heap
helpers here.
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
def heap_key(score: np.float32, index: int, width: int, valid: bool) -> np.int64:
    """`selection.ranking.ranking_keys` of one candidate (larger = ranked first)."""
    # + 0.0 turns -0.0 into +0.0
    bits = np.int64(np.float32(score + np.float32(0.0)).view(np.int32))
    key32 = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone float -> int map (IEEE-754)
    if not valid:
        key32 = _INT32_MIN
    return (key32 << 32) | (width - 1 - index)


@njit(parallel=True, cache=True, nogil=True)
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


@njit(parallel=True, cache=True, nogil=True)
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


@njit(parallel=True, cache=True, nogil=True)
def first_level_ancestor_kernel(parent: np.ndarray) -> tuple[np.ndarray, bool]:
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
def key_index(key: np.int64, width: int) -> int:
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
def heap_push(heap: np.ndarray, n: int, key: np.int64) -> None:
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
def heap_pop(heap: np.ndarray, n: int) -> np.int64:
    """Pop the smallest of a heap of n entries."""
    top = heap[0]
    if n > 1:
        heap[0] = heap[n - 1]
        _sift_down(heap, n - 1, 0)
    return top


@njit(inline="always", cache=True)
def _rank_row(
    score: np.ndarray, valid: np.ndarray, has_valid: bool, k: int, out: np.ndarray
) -> bool:
    """The first k pool indices of one round best-first into `out`; False if a score is NaN/+inf.

    Small k scans the pool once with a k-entry min-heap of keys (O(P log k));
    large k sorts every key.
    """
    width = score.shape[0]
    nan = False
    if not 4 * k < width:
        keys = np.empty(width, dtype=np.int64)
        for i in range(width):
            s = np.float32(score[i])
            nan |= not (s < np.inf)  # NaN or +inf
            keys[i] = heap_key(s, i, width, valid[i] if has_valid else True)
        keys = np.sort(keys)
        for j in range(k):
            out[j] = key_index(keys[width - 1 - j], width)
        return not nan
    heap = np.empty(k, dtype=np.int64)
    for i in range(width):
        s = np.float32(score[i])
        nan |= not (s < np.inf)  # NaN or +inf
        key = heap_key(s, i, width, valid[i] if has_valid else True)
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
        out[j] = key_index(heap_pop(heap, j + 1), width)
    return not nan


@njit(parallel=True, cache=True, nogil=True)
def rank_order_kernel(
    score: np.ndarray, valid: np.ndarray, has_valid: bool, k: int
) -> tuple[np.ndarray, bool]:
    """The first k pool indices best-first by the SPEC tie-break. [R, k] int64.

    Returns ok=False if a score is NaN or +inf (the caller raises).
    """
    n_rounds = score.shape[0]
    out = np.empty((n_rounds, k), dtype=np.int64)
    nan = np.zeros(n_rounds, dtype=np.bool_)
    for r in prange(n_rounds):
        nan[r] = not _rank_row(score[r], valid[r] if has_valid else valid[0], has_valid, k, out[r])
    return out, not nan.any()


@njit(inline="always", cache=True)
def _merge_rank_row(
    score: np.ndarray,
    valid: np.ndarray,
    has_valid: bool,
    draft_order: np.ndarray,
    first: np.ndarray,
    n_groups: int,
    k: int,
    out: np.ndarray,
) -> bool:
    """`_rank_row` for scores whose first-level factors alone differ from draft's.

    Every candidate belongs to one first-level subtree (`first`: its depth-1
    ancestor, in 0..n_groups-1). Each subtree's candidates, laid out in the
    draft order, are sorted by their ranking keys (an insertion sort: the draft
    order already nearly sorts them, a shared first factor moving them
    together), then the sorted subtrees are merged by key. Sorted lists merged
    by unique keys give the order one sort of all keys gives, whatever the
    starting arrangement, which only sets the cost: about one comparison per
    candidate instead of a heap or a sort of the pool.
    """
    width = score.shape[0]
    nan = False
    keys = np.empty(width, dtype=np.int64)
    for i in range(width):
        s = np.float32(score[i])
        nan |= not (s < np.inf)  # NaN or +inf
        keys[i] = heap_key(s, i, width, valid[i] if has_valid else True)
    start = np.zeros(n_groups + 1, dtype=np.int64)
    for i in range(width):
        start[first[i] + 1] += 1
    for g in range(n_groups):
        start[g + 1] += start[g]
    fill = start[:n_groups].copy()
    lists = np.empty(width, dtype=np.int64)  # keys, grouped by subtree, in draft order
    for j in range(width):
        u = draft_order[j]
        g = first[u]
        lists[fill[g]] = keys[u]
        fill[g] += 1
    for g in range(n_groups):  # insertion sort, best first
        for a in range(start[g] + 1, start[g + 1]):
            item = lists[a]
            b = a - 1
            while b >= start[g] and lists[b] < item:
                lists[b + 1] = lists[b]
                b -= 1
            lists[b + 1] = item
    heap = np.empty(n_groups, dtype=np.int64)  # ~key of each subtree's next candidate
    head = start[:n_groups].copy()
    n = 0
    for g in range(n_groups):
        if head[g] < start[g + 1]:
            heap_push(heap, n, ~lists[head[g]])
            n += 1
    for j in range(k):
        key = ~heap_pop(heap, n)
        n -= 1
        u = key_index(key, width)
        out[j] = u
        g = first[u]
        head[g] += 1
        if head[g] < start[g + 1]:
            heap_push(heap, n, ~lists[head[g]])
            n += 1
    return not nan


@njit(cache=True, nogil=True)
def _all_nan(lead_row: np.ndarray) -> bool:
    """No leading factor given: the round ranks like draft selection."""
    for i in range(lead_row.shape[0]):  # noqa: SIM110 (a loop numba compiles; no generators)
        if not np.isnan(lead_row[i]):
            return False
    return True


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
def _cumulative_mass(path_prob_row, order) -> np.ndarray:
    """Cumulative path probability in rank order, accumulated in float64 and rounded to
    float32 as torch's CPU cumsum does."""
    acc = 0.0
    mass = np.empty(order.shape[0], dtype=np.float32)
    for j in range(order.shape[0]):
        acc += path_prob_row[order[j]]
        mass[j] = np.float32(acc)
    return mass


@njit(parallel=True, cache=True, nogil=True)
def lead_factor_values(
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
    draft_order: np.ndarray,
    first: np.ndarray,
    n_groups: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Values of a rule whose leading factors are replaced, per round in one pass.

    What `selection.values` computes from a rule's scores, fused: scores =
    path sums of per-edge log factors, `lead[r, i]` for the first L pool columns
    where not NaN and the draft factor elsewhere (the same float32 sums as
    `path_reduce`); the best-first top k (`_rank_row`); the cumulative path
    probability in that order, accumulated in float64 and rounded to float32 as
    torch's CPU cumsum does, read at positions `at` (-1: the empty tree, 0).
    `curve` keeps the whole cumulative curve ([R, k]; k must then be the pool).
    With `n_groups` > 0 (first-level factors only, `draft_order` the whole pool's,
    `first` each candidate's depth-1 ancestor) the ranking merges the subtrees
    (`_merge_rank_row`); else it takes the heap or sort of `_rank_row`.
    Rounds known to rank like a source rule are copied from its outputs
    (`src_values`, `src_curve`): those with `copy[r]`, and with `nan_copies`
    those whose leading factors are all NaN (the source is then draft selection).
    Returns (values [R, len(at)] float32, curve [R, k or 0] float32, status):
    status 0 ok, 1 a parent after its child (not pool order), 2 a NaN/+inf score.
    """
    n_rounds, width = draft_logprob.shape
    values = np.zeros((n_rounds, at.shape[0]), dtype=np.float32)
    curves = np.empty((n_rounds, k if curve else 0), dtype=np.float32)
    status = np.zeros(n_rounds, dtype=np.int64)
    for r in prange(n_rounds):
        if copy[r] or (nan_copies and _all_nan(lead[r])):
            values[r] = src_values[r]
            if curve:
                curves[r] = src_curve[r]
            continue
        score = np.empty(width, dtype=np.float32)
        if not _lead_scores(draft_logprob[r], lead[r], parent[r], score):
            status[r] = 1
            continue
        order = np.empty(k, dtype=np.int64)
        ok_valid = valid[r] if has_valid else valid[0]
        if n_groups > 0:
            ok = _merge_rank_row(score, ok_valid, has_valid, draft_order[r], first[r], n_groups,
                                 k, order)  # fmt: skip
        else:
            ok = _rank_row(score, ok_valid, has_valid, k, order)
        if not ok:
            status[r] = 2
            continue
        mass = _cumulative_mass(path_prob[r], order)
        for b in range(at.shape[0]):
            if at[b] >= 0:
                values[r, b] = mass[at[b]]
        if curve:
            curves[r] = mass
    return values, curves, status.max()

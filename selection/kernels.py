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
from numba import prange

from specrank.runtime.jit import njit

_INT32_MIN = -(2**31)


def use_threads(n_threads: int) -> None:
    """Run the kernels on n_threads (capped by numba's pool), e.g. torch.get_num_threads()."""
    numba.set_num_threads(max(1, min(n_threads, numba.config.NUMBA_NUM_THREADS)))


@njit(inline="always")
def heap_key(score: np.float32, index: int, width: int, valid: bool) -> np.int64:
    """`selection.ranking.ranking_keys` of one candidate (larger = ranked first)."""
    # + 0.0 turns -0.0 into +0.0
    bits = np.int64(np.float32(score + np.float32(0.0)).view(np.int32))
    key32 = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone float -> int map (IEEE-754)
    if not valid:
        key32 = _INT32_MIN
    return (key32 << 32) | (width - 1 - index)


@njit(parallel=True, nogil=True)
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


@njit(nogil=True)
def greedy_edges(
    token: np.ndarray,
    parent: np.ndarray,
    argmax: np.ndarray,
    root_argmax: np.ndarray,
    lengths: np.ndarray,
) -> np.ndarray:
    """Whether each candidate's token is the target's argmax at its parent's prefix (the root
    row's argmax at depth 1), False past a round's pool. [R, P] bool.

    One pass per round, where numpy's flat take, root substitution and comparison made
    three [R, P] passes and their temporaries (about 1.6x the time at paper scale:
    docs/benchmarks.md).
    """
    n_rounds, width = parent.shape
    out = np.zeros((n_rounds, width), dtype=np.bool_)
    for r in range(n_rounds):
        for i in range(min(lengths[r], width)):
            p = parent[r, i]
            if p >= width:
                raise ValueError("cand_parent: a parent index past the pool's width")
            out[r, i] = token[r, i] == (root_argmax[r] if p < 0 else argmax[r, p])
    return out


@njit(parallel=True, nogil=True)
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


@njit(parallel=True, nogil=True)
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


@njit(inline="always")
def key_index(key: np.int64, width: int) -> int:
    """The pool index a ranking key encodes in its low 32 bits."""
    return width - 1 - (key & 0xFFFFFFFF)


# Min-heaps of the unique keys themselves (the index is decoded from the low
# bits), so comparisons need no indirection; a max-heap stores ~key, which
# reverses the order without overflow.
@njit(inline="always")
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


@njit(inline="always")
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


@njit(inline="always")
def heap_pop(heap: np.ndarray, n: int) -> np.int64:
    """Pop the smallest of a heap of n entries."""
    top = heap[0]
    if n > 1:
        heap[0] = heap[n - 1]
        _sift_down(heap, n - 1, 0)
    return top


@njit(inline="always")
def _radix_order(score: np.ndarray, valid: np.ndarray, has_valid: bool, k: int,
                 out: np.ndarray) -> bool:  # fmt: skip
    """`_rank_row` by a sort of every key: an LSD radix sort, 8 bits a pass, of the keys'
    score halves (their low halves, the index tie-break, come from the sort's stability:
    the candidates enter in index order); a pass whose byte every key shares is skipped.
    About 2.5x faster than numpy's sort of the int64 keys on one thread (docs/benchmarks.md)."""
    width = score.shape[0]
    nan = False
    src_k = np.empty(width, dtype=np.uint32)
    src_i = np.empty(width, dtype=np.int32)
    for i in range(width):
        s = np.float32(score[i])
        nan |= not (s < np.inf)  # NaN or +inf
        key32 = np.int32(heap_key(s, i, width, valid[i] if has_valid else True) >> 32)
        # signed -> unsigned order (flip the sign bit), then complemented: ascending = best first
        src_k[i] = ~(np.uint32(key32) ^ np.uint32(0x80000000))
        src_i[i] = i
    dst_k = np.empty_like(src_k)
    dst_i = np.empty_like(src_i)
    count = np.empty(257, dtype=np.int64)
    for shift in range(0, 32, 8):
        count[:] = 0
        for i in range(width):
            count[((src_k[i] >> shift) & 255) + 1] += 1
        if count[((src_k[0] >> shift) & 255) + 1] == width:
            continue
        for b in range(256):
            count[b + 1] += count[b]
        for i in range(width):
            d = (src_k[i] >> shift) & 255
            dst_k[count[d]] = src_k[i]
            dst_i[count[d]] = src_i[i]
            count[d] += 1
        src_k, dst_k = dst_k, src_k
        src_i, dst_i = dst_i, src_i
    for j in range(k):
        out[j] = src_i[j]
    return not nan


STOP_MARGIN = 1e-3  # relative slack of the draft-order scan's stop, past float32 rounding


@njit(inline="always")
def _stop_below(key: np.int64, lift: float, bits: np.ndarray) -> float:
    """The draft score below which no later candidate of a draft-order scan can beat `key`.

    A rule whose scores are draft's plus at most `lift` (`fused._bounded_top_k`) scores a candidate of
    draft score d at most d + lift, up to float32 rounding: at most a few ulps a level, far
    below the STOP_MARGIN x (1 + |d| + |h|) asked here. With h the key's score and d <= 0,
    d + lift + margin < h holds exactly for d below the returned value. -inf (never stop)
    when the key is invalid or its score not finite: then any candidate may still tie or
    beat it on the index.
    """
    key32 = np.int32(key >> 32)
    if key32 == _INT32_MIN:
        return -np.inf
    bits[0] = key32 ^ ((key32 >> 31) & 0x7FFFFFFF)  # heap_key's map is its own inverse
    h = np.float64(bits.view(np.float32)[0])  # (`bits`: an int32 scratch, no allocation a call)
    if not np.isfinite(h):
        return -np.inf
    room = h - lift - STOP_MARGIN * (1.0 + abs(h))
    # d + lift + margin < h is d (1 -+ STOP_MARGIN) < room for d <= 0 or d > 0: the smaller
    return room / (1.0 - STOP_MARGIN) if room < 0 else room / (1.0 + STOP_MARGIN)


@njit(inline="always")
def _rank_row(
    score: np.ndarray, valid: np.ndarray, has_valid: bool, k: int, out: np.ndarray,
    scan: np.ndarray,
) -> bool:  # fmt: skip
    """The first k pool indices of one round best-first into `out`; False if a score is NaN/+inf.

    Small k scans the pool once with a k-entry min-heap of keys (O(P log k)), in the
    order `scan` when it holds the whole pool (else pool order): the result does not
    depend on it, the time does (in draft order, a first-level factor near draft's
    replaces few heap entries: 29 -> 17 ms for top 59 of a 2048-round sampling chunk,
    one thread; a random one gains nothing); large k sorts every key (`_radix_order`).
    """
    width = score.shape[0]
    nan = False
    if not heap_takes(k, width):
        return _radix_order(score, valid, has_valid, k, out)
    heap = np.empty(k, dtype=np.int64)
    in_scan = scan.shape[0] == width
    for t in range(width):
        i = scan[t] if in_scan else t
        s = np.float32(score[i])
        nan |= not (s < np.inf)  # NaN or +inf
        heap_offer(heap, t, k, heap_key(s, i, width, valid[i] if has_valid else True))
    heap_drain(heap, k, width, out)
    return not nan


@njit(inline="always")
def heap_takes(k: int, width: int) -> bool:
    """Whether a top k of `width` keys is found with a heap (else a radix sort of all)."""
    return 4 * k < width


@njit(inline="always")
def heap_offer(heap: np.ndarray, t: int, k: int, key: np.int64) -> bool:
    """Offer a scan's `t`-th key to the k-entry min-heap of its best keys (the first k fill
    it, heapified at the k-th); True when the heap's smallest key changed."""
    if t < k:
        heap[t] = key
        if t < k - 1:
            return False
        for j in range(k // 2 - 1, -1, -1):
            _sift_down(heap, k, j)
        return True
    if key <= heap[0]:
        return False
    heap[0] = key
    _sift_down(heap, k, 0)
    return True


@njit(inline="always")
def heap_drain(heap: np.ndarray, k: int, width: int, out: np.ndarray) -> None:
    """The heap's k indices best-first into `out` (popped from the smallest key, so the
    order fills from the back)."""
    for j in range(k - 1, -1, -1):
        out[j] = key_index(heap_pop(heap, j + 1), width)


@njit(parallel=True, nogil=True)
def rank_order_kernel(
    score: np.ndarray, valid: np.ndarray, has_valid: bool, k: int, scan: np.ndarray
) -> tuple[np.ndarray, bool]:
    """The first k pool indices best-first by the ranking tie-break (docs/method.md#ranking). [R, k] int64.

    `scan` ([R, P], e.g. the draft order, or [1, 0]: pool order) is the order a top-k heap
    scans in (`_rank_row`: the time depends on it, the result does not).
    Returns ok=False if a score is NaN or +inf (the caller raises).
    """
    n_rounds = score.shape[0]
    use_scan = scan.shape[0] == n_rounds
    out = np.empty((n_rounds, k), dtype=np.int64)
    nan = np.zeros(n_rounds, dtype=np.bool_)
    for r in prange(n_rounds):
        ok_valid = valid[r] if has_valid else valid[0]
        nan[r] = not _rank_row(score[r], ok_valid, has_valid, k, out[r],
                               scan[r] if use_scan else scan[0])  # fmt: skip
    return out, not nan.any()

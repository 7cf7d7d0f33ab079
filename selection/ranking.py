"""The tree selector: score pool candidates, keep an ancestor-closed top-B tree.

Everything is batched over rounds: tensors are `[R, P]` in *pool order* (depths
non-decreasing, parents before children; see `specrank.store.trace_schema`), on any
device. The same functions serve the offline evaluator (R = hundreds of
thousands, in chunks) and the online decoder (R = 1), so there is no per-round
Python loop anywhere.

Scores (docs/method.md#rule-values). A candidate u = (x1, ..., xd) scores the sum of per-edge log
factors along its path. Rules differ only in the factors:

    draft   : log q(x1) + log q(x2) + ... + log q(xd)
    root    : log p(x1|c) + log q(x2) + ...        (first factor replaced)
    reranker: log phat(x1) + log q(x2) + ...       (first factor replaced)
    oracle  : log p(x1|c) + log p(x2|c x1) + ...   (every factor replaced)

Ranking (docs/method.md#pool): score descending, then depth ascending, then pool index
ascending. In pool order (depth-major) the last two are the pool index itself,
so one *stable* descending sort gives the tie-break. Because every score above
is non-increasing along a path and a parent precedes its children, the top-B
set is ancestor-closed with exactly B nodes, even when log factors are exactly
0 or -inf and scores tie.

Two routes, one result. CPU tensors run the compiled per-round kernels of
`selection.kernels` (several times faster than chains of full-tensor torch
ops at paper scale); CUDA tensors run torch ops, which `torch_route()` also
forces on CPU as the reference. Both build the same float32 scores in the same
order and rank by the same unique keys, so selections are identical
(`tests/test_select_kernels.py`).
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

from selection import kernels as select_kernels

_torch_only = False  # see torch_route()


@contextmanager
def torch_route() -> Iterator[None]:
    """Run the primitives with torch even on CPU tensors (the reference route).

    CPU tensors otherwise go through the compiled kernels of
    `selection.kernels`, which give identical results; the tests and
    `bench/select_values.py` use this to compare the two routes.
    """
    global _torch_only
    previous, _torch_only = _torch_only, True
    try:
        yield
    finally:
        _torch_only = previous


_KERNEL_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)


def compiled_route(t: Tensor) -> bool:
    """Whether a primitive on `t` runs as a compiled CPU kernel.

    CPU tensors of the dtypes the kernels are compiled for; CUDA tensors, other
    dtypes (bfloat16 has no numpy view) and autograd tensors take the torch route.
    """
    if t.device.type != "cpu" or _torch_only or t.dtype not in _KERNEL_DTYPES or t.requires_grad:
        return False
    n_threads = torch.get_num_threads()
    select_kernels.use_threads(n_threads)
    # numba's OpenMP threading layer starts its pool on first use with
    # omp_set_num_threads(NUMBA_NUM_THREADS), which is torch's intra-op pool too
    # (one libgomp): restore torch's count, or every later forward runs on another
    # number of threads (other float32 bits, so a prompt's trace would depend on what
    # the process decoded before it; and on a busy machine far slower).
    if torch.get_num_threads() != n_threads:
        torch.set_num_threads(n_threads)
    return True


def kernel_valid(valid: Tensor | None, like: Tensor) -> tuple[np.ndarray, bool]:
    """A valid mask as the kernels take it: (array, has_valid); None means all valid."""
    if valid is None:
        return np.ones((1, 1), dtype=np.bool_), False
    return valid.expand_as(like).contiguous().numpy(), True


def _check_parent(parent: Tensor) -> None:
    if parent.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"parent must be an int64/int32 tensor [R, P]; got dtype {parent.dtype}")


Levels = list[tuple[int, int]]


def pool_levels(parent: Tensor, depth: Tensor) -> Levels | None:
    """Contiguous pool-index ranges of depths 1, 2, ... when every round shares them.

    Pools grown with one configuration have the same depth layout in every
    round (10, 100, 100, ...); then path quantities take one pass per level
    instead of a fixed-point iteration, and the leading depths are leading
    columns. Returns None when layouts differ or a parent does not sit in an
    earlier level (then the general routes are used).
    """
    _check_parent(parent)
    if depth.shape[0] == 0 or depth.shape[-1] == 0:
        return None
    d = depth[0].tolist()  # candidate layout from the first round, checked on all below
    if d[0] != 1 or any(b < a for a, b in itertools.pairwise(d)):
        return None
    bounds = [0] + [i for i in range(1, len(d)) if d[i] != d[i - 1]] + [len(d)]
    levels = list(itertools.pairwise(bounds))
    if compiled_route(depth) and depth.dim() == 2:
        level_start = np.repeat([lo for lo, _ in levels], [hi - lo for lo, hi in levels])
        holds = select_kernels.layout_holds(
            depth.contiguous().numpy(), parent.contiguous().numpy(), np.asarray(d), level_start
        )
        return levels if holds else None
    # Column-wise min/max: one reduction pass each over depth and parent, where
    # per-level boolean checks cost several full passes.
    d_min, d_max = torch.aminmax(depth, dim=0)
    if not (torch.equal(d_min, d_max) and d_min.tolist() == d):
        return None
    p_min, p_max = torch.aminmax(parent, dim=0)
    lo1, hi1 = levels[0]
    if not bool((p_max[lo1:hi1] < 0).all()):
        return None
    for lo, hi in levels[1:]:
        if not bool((p_min[lo:hi] >= 0).all() and (p_max[lo:hi] < lo).all()):
            return None
    return levels


def _path_reduce(
    edge: Tensor, parent: Tensor, levels: Levels | None, identity: float, combine
) -> Tensor:
    _check_parent(parent)
    if compiled_route(edge) and edge.dim() == 2:
        out, in_pool_order = select_kernels.path_reduce(
            edge.contiguous().numpy(), parent.contiguous().numpy(), combine is torch.mul
        )
        if in_pool_order:
            return torch.from_numpy(out)
    acc = edge.clone()
    if levels:
        # One pass per level: every parent sits in an earlier level, already final.
        for lo, hi in levels[1:]:
            above = torch.gather(acc, -1, parent[:, lo:hi].long())
            acc[:, lo:hi] = combine(above, edge[:, lo:hi])
        return acc
    # General case, fixed-point propagation: after k sweeps every node of depth
    # <= k holds its full path value; stop when nothing changes.
    has_parent = parent >= 0  # [R, P]
    gather_idx = parent.clamp(min=0).long()  # [R, P]
    for _ in range(edge.shape[-1]):
        above = torch.where(has_parent, torch.gather(acc, -1, gather_idx), identity)
        new = combine(above, edge)
        if torch.equal(new, acc):
            break
        acc = new
    return acc


def path_sum(edge: Tensor, parent: Tensor, levels: Levels | None = None) -> Tensor:
    """Sum of per-edge values along each candidate's path from the root. [R, P].

    Pass `levels` (from `pool_levels`) for the fast one-pass-per-level route.
    """
    return _path_reduce(edge, parent, levels, 0.0, torch.add)


def path_product(edge: Tensor, parent: Tensor, levels: Levels | None = None) -> Tensor:
    """Product of per-edge values along each candidate's path (path probability). [R, P]."""
    return _path_reduce(edge, parent, levels, 1.0, torch.mul)


def first_level_ancestor(parent: Tensor, levels: Levels | None = None) -> Tensor:
    """Pool index of each candidate's depth-1 ancestor (itself at depth 1). [R, P] int64."""
    _check_parent(parent)
    if compiled_route(parent) and parent.dim() == 2:
        out, in_pool_order = select_kernels.first_level_ancestor_kernel(parent.contiguous().numpy())
        if in_pool_order:
            return torch.from_numpy(out)
    self_idx = torch.arange(parent.shape[-1], device=parent.device).expand_as(parent)
    anc = torch.where(parent >= 0, parent.long(), self_idx)
    if levels:
        for lo, hi in levels[1:]:  # a parent's ancestor is final one level up
            anc[:, lo:hi] = torch.gather(anc, -1, anc[:, lo:hi])
        return anc
    for _ in range(parent.shape[-1]):  # pointer jumping: log2(depth) rounds
        up = torch.gather(anc, -1, anc)
        if torch.equal(up, anc):
            break
        anc = up
    return anc


_INT32_MIN = -(2**31)
NAN_SCORES_MESSAGE = (
    "candidate scores contain NaN or +inf; a score must be a finite number or -inf "
    "(+inf ties would break the ancestor-closed top-B tree)"
)
# Keys are assembled by viewing [low, high] int32 pairs as one int64, which is
# exact only on little-endian hosts (x86, ARM, CUDA); elsewhere use shifts.
_LITTLE_ENDIAN = sys.byteorder == "little"


def ranking_keys(score: Tensor, valid: Tensor | None = None) -> Tensor:
    """Unique int64 keys, larger = ranked first, encoding the full ranking tie-break (docs/method.md#ranking). [R, P].

    High 32 bits: the float32 score mapped to an order-preserving int32 (so
    -inf and exact ties compare correctly); low 32 bits: P-1-index, so equal
    scores fall to the lower pool index (= shallower depth in pool order).
    Invalid candidates get the lowest score key and rank after -inf. Unique
    keys let us use fast unstable sorts and top-k with a deterministic result.
    """
    if not bool((score < math.inf).all()):  # NaN and +inf both fail `< inf`
        raise ValueError(NAN_SCORES_MESSAGE)
    bits = (score.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    key32 = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone float -> int map (IEEE-754)
    if valid is not None:
        key32 = torch.where(valid, key32, _INT32_MIN)
    width = score.shape[-1]
    low = width - 1 - torch.arange(width, device=score.device, dtype=torch.int32)
    if _LITTLE_ENDIAN:  # one int32-pair write instead of three int64 passes
        pair = torch.stack(torch.broadcast_tensors(low, key32), dim=-1)
        return pair.view(torch.int64).squeeze(-1)
    return (key32.long() << 32) | low.long()


def rank_order(
    score: Tensor,
    valid: Tensor | None = None,
    k: int | None = None,
    keys: Tensor | None = None,
    scan: Tensor | None = None,
) -> Tensor:
    """Pool indices best-first by the ranking tie-break (docs/method.md#ranking); invalid last. [R, k or P].

    `k` keeps only the first k (a top-k is much cheaper than a full sort);
    `keys` passes precomputed `ranking_keys(score, valid)`; `scan`, an order of the whole
    pool near the expected one (the draft order), makes the compiled top-k cheaper
    without changing its result.
    """
    if keys is None and compiled_route(score) and score.dim() == 2:
        width = score.shape[-1]
        valid_np, has_valid = kernel_valid(valid, score)
        order, no_nan = select_kernels.rank_order_kernel(
            score.float().contiguous().numpy(),
            valid_np,
            has_valid,
            width if k is None else min(k, width),
            np.zeros((1, 0), np.int64) if scan is None else scan.contiguous().numpy(),
        )
        if not no_nan:
            raise ValueError(NAN_SCORES_MESSAGE)
        return torch.from_numpy(order)
    keys = ranking_keys(score, valid) if keys is None else keys
    width = keys.shape[-1]
    if k is not None and k < width // 4:
        return torch.topk(keys, k, dim=-1, sorted=True).indices
    if keys.device.type == "cpu":
        # numpy's SIMD argsort is ~3x faster than torch.sort on CPU here
        # (bench/select_values.py); keys are unique, so an unstable sort is exact.
        order = torch.from_numpy(np.argsort(~keys.numpy(), axis=-1))
    else:
        order = torch.sort(keys, dim=-1, descending=True).indices
    return order if k is None else order[:, :k]


def rank_candidates(score: Tensor, valid: Tensor | None = None) -> Tensor:
    """Rank of every candidate (0 = kept first). [R, P] int64."""
    return ranks_of_order(rank_order(score, valid))


def ranks_of_order(order: Tensor) -> Tensor:
    """The inverse permutation of a best-first `order`: each candidate's rank. [R, P] int64."""
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions)


def top_b(score: Tensor, budget: int, valid: Tensor | None = None) -> Tensor:
    """The selected tree: the `budget` best-ranked valid candidates. [R, P] bool.

    Ancestor-closed with exactly min(budget, n_valid) nodes, provided scores are
    non-increasing along paths and `valid` is itself ancestor-closed.
    """
    if budget < 0:
        raise ValueError(f"The 'budget' must be an int >= 0. Got {budget} instead.")
    width = score.shape[-1]
    keep = torch.zeros_like(score, dtype=torch.bool)
    if budget > 0:
        order = rank_order(score, valid, k=min(budget, width))
        keep.scatter_(-1, order, True)
    return keep if valid is None else keep & valid


def draft_scores(draft_logprob: Tensor, parent: Tensor, levels: Levels | None = None) -> Tensor:
    """Cumulative draft log-probability of every candidate (the draft rule). [R, P].

    Refuses NaN, +inf or positive log q: scores must not rise along a path.
    """
    if not bool((draft_logprob <= 0).all()):
        raise ValueError(
            "draft log-probabilities must be <= 0 or -inf (scores may not rise along a "
            f"path); found NaN, +inf or positive values (largest {draft_logprob.max().item()})"
        )
    return path_sum(draft_logprob, parent, levels)


def leading_factor_edges(
    draft_logprob: Tensor, replacement: Tensor, depth: Tensor, upto: int, levels: Levels | None
) -> Tensor:
    """Per-edge log factors: `replacement` at depths <= upto (where not NaN), draft below. [R, P].

    With `levels` the replaced depths are the leading columns, so `replacement`
    may cover just those ([R, n]) and nothing else is computed for the rest.
    """
    if levels:
        end = levels[min(upto, len(levels)) - 1][1]
        lead = replacement[:, :end]
        lead = torch.where(torch.isnan(lead), draft_logprob[:, :end], lead)
        return torch.cat([lead, draft_logprob[:, end:]], dim=-1)
    mask = (depth <= upto) & ~torch.isnan(replacement)
    return torch.where(mask, replacement, draft_logprob)


def replace_first_factor(
    draft_logprob: Tensor, depth: Tensor, first_logprob: Tensor, parent: Tensor
) -> Tensor:
    """Scores with the depth-1 factor replaced: log r(x1) + log q(x2) + ... [R, P].

    `first_logprob` is [R, P] (its values at depth-1 entries are used; NaN keeps
    the draft factor). This is how root, reranker, calibrated and substituted
    rules enter the selector.
    """
    levels = pool_levels(parent, depth)
    edge = leading_factor_edges(draft_logprob, first_logprob, depth, 1, levels)
    return path_sum(edge, parent, levels)


def restrict_to_top_m(draft_score: Tensor, top_m: int, valid: Tensor | None = None) -> Tensor:
    """Valid mask of the sub-pool of the M highest-ranked candidates under draft ranking.

    The result is ancestor-closed, so every rule restricted to it still selects
    ancestor-closed trees. M <= 0 means no restriction.
    """
    if top_m <= 0:
        return torch.ones_like(draft_score, dtype=torch.bool) if valid is None else valid
    return top_b(draft_score, top_m, valid)

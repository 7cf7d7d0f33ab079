"""A tree's coverage under a scored-set policy, as compiled passes per round
(`rerank.evaluate.policy.own_tree_coverage`'s CPU route; its torch route stays the
reference, and tests/test_policy.py holds the two equal bit for bit).

The torch route ranks every candidate, then builds the tree, frontier and scored set as
[R, P] masks: about ten passes over the pool per call, 31 ms per 2,048 rounds under
top_m. The kernel walks each round's order once, over the first B + M positions under
top_m. The coverage is a float64 sum of the frontier's scored path probabilities, and
its bits depend on the order of the additions; so

- a round with at most two such terms (every greedy round: its one path leaves the tree
  once) has the sum directly: adding zeros is exact, and a + b is b + a;
- when any round has more, the terms are written where the torch route's `where` would
  put them and the same torch sum adds them, so every sum is that route's to the bit.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from torch import Tensor

from specrank.runtime.jit import njit

# the policies whose scored set reaches outside the tree (`tree` scores the tree alone)
_MODES = {"top_m": 0, "frontier": 1, "record": 2, "pool": 3}
# Each thread's [R, P] terms, kept for its next call: a chunk's calls (two budgets, two or
# more orders) share one shape, and a fresh 6 MB array costs its page faults each time
# (about 4 ms of the 11 per call on 2,048 rounds). The sum has read it before it is reused.
_TERMS = threading.local()


@njit(nogil=True)
def _coverage(order, valid, parent, path_prob, scored, budget, mode, top_m, terms, write,
              cov, n_tree, n_scored):  # fmt: skip
    """Per round r: n_tree[r] and n_scored[r], the tree's nodes and the scored prefixes
    outside it; cov[r], the sum of the terms (P(c) for c in the frontier and the scored
    set) where they are at most two. With `write`, terms[r] holds them (zeros elsewhere).
    Returns the most terms of any round."""
    rounds, width = order.shape
    in_tree = np.zeros(width, dtype=np.bool_)
    most = 0
    for r in range(rounds):
        in_tree[:] = False
        if write:
            terms[r, :] = 0
        nodes = 0
        for k in range(min(budget, width)):  # the tree: the valid ones of the first B
            c = order[r, k]
            if valid[r, c]:
                in_tree[c] = True
                nodes += 1
        outside = count = 0
        total = 0.0
        if mode == 0:  # top_m: the valid ones of the next M in the rule's own order
            for k in range(min(budget, width), min(budget + top_m, width)):
                c = order[r, k]
                v = valid[r, c]
                outside += v
                p = parent[r, c]
                # arithmetic where it can be: the valid and frontier tests mispredict often
                x = path_prob[r, c] if v and (p < 0 or in_tree[max(p, 0)]) else 0.0
                count += x != 0
                total += np.float64(x)
                if write and x != 0:
                    terms[r, c] = x
        else:  # the pool, in pool order
            for c in range(width):
                if not valid[r, c] or in_tree[c]:
                    continue
                p = parent[r, c]
                frontier = p < 0 or in_tree[p]
                q = frontier if mode == 1 else (scored[r, c] if mode == 2 else True)
                if q:
                    outside += 1
                    if frontier and path_prob[r, c] != 0:
                        count += 1
                        total += np.float64(path_prob[r, c])
                        if write:
                            terms[r, c] = path_prob[r, c]
        n_tree[r] = nodes
        n_scored[r] = outside
        cov[r] = total if count <= 2 else np.nan
        most = max(most, count)
    return most


def compiled_coverage(order: Tensor, valid: Tensor, parent: Tensor, path_prob: Tensor,
                      budget: int, policy: str, top_m: int, scored: Tensor | None,
                      few_terms: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """`own_tree_coverage`'s (coverage, tree size, prefixes scored outside the tree) for a
    policy other than `tree`, on CPU tensors ([R, P]; `scored` only for `record`).
    `few_terms`: whether every round is expected to have at most two terms (greedy rounds),
    so that the sums are tried without the terms first; only the time depends on it."""
    rounds = order.shape[0]
    prob = path_prob.contiguous().numpy()
    terms = getattr(_TERMS, "array", None)
    if terms is None or terms.shape != prob.shape or terms.dtype != prob.dtype:
        terms = _TERMS.array = np.empty(prob.shape, dtype=prob.dtype)
    cov = np.empty(rounds, dtype=np.float64)
    n_tree = np.empty(rounds, dtype=np.int64)
    n_scored = np.empty(rounds, dtype=np.int64)
    flags = valid.contiguous().numpy()
    args = (order.contiguous().numpy(), flags, parent.contiguous().numpy(), prob,
            flags if scored is None else scored.contiguous().numpy(), budget, _MODES[policy],
            top_m, terms)  # fmt: skip
    # the sums without the terms first where few are expected; the terms written (and,
    # where a round has more than two, summed by the torch route's own sum) otherwise
    direct = few_terms and _coverage(*args, False, cov, n_tree, n_scored) <= 2
    if not direct and _coverage(*args, True, cov, n_tree, n_scored) > 2:
        cov = torch.from_numpy(terms).sum(-1, dtype=torch.float64).numpy()
    return torch.from_numpy(cov), torch.from_numpy(n_tree), torch.from_numpy(n_scored)


@njit(nogil=True)
def _parents_scored(scored, parent, valid, out):
    for r in range(parent.shape[0]):
        out[r] = True
        for c in range(parent.shape[1]):
            p = parent[r, c]
            if valid[r, c] and p >= 0 and not scored[r, p]:
                out[r] = False
                break


def parents_scored(scored: Tensor, parent: Tensor, valid: Tensor) -> np.ndarray:
    """[R] bool: whether every valid candidate's parent (if any) was scored, for CPU tensors
    (`rerank.evaluate.policy.simulable_rounds`: one pass, not four [R, P] ones)."""
    out = np.empty(parent.shape[0], dtype=np.bool_)
    _parents_scored(scored.contiguous().numpy(), parent.contiguous().numpy(),
                    valid.contiguous().numpy(), out)  # fmt: skip
    return out

"""Stopping rules of tree verification: exact expectations and a Monte Carlo check (docs/method.md#verification).

A pool is given per round as `[R, P]` arrays in pool order: `parent` (-1 =
root), `edge_prob` (the target probability of each candidate's edge under the
decoding law; a reached node draws each pool child with its edge probability
and leaves the pool with the rest of its row's mass), the verified tree `T`
(`in_tree`, ancestor-closed) and the scored set `Q ⊇ T` (`scored`).

Traversal from the root: the reached node u draws a token. If the child c it
labels is *acceptable*, c is accepted and becomes the reached node; otherwise
the draw is the continuation, the emitted address is c, and the round is
covered iff c is a scored pool node. Rules differ only in what is acceptable:

    exhaustive    c in T
    cap-k         c in T and depth(c) <= k       (the (k+1)-th draw is emitted)
    sampled-leaf  c in T and c has a child in T  (a draw on a leaf of T is emitted)

Each acceptable set is ancestor-closed, so with P(c) the path probability of c
(product of edge probabilities along its path):

    E[accepted] = sum_c P(c) [c acceptable]
    P(covered)  = sum_c P(c) [parent(c) is the root or acceptable] [c not acceptable] [c in Q]
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from selection.ranking import path_product

STOP_RULES = ("exhaustive", "cap", "sampled_leaf")


def _check_rule(rule: str, cap: int | None) -> None:
    if rule not in STOP_RULES:
        raise ValueError(f"The 'rule' parameter must be one of {STOP_RULES}. Got {rule!r} instead.")
    if rule == "cap" and (not isinstance(cap, int) or cap < 0):
        raise ValueError(
            f"The 'cap' parameter of rule 'cap' must be an int >= 0. Got {cap!r} instead."
        )


def _parent_value(values: Tensor, parent: Tensor, root_value: bool) -> Tensor:
    """values[parent] for every candidate (root_value for children of the root). [R, P]."""
    above = torch.gather(values, -1, parent.clamp(min=0).long())
    return torch.where(parent >= 0, above, torch.full_like(above, root_value))


def depth_of(parent: Tensor) -> Tensor:
    """Depth of every candidate (1 = child of the root). [R, P] int64."""
    depth = torch.ones_like(parent, dtype=torch.int64)
    for _ in range(parent.shape[-1]):  # stops after max-depth sweeps
        new = torch.where(parent >= 0, _parent_value(depth, parent, False) + 1, 1)
        if torch.equal(new, depth):
            break
        depth = new
    return depth


def has_tree_child(parent: Tensor, in_tree: Tensor) -> Tensor:
    """Whether each candidate has a child in the tree (False for leaves of T). [R, P] bool."""
    n_rounds, width = parent.shape
    slots = torch.zeros(
        n_rounds, width + 1, dtype=torch.int64, device=parent.device
    )  # slot 0 = root
    slots.scatter_add_(-1, (parent.long() + 1), in_tree.long())
    return slots[:, 1:] > 0


def check_tree(parent: Tensor, in_tree: Tensor, scored: Tensor) -> None:
    """Refuse a tree that is not ancestor-closed or a scored set that misses part of it."""
    orphan = in_tree & ~_parent_value(in_tree, parent, True)
    if orphan.any():
        r, i = (int(v) for v in orphan.nonzero()[0])
        raise ValueError(
            f"in_tree is not ancestor-closed: round {r}, candidate {i} is in T but its parent is not"
        )
    missing = in_tree & ~scored
    if missing.any():
        r, i = (int(v) for v in missing.nonzero()[0])
        raise ValueError(
            f"scored must contain the tree: round {r}, candidate {i} is in T but not scored"
        )


def acceptable(parent: Tensor, in_tree: Tensor, rule: str, cap: int | None = None) -> Tensor:
    """Candidates the rule accepts when drawn at their (reached) parent. [R, P] bool."""
    _check_rule(rule, cap)
    if rule == "exhaustive":
        return in_tree.clone()
    if rule == "cap":
        return in_tree & (depth_of(parent) <= cap)
    return in_tree & has_tree_child(parent, in_tree)


def expected_outcome(
    edge_prob: Tensor,
    parent: Tensor,
    in_tree: Tensor,
    scored: Tensor,
    rule: str = "exhaustive",
    cap: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact expected accepted tokens and coverage probability of each round. ([R], [R])."""
    check_tree(parent, in_tree, scored)
    acc = acceptable(parent, in_tree, rule, cap)  # [R, P]
    path_p = path_product(edge_prob, parent)  # [R, P]
    reached_parent = _parent_value(acc, parent, True)
    exits_covered = reached_parent & ~acc & scored
    zero = torch.zeros_like(path_p)
    return torch.where(acc, path_p, zero).sum(-1), torch.where(exits_covered, path_p, zero).sum(-1)


def simulate(
    edge_prob: np.ndarray,
    parent: np.ndarray,
    in_tree: np.ndarray,
    scored: np.ndarray,
    rule: str,
    n_trials: int,
    rng: np.random.Generator,
    cap: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Monte Carlo traversals: accepted tokens [R, N] int64 and covered flags [R, N] bool.

    Walks the pool draw by draw (independently of `expected_outcome`'s algebra):
    children of each node are gathered through a CSR index and one uniform per
    step picks a child by its edge probability, or an exit with the rest.
    """
    _check_rule(rule, cap)
    edge_prob = np.asarray(edge_prob, dtype=np.float64)
    parent, in_tree, scored = (
        np.asarray(parent).astype(np.int64),
        np.asarray(in_tree),
        np.asarray(scored),
    )
    n_rounds, width = parent.shape
    # Node ids: r * (P + 1) + 1 + i for candidate i, r * (P + 1) for the root of round r.
    parent_id = np.arange(n_rounds)[:, None] * (width + 1) + 1 + parent  # [R, P]
    order = np.argsort(parent_id.reshape(-1), kind="stable")  # children grouped by parent
    counts = np.bincount(parent_id.reshape(-1), minlength=n_rounds * (width + 1))
    starts = np.cumsum(counts) - counts
    fanout = max(int(counts.max()), 1)
    leaf_in_tree = (
        in_tree & ~has_tree_child(torch.from_numpy(parent), torch.from_numpy(in_tree)).numpy()
    )
    flat_prob, flat_tree, flat_scored = (
        edge_prob.reshape(-1),
        in_tree.reshape(-1),
        scored.reshape(-1),
    )
    flat_leaf = leaf_in_tree.reshape(-1)

    node = np.repeat(np.arange(n_rounds) * (width + 1), n_trials)  # [R * N]
    accepted = np.zeros(n_rounds * n_trials, dtype=np.int64)
    covered = np.zeros(n_rounds * n_trials, dtype=bool)
    active = np.ones(n_rounds * n_trials, dtype=bool)
    while active.any():
        live = np.nonzero(active)[0]
        cur = node[live]
        slot = np.arange(fanout)
        valid = slot[None, :] < counts[cur][:, None]  # [n, K]
        kids = order[
            np.minimum(starts[cur][:, None] + slot, order.size - 1)
        ]  # flat candidate index
        cum = np.cumsum(np.where(valid, flat_prob[kids], 0.0), axis=1)
        j = (cum <= rng.random(len(live))[:, None]).sum(axis=1)  # child j, or j = K: exit the pool
        in_pool = j < counts[cur]
        child = kids[np.arange(len(live)), np.minimum(j, fanout - 1)]
        take = in_pool & flat_tree[child]
        if rule == "cap":
            take &= accepted[live] < cap
        elif rule == "sampled_leaf":
            take &= ~flat_leaf[child]
        stop = live[~take]
        covered[stop] = (in_pool & flat_scored[child])[~take]
        go = live[take]
        accepted[go] += 1
        node[go] = (go // n_trials) * (width + 1) + 1 + (child[take] % width)
        active[stop] = False
    return accepted.reshape(n_rounds, n_trials), covered.reshape(n_rounds, n_trials)

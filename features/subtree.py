"""Statistics of the pool subtree below each first-level candidate (SPEC §7).

The cumulative draft score of a prefix u = (x1, ..., xd) is
log q(x1) + ... + log q(xd), the score draft selection ranks by. "Below x1"
means the descendants of x1 in the pool, x1 itself excluded.
"""

from __future__ import annotations

import numpy as np

from features.rounds import RoundArrays

STATS = {  # name -> dtype of the [R, W] statistics below
    "subtree_size": np.int32,
    "subtree_depth": np.int32,
    "subtree_best_d2": np.float32,
    "subtree_best_deepest": np.float32,
    "subtree_draft_mass": np.float32,
    "subtree_draft_mass_rel": np.float32,
}


def pool_subtree_stats(rounds: RoundArrays, width: int) -> dict[str, np.ndarray]:
    """[R, width] statistics of the pool subtree below each first-level candidate.

    subtree_size          descendants in the pool
    subtree_depth         deepest depth in the subtree (1 = no descendants)
    subtree_best_d2       best cumulative draft score at depth 2 (NaN: no children)
    subtree_best_deepest  best cumulative draft score at subtree_depth (NaN: no descendants)
    subtree_draft_mass    sum of exp(cumulative draft score) over descendants (0 if none):
                          the draft's expected accepted length below x1
    subtree_draft_mass_rel  the same divided by q(x1): that expectation given x1 is accepted

    Rounds are processed in groups sharing one depth layout (all of them, as a
    rule: a pool configuration fixes the candidates per depth), so every depth
    is one column block of the group's [G, P] arrays.
    """
    depth = rounds.cand_depth  # [R, P]
    R = depth.shape[0]
    if R == 0 or (depth == depth[0]).all():
        layouts, group_of = depth[:1], np.zeros(R, dtype=np.int64)
    else:
        layouts, group_of = np.unique(depth, axis=0, return_inverse=True)
        group_of = group_of.ravel()
    out = {name: np.empty((R, width), dtype=dtype) for name, dtype in STATS.items()}
    for g, layout in enumerate(layouts):
        rows = np.flatnonzero(group_of == g) if len(layouts) > 1 else slice(None)
        stats = _one_layout(
            rounds.cand_parent[rows], rounds.cand_draft_logprob[rows], layout, width
        )
        for name, value in stats.items():
            out[name][rows] = value
    return out


def _depth_blocks(layout: np.ndarray) -> list[tuple[int, int]]:
    """Column range [start, end) of each depth 1..D of one pool layout [P] (padding: depth 0)."""
    n = int((layout > 0).sum())
    if (
        not (layout[:n] > 0).all()
        or (np.diff(layout[:n].astype(np.int64)) < 0).any()
        or (n and layout[0] != 1)
    ):
        raise ValueError(
            f"RoundArrays: depth layout {layout.tolist()[:40]}... is not in pool order "
            "(expected depths 1, .., non-decreasing, padding (0) last)"
        )
    ends = np.searchsorted(layout[:n], np.arange(1, int(layout.max(initial=0)) + 1), side="right")
    return list(zip([0, *ends[:-1].tolist()], ends.tolist(), strict=True))


def _one_layout(
    parent: np.ndarray, logprob: np.ndarray, layout: np.ndarray, width: int
) -> dict[str, np.ndarray]:
    """The statistics of G rounds sharing the depth layout [P]: parent, logprob [G, P]."""
    G, P = parent.shape
    blocks = _depth_blocks(layout)
    n_groups = G * width  # group = (round, first-level index)
    row_base = (np.arange(G, dtype=np.int64) * P)[:, None]  # [G, 1] flat offset of each round
    group_base = (np.arange(G, dtype=np.int64) * width)[:, None]  # [G, 1]
    cum = logprob.astype(np.float64)  # [G, P] cumulative draft log q, filled depth by depth
    anc = np.empty((G, P), dtype=np.int64)  # [G, P] first-level ancestor (depth >= 2)
    size = np.zeros(n_groups, dtype=np.int64)
    mass = np.zeros(n_groups)
    sub_depth = np.ones(n_groups, dtype=np.int32)
    best_deepest = np.full(n_groups, np.nan)
    best_d2 = np.full(n_groups, np.nan)
    for d in range(2, len(blocks) + 1):
        (ps, pe), (s, e) = blocks[d - 2], blocks[d - 1]
        par = parent[:, s:e].astype(np.int64)  # [G, n_d]
        bad = (par < ps) | (par >= pe)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise ValueError(
                f"RoundArrays: a round's candidate {s + c} at depth {d} has parent {par[r, c]}; "
                f"expected an earlier candidate at depth {d - 1}"
            )
        # np.take on flat indices: several times faster than 2-D fancy indexing
        gpar = (row_base + par).ravel()  # [G * n_d] flat index of the parent
        cum[:, s:e] += np.take(cum.ravel(), gpar).reshape(G, e - s)
        a = par if d == 2 else np.take(anc.ravel(), gpar).reshape(G, e - s)
        anc[:, s:e] = a
        key = (group_base + a).ravel()  # [G * n_d]
        score = cum[:, s:e].ravel()
        count = np.bincount(key, minlength=n_groups)
        size += count
        mass += np.bincount(key, weights=np.exp(score), minlength=n_groups)
        best = np.full(n_groups, -np.inf)
        np.maximum.at(best, key, score)
        reached = count > 0  # depths only grow, so the last depth reached is the deepest
        sub_depth[reached] = d
        best_deepest[reached] = best[reached]
        if d == 2:
            best_d2[reached] = best[reached]

    q1 = np.exp(cum[:, :width]).ravel()  # [G*W] draft prob of x1
    with np.errstate(divide="ignore", invalid="ignore"):
        # q(x1) = 0 only on padding or a degenerate drafter: then NaN/inf, never a made-up 0
        mass_rel = mass / q1
    grid = (G, width)
    return {
        "subtree_size": size.reshape(grid),
        "subtree_depth": sub_depth.reshape(grid),
        "subtree_best_d2": best_d2.reshape(grid),
        "subtree_best_deepest": best_deepest.reshape(grid),
        "subtree_draft_mass": mass.reshape(grid),
        "subtree_draft_mass_rel": mass_rel.reshape(grid),
    }

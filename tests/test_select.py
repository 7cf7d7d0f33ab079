"""Invariants of the tree selector and of rule values (SPEC §2, §6)."""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selection.draws import matched_budget
from selection.ranking import (
    first_level_ancestor,
    path_product,
    path_sum,
    pool_levels,
    rank_candidates,
    rank_order,
    restrict_to_top_m,
    top_b,
    torch_route,
)
from selection.rules import FACTOR_RULES, POOL_RULES
from selection.values import evaluate_pools
from tests.random_pools import random_pool_batch, random_tree


def _ancestor_closed(keep: np.ndarray, parent: np.ndarray) -> bool:
    return all(parent[i] < 0 or keep[parent[i]] for i in np.flatnonzero(keep))


@st.composite
def pools_and_scores(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    levels = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    parent, depth = random_tree(rng, levels)
    # per-edge log factors from a tiny set (ties), exact zeros and -inf included
    edge = draw(
        st.lists(
            st.sampled_from([0.0, -0.0, -0.5, -1.0, -np.inf]),
            min_size=len(parent),
            max_size=len(parent),
        )
    )
    return parent, depth, np.array(edge, dtype=np.float32)


@settings(max_examples=300, deadline=None)
@given(pools_and_scores(), st.integers(0, 30), st.integers(0, 30))
def test_selection_is_ancestor_closed_with_exactly_b_nodes(case, budget, top_m):
    parent, _depth, edge = case
    par = torch.from_numpy(parent)[None]
    score = path_sum(torch.from_numpy(edge)[None], par)
    keep = top_b(score, budget)[0].numpy()
    assert keep.sum() == min(budget, len(parent))
    assert _ancestor_closed(keep, parent)
    # restricted to the top-M sub-pool: still closed, exactly min(B, M, P) nodes
    valid = restrict_to_top_m(score, top_m)
    keep_m = top_b(score, budget, valid)[0].numpy()
    assert keep_m.sum() == min(budget, top_m if top_m > 0 else len(parent), len(parent))
    assert _ancestor_closed(keep_m, parent)
    assert not (keep_m & ~valid[0].numpy()).any()


@settings(max_examples=200, deadline=None)
@given(pools_and_scores())
def test_rank_follows_spec_tie_break(case):
    parent, depth, edge = case
    score = path_sum(torch.from_numpy(edge)[None], torch.from_numpy(parent)[None])[0].numpy()
    # reference: sort by (score desc, depth asc, pool index asc) with Python's stable sort
    ref = sorted(range(len(score)), key=lambda i: (-score[i], depth[i], i))
    got = rank_order(torch.from_numpy(score)[None])[0].tolist()
    assert got == ref
    ranks = rank_candidates(torch.from_numpy(score)[None])[0].tolist()
    assert [ranks[i] for i in ref] == list(range(len(ref)))


def test_top_k_order_equals_full_order():
    rng = np.random.default_rng(0)
    score = torch.from_numpy(
        rng.choice([0.0, -1.0, -2.0, -np.inf], size=(50, 400)).astype(np.float32)
    )
    assert torch.equal(rank_order(score, k=20), rank_order(score)[:, :20])


def test_nan_scores_are_refused():
    with pytest.raises(ValueError, match="NaN"):
        rank_order(torch.tensor([[0.0, float("nan")]]))


@pytest.mark.parametrize("route", ["kernels", "torch levels", "torch fixed-point"])
def test_path_reductions_match_a_python_walk_on_every_route(route):
    rng = np.random.default_rng(1)
    pool = random_pool_batch(rng, 6, [3, 5, 4, 2])
    levels = pool_levels(pool.parent, pool.depth)
    assert levels is not None and len(levels) == 4
    lv = None if route == "torch fixed-point" else levels
    with torch_route() if route.startswith("torch") else contextlib.nullcontext():
        prod = path_product(pool.target_prob, pool.parent, lv)
        summ = path_sum(pool.draft_logprob, pool.parent, lv)
        anc = first_level_ancestor(pool.parent, lv)
    for r, i in itertools.product(range(6), range(pool.shape[1])):
        p, s, j = 1.0, 0.0, i
        while pool.parent[r, j] >= 0:
            p *= float(pool.target_prob[r, j])
            s += float(pool.draft_logprob[r, j])
            j = int(pool.parent[r, j])
        p *= float(pool.target_prob[r, j])
        s += float(pool.draft_logprob[r, j])
        assert prod[r, i].item() == pytest.approx(p, rel=1e-5)
        assert summ[r, i].item() == pytest.approx(s, rel=1e-5, abs=1e-5)
        assert anc[r, i].item() == j


def _brute_force_values(pool, r, budget):
    """Reference values of one round by explicit Python loops over the pool."""
    parent = pool.parent[r].tolist()
    depth = pool.depth[r].tolist()
    n = len(parent)
    law = pool.law_edge_prob()[r].double().tolist()

    def path(i):
        out = [i]
        while parent[out[-1]] >= 0:
            out.append(parent[out[-1]])
        return out[::-1]

    prob = [float(np.prod([law[j] for j in path(i)])) for i in range(n)]
    draft = [sum(float(pool.draft_logprob[r, j]) for j in path(i)) for i in range(n)]
    order = sorted(range(n), key=lambda i: (-draft[i], depth[i], i))
    tree = set(order[:budget])
    first = [path(i)[0] for i in range(n)]
    root_draw = 1.0
    for g in (i for i in range(n) if depth[i] == 1):
        below = [i for i in order if depth[i] >= 2 and first[i] == g][: budget - 1]
        root_draw += sum(prob[i] for i in below)
    pearl = 1.0 + sum(prob[i] for i in tree if depth[i] >= 2)
    top = order[0]
    commit_below = [i for i in order if depth[i] >= 2 and first[i] == top][: budget - 1]
    commit = 1.0 + sum(prob[i] for i in commit_below)
    # oracle: best ancestor-closed B-set by brute force over all closed subsets
    best = 0.0
    for subset in itertools.combinations(range(n), min(budget, n)):
        s = set(subset)
        if all(parent[i] < 0 or parent[i] in s for i in s):
            best = max(best, sum(prob[i] for i in s))
    return {
        "draft": sum(prob[i] for i in tree),
        "root_draw": root_draw,
        "pearl": pearl,
        "pearl_commit": commit,
        "oracle": best,
    }


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_values_equal_brute_force(temperature):
    rng = np.random.default_rng(2)
    pool = random_pool_batch(rng, 8, [3, 4, 3], temperature=temperature)
    budgets = [1, 2, 4, 7, 20]
    got = evaluate_pools(pool, budgets)
    for r, (j, b) in itertools.product(range(8), enumerate(budgets)):
        ref = _brute_force_values(pool, r, b)
        for rule, value in ref.items():
            assert got[rule][r, j].item() == pytest.approx(value, abs=1e-5), (rule, r, b)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_oracle_dominates_and_draw_rules_order(temperature):
    rng = np.random.default_rng(3)
    pool = random_pool_batch(rng, 200, [6, 12, 12, 8], temperature=temperature, tie_values=True)
    budgets = [1, 2, 3, 8, 16, 59]
    v = evaluate_pools(pool, budgets, top_m=0)
    tol = 1e-5  # float32 cumulative sums of at most 38 path probabilities
    for rule in FACTOR_RULES:
        assert (v["oracle"] >= v[rule] - tol).all(), rule
    # paper, App. D.2: root-draw >= PEARL >= draft in every round; PEARL-commit <= root-draw
    assert (v["root_draw"] >= v["pearl"] - tol).all()
    assert (v["pearl"] >= v["draft"] - tol).all()
    assert (v["root_draw"] >= v["pearl_commit"] - tol).all()
    if temperature == 0:
        # greedy: root selection never accepts fewer tokens than draft selection
        assert (v["root"] >= v["draft"]).all()
        assert (v["depth_two"] >= v["root"]).all()


def test_greedy_root_row_is_a_point_mass():
    rng = np.random.default_rng(4)
    pool = random_pool_batch(rng, 50, [5, 10, 10], temperature=0.0)
    law = pool.law_edge_prob()
    assert set(law.unique().tolist()) <= {0.0, 1.0}
    v = evaluate_pools(pool, [100])  # whole pool: value = greedy path length inside it
    assert torch.allclose(v["oracle"][:, 0], path_product(law, pool.parent).sum(-1))


def test_top_m_restriction_bounds_values():
    rng = np.random.default_rng(5)
    pool = random_pool_batch(rng, 40, [5, 10, 10, 10])
    full = evaluate_pools(pool, [8, 20], rules=POOL_RULES)
    small = evaluate_pools(pool, [8, 20], rules=POOL_RULES, top_m=10)
    assert (small["oracle"] <= full["oracle"] + 1e-6).all()
    assert torch.allclose(small["draft"][:, 0], full["draft"][:, 0])  # B=8 lies inside top-10
    assert (small["root"][:, 1] <= small["oracle"][:, 1] + 1e-6).all()


def test_matched_budget_interpolates_the_size_curve():
    curve = torch.tensor([1.0, 1.5, 2.5, 4.0])
    assert matched_budget(curve, 2.0) == (2, 3, 0.5)
    lo, hi, w = matched_budget(curve, 4.0)
    assert (lo, hi) == (3, 4) and w == pytest.approx(0.0)
    with pytest.raises(ValueError, match="cannot reach mean size"):
        matched_budget(curve, 5.0)


def test_unknown_rule_is_refused():
    rng = np.random.default_rng(6)
    pool = random_pool_batch(rng, 2, [2, 2])
    with pytest.raises(ValueError, match="Unknown rule"):
        evaluate_pools(pool, [2], rules=["draft", "nope"])


def test_curves_equal_values_at_every_budget():
    rng = np.random.default_rng(7)
    pool = random_pool_batch(rng, 30, [4, 8, 8])
    budgets = list(range(1, pool.shape[1] + 1))
    v = evaluate_pools(pool, [3], rules=["pearl"], curves=True)
    at = evaluate_pools(pool, budgets, rules=["pearl", "draft"])
    assert torch.equal(v["curve/draft"], at["draft"])  # draft's value at every budget
    assert torch.allclose(v["curve/pearl"], at["pearl"], atol=1e-6)
    assert torch.allclose(v["curve/size/pearl"], at["size/pearl"], atol=1e-6)
    # sizes grow with the budget and never exceed 1 + (budget - 1) nodes
    size = v["curve/size/pearl"]
    assert (size[:, 1:] >= size[:, :-1] - 1e-6).all()
    assert (size <= torch.tensor(budgets, dtype=size.dtype) + 1e-6).all()

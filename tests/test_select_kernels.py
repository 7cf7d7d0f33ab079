"""The compiled CPU kernels give what the torch route gives (selection/kernels.py).

CPU tensors go through the kernels by default; `torch_route()` forces the torch
implementation, which also serves CUDA. Selections must be identical (same
float32 scores, same unique keys); values are sums of the same terms and agree
to float32 rounding.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selection.context import pool_context
from selection.draws import draw_values, pearl_curves
from selection.ranking import (
    draft_scores,
    first_level_ancestor,
    path_product,
    path_sum,
    pool_levels,
    rank_order,
    restrict_to_top_m,
    top_b,
    torch_route,
)
from selection.rules import DRAW_RULES, POOL_RULES
from selection.values import evaluate_pools, lead_factor_scores
from specrank.settings.paths import PROJECT_ROOT
from tests.random_pools import random_pool_batch, random_tree


def _both_routes(fn):
    """(compiled kernels, torch route) results of fn()."""
    compiled = fn()
    with torch_route():
        reference = fn()
    return compiled, reference


@st.composite
def scored_pools(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    levels = draw(st.lists(st.integers(1, 7), min_size=1, max_size=4))
    n_rounds = draw(st.integers(1, 4))
    trees = [random_tree(rng, levels) for _ in range(n_rounds)]
    parent = torch.from_numpy(np.stack([t[0] for t in trees]))
    depth = torch.from_numpy(np.stack([t[1] for t in trees]))
    # tie-heavy edges: exact zeros of both signs and -inf included
    edge = rng.choice(np.array([0.0, -0.0, -0.5, -1.0, -np.inf], dtype=np.float32), parent.shape)
    return parent, depth, torch.from_numpy(edge)


@settings(max_examples=200, deadline=None)
@given(scored_pools(), st.integers(0, 30), st.integers(1, 40))
def test_primitives_match_the_torch_route(case, top_m, k):
    parent, depth, edge = case
    width = parent.shape[1]
    prob = torch.exp(edge)
    for fn in (
        lambda: path_sum(edge, parent),
        lambda: path_product(prob, parent),
        lambda: first_level_ancestor(parent),
    ):
        got, ref = _both_routes(fn)
        assert torch.equal(got, ref)
    got, ref = _both_routes(lambda: pool_levels(parent, depth))
    assert got == ref
    score = path_sum(edge, parent)
    valid = restrict_to_top_m(score, top_m)
    # a scan order (any permutation of the pool) changes the heap's work, not its result
    scan = torch.argsort(torch.rand(score.shape, generator=torch.Generator().manual_seed(k)))
    for kk in (min(k, width), None):  # heap top-k and full sort
        got, ref = _both_routes(lambda kk=kk: rank_order(score, valid, k=kk))
        assert torch.equal(got, ref)
        assert torch.equal(rank_order(score, valid, k=kk, scan=scan), ref)


def test_pool_levels_agree_on_layouts_that_break():
    rng = np.random.default_rng(0)
    pool = random_pool_batch(rng, 5, [3, 4, 2])
    depth = pool.depth.clone()
    depth[2, 5] = 3  # one round with another depth layout
    parent = pool.parent.clone()
    parent[4, 8] = 8  # a parent that is not in an earlier level
    for d, p in ((pool.depth, pool.parent), (depth, pool.parent), (pool.depth, parent)):
        got, ref = _both_routes(lambda d=d, p=p: pool_levels(p, d))
        assert got == ref
    assert pool_levels(pool.parent, pool.depth) == [(0, 3), (3, 7), (7, 9)]
    assert pool_levels(pool.parent, depth) is None and pool_levels(parent, pool.depth) is None


def test_pools_out_of_pool_order_take_the_general_route():
    # A chain 0 <- 2 <- 1: the parent of node 1 comes after it. The kernels
    # refuse it and the torch fixed-point route gives the path values.
    parent = torch.tensor([[-1, 2, 0]])
    edge = torch.tensor([[-1.0, -2.0, -4.0]])
    assert path_sum(edge, parent).tolist() == [[-1.0, -7.0, -5.0]]
    assert first_level_ancestor(parent).tolist() == [[0, 0, 0]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("top_m", [0, 25])
def test_rule_values_match_the_torch_route(temperature, top_m):
    rng = np.random.default_rng(8)
    pool = random_pool_batch(rng, 120, [6, 12, 12, 8], temperature=temperature, tie_values=True)
    budgets = [1, 2, 8, 20, 38]
    noise = torch.rand(pool.shape, generator=torch.Generator().manual_seed(0))
    extra = {"noisy": path_sum(pool.draft_logprob - noise, pool.parent)}  # still path-monotone
    got, ref = _both_routes(
        lambda: evaluate_pools(
            pool, budgets, POOL_RULES, top_m=top_m, extra_scores=extra, curves=True
        )
    )
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-6, msg=name)


def test_draw_rules_refuse_draft_scores_that_rise_along_a_path():
    rng = np.random.default_rng(9)
    pool = random_pool_batch(rng, 4, [3, 5, 5])
    pool.draft_logprob[1, 4] = 0.5  # a log-probability above 0: the child outranks its parent
    with pytest.raises(ValueError, match="rise along a path"):
        evaluate_pools(pool, [4], rules=["root_draw"])


@pytest.mark.parametrize("top_m", [0, 25])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draw_curves_from_the_draft_order_match_the_torch_sort(temperature, top_m):
    # the scan of the whole pool's order, given or ranked inside, against the torch route's
    # sort by (first-level ancestor, draft rank): the same terms, summed in another order
    rng = np.random.default_rng(12)
    pool = random_pool_batch(rng, 96, [6, 12, 12, 8], temperature=temperature, tie_values=True)
    ctx = pool_context(pool, top_m)
    order = rank_order(ctx.draft, ctx.restrict)
    budgets = [1, 2, 8, 20, 38, 60]
    given = draw_values(ctx, budgets, order)
    ranked = draw_values(ctx, budgets, order[:, :5])  # too short: ranked inside
    with torch_route():
        want = draw_values(ctx, budgets)
    assert given.keys() == ranked.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(given[name], ranked[name]), name
        torch.testing.assert_close(given[name], w, rtol=1e-6, atol=1e-6, msg=name)
    assert (given["root_draw"][:, -1] > given["root_draw"][:, 1]).any()  # deep subtrees


def test_draw_rules_refuse_rising_draft_scores_on_the_scan_route():
    rng = np.random.default_rng(9)
    pool = random_pool_batch(rng, 4, [3, 5, 5])
    ctx = pool_context(pool)  # valid log-probabilities; then a child's score above its parent's
    child = 4
    ctx.draft[1, child] = ctx.draft[1, pool.parent[1, child]] + 1.0
    order = rank_order(ctx.draft, ctx.restrict)
    with pytest.raises(ValueError, match="this batch breaks that"):
        draw_values(ctx, [4], order)


def test_nan_scores_are_refused_on_both_routes():
    score = torch.tensor([[0.0, float("nan"), -1.0]])
    with pytest.raises(ValueError, match="NaN"):
        rank_order(score, k=1)
    with torch_route(), pytest.raises(ValueError, match="NaN"):
        rank_order(score, k=1)


@pytest.mark.parametrize("route", ["compiled", "torch"])
def test_infinite_and_positive_scores_are_refused_on_both_routes(route):
    """+inf ties and positive log q would make top-B trees that are not ancestor-closed."""
    ctx = torch_route() if route == "torch" else contextlib.nullcontext()
    parent = torch.tensor([[-1, 0, -1]])
    with ctx:
        with pytest.raises(ValueError, match=r"NaN or \+inf"):
            top_b(torch.tensor([[-1.0, float("inf"), -2.0]]), 2)
        with pytest.raises(ValueError, match=r"NaN or \+inf"):
            rank_order(torch.tensor([[float("inf"), -1.0, -2.0]]))
        with pytest.raises(ValueError, match="must be <= 0"):
            draft_scores(torch.tensor([[-1.0, 0.5, -2.0]]), parent)
        with pytest.raises(ValueError, match="must be <= 0"):
            draft_scores(torch.tensor([[-1.0, float("inf"), -2.0]]), parent)
        # -inf is a valid score (zero probability): ranked last, the tree stays closed
        keep = top_b(draft_scores(torch.tensor([[-1.0, -float("inf"), -2.0]]), parent), 2)
        assert keep.tolist() == [[True, False, True]]


def test_compiled_route_keeps_torchs_thread_count():
    """numba's first launch of its OpenMP pool must not change torch's intra-op threads.

    Both share one libgomp: numba's launch calls omp_set_num_threads(NUMBA_NUM_THREADS),
    which silently undid `decode.record`'s torch.set_num_threads(1) after a process's
    first round, so a prompt's trace bits depended on what the process ran before it.
    A fresh interpreter: the pool launches once per process.
    """
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from selection.ranking import compiled_route\n"
        "assert compiled_route(torch.zeros(3))\n"
        "print(torch.get_num_threads())\n"
    )
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True,
        timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1"]


@pytest.mark.parametrize("top_m", [0, 25])
def test_fused_first_factor_values_equal_the_scores_route(top_m):
    """One compiled pass (scores, top k, values) gives what each rule's scores give, exactly.

    Rounds of both laws in one batch (root_softmax copies root under sampling); first
    factors with ties, -inf, partly NaN and all-NaN rounds (copied from draft).
    """
    rng = np.random.default_rng(12)
    pool = random_pool_batch(rng, 90, [6, 12, 12, 8], temperature=1.0, tie_values=True)
    pool.temperature[::3] = 0.0  # every third round greedy
    n1 = 6
    lead = torch.from_numpy(  # log 1, log 0.5, log 0.25 and log 0 = -inf
        rng.choice(np.float32([0.0, -0.6931472, -1.3862944, -np.inf]), size=(90, n1))
    )
    lead[rng.random((90, n1)) < 0.2] = torch.nan
    lead[::4] = torch.nan  # rounds without the factor: draft selection's values
    # two rules with curves and three without, each set ranked in one pass (its own NaN rounds)
    firsts = {"learned": lead, "shuffled": lead[torch.randperm(90)],
              "lowered": lead[torch.randperm(90)] - 0.5, "raised": lead.flip(0) + 0.25,
              "narrow": lead[:, :3]}  # fewer columns: the rest keep draft's factors  # fmt: skip
    budgets = [1, 3, 8, 20, 38, 80]
    curve_rules = ["root", "learned", "raised"]

    def run():
        return evaluate_pools(pool, budgets, POOL_RULES, top_m=top_m, first_factors=firsts,
                              curves=True, curve_rules=curve_rules)  # fmt: skip

    fused = run()
    with torch_route():  # the reference: scores per rule, ranked and valued by torch
        ref = run()
    # ... and the same first factors given as whole scores on the compiled route
    ctx = pool_context(pool, top_m)
    scores = {k: lead_factor_scores(ctx, v) for k, v in firsts.items()}
    as_scores = evaluate_pools(pool, budgets, POOL_RULES, top_m=top_m, extra_scores=scores,
                               curves=True, curve_rules=curve_rules)  # fmt: skip
    assert list(fused) == list(ref) == list(as_scores)  # the same rules in the same order
    exact = [n for n in ref if n.split("/")[-1] not in DRAW_RULES]
    for name in exact:
        assert torch.equal(fused[name], ref[name]), name
        assert torch.equal(fused[name], as_scores[name]), name
    for name in firsts:  # the factors do move the values, each rule's its own way
        assert not torch.equal(fused[name], fused["draft"]), name
    assert not torch.equal(fused["shuffled"], fused["lowered"])
    assert not torch.equal(fused["curve/learned"], fused["curve/raised"])


@pytest.mark.parametrize("seed", [0, 1])
def test_score_rule_values_equal_a_brute_force_sort_on_tied_scores(seed):
    """A rule given as whole-candidate scores (the per-depth calibration's path sums of
    isotonic steps tie often) takes the B best by (score, then lower pool index), whose
    path probabilities sum to its value: checked against numpy's lexsort, not the kernels."""
    rng = np.random.default_rng(seed)
    pool = random_pool_batch(rng, 64, [10, 30, 40], tie_values=True)
    steps = np.log(np.array([1.0, 0.5, 0.25], dtype=np.float32))  # a step map's few values
    edge = torch.from_numpy(rng.choice(steps, pool.parent.shape).astype(np.float32))
    score = torch.where(pool.valid, path_sum(edge, pool.parent), -torch.inf)
    budgets = [1, 8, 59]
    got = evaluate_pools(pool, budgets, rules=["draft"], extra_scores={"tied": score})["tied"]
    path_prob = pool_context(pool).path_prob.numpy()
    for r in range(pool.shape[0]):
        idx = np.flatnonzero(pool.valid[r].numpy())
        order = idx[np.lexsort((idx, -score[r, idx].numpy().astype(np.float64)))]
        want = [path_prob[r, order[:b]].astype(np.float64).sum() for b in budgets]
        np.testing.assert_allclose(got[r].numpy(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_radix_ranking_equals_a_brute_force_sort(seed):
    """The whole-pool ranking (`kernels._radix_order`) on scores with ties, both zeros,
    -inf, and invalid candidates: descending score, then lower index, invalid last by
    index, as numpy's lexsort orders them (not the kernels' own keys)."""
    rng = np.random.default_rng(seed)
    values = np.float32([0.0, -0.0, -1.5, -1.5000001, -3.0, -np.inf, -(2.0**-149)])
    score = torch.from_numpy(rng.choice(values, size=(40, 300)).astype(np.float32))
    valid = torch.from_numpy(rng.random((40, 300)) < 0.9)
    got = rank_order(score, valid).numpy()
    for r in range(40):
        s = np.where(valid[r].numpy(), score[r].numpy().astype(np.float64) + 0.0, np.nan)
        idx = np.arange(300)
        want = np.lexsort((idx, np.where(np.isnan(s), np.inf, -s), ~valid[r].numpy()))
        assert got[r].tolist() == want.tolist()


@pytest.mark.parametrize("top_m", [0, 25])
def test_every_route_of_the_fused_kernel_gives_the_torch_rankings_values(top_m):
    """The fused kernel's shortcuts change no value or curve bit: greedy rounds valued from
    their mass-holding candidates' ranks (`_sparse_mass`), the top-k heap scanning in the
    draft order or in pool order, the radix sort of the whole pool (`_rank_row`); against
    each rule's scores ranked by torch and cumulated in that order."""
    from selection import fused
    from selection.ranking import kernel_valid

    rng = np.random.default_rng(21)
    pool = random_pool_batch(rng, 120, [6, 12, 12, 8], temperature=1.0, tie_values=True)
    pool.temperature[::2] = 0.0
    ctx = pool_context(pool, top_m)
    n1 = 6
    lead = torch.from_numpy(  # first-level factors, or (upto 2) the second level's too
        rng.choice(np.float32([0.0, -0.6931472, -1.3862944, -np.inf, np.nan]), size=(120, 18))
    )
    lead[5, 0] = 0.5  # factors above 0 (scores that rise along a path), first level and below
    lead[7, n1:] = 3.0
    valid, has_valid = kernel_valid(ctx.restrict, ctx.draft)
    nonzero, count = ctx.sparse_mass
    assert (count[::2] >= 0).all()  # greedy rounds: mass on the argmax path
    assert top_m or (count[1::2] < 0).all()  # sampling: everywhere (but the top M)
    draft_order = rank_order(ctx.draft, ctx.restrict).numpy()
    width = pool.shape[1]

    def run(lead, k, curve, sparse, scan, bounded):
        values, cum, status = fused.rules_lead_values(
            pool.draft_logprob.numpy(), pool.parent.numpy(), lead.numpy()[None],
            ctx.path_prob.numpy(), valid, has_valid, k, np.int64([0, 2, 3, k - 1]), curve,
            np.zeros(120, np.bool_), False, np.zeros((120, 4), np.float32),
            np.zeros((0, 0), np.float32), nonzero, count if sparse else np.full(120, -1),
            scan, ctx.draft.numpy() if bounded else np.zeros((1, 0), np.float32),
        )  # fmt: skip
        return values[0], cum[0], status  # the one rule's

    for n_lead in (n1, 18):
        score = lead_factor_scores(ctx, lead[:, :n_lead], upto=1 if n_lead == n1 else 2)
        with torch_route():
            order = rank_order(score, ctx.restrict)
        mass = torch.cumsum(torch.gather(ctx.path_prob, -1, order), -1).numpy()
        for k, curve in ((4, False), (9, False), (12, False), (width, True)):  # heap, radix
            want = mass[:, [0, 2, 3, k - 1]]
            for sparse in (False, True):
                for scan, bounded in ((np.zeros((1, 0), np.int64), False), (draft_order, False),
                                      (draft_order, True)):  # fmt: skip
                    values, cum, status = run(lead[:, :n_lead], k, curve, sparse, scan, bounded)
                    assert status == 0
                    assert np.array_equal(values, want)
                    assert not curve or np.array_equal(cum, mass)


@pytest.mark.parametrize("top_m", [0, 25])
def test_pearl_curves_kernel_gives_the_torch_routes_bits(top_m):
    # sampling pools with ties and a top-M restriction: invalid entries inside the order
    rng = np.random.default_rng(11)
    pool = random_pool_batch(rng, 64, [6, 12, 12, 8], temperature=1.0, tie_values=True)
    ctx = pool_context(pool, top_m)
    for k in (None, 7):  # the whole pool's order and a top-k prefix of it
        order = rank_order(ctx.draft, ctx.restrict, k=k)
        got, ref = _both_routes(lambda order=order: pearl_curves(ctx, order))
        assert got[0].dtype == ref[0].dtype == torch.float32
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        assert not torch.equal(got[0], torch.ones_like(got[0]))  # curves that hold mass


@pytest.mark.parametrize("top_m", [0, 25])
@pytest.mark.parametrize("curve", [False, True])
def test_edge_factor_rules_equal_their_path_sums_ranked_as_scores(top_m, curve):
    # the per-depth rule's route: every edge's factor through the fused pass (greedy rounds
    # from their few mass-holding candidates, sampling rounds by the heap or the sort)
    # against its path sums ranked as scores, bit for bit
    rng = np.random.default_rng(13)
    pool = random_pool_batch(rng, 120, [6, 12, 12, 8], temperature=1.0, tie_values=True)
    pool.temperature[::2] = 0.0
    noise = torch.rand(pool.shape, generator=torch.Generator().manual_seed(1))
    factors = torch.where(pool.valid, pool.draft_logprob - noise, -torch.inf)
    kw = {"curves": curve, "curve_rules": ["cal"] if curve else ()}
    budgets = [1, 2, 8, 20, 38]
    got = evaluate_pools(pool, budgets, ["draft"], top_m, edge_factors={"cal": factors}, **kw)
    scores = {"cal": path_sum(factors, pool.parent)}
    want = evaluate_pools(pool, budgets, ["draft"], top_m, extra_scores=scores, **kw)
    assert torch.equal(got["cal"], want["cal"])
    assert not torch.equal(got["cal"], got["draft"])  # a rule that ranks otherwise
    assert not curve or torch.equal(got["curve/cal"], want["curve/cal"])
    with torch_route():  # off the compiled pass: scored as the path sums
        ref = evaluate_pools(pool, budgets, ["draft"], top_m, edge_factors={"cal": factors}, **kw)
    torch.testing.assert_close(ref["cal"], want["cal"], rtol=1e-6, atol=1e-6)
    factors[3, 2] = torch.nan
    with pytest.raises(ValueError, match="edge factors of cal: NaN"):
        evaluate_pools(pool, budgets, ["draft"], top_m, edge_factors={"cal": factors})

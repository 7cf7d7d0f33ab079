"""Stopping rules (SPEC §3): the §10 worked example exactly, exact vs Monte Carlo, V(T)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from selection.ranking import draft_scores, path_product, top_b
from tests.random_pools import random_pool_batch
from tree.stopping import check_tree, expected_outcome, simulate

# SPEC §10: IID uniform binary target, T = {a, b, aa, ab, ba, aaa, aab} = Q, pool order.
#                 a   b  aa  ab  ba aaa aab
BINARY_PARENT = [-1, -1, 0, 0, 1, 2, 2]
CASES = [  # rule, cap, coverage, acceptance
    ("exhaustive", None, Fraction(0), Fraction(2)),
    ("cap", 1, Fraction(3, 4), Fraction(1)),
    ("sampled_leaf", None, Fraction(3, 4), Fraction(5, 4)),
    ("cap", 2, Fraction(1, 4), Fraction(7, 4)),
]


def _binary():
    parent = torch.tensor([BINARY_PARENT])
    edge = torch.full((1, 7), 0.5, dtype=torch.float64)
    tree = torch.ones(1, 7, dtype=torch.bool)
    return edge, parent, tree


@pytest.mark.parametrize(("rule", "cap", "coverage", "acceptance"), CASES)
def test_spec_binary_example_exact(rule, cap, coverage, acceptance):
    edge, parent, tree = _binary()
    acc, cov = expected_outcome(edge, parent, tree, tree, rule, cap)
    # powers of 1/2 are exact in binary floating point: equality, not approx
    assert acc.item() == float(acceptance)
    assert cov.item() == float(coverage)


@pytest.mark.parametrize(("rule", "cap", "coverage", "acceptance"), CASES)
def test_spec_binary_example_monte_carlo(rule, cap, coverage, acceptance):
    edge, parent, tree = _binary()
    n = 40_000
    acc, cov = simulate(
        edge.numpy(),
        parent.numpy(),
        tree.numpy(),
        tree.numpy(),
        rule,
        n,
        np.random.default_rng(1),
        cap,
    )
    # 5 standard errors: a correct simulator fails with probability ~6e-7 for any
    # seed; per-trial sd <= 1.2 tokens, so 5 SE ~ 0.03, far below any rule's gap.
    assert abs(acc.mean() - float(acceptance)) < 5 * acc.std() / np.sqrt(n) + 1e-12
    assert abs(cov.mean() - float(coverage)) < 5 * cov.std() / np.sqrt(n) + 1e-12


def test_binary_example_sampled_leaf_exit_law():
    # SPEC §10: sampled-leaf ends covered at aaa, aab (2 accepted), ab, ba (1 accepted)
    # with 1/8, 1/8, 1/4, 1/4; the remaining 1/4 leaves the pool at bb (1 accepted).
    edge, parent, tree = _binary()
    n = 40_000
    acc, cov = simulate(
        edge.numpy(),
        parent.numpy(),
        tree.numpy(),
        tree.numpy(),
        "sampled_leaf",
        n,
        np.random.default_rng(2),
    )
    assert set(np.unique(acc)) == {1, 2}
    assert cov[acc == 2].all()  # a draw on a leaf is emitted, and leaves are scored
    for event, prob in ((acc == 2, 1 / 4), ((acc == 1) & cov, 1 / 2), ((acc == 1) & ~cov, 1 / 4)):
        se = np.sqrt(prob * (1 - prob) / n)
        assert abs(event.mean() - prob) < 5 * se


def _random_rounds(seed: int, temperature: float = 1.0, n_rounds: int = 24):
    rng = np.random.default_rng(seed)
    pool = random_pool_batch(rng, n_rounds, [4, 8, 12, 10, 6], temperature=temperature)
    score = draft_scores(pool.draft_logprob, pool.parent)
    tree = top_b(score, 9)
    scored = top_b(score, 20) | tree
    return pool, tree, scored


def _simulate(edge, pool, tree, scored, rule, n, seed, cap):
    """The Monte Carlo reference on numpy copies of one batch of rounds."""
    args = (edge.numpy(), pool.parent.numpy(), tree.numpy(), scored.numpy())
    return simulate(*args, rule, n, np.random.default_rng(seed), cap)


@pytest.mark.parametrize(
    ("rule", "cap"), [("exhaustive", None), ("cap", 1), ("cap", 2), ("sampled_leaf", None)]
)
def test_exact_matches_monte_carlo_on_random_pools(rule, cap):
    pool, tree, scored = _random_rounds(3)
    edge = pool.target_prob.double()
    acc, cov = expected_outcome(edge, pool.parent, tree, scored, rule, cap)
    n = 4000
    sim_acc, sim_cov = _simulate(edge, pool, tree, scored, rule, n, 4, cap)
    # Pooled over rounds (trials are independent): the mean over R * N trials has
    # standard error sd / sqrt(R * N). 5 SE keeps the false-alarm rate ~6e-7 while
    # a wrong acceptable set (e.g. cap off by one) moves the mean by > 0.1 >> 5 SE ~ 0.02.
    total = sim_acc.size
    assert abs(sim_acc.mean() - acc.mean().item()) < 5 * sim_acc.std() / np.sqrt(total)
    assert abs(sim_cov.mean() - cov.mean().item()) < 5 * sim_cov.std() / np.sqrt(total) + 1e-12
    # per round too, at 5 SE of that round's N trials
    se = np.maximum(sim_acc.std(axis=1), 1e-9) / np.sqrt(n)
    assert (np.abs(sim_acc.mean(axis=1) - acc.numpy()) < 5 * se + 1e-9).all()


def test_greedy_law_is_deterministic_and_exact():
    pool, tree, scored = _random_rounds(5, temperature=0.0)
    edge = pool.law_edge_prob().double()  # one-hot on the argmax edges
    for rule, cap in (("exhaustive", None), ("cap", 2), ("sampled_leaf", None)):
        acc, cov = expected_outcome(edge, pool.parent, tree, scored, rule, cap)
        sim_acc, sim_cov = _simulate(edge, pool, tree, scored, rule, 3, 6, cap)
        assert (sim_acc == acc.numpy()[:, None]).all()
        assert (sim_cov == cov.numpy()[:, None].astype(bool)).all()


def test_exhaustive_acceptance_is_tree_value():
    # E[accepted] under exhaustive traversal = V(T) = sum over T of path probabilities
    pool, tree, scored = _random_rounds(7)
    edge = pool.target_prob.double()
    acc, _ = expected_outcome(edge, pool.parent, tree, scored)
    value = (path_product(edge, pool.parent) * tree).sum(-1)
    torch.testing.assert_close(acc, value)


def test_exhaustive_with_scored_equal_tree_is_never_covered():
    pool, tree, _ = _random_rounds(8)
    _, cov = expected_outcome(pool.target_prob.double(), pool.parent, tree, tree)
    assert (cov == 0).all()


def test_cap_beyond_depth_is_exhaustive_and_cap_zero_accepts_nothing():
    pool, tree, scored = _random_rounds(9)
    edge = pool.target_prob.double()
    ex = expected_outcome(edge, pool.parent, tree, scored)
    deep = expected_outcome(edge, pool.parent, tree, scored, "cap", 5)
    torch.testing.assert_close(ex, deep)
    acc0, cov0 = expected_outcome(edge, pool.parent, tree, scored, "cap", 0)
    assert (acc0 == 0).all()
    # cap 0 emits the root draw: covered when it labels a scored first-level node
    torch.testing.assert_close(cov0, (edge * (pool.depth == 1) * scored).sum(-1))


def test_coverage_and_acceptance_bounds():
    pool, tree, scored = _random_rounds(10)
    edge = pool.target_prob.double()
    for rule, cap in (("exhaustive", None), ("cap", 1), ("sampled_leaf", None)):
        acc, cov = expected_outcome(edge, pool.parent, tree, scored, rule, cap)
        assert ((cov >= 0) & (cov <= 1 + 1e-12)).all()
        assert (acc <= tree.sum(-1)).all()
    # sampled-leaf never accepts more than exhaustive; it covers at least as often
    ex_acc, ex_cov = expected_outcome(edge, pool.parent, tree, scored)
    sl_acc, sl_cov = expected_outcome(edge, pool.parent, tree, scored, "sampled_leaf")
    assert (sl_acc <= ex_acc + 1e-12).all()
    assert (sl_cov >= ex_cov - 1e-12).all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rule": "greedy"}, "The 'rule' parameter must be one of"),
        ({"rule": "cap"}, "The 'cap' parameter of rule 'cap' must be an int >= 0. Got None"),
        ({"rule": "cap", "cap": -1}, "Got -1 instead"),
    ],
)
def test_bad_rule_is_refused(kwargs, message):
    edge, parent, tree = _binary()
    with pytest.raises(ValueError, match=message):
        expected_outcome(edge, parent, tree, tree, **kwargs)


def test_tree_contract_is_enforced():
    edge, parent, tree = _binary()
    orphan = tree.clone()
    orphan[0, 2] = False  # aa out, aaa still in
    with pytest.raises(ValueError, match="round 0, candidate 5 is in T but its parent is not"):
        check_tree(parent, orphan, tree)
    with pytest.raises(ValueError, match="scored must contain the tree"):
        expected_outcome(edge, parent, tree, torch.zeros_like(tree))

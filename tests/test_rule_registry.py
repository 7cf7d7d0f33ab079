"""A new selection rule with a new ranking is its entry, its ranking functions and its test in
one module: this one. Nothing else changes for it to get offline values
(`selection.values.evaluate_pools`) and to decode online (`decode.tree_pass`).

The rule, `half_root`, ranks by the geometric mean of the root row and the drafter at the first
level, log r(x1) = w log p(x1 | c) + (1 - w) log q(x1), and by the draft factors below; its
weight w sits in the entry's `params`.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import Tensor

from decode.baseline import autoregressive_decode
from decode.loop import decode_prompt
from decode.settings import OnlineSettings
from decode.stream import DecodeSettings
from decode.tree_pass import select_step
from pairs.prompts import encode_prompt
from selection.context import PoolContext, pool_context
from selection.ranking import path_sum, rank_candidates
from selection.routes import OfflineRoute, OnlineRoute, TreeInputs, register_tree
from selection.rules import RULES, Rule, online_rules, rule
from selection.values import evaluate_pools
from tests.online_fixtures import PROMPTS, settings
from tests.random_pools import random_pool_batch
from tests.tiny_models import one_thread, tiny_pair
from tree.attention import ancestor_matrix
from tree.config import SelectConfig
from tree.pool import Pool

# -- the rule: its ranking functions and its entry --------------------------------------------


def _half_root_scores(ctx: PoolContext, entry: Rule) -> Tensor:
    """Offline: path sums with the mixed first factor. [R, P]."""
    w, pool = float(entry.params["weight"]), ctx.pool
    first = w * torch.log(ctx.law) + (1 - w) * pool.draft_logprob
    edge = torch.where(pool.depth == 1, first, pool.draft_logprob)
    return path_sum(edge, pool.parent, ctx.levels)


HALF_ROOT_OFFLINE = OfflineRoute(name="half_root", scores=_half_root_scores)
# online the decoder hands the tree function the root row's first factor (a root pass)
HALF_ROOT_ONLINE = OnlineRoute(name="half_root", first_factor=True)
TREES_BUILT: list[Tensor] = []  # the trees the decoder took from this rule


@register_tree(HALF_ROOT_ONLINE)
def _half_root_tree(t: TreeInputs) -> tuple[Tensor, Tensor]:
    w, pool = float(t.entry.params["weight"]), t.pool
    first = w * t.first_logprob + (1 - w) * pool.draft_logprob[: pool.n_first]
    edge = torch.cat([first, pool.draft_logprob[pool.n_first :]])  # pool order: depth 1 first
    rank = rank_candidates(path_sum(edge[None], pool.parent[None], t.levels))[0]
    TREES_BUILT.append(rank < t.budget)
    return rank < t.budget, rank


HALF_ROOT = Rule(name="half_root", family="exact", kind="factor", offline=HALF_ROOT_OFFLINE,
                 online=HALF_ROOT_ONLINE, root_pass=True, rows=("root",),
                 params={"weight": "0.5"})  # fmt: skip


@pytest.fixture
def half_root(monkeypatch):
    """The rule in the table for one test (the shipped table stays as it is)."""
    monkeypatch.setitem(RULES, HALF_ROOT.name, HALF_ROOT)
    return HALF_ROOT


# -- offline ----------------------------------------------------------------------------------


def _reference_values(pool, budgets: list[int]) -> np.ndarray:
    """The rule's values by hand: mixed first factors, path sums, a stable sort per round."""
    ctx = pool_context(pool)
    law, q = ctx.law.double().numpy(), pool.draft_logprob.double().numpy()
    parent, depth, mass = pool.parent.numpy(), pool.depth.numpy(), ctx.path_prob.numpy()
    out = np.zeros((pool.shape[0], len(budgets)))
    for r in range(pool.shape[0]):
        edge = np.where(depth[r] == 1, 0.5 * np.log(law[r]) + 0.5 * q[r], q[r])
        score = edge.copy()
        for i in range(len(score)):  # pool order: a parent precedes its children
            if parent[r, i] >= 0:
                score[i] += score[parent[r, i]]
        order = np.argsort(-score, kind="stable")  # ties: depth, then pool index (pool order)
        cum = np.cumsum(mass[r, order])
        out[r] = [cum[min(b, len(cum)) - 1] for b in budgets]
    return out


def test_a_rule_defined_here_gets_offline_values(half_root):
    pool = random_pool_batch(np.random.default_rng(5), 16, [4, 6, 5, 3], temperature=1.0)
    budgets = [1, 3, 8]
    got = evaluate_pools(pool, budgets, rules=["draft", "root", "half_root"])
    want = _reference_values(pool, budgets)
    np.testing.assert_allclose(got["half_root"].double().numpy(), want, rtol=1e-5, atol=1e-6)
    # a ranking of its own: its values are neither draft's nor root's
    for other in ("draft", "root"):
        assert not torch.equal(got["half_root"], got[other]), other


def test_the_rule_joins_the_tables_only_while_registered(half_root):
    assert rule("half_root") is half_root and "half_root" in online_rules()
    OnlineSettings(rule="half_root").check()  # run.rule accepts it
    # routes are registry values: a copied entry (copy and pickle both go through the routes'
    # __reduce__, so workers receive it alike) holds the same route objects, not copies
    back = copy.deepcopy(half_root)
    assert back.offline is HALF_ROOT_OFFLINE and back.online is HALF_ROOT_ONLINE


def test_the_shipped_table_does_not_hold_it():
    assert "half_root" not in RULES and "half_root" not in online_rules()
    with pytest.raises(ValueError, match="Unknown rule"):
        evaluate_pools(random_pool_batch(np.random.default_rng(0), 2, [2, 2]), [2], ["half_root"])


# -- online -----------------------------------------------------------------------------------

PARENT = torch.tensor([-1, -1, -1, 0, 0, 1, 3])
DEPTH = torch.tensor([1, 1, 1, 2, 2, 2, 3])
LEVELS = [(0, 3), (3, 6), (6, 7)]


def test_the_online_tree_is_the_rules_own(half_root):
    n = PARENT.shape[0]
    edge = torch.tensor([-0.1, -1.5, -2.0, -0.3, -0.9, -0.2, -0.4])
    score = path_sum(edge[None], PARENT[None], LEVELS)[0]
    pool = Pool(torch.arange(n), PARENT, DEPTH, edge, score, torch.zeros(n, dtype=torch.bool),
                ancestor_matrix(PARENT, 3), -torch.ones(n, dtype=torch.long), n_first=3)  # fmt: skip
    root_first = torch.tensor([-1.2, -0.05, -3.0])  # the root row prefers candidate 1
    s = OnlineSettings(base=DecodeSettings(select=SelectConfig("draft", 2, 0)), rule="half_root")
    planned = select_step(s, pool, LEVELS, root_first, None)
    # first factors: draft -0.1, -1.5, -2.0; root -1.2, -0.05, -3.0; mixed -0.65, -0.775, -2.5
    # B=2: draft keeps 0 and its child 3 (-0.4), root 1 and its child 5, the mixture 0 and 1
    assert planned.sel.in_tree.nonzero().flatten().tolist() == [0, 1]


def test_greedy_decoding_under_the_rule_is_the_targets(half_root, tmp_path):
    TREES_BUILT.clear()
    with one_thread():
        pair = tiny_pair(tmp_path / "llama", "llama")
        p = PROMPTS[0]
        ids = encode_prompt(pair.tokenizer, p.text)
        s = settings("half_root", max_new_tokens=12)
        r = decode_prompt(pair.target, pair.drafter, ids, s, frozenset(), p.id, p.task, None)
    assert r.output == autoregressive_decode(pair.target, ids, len(r.output))
    assert len(TREES_BUILT) == len(r.rounds)  # every round's tree was this rule's

"""The online tree pass: a rule's own tree, the draft rank for everything the recording fixes."""

from __future__ import annotations

import torch

from decode.settings import OnlineSettings
from decode.stream import DecodeSettings
from decode.tree_pass import select_step
from selection.ranking import path_sum
from tree import root_pass as RP
from tree.attention import ancestor_matrix
from tree.config import SelectConfig
from tree.pool import Pool

PARENT = torch.tensor([-1, -1, -1, 0, 0, 1, 3])
DEPTH = torch.tensor([1, 1, 1, 2, 2, 2, 3])
LEVELS = [(0, 3), (3, 6), (6, 7)]


def _pool() -> Pool:
    n = PARENT.shape[0]
    edge = torch.tensor([-0.1, -0.5, -2.0, -0.3, -0.9, -0.2, -0.4])  # draft order: 0 before 1
    score = path_sum(edge[None], PARENT[None], LEVELS)[0]
    return Pool(torch.arange(n), PARENT, DEPTH, edge, score, torch.zeros(n, dtype=torch.bool),
                ancestor_matrix(PARENT, 3), -torch.ones(n, dtype=torch.long), n_first=3)  # fmt: skip


def test_a_reranker_keeps_its_own_tree_but_the_retained_rows_follow_the_draft_rank():
    pool = _pool()
    s = OnlineSettings(base=DecodeSettings(select=SelectConfig("draft", 3, 0)), rule="reranker")
    first = torch.tensor([-3.0, -0.05, -0.1])  # the reranker prefers candidate 1 over 0
    planned = select_step(s, pool, LEVELS, first, None)
    draft_rank = RP.rank_of(pool.score)
    rule_rank = RP.rank_of(RP.factor_scores(pool, first, LEVELS))
    assert not torch.equal(rule_rank, draft_rank)  # the two orders differ here
    assert torch.equal(planned.sel.in_tree, rule_rank < 3)  # the tree is the reranker's
    assert torch.equal(planned.sel.rank, draft_rank)  # the rows' prefixes: the draft rank's

"""`decode.verifier=coupling`: a chain drafted at T_d > 0 verified by speculative sampling's
maximal coupling (accept c ~ q with min(1, p/q), else draw from (p - q)+), as DFlash's block
acceptance at 1|1. The outcome at a row follows p; it accepts sum_c min(p, q) of the time,
more than a verifier that accepts with p(c); refused where it does not apply."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decode.settings import OnlineSettings
from decode.stream import DecodeSettings
from tests.test_decode_sampling import _chi_square_p, assert_samples_follow_the_target_law
from tests.test_draft_temperature import N_RUNS, tiny_vocab  # noqa: F401  (the fixture)
from tree.config import DecodeConfig, PoolConfig, SelectConfig
from tree.pool import DraftDraw, _children
from tree.verify import outcome_coupling

P_ROW = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
Q_ROW = torch.tensor([0.10, 0.45, 0.05, 0.30, 0.02, 0.08])


def test_the_outcome_follows_p_when_the_child_is_drawn_from_q():
    """20,000 rows, each with one child drawn from q: the outcomes' chi-square against p, and
    the acceptance rate against sum_c min(p, q) within 4 binomial standard errors."""
    n, gen = 20_000, torch.Generator().manual_seed(0)
    child = torch.multinomial(Q_ROW, n, replacement=True, generator=gen)
    row_logp = P_ROW.log().expand(n, -1).contiguous()
    out = outcome_coupling(row_logp, child, torch.arange(n), Q_ROW.log()[child],
                           Q_ROW.expand(n, -1), gen)  # fmt: skip
    counts = np.bincount(out.numpy(), minlength=len(P_ROW))
    assert _chi_square_p(counts, P_ROW.double().numpy()) > 1e-3
    rate, expected = (out == child).double().mean().item(), torch.minimum(P_ROW, Q_ROW).sum().item()
    assert abs(rate - expected) < 4 * np.sqrt(expected * (1 - expected) / n)
    assert rate > (P_ROW * Q_ROW).sum().item() + 0.2  # accepting with p(c) would give 0.214


def test_rows_without_a_child_draw_from_p():
    n, gen = 20_000, torch.Generator().manual_seed(1)
    row_logp = P_ROW.log().expand(n, -1).contiguous()
    none = torch.empty(0, dtype=torch.long)
    out = outcome_coupling(row_logp, none, none, torch.empty(0), torch.empty(0, 6), gen)
    assert _chi_square_p(np.bincount(out.numpy(), minlength=6), P_ROW.double().numpy()) > 1e-3


def test_kept_rows_are_the_rows_each_node_was_drawn_from():
    """A node's draft log-prob is its parent's kept row at its token."""
    from tree.growth import grow_tree_pool

    class Draft:  # a TreeDraft whose rows are random
        token_ids, n_context, shared_rows = None, 0, False

        def __init__(self):
            self.gen = torch.Generator().manual_seed(2)

        def root_logits(self, n_tree):
            return torch.randn(1, 9, generator=self.gen)

        def level_logits(self, level):
            return torch.randn(len(level.token), 9, generator=self.gen)

    draw = DraftDraw(0.7, torch.Generator().manual_seed(3), keep_rows=True)
    pool = grow_tree_pool(Draft(), PoolConfig(top_k=1, expand_steps=4, expand=1), draw)
    assert pool.q_rows.shape == (1 + int(pool.expanded.sum()), 9)
    assert torch.equal(pool.q_rows[pool.q_parent_row, pool.token], pool.draft_logprob)
    assert torch.allclose(pool.q_rows.exp().sum(-1), torch.ones(len(pool.q_rows)))
    _, _, rows = _children(torch.zeros(1, 9), 1)
    assert rows is None  # deterministic drafts keep nothing: q is a point mass


@pytest.mark.parametrize("kind", ["block", pytest.param("standalone", marks=pytest.mark.slow)])
def test_a_sampled_chain_keeps_the_target_law_and_accepts_more(tiny_vocab, kind):  # noqa: F811
    """1|1 chains: chi-square over the first two tokens for both verifiers, on the same
    prompt ids; coupling accepts more drafts than eagle3 (which accepts with p(c))."""
    target, drafters = tiny_vocab
    got = {v: assert_samples_follow_the_target_law(target, drafters[kind], v, N_RUNS, 1.0,
                                                   chain=True)
           for v in ("coupling", "eagle3")}  # fmt: skip
    assert got["coupling"] > got["eagle3"]


@pytest.mark.parametrize(("change", "message"), [
    ({"pool": PoolConfig(top_k=3, expand_steps=2, expand=2)}, "verifies a chain"),
    ({"rule": "root_draw"}, "rule=root_draw"),
    ({"record": True, "score": "record"}, "while recording"),
])  # fmt: skip
def test_coupling_is_refused_where_it_does_not_apply(change, message):
    base = DecodeSettings(pool=change.pop("pool", PoolConfig(top_k=1, expand_steps=3, expand=1)),
                          select=SelectConfig(budget=3),
                          decode=DecodeConfig(temperature=1.0, verifier="coupling",
                                              draft_temperature=1.0))  # fmt: skip
    with pytest.raises(ValueError, match=message):
        OnlineSettings(base, **change).check()

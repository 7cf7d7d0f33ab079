"""Pool growth (SPEC §2): counts, pool order, draft factors, expansion rule, chains, ties."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import one_thread, tiny_pair
from tree.attention import cache_length, forward_chain, new_cache
from tree.config import PoolConfig
from tree.growth import grow_pool
from tree.pool import _top_k, level_sizes, pool_size, stable_topk, tie_keys

CONTEXT = [40, 41, 72, 79, 79, 82, 3, 90]  # committed tokens; the last one is the root


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with one_thread():
        yield tiny_pair(tmp_path_factory.mktemp("llama"), "llama")


def _grow(pair, cfg: PoolConfig, pending_from: int = len(CONTEXT) - 1):
    """Cache CONTEXT[:pending_from] in the drafter, then grow with the rest pending."""
    cache = new_cache(pair.drafter)
    if pending_from:
        forward_chain(pair.drafter, torch.tensor(CONTEXT[:pending_from]), cache)
    pool = grow_pool(
        pair.drafter, cache, torch.tensor(CONTEXT[pending_from:]), len(CONTEXT) - 1, cfg
    )
    return pool, cache


def test_default_pool_counts_and_order(pair):
    with one_thread():
        pool, cache = _grow(pair, PoolConfig())
    depth = pool.depth
    assert pool.size == 710 == pool_size(PoolConfig())
    assert [int((depth == d).sum()) for d in range(1, 9)] == [10] + [100] * 7
    assert int(pool.expanded.sum()) == 70
    assert [int(pool.expanded[depth == d].sum()) for d in range(1, 9)] == [10] * 7 + [0]
    # Pool order: depths non-decreasing, parents precede children, every parent is the
    # root or an expanded node, and a node's depth is its parent's plus one.
    assert bool((depth[1:] >= depth[:-1]).all())
    child = pool.parent >= 0
    assert bool((pool.parent[child] < torch.arange(710)[child]).all())
    assert bool(pool.expanded[pool.parent[child]].all())
    assert bool((depth[child] == depth[pool.parent[child]] + 1).all()) and bool(
        (depth[~child] == 1).all()
    )
    # Siblings carry distinct tokens (top-k of one row).
    keys = set(zip(pool.parent.tolist(), pool.token.tolist(), strict=True))
    assert len(keys) == 710
    # The drafter cache holds context + root + the 70 expanded nodes, at drafter_pos.
    assert cache_length(cache) == len(CONTEXT) + 70
    assert sorted(pool.drafter_pos[pool.expanded].tolist()) == list(
        range(len(CONTEXT), len(CONTEXT) + 70)
    )
    assert bool((pool.drafter_pos[~pool.expanded] == -1).all())


def test_expansion_keeps_the_best_new_candidates_of_each_step(pair):
    with one_thread():
        pool, _ = _grow(pair, PoolConfig())
    for d in range(2, 8):
        at = pool.depth == d
        best = torch.sort(pool.score[at], descending=True, stable=True).values[:10]
        assert torch.equal(torch.sort(pool.score[at & pool.expanded], descending=True).values, best)
    # Children of a node are its drafter's top-k, in descending draft probability.
    first = pool.draft_logprob[:10]
    assert bool((first[1:] <= first[:-1]).all())


def test_draft_factors_equal_sequential_drafter_rows(pair):
    """Every edge's float32 log q equals the drafter's row computed along the path (tol 1e-4)."""
    with one_thread(), torch.inference_mode():
        pool, _ = _grow(pair, PoolConfig())
        anc = pool.anc
        for i in [0, 9, 10, 55, 109, 300, 500, 709]:
            path = torch.nonzero(anc[i])[:, 0]  # ancestors-or-self, pool order = depth order
            seq = torch.tensor(CONTEXT + pool.token[path[:-1]].tolist())
            logq = pair.drafter(input_ids=seq[None]).logits[0, -1].float().log_softmax(-1)
            assert abs(float(logq[pool.token[i]]) - float(pool.draft_logprob[i])) < 1e-4
            assert abs(float(pool.draft_logprob[path].sum()) - float(pool.score[i])) < 1e-4


def test_pending_tokens_are_fed_before_the_root(pair):
    """A drafter that lags 3 tokens behind grows the same pool (tol 1e-4 on draft factors)."""
    with one_thread():
        a, _ = _grow(pair, PoolConfig(top_k=4, expand_steps=3, expand=3))
        b, cache = _grow(
            pair, PoolConfig(top_k=4, expand_steps=3, expand=3), pending_from=len(CONTEXT) - 4
        )
    assert torch.equal(a.token, b.token) and torch.equal(a.parent, b.parent)
    assert torch.allclose(a.draft_logprob, b.draft_logprob, atol=1e-4)
    assert cache_length(cache) == len(CONTEXT) + int(b.expanded.sum())


def test_chain_setting_grows_a_chain(pair):
    """7/1/8-style chain: one child per step, every node but the last expanded."""
    cfg = PoolConfig(top_k=1, expand_steps=6, expand=1)
    assert level_sizes(cfg) == [(1, 1)] * 6 + [(1, 0)]
    with one_thread():
        pool, _ = _grow(pair, cfg)
    assert pool.parent.tolist() == [-1, 0, 1, 2, 3, 4, 5]
    assert pool.depth.tolist() == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize(
    ("cfg", "sizes"),
    [
        (PoolConfig(), [(10, 10)] + [(100, 10)] * 6 + [(100, 0)]),
        (PoolConfig(top_k=4, expand_steps=3, expand=2), [(4, 2), (8, 2), (8, 2), (8, 0)]),
        (PoolConfig(top_k=3, expand_steps=0, expand=5), [(3, 0)]),
    ],
)
def test_level_sizes(cfg, sizes):
    assert level_sizes(cfg) == sizes


@pytest.mark.parametrize(
    ("cfg", "msg"),
    [
        (PoolConfig(top_k=0), r"'pool.top_k' must be an int >= 1. Got 0"),
        (PoolConfig(expand_steps=-1), r"'pool.expand_steps' must be an int >= 0. Got -1"),
        (
            PoolConfig(expand=0),
            r"'pool.expand' must be an int >= 1 when pool.expand_steps > 0. Got 0",
        ),
    ],
)
def test_bad_pool_settings_are_refused(cfg, msg):
    with pytest.raises(ValueError, match=msg):
        level_sizes(cfg)


def test_stable_topk_breaks_ties_by_lower_token_id():
    x = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 0.5], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    _, idx = stable_topk(x, 3)
    assert idx.tolist() == [[1, 2, 4], [0, 1, 2]]
    _, idx = stable_topk(x, 4)
    assert idx.tolist() == [[1, 2, 4, 3], [0, 1, 2, 3]]


def test_stable_topk_equals_a_full_stable_sort_on_tie_heavy_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 6, (50, 40), generator=g).float()  # many ties, as bf16 logits have
    for k in (1, 5, 17):
        ref = torch.sort(x, dim=-1, descending=True, stable=True)
        vals, idx = stable_topk(x, k)
        assert torch.equal(idx, ref.indices[:, :k]) and torch.equal(vals, ref.values[:, :k])


def test_the_tie_keyed_top_k_is_a_stable_sorts_first_k():
    """`tree.pool._top_k` (topk over `tie_keys`) against a full stable descending sort, on
    log-prob-like rows (<= 0) with heavy ties, zeros, -0.0, subnormals and wide ranges."""
    g = torch.Generator().manual_seed(0)
    steps = -torch.randint(0, 6, (60, 300), generator=g).float()  # many equal values
    scale = torch.tensor([1.0, 1e-3, 1e-30, 1e-42, 37.0, 1e4]).repeat(10)[:, None]
    rows = [steps * scale, torch.randn(40, 513, generator=g).log_softmax(-1)]
    rows.append(torch.tensor([[0.0, -0.0, -1.0, 0.0, -0.0, -1.0, -2.0, -1e-45, -1e-45]]))
    near = torch.full((1, 64), -1.0)
    near[0, ::2] = torch.nextafter(torch.tensor(-1.0), torch.tensor(0.0))  # an ulp apart
    rows.append(near)
    wide = (torch.randn(3, 49152, generator=g) * 8).round() / 8  # a full-size vocabulary, tied
    rows.append(wide.log_softmax(-1))
    for x in rows:
        ref = torch.sort(x, dim=-1, descending=True, stable=True)
        for k in (1, 5, 17):
            vals, idx = _top_k(x, min(k, x.shape[-1]))
            assert torch.equal(idx, ref.indices[:, :k]) and torch.equal(vals, ref.values[:, :k])
    flat = steps[0] * 1e-3  # the expansion's ranking of a level's scores (one dimension)
    top = torch.topk(tie_keys(flat), 7).indices
    assert torch.equal(top, torch.sort(flat, descending=True, stable=True).indices[:7])

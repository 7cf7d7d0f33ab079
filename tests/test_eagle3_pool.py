"""Pool growth with an EAGLE-3 head: tree-batched drafting equals drafting each path sequentially.

The reference runs the head one position at a time under plain causal attention: the
committed pairs (feature j, token j + 1), then each ancestor of a node in turn, each
taking the previous position's output as its hidden. Tolerance 1e-4 on float32 draft
log-probabilities (the standalone drafter's pool test uses the same).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from pairs.eagle3.pool import Eagle3State, feed_pairs, grow_pool_eagle3, run_head
from pairs.models import load_model_pair
from tests.eagle3_heads import eagle3_config, tiny_target, write_head
from tests.tiny_models import one_thread
from tree.attention import cache_length, forward_chain, new_cache
from tree.config import PoolConfig
from tree.pool import pool_size

CONTEXT = [40, 41, 72, 79, 79, 82, 3, 90, 11, 57]  # committed tokens; the last one is the root
TOL = 1e-4


@pytest.fixture(scope="module", params=[("llama", None), ("qwen3", 50)], ids=["llama", "qwen3-d2t"])
def pair(request, tmp_path_factory):
    arch, draft_vocab = request.param
    root = tmp_path_factory.mktemp(arch)
    target = tiny_target(root, arch)
    head = write_head(root / "head", target, draft_vocab=draft_vocab, n_layers=1)
    with one_thread():
        yield load_model_pair(eagle3_config(target, head))


def _state(pair, fed: int) -> Eagle3State:
    """Target features of CONTEXT[:-1] captured from a prefill; `fed` pairs already in the head."""
    tcache = new_cache(pair.target)
    st = pair.drafter.new_state(tcache)
    forward_chain(pair.target, torch.tensor(CONTEXT[:-1]), tcache)
    if fed:
        feed_pairs(pair.drafter.head, st, CONTEXT, fed)
    return st


def _sequential_row(head, feats: torch.Tensor, path_tokens: list[int]) -> torch.Tensor:
    """Draft log-probs after the committed pairs and then `path_tokens`, one position at a time."""
    cache = DynamicCache(config=head.config)
    n = feats.shape[0]
    out = None
    for j in range(n + len(path_tokens)):
        if j < n:
            hidden, tok = head.fuse(feats[j : j + 1]), CONTEXT[j + 1]
        else:
            hidden, tok = out, path_tokens[j - n]
        vis = torch.ones(1, j + 1, dtype=torch.bool)
        out = run_head(head, hidden, torch.tensor([tok]), torch.tensor([j]), vis, cache)
    return head.logits(out)[0].float().log_softmax(-1)


@pytest.mark.parametrize("fed", [0, 6])
def test_tree_batched_rows_equal_sequential_rows(pair, fed):
    head, cfg = pair.drafter.head, PoolConfig(top_k=5, expand_steps=4, expand=4)
    with one_thread(), torch.inference_mode():
        feats = _state(pair, 0).features.rows(0, len(CONTEXT) - 1)  # every committed pair's
        st = _state(pair, fed)
        pool = grow_pool_eagle3(head, st, CONTEXT, len(CONTEXT) - 1, cfg)
        ids = head.token_ids
        for i in range(pool.size):
            path = torch.nonzero(pool.anc[i])[:, 0]  # ancestors-or-self in depth order
            logq = _sequential_row(head, feats, pool.token[path[:-1]].tolist())
            col = int(pool.token[i]) if ids is None else int(torch.nonzero(ids == pool.token[i]))
            assert abs(float(logq[col]) - float(pool.draft_logprob[i])) < TOL
            assert abs(float(pool.draft_logprob[path].sum()) - float(pool.score[i])) < TOL
        # The first level is the head's top-k at the root, in order.
        top = torch.topk(_sequential_row(head, feats, []), cfg.top_k).indices
        want = top if ids is None else ids[top]
        assert torch.equal(pool.token[: cfg.top_k], want)
    assert pool.size == pool_size(cfg)
    if ids is not None:  # every drafted token is a draft-vocabulary token, mapped to its target id
        assert (
            bool(torch.isin(pool.token, ids).all()) and ids.shape[0] < pair.target.config.vocab_size
        )


def test_pool_structure_and_the_round_end(pair):
    cfg = PoolConfig()
    with one_thread():
        st = _state(pair, 4)
        pool = grow_pool_eagle3(pair.drafter.head, st, CONTEXT, len(CONTEXT) - 1, cfg)
    depth = pool.depth
    assert pool.size == 710 and int(pool.expanded.sum()) == 70
    assert [int((depth == d).sum()) for d in range(1, 9)] == [10] + [100] * 7
    keys = set(zip(pool.parent.tolist(), pool.token.tolist(), strict=True))
    assert len(keys) == 710  # siblings carry distinct target tokens (d2t is one-to-one)
    # The head fed every committed pair (the root's last), then the 70 expanded nodes ...
    r = len(CONTEXT) - 1
    assert st.n_fed == r and cache_length(st.cache) == r + 70
    assert sorted(pool.drafter_pos[pool.expanded].tolist()) == list(range(r, r + 70))
    # ... and a commit drops the draft KV past the committed pairs (target cache: r + 1 kept).
    st.features.append(torch.zeros(1, 3 * pair.target.config.hidden_size))  # the root's row
    st.commit(r + 1, [], r + 1)
    assert cache_length(st.cache) == r and st.features.start == r and st.features.end == r + 1


def test_a_round_without_a_pending_pair_is_refused(pair):
    with one_thread():
        st = _state(pair, len(CONTEXT) - 1)
        with pytest.raises(ValueError, match=r"the root sits at position 9 but the head has fed 9"):
            grow_pool_eagle3(pair.drafter.head, st, CONTEXT, len(CONTEXT) - 1, PoolConfig())

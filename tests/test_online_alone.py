"""X1 alone (paper App. D.3, D.10): a draw off the pool's first level is verified as a one-node tree.

On a chain pool (pool.top_k=1: one first-level candidate) the draw X1 often differs
from the drafter's token. Then root-draw and PEARL verify X1 alone in the tree pass and
emit X1 and its continuation (tau 2, two passes); the covering decoder emits X1 as the
leaf of that one-node tree from one pass and holds X1's row. Checks: the batched row
of X1 is the target's row at c X1 and leaves the pool rows unchanged; greedy output
equals the target's; every covering round makes a pass; the sampled law of the first
two tokens is the target's (chi-square, as tests/test_online_decode.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from decode.baseline import autoregressive_decode
from decode.loop import decode_prompt
from pairs.prompts import encode_prompt
from tests.online_fixtures import PROMPTS, settings, tiny_vocab_models
from tests.test_decode_sampling import ALPHA, PROMPT, TINY_V, _chi_square_p, _exact_two_token_law
from tests.tiny_models import one_thread, tiny_pair
from tree.attention import forward_chain, new_cache
from tree.config import PoolConfig
from tree.growth import grow_pool
from tree.root_pass import cached_root_tree_pass, root_pass

CHAIN = PoolConfig(top_k=1, expand_steps=3, expand=1)  # 4 candidates, one per depth


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with one_thread():
        yield tiny_pair(tmp_path_factory.mktemp("llama"), "llama")


def test_alone_row_is_the_targets_row_after_x1(pair):
    """X1's batch row: position root + 1, sees context + root + itself; pool rows unchanged."""
    target, drafter = pair.target, pair.drafter
    ids = encode_prompt(pair.tokenizer, PROMPTS[0].text)
    ctx, root = ids[:-1], ids[-1]
    s = settings("root_draw", pool=CHAIN).base
    with one_thread(), torch.inference_mode():
        tc, dc = new_cache(target), new_cache(drafter)
        forward_chain(target, torch.tensor(ctx), tc, logits_to_keep=1)
        forward_chain(drafter, torch.tensor(ctx), dc, logits_to_keep=1)
        pool = grow_pool(drafter, dc, torch.tensor([root]), len(ctx), s.pool)
        x1 = int((pool.token[0] + 1) % pair.target.config.vocab_size)  # off the first level
        root_pass(target, tc, root)
        scored = torch.arange(pool.size)
        plain = cached_root_tree_pass(target, tc, len(ctx), pool, scored)
        for layer in tc.layers:  # drop the pass's KV again (keep context + root)
            layer.keys, layer.values = (
                layer.keys[..., : len(ctx) + 1, :],
                layer.values[..., : len(ctx) + 1, :],
            )
        both = cached_root_tree_pass(target, tc, len(ctx), pool, scored, torch.tensor([x1]))
        ref = target(input_ids=torch.tensor([[*ctx, root, x1]])).logits[0, -1]
    assert both.shape[0] == pool.size + 1
    torch.testing.assert_close(both[:-1], plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(both[-1], ref, rtol=1e-4, atol=1e-4)


def _decode(pair, rule: str, temperature: float = 0.0, n: int = 4, budget: int = 4):
    s = settings(rule, temperature, budget=budget, max_new_tokens=24, pool=CHAIN)
    runs = []
    with one_thread():
        for p in PROMPTS[:n]:
            ids = encode_prompt(pair.tokenizer, p.text)
            r = decode_prompt(pair.target, pair.drafter, ids, s, frozenset(), p.id, p.task)
            runs.append((ids, r))
    return runs


@pytest.mark.parametrize("rule", ["root_draw", "pearl"])
def test_draw_rules_verify_x1_alone_and_emit_two_tokens(pair, rule):
    runs = _decode(pair, rule)
    rounds = [x for _, r in runs for x in r.rounds]
    alone = [x for x in rounds if x.x1_alone]
    assert alone, "the chain pool never missed the draw: the test has no power"
    for x in alone:  # X1 accepted outside the pool, its continuation from the tree pass
        assert len(x.emitted) == 2 and x.n_accepted == 1
        assert x.passes == 2 and x.tree_size == 1 and not x.covered
    assert all(len(x.emitted) >= 2 and x.passes == 2 for x in rounds)  # every round: tau >= 2
    for ids, r in runs:
        assert r.output == autoregressive_decode(pair.target, ids, len(r.output))


def test_covering_makes_a_pass_for_every_round(pair):
    for t in (0.0, 1.0):
        runs = _decode(pair, "covering", t, budget=1)  # B=1: every accepted X1 is a leaf
        rounds = [x for _, r in runs for x in r.rounds]
        assert all(x.passes == 1 for x in rounds)  # one pass per round, never none
        alone = [x for x in rounds if x.x1_alone]
        assert alone
        for x in alone:  # X1 is the one-node tree's leaf: emitted, its row held
            assert len(x.emitted) == 1 and x.n_accepted == 0 and x.covered and x.tree_size == 1
        tokens = sum(len(x.emitted) for x in rounds)
        assert tokens / sum(x.passes for x in rounds) == tokens / len(rounds)
        if t == 0.0:
            for ids, r in runs:
                assert r.output == autoregressive_decode(pair.target, ids, len(r.output))


# -- sampling: the law of the first two tokens through the X1-alone path ------------------------


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    with one_thread():
        yield tiny_vocab_models(tmp_path_factory.mktemp("tinyv"))


N_RUNS = 250


@pytest.mark.parametrize(
    ("rule", "verifier"),
    [("root_draw", "exhaustive"), ("pearl", "eagle3"), ("covering", "exhaustive")],
)
def test_sampled_law_through_x1_alone(tiny_vocab, rule, verifier):
    target, drafter = tiny_vocab
    # covering at B=1: round 1's tree is one leaf, so token 2 often comes from a held row
    # whose draw is off the first level (X1 alone); the draw rules take X1 alone in round 1.
    s = settings(
        rule, 1.0, budget=1 if rule == "covering" else 2, max_new_tokens=2, verifier=verifier
    )
    s = dataclasses.replace(
        s, base=dataclasses.replace(s.base, pool=PoolConfig(top_k=1, expand_steps=1, expand=1))
    )
    counts = np.zeros((TINY_V, TINY_V))
    alone = 0
    with one_thread():
        for i in range(N_RUNS):
            r = decode_prompt(target, drafter, PROMPT, s, frozenset(), f"p{i}", "")
            counts[r.output[0], r.output[1]] += 1
            alone += sum(x.x1_alone for x in r.rounds)
            assert all(x.passes >= 1 for x in r.rounds)
    assert alone >= 10  # the X1-alone path is taken (covering: ~8% of runs, draw rules: most)
    p = _chi_square_p(counts.reshape(-1), _exact_two_token_law(target, 1.0).reshape(-1))
    assert p > ALPHA, f"chi-square p = {p:.2e}"

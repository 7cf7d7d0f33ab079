"""Decoding with an EAGLE-3 head: lossless greedy output, the target's sampling law, features.

Heads are random (built from a config, saved, loaded back like a released one), so the
tests check the decoder's invariants, not a head's quality (tests/test_eagle3_pocket.py
runs the trained pocket head).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decode.baseline import autoregressive_decode
from decode.loop import decode_prompt
from decode.settings import OnlineSettings
from decode.stream import DecodeSettings
from pairs.config import ModelConfig
from pairs.eagle3.capture import FeatureRows
from pairs.eagle3.drafter import attach_head, read_head
from pairs.models import load_causal_lm, load_model_pair
from pairs.prompts import encode_prompt
from tests.eagle3_heads import eagle3_config, pocket_eagle3_config, tiny_target, write_head
from tests.recording import decode_recorded
from tests.test_decode_sampling import (
    TINY_V,
    _exact_two_token_law,
    assert_samples_follow_the_target_law,
    assert_sampling_is_seeded_per_prompt,
)
from tests.tiny_models import build_tiny_pair, one_thread
from tree.attention import forward_chain, new_cache
from tree.config import DecodeConfig, PoolConfig, SelectConfig

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return"]
NEW_TOKENS = 24
SMALL_POOL = PoolConfig(top_k=6, expand_steps=5, expand=6)


@pytest.fixture(scope="module", params=[("llama", None), ("qwen3", 60)], ids=["llama", "qwen3-d2t"])
def pair(request, tmp_path_factory):
    arch, draft_vocab = request.param
    root = tmp_path_factory.mktemp(arch)
    target = tiny_target(root, arch)
    head = write_head(root / "head", target, draft_vocab=draft_vocab, seed=5)
    with one_thread():
        yield load_model_pair(eagle3_config(target, head))


def _settings(budget: int, pool: PoolConfig = SMALL_POOL, **decode) -> DecodeSettings:
    return DecodeSettings(
        pool=pool,
        select=SelectConfig(budget=budget),
        decode=DecodeConfig(max_new_tokens=NEW_TOKENS, **decode),
    )


@pytest.mark.parametrize(("budget", "record"), [(1, False), (8, True), (59, False)])
def test_greedy_output_equals_plain_greedy(pair, budget, record):
    pool = PoolConfig() if budget == 59 else SMALL_POOL
    with one_thread():
        for text in PROMPTS:
            prompt = encode_prompt(pair.tokenizer, text)
            res = decode_recorded(
                pair.target,
                pair.drafter,
                prompt,
                _settings(budget, pool),
                frozenset(),
                record=record,
            )
            assert res.output == autoregressive_decode(pair.target, prompt, len(res.output))
            assert sum(res.accepted) + len(res.accepted) == len(res.output)
            assert len(res.rounds) == (len(res.accepted) if record else 0)


@pytest.mark.parametrize("rule", ["root", "root_draw", "pearl", "covering"])
def test_greedy_equality_under_every_online_rule(pair, rule):
    """Root passes, X1 verified alone, covering's held rows: the features still follow the cache."""
    s = OnlineSettings(_settings(8), rule=rule, score="tree")
    with one_thread():
        for text in PROMPTS:
            prompt = encode_prompt(pair.tokenizer, text)
            run = decode_prompt(pair.target, pair.drafter, prompt, s, frozenset())
            assert run.output == autoregressive_decode(pair.target, prompt, len(run.output))


def test_greedy_equality_under_eager_attention(tmp_path):
    target = tiny_target(tmp_path, "llama")
    head = write_head(tmp_path / "head", target, seed=2)
    p = load_model_pair(eagle3_config(target, head, attn_implementation="eager"))
    prompt = encode_prompt(p.tokenizer, PROMPTS[0])
    with one_thread():
        res = decode_recorded(p.target, p.drafter, prompt, _settings(8), frozenset())
        assert res.output == autoregressive_decode(p.target, prompt, len(res.output))


def _plain_hidden(target, tokens: list[int], layer_ids) -> torch.Tensor:
    with torch.inference_mode():
        hs = target(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in layer_ids], -1)  # [n, k * H]


@pytest.mark.parametrize(
    ("aux", "convention", "entering"),
    [(None, "input", (2, 3, 4)), ([0, 3, 6], "input", (0, 3, 6)), ([0, 3, 5], "output", (1, 4, 6))],
)
def test_captured_features_equal_plain_hidden_states(pair, tmp_path, aux, convention, entering):
    """hidden_states[i] of a plain forward, i = the configured ids in the input convention
    (float32; atol 1e-4, rtol 1e-5: two cached passes round apart from one, states are O(10))."""
    cfg = eagle3_config(
        pair.ids["target"], pair.ids["drafter"], aux_layers=aux, aux_layer_convention=convention
    )
    p = load_model_pair(cfg)
    assert p.drafter.aux_layers == entering
    tokens = encode_prompt(p.tokenizer, PROMPTS[1])
    with one_thread(), torch.inference_mode():
        cache = new_cache(p.target)
        rows = p.drafter.capture.track(cache)
        forward_chain(p.target, torch.tensor(tokens[:5]), cache)  # two passes, as decoding runs
        forward_chain(p.target, torch.tensor(tokens[5:]), cache)
        untracked = new_cache(p.target)
        forward_chain(p.target, torch.tensor(tokens), untracked)  # adds nothing anywhere
        got = rows.rows(0, len(tokens))
    assert rows.end == len(tokens)
    torch.testing.assert_close(got, _plain_hidden(p.target, tokens, entering), atol=1e-4, rtol=1e-5)


@pytest.fixture(scope="module")
def pocket():
    with one_thread():
        yield load_model_pair(pocket_eagle3_config())


def test_the_head_reads_the_verification_pass_features(pair, monkeypatch):
    _check_rows_read(pair, monkeypatch, trained=False)


def test_the_pocket_head_reads_the_features_of_accepted_paths(pocket, monkeypatch):
    _check_rows_read(pocket, monkeypatch, trained=True)


def _check_rows_read(pair, monkeypatch, trained: bool) -> None:
    """Every feature row the head is fed equals the plain forward's hidden state at its position
    (atol 1e-4, rtol 1e-5: tree-batched vs causal rounding), and the target runs one pass a round.
    The trained pocket head gets drafts accepted, so accepted paths' rows are among them."""
    seen: list[tuple[int, torch.Tensor]] = []
    real_rows = FeatureRows.rows

    def spy(self, lo, hi):
        out = real_rows(self, lo, hi)
        seen.append((lo, out.clone()))
        return out

    monkeypatch.setattr(FeatureRows, "rows", spy)
    passes = []
    hook = pair.target.register_forward_hook(lambda *a: passes.append(1))
    prompt = encode_prompt(pair.tokenizer, PROMPTS[0])
    try:
        with one_thread():
            res = decode_recorded(pair.target, pair.drafter, prompt, _settings(8), frozenset())
    finally:
        hook.remove()
    assert len(passes) == 1 + len(res.accepted)  # the prefill, then one verification pass a round
    if trained:
        assert max(res.accepted) >= 2  # multi-node accepted paths' rows are among those read
    want = _plain_hidden(pair.target, prompt + res.output, pair.drafter.aux_layers)
    fed = 0
    for lo, rows in seen:
        assert lo == fed  # every committed position exactly once, in order
        torch.testing.assert_close(rows, want[lo : lo + rows.shape[0]], atol=1e-4, rtol=1e-5)
        fed += rows.shape[0]
    last_root = len(prompt) - 1 + len(res.output) - (res.accepted[-1] + 1)
    assert fed == last_root  # every pair up to (feature before the last round's root, that root)


def test_a_one_token_prompt_is_refused(pair):
    with pytest.raises(ValueError, match=r"drafter_kind=eagle3: the prompt has 1 token"):
        decode_recorded(pair.target, pair.drafter, [5], _settings(8), frozenset())


# -- the sampling law -------------------------------------------------------------------------

N_RUNS = 250  # as tests/test_decode_sampling.py: ~10 s per verifier; `-m slow` runs 3,000


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """An 8-token target (7 layers) and a head over 6 of its tokens (d2t), briefly trained on
    the target's samples, loaded part by part (the 8-row embedding cannot hold the test
    tokenizer, so load_model_pair would refuse it)."""
    root = tmp_path_factory.mktemp("tinyv")
    with one_thread():
        yield _tiny_vocab(root)


def _tiny_vocab(root):
    build_tiny_pair(root, "llama", vocab_size=TINY_V, init_std=0.6, layers=7)
    # The draft vocabulary leaves out the two tokens least likely to come first (EAGLE-3 keeps
    # the frequent ones), so that drafts can be accepted while d2t is exercised.
    first = _exact_two_token_law(
        load_causal_lm(
            str(root / "target"), ModelConfig(name="t", target="", drafter=""), "model.target"
        ),
        1.0,
    ).sum(1)
    keep = sorted(np.argsort(-first, kind="stable")[:6].tolist())
    head = write_head(root / "head", root / "target", draft_vocab=6, draft_ids=keep, seed=3, fit=60)
    cfg = eagle3_config(root / "target", head)
    target = load_causal_lm(cfg.target, cfg, "model.target")
    return target, attach_head(read_head(head, target.config, cfg), target, cfg)


@pytest.mark.parametrize("n", [N_RUNS, pytest.param(3000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("verifier", ["exhaustive", "eagle3"])
def test_sampled_output_follows_the_target_law(tiny_vocab, verifier, n):
    """Chi-square over the first two tokens, as the standalone drafter's test."""
    assert_samples_follow_the_target_law(*tiny_vocab, verifier, n)


def test_sampling_is_seeded_per_prompt(tiny_vocab):
    assert_sampling_is_seeded_per_prompt(*tiny_vocab)


def test_model_config_declares_the_new_settings():
    cfg = ModelConfig(name="x", target="t", drafter="d")
    assert (cfg.drafter_kind, cfg.aux_layers, cfg.aux_layer_convention) == (
        "standalone",
        None,
        "input",
    )

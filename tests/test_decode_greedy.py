"""Greedy speculative decoding equals plain greedy decoding of the target, token for token."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from decode.baseline import autoregressive_decode
from decode.stream import DecodeSettings
from pairs.models import load_model_pair
from pairs.prompts import encode_prompt
from tests.recording import decode_recorded
from tests.tiny_models import one_thread, tiny_model_config, tiny_pair
from tree.config import DecodeConfig, PoolConfig, SelectConfig

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return"]
NEW_TOKENS = 24
# A mid-size pool keeps the default run fast (6 + 5 * 36 = 186 candidates); B=59
# runs on the paper's 710-candidate pool.
SMALL_POOL = PoolConfig(top_k=6, expand_steps=5, expand=6)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, tmp_path_factory):
    with one_thread():
        yield tiny_pair(tmp_path_factory.mktemp(request.param), request.param)


def _settings(budget: int, pool: PoolConfig | None = None, **decode) -> DecodeSettings:
    return DecodeSettings(
        pool=pool or PoolConfig(),
        select=SelectConfig(budget=budget),
        decode=DecodeConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, **decode),
    )


@pytest.mark.parametrize("budget", [1, 8, 59])
def test_greedy_output_equals_plain_greedy(pair, budget):
    pool = PoolConfig() if budget == 59 else SMALL_POOL
    with one_thread():
        for text in PROMPTS:
            prompt = encode_prompt(pair.tokenizer, text)
            res = decode_recorded(
                pair.target, pair.drafter, prompt, _settings(budget, pool), frozenset()
            )
            # Stops after the round that reaches the limit: at most depth (8) tokens over.
            assert NEW_TOKENS <= len(res.output) <= NEW_TOKENS + 8
            ref = autoregressive_decode(pair.target, prompt, len(res.output))
            assert res.output == ref
            assert sum(res.accepted) + len(res.accepted) == len(
                res.output
            )  # accepted + 1 per round
            if budget == 1:
                assert max(res.accepted) <= 1


@pytest.mark.slow
@pytest.mark.parametrize("budget", [2, 8, 16, 59, 100])
def test_greedy_equality_long_outputs(pair, budget):
    """Longer outputs, more prompts, the default pool (slow run)."""
    texts = [*PROMPTS, "Translate German to English: Guten Morgen", "Summarize: a b c d e f g"]
    s = DecodeSettings(select=SelectConfig(budget=budget), decode=DecodeConfig(max_new_tokens=120))
    with one_thread():
        for text in texts:
            prompt = encode_prompt(pair.tokenizer, text)
            res = decode_recorded(pair.target, pair.drafter, prompt, s, frozenset())
            assert res.output == autoregressive_decode(pair.target, prompt, len(res.output))


def test_greedy_equality_with_a_chain_pool_and_recording(pair):
    """Chain pools (top-k 1) and recording mode change nothing in the output."""
    prompt = encode_prompt(pair.tokenizer, PROMPTS[1])
    s = _settings(7, PoolConfig(top_k=1, expand_steps=6, expand=1))
    with one_thread():
        res = decode_recorded(pair.target, pair.drafter, prompt, s, frozenset(), record=True)
        ref = autoregressive_decode(pair.target, prompt, len(res.output))
    assert res.output == ref and len(res.rounds) == len(res.accepted)


def test_greedy_equality_under_eager_attention(tmp_path):
    pair = tiny_pair(tmp_path, "llama", attn="eager")
    prompt = encode_prompt(pair.tokenizer, PROMPTS[0])
    with one_thread():
        res = decode_recorded(
            pair.target, pair.drafter, prompt, _settings(8, SMALL_POOL), frozenset()
        )
        assert res.output == autoregressive_decode(pair.target, prompt, len(res.output))


def test_generation_stops_after_the_round_with_eos(pair):
    prompt = encode_prompt(pair.tokenizer, PROMPTS[0])
    with one_thread():
        ref = autoregressive_decode(pair.target, prompt, NEW_TOKENS)
        eos = ref[5]  # pretend the 6th greedy token ends the sequence
        res = decode_recorded(
            pair.target, pair.drafter, prompt, _settings(8, SMALL_POOL), frozenset({eos})
        )
    first = ref.index(eos)
    assert eos in res.output[first : first + 1]
    # The round containing EOS is the last one: EOS lies in the last round's emitted tokens.
    emitted_last = res.accepted[-1] + 1
    assert len(res.output) - emitted_last <= first < len(res.output)
    assert res.output == ref[: len(res.output)]


def test_bad_settings_are_refused(pair):
    prompt = encode_prompt(pair.tokenizer, PROMPTS[0])
    bad = DecodeSettings(select=SelectConfig(rule="root"))
    with pytest.raises(
        ValueError,
        match=r"'select.rule' for recording must be one of \['draft'\]. Got 'root'",
    ):
        decode_recorded(pair.target, pair.drafter, prompt, bad, frozenset())
    bad = DecodeSettings(decode=DecodeConfig(verifier="typo"))
    with pytest.raises(
        ValueError, match=r"'decode.verifier' must be one of \['exhaustive', 'eagle3', 'coupling'\]"
    ):
        decode_recorded(pair.target, pair.drafter, prompt, bad, frozenset())
    with pytest.raises(ValueError, match="the prompt has no tokens"):
        decode_recorded(pair.target, pair.drafter, [], DecodeSettings(), frozenset())
    assert torch.is_inference_mode_enabled() is False


def test_runs_past_the_models_positions_are_refused(pair):
    s = DecodeSettings(decode=DecodeConfig(max_new_tokens=5000))
    with pytest.raises(
        ValueError, match=r"model.target: a 3-token prompt .* needs 5011 positions.*=4096"
    ):
        decode_recorded(pair.target, pair.drafter, [5, 6, 7], s, frozenset())


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equality_recording_and_sampling_on_cuda(tmp_path, arch):
    """The same invariants on the device: greedy equality, recording, seeded sampling."""
    cfg = dataclasses.replace(tiny_model_config(tmp_path, arch), device="cuda")
    pair = load_model_pair(cfg)
    prompt = encode_prompt(pair.tokenizer, PROMPTS[0])
    res = decode_recorded(
        pair.target, pair.drafter, prompt, _settings(59), frozenset(), record=True
    )
    assert res.output == autoregressive_decode(pair.target, prompt, len(res.output))
    assert all(r["time_verify_ms"] > 0 for r in res.rounds)
    s = DecodeSettings(decode=DecodeConfig(temperature=1.0, verifier="eagle3", max_new_tokens=30))
    a = decode_recorded(
        pair.target, pair.drafter, prompt, s, frozenset(), prompt_id="x", record=True
    )
    b = decode_recorded(
        pair.target, pair.drafter, prompt, s, frozenset(), prompt_id="x", record=True
    )
    assert a.output == b.output

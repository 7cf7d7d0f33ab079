"""DFlare's per-draft-layer context mixing (`dflash_config.context_mixing: per_layer`, the DCore
recipe's context): the layout it is saved and refused in, its context from the target's states
including the last layer's, and lossless decoding with it."""

from __future__ import annotations

import json

import pytest
import torch

from decode.baseline import autoregressive_decode
from pairs.block.layout import block_shapes, read_block_config
from pairs.models import load_model_pair
from pairs.prompts import encode_prompt
from tests.block_drafters import block_config, write_block
from tests.eagle3_heads import tiny_target
from tests.recording import decode_recorded
from tests.test_block_drafter import CHAIN, PROMPTS, TREE, _plain_marginals, _settings
from tests.tiny_models import one_thread
from tree.attention import forward_chain, new_cache

LAYER_IDS = (0, 3, 6)  # of the tiny target's 7: id 6 is the last layer's output (the final norm's)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixing")
    target = tiny_target(root, "llama")
    drafter = write_block(root / "block", target, seed=5, mixing="per_layer", layer_ids=LAYER_IDS,
                          layers=2)  # fmt: skip
    with one_thread():
        pair = load_model_pair(block_config(target, drafter))
    with torch.no_grad():  # a final norm that is not the identity: its input and output differ
        norm = pair.target.model.norm.weight
        norm.copy_(torch.rand(norm.shape, generator=torch.Generator().manual_seed(0)) * 3 + 0.5)
    return pair, drafter


def test_the_layout_names_the_mixing_and_its_own_keys(mixed):
    pair, folder = mixed
    raw = json.loads((folder / "config.json").read_text())
    assert raw["dflash_config"]["context_mixing"] == "per_layer"
    spec = read_block_config(folder)
    shapes = block_shapes(spec)
    kv = spec.layer.num_key_value_heads * spec.layer.head_dim
    assert shapes["fuse"] == (2, 3) and "fc.weight" not in shapes  # W_fuse [layers, k]
    for i in range(2):
        assert shapes[f"layers.{i}.context_k_proj.weight"] == (kv, spec.layer.hidden_size)
        assert shapes[f"layers.{i}.context_v_proj.weight"] == (kv, spec.layer.hidden_size)
    assert pair.ids["context_mixing"] == "per_layer"
    # each draft layer mixes the states with its own weights: the rows differ (random W_fuse)
    alpha = pair.drafter.module.fuse.softmax(-1)
    assert torch.allclose(alpha.sum(-1), torch.ones(2)) and not torch.allclose(alpha[0], alpha[1])


def test_an_unknown_mixing_is_refused_by_name(mixed, tmp_path):
    _, folder = mixed
    raw = json.loads((folder / "config.json").read_text())
    raw["dflash_config"]["context_mixing"] = "mean"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ValueError, match=r"context_mixing: expected one of \['shared', 'per_layer'\]"
    ):
        read_block_config(tmp_path)


def test_the_last_layer_s_state_is_the_final_norm_s_output(mixed):
    """Capture id n (past the stack) holds what transformers gives as hidden_states[n]."""
    from pairs.eagle3.capture import AuxCapture

    pair, _ = mixed
    n = pair.target.config.num_hidden_layers
    capture = AuxCapture(pair.target, (n - 1, n))
    try:
        with one_thread(), torch.inference_mode():
            cache = new_cache(pair.target)
            rows = capture.track(cache)
            forward_chain(pair.target, torch.arange(3, 11), cache)
            hs = pair.target(input_ids=torch.arange(3, 11)[None], output_hidden_states=True)
    finally:
        capture.close()
    want = torch.cat([hs.hidden_states[n - 1][0], hs.hidden_states[n][0]], -1)
    torch.testing.assert_close(rows.rows(0, 8), want, atol=1e-5, rtol=1e-5)


def test_the_marginals_from_decoding_passes_equal_a_plain_computation(mixed):
    """The captured states (the last layer's from the final norm) mixed per layer equal one plain
    forward's hidden_states[i + 1] (float32; atol 1e-4)."""
    pair, _ = mixed
    tokens = encode_prompt(pair.tokenizer, PROMPTS[1])
    with one_thread(), torch.inference_mode():
        cache = new_cache(pair.target)
        state = pair.drafter.new_state(cache)
        forward_chain(pair.target, torch.tensor(tokens[:6]), cache)
        got = pair.drafter.marginals(state, tokens[6], 6)
    torch.testing.assert_close(got, _plain_marginals(pair, tokens, 6), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(("pool", "budget"), [(CHAIN, 7), (TREE, 8)])
def test_greedy_output_equals_plain_greedy(mixed, pool, budget):
    pair, _ = mixed
    with one_thread():
        for text in PROMPTS:
            prompt = encode_prompt(pair.tokenizer, text)
            res = decode_recorded(pair.target, pair.drafter, prompt, _settings(budget, pool),
                                  frozenset(), record=True)  # fmt: skip
            assert res.output == autoregressive_decode(pair.target, prompt, len(res.output))

"""Block drafters (`model.drafter_kind=block`, pairs/block): DFlash's checkpoint layout and its
refusals, the block's marginals from the target's states, lossless greedy and sampled decoding.

Drafters are random (built from a config, saved in the reference layout, loaded back as a
released one is), so the tests check the decoder's invariants, not a drafter's quality.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from decode.baseline import autoregressive_decode
from decode.loop import decode_prompt
from decode.settings import OnlineSettings
from decode.stream import DecodeSettings
from pairs import models
from pairs.block.drafter import attach_block, read_block
from pairs.block.layout import block_shapes, build_target_layer_ids, read_block_config
from pairs.models import load_causal_lm, load_model_pair
from pairs.positions import check_prompt_lengths
from pairs.prompts import Prompt, encode_prompt
from specrank.settings.errors import Refusal
from tests.block_drafters import block_config, block_spec, write_block
from tests.eagle3_heads import tiny_target
from tests.recording import decode_recorded
from tests.test_decode_sampling import (
    TINY_V,
    assert_samples_follow_the_target_law,
    assert_sampling_is_seeded_per_prompt,
)
from tests.tiny_models import build_tiny_pair, one_thread
from tree.attention import forward_chain, new_cache
from tree.config import DecodeConfig, PoolConfig, SelectConfig

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return"]
CHAIN = PoolConfig(
    top_k=1, expand_steps=6, expand=1
)  # the block's argmax: depth 7 = block_size - 1
TREE = PoolConfig(top_k=4, expand_steps=4, expand=4)


def _pair(root, arch: str):
    target = tiny_target(root, arch)  # 7 layers
    drafter = write_block(root / "block", target, seed=4)
    with one_thread():
        return load_model_pair(block_config(target, drafter))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, tmp_path_factory):
    return _pair(tmp_path_factory.mktemp(request.param), request.param)


def test_the_weights_are_named_and_shaped_as_the_reference_s(tmp_path):
    """The 58 tensors of z-lab's released 5-layer Qwen3-8B-DFlash-b16 (H 4096, 32 heads, 8 kv
    heads, head_dim 128, MLP 12288, 5 target layers), from a spec of that shape (a
    config.json-only 36-layer target: nothing loads)."""
    Qwen3Config(hidden_size=4096, num_hidden_layers=36, vocab_size=151936).save_pretrained(
        tmp_path / "t"
    )
    spec = block_spec(tmp_path / "t", layer_ids=(1, 9, 17, 25, 33), layers=5)
    spec.layer.num_attention_heads, spec.layer.num_key_value_heads = 32, 8
    spec.layer.head_dim, spec.layer.intermediate_size = 128, 12288
    shapes = block_shapes(spec)
    assert len(shapes) == 58
    assert shapes["fc.weight"] == (4096, 20480) and shapes["hidden_norm.weight"] == (4096,)
    assert shapes["layers.4.self_attn.q_proj.weight"] == (4096, 4096)
    assert shapes["layers.4.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["layers.0.self_attn.k_norm.weight"] == (128,)
    assert shapes["layers.0.mlp.down_proj.weight"] == (4096, 12288)
    assert {"norm.weight", "layers.0.post_attention_layernorm.weight"} <= set(shapes)


DROP = object()  # _edit_config: remove the key


def _edit_config(folder, **changes):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        place, key = (raw["dflash_config"], key.split(".", 1)[1]) if key.startswith(
            "dflash_config.") else (raw, key)  # fmt: skip
        if value is DROP or (value is None and place is raw):
            place.pop(key, None)
        else:
            place[key] = value
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize(("changes", "message"), [
    ({"architectures": ["DFlash2DraftModel"]}, r"the DFlash2 variant is not supported"),
    # a DFlash2 file renamed DFlashDraftModel: refused by its cause, its keys named
    ({"dflash_config.selector_rank": 256, "conv_kernel_size": 4},
     r"keys \['dflash_config.selector_rank', 'conv_kernel_size'\]: the DFlash2 variant is not "
     r"supported .*whatever the architectures say \(\['DFlashDraftModel'\]\)"),
    # each setting where the reference reads it; the other place must agree
    ({"block_size": DROP, "dflash_config.block_size": 8},
     r"top-level block_size: absent \(only dflash_config.block_size is set\); DFlash's reference "
     r"reads it there only, with no default"),
    ({"block_size": DROP}, r"top-level block_size: absent \(neither place sets it\)"),
    ({"dflash_config.block_size": 16},
     r"top-level block_size is 8 \(where the reference reads it\) but dflash_config.block_size is "
     r"16: the two places must agree"),
    ({"mask_token_id": 5}, r"dflash_config.mask_token_id is 102 .* but top-level mask_token_id is 5"),
    ({"dflash_config.mask_token_id": DROP, "mask_token_id": 102},
     r"dflash_config.mask_token_id: absent \(only top-level mask_token_id is set\)"),
    ({"target_layer_ids": [1, 3]},
     r"dflash_config.target_layer_ids is \[1, 3, 4\] .* but top-level target_layer_ids is \[1, 3\]"),
    ({"dflash_config.target_layer_ids": DROP, "num_target_layers": None},
     r"target_layer_ids: absent, and no num_target_layers to derive them from"),
    ({"dflash_config.context_mixing": "shared", "context_mixing": "per_layer"},
     r"context_mixing: the top level holds 'per_layer' and dflash_config.context_mixing 'shared'"),
    ({"dflash_config.target_layer_ids": None}, r"target_layer_ids: expected a non-empty list"),
    ({"dflash_config.target_layer_ids": [4, 1]}, r"expected distinct ascending ids"),
    ({"dflash_config.target_layer_ids": [1, 7]}, r"expected ids in \[0, 6\]"),
    ({"dflash_config.mask_token_id": 10**6}, r"mask_token_id: 1000000 is not a row"),
    ({"hidden_size": 48}, r"hidden_size: the drafter reads .* width 32, found 48"),
    ({"num_target_layers": 9}, r"num_target_layers: expected the target's 7, found 9"),
    ({"is_causal": True}, r"is_causal: true: causal drafter attention is not supported"),
    ({"layer_types": ["sliding_attention"]}, r"sliding-window drafter attention"),
    ({"final_logit_softcapping": 20.0}, r"final_logit_softcapping: 20.0 is not supported"),
])  # fmt: skip
def test_a_mismatched_config_is_refused_by_name_before_the_target_loads(
    tmp_path, monkeypatch, changes, message
):
    target = tiny_target(tmp_path, "qwen3")
    drafter = write_block(tmp_path / "block", target)
    _edit_config(drafter, **changes)
    monkeypatch.setattr(models, "load_causal_lm", lambda *a: pytest.fail("the target loaded"))
    with pytest.raises(Refusal, match=message):
        load_model_pair(block_config(target, drafter))


@pytest.mark.parametrize(("changes", "layer_ids"), [
    ({"dflash_config.target_layer_ids": DROP}, (3,)),  # one draft layer: num_target_layers // 2
    ({"dflash_config.target_layer_ids": DROP, "num_hidden_layers": 3,
      "layer_types": ["full_attention"] * 3}, (1, 2, 4)),  # round(1 + i * 3 / 2): 2.5 to even
    ({"block_size": 8, "dflash_config.block_size": 8, "target_layer_ids": [1, 3, 4]}, (1, 3, 4)),
])  # fmt: skip
def test_absent_layer_ids_are_derived_and_agreeing_places_accepted(tmp_path, changes, layer_ids):
    """As the reference's build_target_layer_ids (from num_target_layers and the drafter's
    layers); a key in both places with one value reads as that value."""
    target = tiny_target(tmp_path, "qwen3")
    drafter = write_block(tmp_path / "block", target)
    _edit_config(drafter, **changes)
    spec = read_block_config(drafter)
    assert (spec.target_layer_ids, spec.block_size, spec.mask_token_id) == (layer_ids, 8, 102)
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab's Qwen3-8B-DFlash-b16


@pytest.mark.parametrize(("edit", "message"), [
    ("drop", r"lacks key 'layers.0.mlp.up_proj.weight' \(expected shape \[64, 32\]\)"),
    ("extra", r"unexpected key 'lm_head.weight'"),
    ("shape", r"key 'fc.weight': expected shape \[32, 96\], found \[32, 64\]"),
])  # fmt: skip
def test_mismatched_weights_are_refused_by_name(tmp_path, edit, message):
    target = tiny_target(tmp_path, "llama")
    drafter = write_block(tmp_path / "block", target)
    state = load_file(drafter / "model.safetensors")
    if edit == "drop":
        del state["layers.0.mlp.up_proj.weight"]
    elif edit == "extra":
        state["lm_head.weight"] = torch.zeros(3, 32)
    else:
        state["fc.weight"] = torch.zeros(32, 64)
    save_file(state, drafter / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        load_model_pair(block_config(target, drafter))


def test_a_pool_deeper_than_the_block_is_refused_before_loading(pair):
    cfg = block_config(pair.ids["target"], pair.ids["drafter"])
    prompt = [Prompt("p", "qa", "hello")]
    deep = PoolConfig(top_k=2, expand_steps=7, expand=2)  # depth 8 > block_size - 1 = 7
    with pytest.raises(
        ValueError, match=r"pool.expand_steps=7: a pool of depth 8 needs block_size >= 9"
    ):
        check_prompt_lengths(cfg, prompt, 8, deep, "refuse")
    assert check_prompt_lengths(cfg, prompt, 8, CHAIN, "refuse") == prompt
    with pytest.raises(ValueError, match=r"pool.expand_steps=7: a pool of depth 8"):  # decoding too
        decode_recorded(pair.target, pair.drafter, [5, 6, 7], _settings(4, deep), frozenset())


def test_the_manifest_names_the_kind_block_size_layers_and_marginals(pair):
    assert pair.ids["drafter_kind"] == "block" and pair.ids["block_size"] == "8"
    assert (pair.ids["target_layer_ids"], pair.ids["layer_id_convention"]) == ("1,3,4", "output")
    assert "not conditioned on earlier draft tokens" in pair.ids["pool_marginals"]
    assert pair.ids["first_round"] == "root: the target's first token, context: the whole prompt"
    assert set(models.DRAFTERS["block"].manifest_fields) <= set(pair.ids)


def _plain_marginals(pair, tokens: list[int], r: int) -> torch.Tensor:
    """The block at root position r computed from scratch: one plain target forward, the states
    leaving the configured layers (hidden_states[i + 1]), all the context at once."""
    d = pair.drafter
    with torch.inference_mode():
        hs = pair.target(input_ids=torch.tensor([tokens[:r]]), output_hidden_states=True)
        feats = torch.cat([hs.hidden_states[i + 1][0] for i in d.spec.target_layer_ids], -1)
        ctx = d.module.context(feats, torch.arange(r))
        ids = torch.tensor([tokens[r]] + [d.spec.mask_token_id] * (d.spec.block_size - 1))
        return d.lm_head(d.module(d.embed(ids), torch.arange(r, r + len(ids)), ctx)[1:])


def test_marginals_from_the_decoding_passes_equal_a_plain_computation(pair):
    """The context fed in two rounds from the cached passes' captured states equals one plain
    forward's (float32; atol 1e-4, rtol 1e-5: cached passes round apart from one)."""
    tokens = encode_prompt(pair.tokenizer, PROMPTS[1])
    assert len(tokens) >= 10
    with one_thread(), torch.inference_mode():
        cache = new_cache(pair.target)
        state = pair.drafter.new_state(cache)
        forward_chain(pair.target, torch.tensor(tokens[:5]), cache)
        first = pair.drafter.marginals(state, tokens[5], 5)
        forward_chain(pair.target, torch.tensor(tokens[5:9]), cache)
        second = pair.drafter.marginals(state, tokens[9], 9)
    torch.testing.assert_close(first, _plain_marginals(pair, tokens, 5), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(second, _plain_marginals(pair, tokens, 9), atol=1e-4, rtol=1e-5)
    assert state.n_fed == 9 and state.ctx[0][0].shape[1] == 9


def _settings(budget: int, pool: PoolConfig, **decode) -> DecodeSettings:
    return DecodeSettings(pool=pool, select=SelectConfig(budget=budget),
                          decode=DecodeConfig(max_new_tokens=24, **decode))  # fmt: skip


@pytest.mark.parametrize(("pool", "budget", "record"), [
    (CHAIN, 7, False), (CHAIN, 4, True), (TREE, 8, True), (TREE, 1, False),
])  # fmt: skip
def test_greedy_output_equals_plain_greedy(pair, pool, budget, record):
    passes = []
    hook = pair.target.register_forward_hook(lambda *a: passes.append(1))
    try:
        with one_thread():
            for text in PROMPTS:
                prompt = encode_prompt(pair.tokenizer, text)
                passes.clear()
                res = decode_recorded(pair.target, pair.drafter, prompt, _settings(budget, pool),
                                      frozenset(), record=record)  # fmt: skip
                # the prefill, then one verification pass a round: no extra pass for the states
                assert len(passes) == 1 + len(res.accepted)
                assert res.output == autoregressive_decode(pair.target, prompt, len(res.output))
                # the prefill emits the first token, then each round its accepted drafts + 1
                assert 1 + sum(res.accepted) + len(res.accepted) == len(res.output)
                if record:  # round 0's root is the target's first token, at position n
                    first = res.rounds[0]
                    assert (first["root_token"], first["tokens_before"]) == (res.output[0], 1)
    finally:
        hook.remove()


@pytest.mark.parametrize("rule", ["root", "root_draw", "covering"])
def test_greedy_equality_under_online_rules(pair, rule):
    """Root passes, X1 verified alone, covering's held rows: the states still follow the cache."""
    s = OnlineSettings(_settings(8, TREE), rule=rule, score="tree")
    with one_thread():
        for text in PROMPTS:
            prompt = encode_prompt(pair.tokenizer, text)
            run = decode_prompt(pair.target, pair.drafter, prompt, s, frozenset())
            assert run.output == autoregressive_decode(pair.target, prompt, len(run.output))


# -- the sampling law -------------------------------------------------------------------------

N_RUNS = 250  # as tests/test_decode_sampling.py; `-m slow` runs 3,000


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """An 8-token target (7 layers) and a random block drafter whose mask is token 7, loaded
    part by part (the 8-row embedding cannot hold the test tokenizer)."""
    root = tmp_path_factory.mktemp("tinyv_block")
    with one_thread():
        build_tiny_pair(root, "llama", vocab_size=TINY_V, init_std=0.6, layers=7)
        drafter = write_block(root / "block", root / "target", seed=1, init_std=0.6)
        cfg = block_config(root / "target", drafter)
        target = load_causal_lm(cfg.target, cfg, "model.target")
        yield target, attach_block(read_block(drafter, target.config), target, cfg)


@pytest.mark.parametrize("n", [N_RUNS, pytest.param(3000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("verifier", ["exhaustive", "eagle3"])
def test_sampled_output_follows_the_target_law(tiny_vocab, verifier, n):
    """Chi-square over the first two tokens at T_t|T_d = 1|0 (deterministic top-k drafting)."""
    assert_samples_follow_the_target_law(*tiny_vocab, verifier, n)


@pytest.mark.parametrize(("pool", "window"), [(CHAIN, None), (TREE, None), (TREE, 2)],
                         ids=["chain", "tree", "tree-window"])  # fmt: skip
def test_greedy_output_equals_plain_greedy_with_drafts_accepted(tiny_vocab, pool, window):
    """On the 8-token target the random drafter's drafts are accepted, so the verified paths
    (not only continuations) are checked; with `model.drafter_window` 2 too (every prompt's
    context passes it)."""
    target, drafter = tiny_vocab
    drafter = dataclasses.replace(drafter, window=window)
    accepted = 0
    with one_thread():
        for prompt in ([1, 5, 3, 6], [2, 2, 7, 0, 4], [6, 1]):
            res = decode_recorded(target, drafter, prompt, _settings(4, pool), frozenset())
            assert res.output == autoregressive_decode(target, prompt, len(res.output))
            accepted += sum(res.accepted)
    assert accepted >= 10


def _reference_rounds(target, drafter, prompt: list[int], max_new: int):
    """z-lab/dflash's `dflash_generate` at T=0, transcribed on this drafter's module and
    recomputed from scratch each round (no caches): the whole prompt prefilled, the first block
    drafted from the target's first token at position n over the context [0, n). Returns the
    output and each round's accepted drafts (its acceptance length - 1)."""
    d, n = drafter, len(prompt)
    bs, mask = d.spec.block_size, d.spec.mask_token_id
    tokens = [*prompt, int(target(input_ids=torch.tensor([prompt])).logits[0, -1].argmax())]
    accepted = []
    while len(tokens) - n < max_new:
        start = len(tokens) - 1
        hs = target(input_ids=torch.tensor([tokens[:start]]), output_hidden_states=True)
        feats = torch.cat([hs.hidden_states[i + 1][0] for i in d.spec.target_layer_ids], -1)
        ctx = d.module.context(feats, torch.arange(start))
        block = [tokens[start]] + [mask] * (bs - 1)
        hidden = d.module(d.embed(torch.tensor(block)), torch.arange(start, start + bs), ctx)
        block[1:] = d.lm_head(hidden[1:]).argmax(-1).tolist()
        post = target(input_ids=torch.tensor([tokens[:start] + block])).logits[0, start:]
        post = post.argmax(-1).tolist()
        a = 0
        while a < bs - 1 and block[a + 1] == post[a]:
            a += 1
        tokens += [*block[1 : a + 1], post[a]]
        accepted.append(a)
    return tokens[n:], accepted


def test_rounds_follow_the_reference_s_from_its_first_block(tiny_vocab):
    """The block's argmax chain, all of it verified (budget block_size - 1): each round accepts
    what the reference's loop accepts, its first round included (one drafted from the prompt's
    last token instead would add a round and shift every later one)."""
    target, drafter = tiny_vocab
    chain = PoolConfig(top_k=1, expand_steps=drafter.spec.block_size - 2, expand=1)
    accepted = 0
    with one_thread(), torch.inference_mode():
        for prompt in ([1, 5, 3, 6], [2, 2, 7, 0, 4], [6, 1]):
            res = decode_recorded(target, drafter, prompt, _settings(7, chain), frozenset())
            want, want_accepted = _reference_rounds(target, drafter, prompt, 24)
            assert (res.output, res.accepted) == (want, want_accepted)
            accepted += sum(res.accepted)
    assert accepted >= 10


def test_sampling_is_seeded_per_prompt(tiny_vocab):
    assert_sampling_is_seeded_per_prompt(*tiny_vocab)


# -- a block drafter's trace through the pipeline ---------------------------------------------


def test_a_block_drafter_s_trace_flows_through_extract_and_train(tmp_path):
    """Recorded at both laws (score=record), extracted and trained on as any trace is."""
    from decode.recording import record_traces
    from features.extract import extract
    from rerank.config import BoosterConfig, RerankConfig
    from rerank.train import train_and_evaluate
    from specrank.settings.config import MlflowConfig
    from specrank.store.trace_schema import trace_store
    from tests.online_fixtures import PROMPTS as SUITE
    from tests.online_fixtures import settings

    pair = _pair(tmp_path / "models", "llama")
    traces, features = tmp_path / "traces", tmp_path / "features"
    with one_thread():
        for temperature in (0.0, 1.0):
            s = settings(temperature=temperature, score="record", record=True).base
            sections = {"model": {"drafter_kind": "block"}, "pool": asdict(s.pool),
                        "select": asdict(s.select)}  # fmt: skip
            record_traces(traces, pair, SUITE[:4], s, 2, sections, progress=False)
    assert trace_store(traces).read(["round_index"]).num_rows > 0
    extract(traces, features, log=lambda _: None)
    config = RerankConfig(traces=str(traces), features=str(features), feature_sets=["rows"],
                          booster=BoosterConfig(kind="lgbm", n_threads=1), n_resamples=100,
                          calibration_edges=2_000, budgets=[6], fits=None)  # fmt: skip
    result = train_and_evaluate(config, MlflowConfig(tracking_uri=f"sqlite:///{tmp_path}/m.db"),
                                {}, 0, tmp_path / "run")  # fmt: skip
    rules = set(result.summary["rule"])
    assert {"draft", "root", "rows_lgbm"} <= rules and set(result.summary["law"]) == {
        "greedy", "sampling"}  # fmt: skip

"""EAGLE-3 heads on disk: every key layout round-trips bit-exactly; mismatches are refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pairs.eagle3.capture import resolve_aux_layers
from pairs.eagle3.layout import LAYOUTS, read_head_config
from pairs.eagle3.save import save_head
from pairs.models import DRAFTERS, load_model_pair
from tests.eagle3_heads import eagle3_config, head_spec, random_head, tiny_target, write_head
from tests.tiny_models import one_thread


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target_dir(request, tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp(request.param), request.param)


def _probe(head, n_aux: int, hidden: int, seed: int = 3):
    """Draft logits of a few pairs + a two-node tree through the head's own forward."""
    from pairs.eagle3.pool import run_head

    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(5, n_aux * hidden, generator=g)
    ids = torch.randint(0, head.config.vocab_size, (5,), generator=g)
    from transformers import DynamicCache

    cache = DynamicCache(config=head.config)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    with torch.inference_mode():
        out = run_head(head, head.fuse(feats), ids, torch.arange(5), causal, cache)
        vis = torch.cat([torch.ones(2, 5, dtype=torch.bool), torch.eye(2, dtype=torch.bool)], 1)
        tree = run_head(head, out[-1:].expand(2, -1), ids[:2], torch.tensor([5, 5]), vis, cache)
        return head.logits(torch.cat([out, tree])), head.token_ids


CASES = [
    # (layout, weights format, "model." prefix, head layers, draft vocab smaller, own embedding)
    ("eagle3", "safetensors", False, 1, False, False),
    ("eagle3", "bin", True, 1, True, False),
    ("eagle3_layers", "safetensors", True, 2, True, True),
    ("speculators", "safetensors", False, 1, True, False),
    ("speculators", "bin", False, 2, False, True),
]


@pytest.mark.parametrize(("layout", "fmt", "prefix", "n_layers", "small", "embed"), CASES)
def test_every_layout_loads_back_with_identical_logits(
    target_dir, tmp_path, layout, fmt, prefix, n_layers, small, embed
):
    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    spec = head_spec(
        target_dir, draft_vocab=vocab // 2 if small else None, n_layers=n_layers, aux=(1, 3, 5)
    )
    head = random_head(spec, 3, seed=1, own_embed=embed)
    save_head(tmp_path, head.own_state(), spec, layout, fmt, prefix)
    with one_thread():
        pair = load_model_pair(eagle3_config(target_dir, tmp_path))
        if not embed:  # the reference shares the same target embedding the loaded head uses
            head.share(pair.target.get_input_embeddings(), None)
        want, want_ids = _probe(head, 3, spec.target_hidden_size)
        got, got_ids = _probe(pair.drafter.head, 3, spec.target_hidden_size)
    assert torch.equal(got, want)  # bit-exact: same weights, same ops
    assert (got_ids is None) == (not small) and (not small or torch.equal(got_ids, want_ids))
    assert pair.drafter.aux_layers == (1, 3, 5)
    assert pair.ids["drafter_kind"] == "eagle3" and pair.ids["aux_layers"] == "1,3,5"
    assert set(pair.ids) == set(DRAFTERS["eagle3"].manifest_fields)  # the registry's
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert ("transformer_layer_config" in cfg) == (layout == "speculators")
    assert layout in LAYOUTS


def test_released_config_fields_parse(tmp_path):
    """A Llama-3.1-8B EAGLE-3 head's config (llama3 RoPE, draft vocab, eagle_config ids)."""
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "vocab_size": 128256,
        "draft_vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rope_theta": 500000.0,
        "model_type": "llama",
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [1, 15, 28],
            "use_aux_hidden_state": True,
        },
        "torch_dtype": "float16",
        "bos_token_id": 128000,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    spec = read_head_config(tmp_path)
    assert spec.layout == "eagle3" and spec.draft_vocab_size == 32000
    assert spec.layer.head_dim == 128 and spec.layer.rope_parameters["rope_type"] == "llama3"
    assert spec.aux_layer_ids == (1, 15, 28) and spec.target_hidden_size == 4096
    # Written as outputs of layers 1, 15, 28 = inputs to 2, 16, 29: Llama-3.1-8B's default.
    assert resolve_aux_layers(None, spec.aux_layer_ids, "output", 32, "c") == (2, 16, 29)
    assert resolve_aux_layers(None, None, "input", 32, "c") == (2, 16, 29)
    assert resolve_aux_layers(None, None, "input", 36, "c") == (2, 18, 33)  # Qwen3-8B


# -- refusals ---------------------------------------------------------------------------------


def _head(tmp_path, target_dir, **kw):
    return write_head(tmp_path / "head", target_dir, **kw)


def _tamper(folder, edit):
    path = folder / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path)


def _refused(target_dir, head, match, exc=ValueError, **cfg):
    with pytest.raises(exc, match=match):
        load_model_pair(eagle3_config(target_dir, head, **cfg))


def test_missing_key_is_named(target_dir, tmp_path):
    head = _head(tmp_path, target_dir)
    _tamper(head, lambda s: s.pop("midlayer.hidden_norm.weight"))
    _refused(target_dir, head, r"lacks key 'midlayer.hidden_norm.weight' \(expected shape \[32\]\)")


def test_unexpected_key_is_named(target_dir, tmp_path):
    head = _head(tmp_path, target_dir)
    _tamper(head, lambda s: s.update({"midlayer.self_attn.q_norm.weight": torch.ones(8)}))
    _refused(target_dir, head, r"unexpected key 'midlayer.self_attn.q_norm.weight' \(shape \[8\]\)")


def test_wrong_shape_names_key_expected_and_found(target_dir, tmp_path):
    head = _head(tmp_path, target_dir)
    _tamper(head, lambda s: s.update({"fc.weight": torch.zeros(32, 64)}))
    _refused(target_dir, head, r"key 'fc.weight': expected shape \[32, 96\] .*found \[32, 64\]")


def test_vocabulary_and_hidden_mismatches_are_refused(target_dir, tmp_path):
    head = _head(tmp_path, target_dir)
    cfg = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(cfg | {"vocab_size": 500}))
    _refused(target_dir, head, r"vocab_size: expected the target's \d+, found 500")
    (head / "config.json").write_text(json.dumps(cfg | {"target_hidden_size": 48}))
    _refused(
        target_dir,
        head,
        r"target_hidden_size: the head reads target hidden states of width "
        r"48, but the target's hidden_size is 32",
    )


def test_a_broken_vocabulary_map_is_refused(target_dir, tmp_path):
    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    head = _head(tmp_path, target_dir, draft_vocab=40)
    _tamper(head, lambda s: s.update({"d2t": torch.full((40,), vocab)}))
    _refused(target_dir, head, r"'d2t' maps draft ids to target ids .*expected 40 distinct ids")
    head = _head(tmp_path, target_dir, draft_vocab=40, seed=1)
    _tamper(head, lambda s: s.update({"t2d": torch.zeros(vocab, dtype=torch.bool)}))
    _refused(target_dir, head, r"'t2d' marks 0 target ids, expected exactly the 40")
    head = _head(tmp_path, target_dir, draft_vocab=40, seed=2)
    _tamper(head, lambda s: (s.pop("d2t"), s.pop("t2d")))
    _refused(target_dir, head, r"draft_vocab_size 40 differs from vocab_size \d+ .*no 'd2t'")


def test_aux_layer_ids_are_checked_against_the_target(target_dir, tmp_path):
    head = _head(tmp_path, target_dir)  # 7 target layers: default ids (2, 3, 4)
    _refused(
        target_dir,
        head,
        r"model.aux_layers: \[2, 2, 5\] read as 'input to layer i' are "
        r"\[2, 2, 5\]; expected distinct ids in \[0, 7\)",
        aux_layers=[2, 2, 5],
    )
    _refused(
        target_dir,
        head,
        r"read as 'output of layer i = input to i \+ 1' are \[3, 5, 7\]",
        aux_layers=[2, 4, 6],
        aux_layer_convention="output",
    )
    _refused(
        target_dir,
        head,
        r"'model.aux_layer_convention' must be one of \['input', 'output'\]",
        aux_layer_convention="outputs",
    )


def test_bad_model_settings_are_refused_before_loading(target_dir, tmp_path):
    head = _head(tmp_path, target_dir)
    _refused(
        target_dir,
        head,
        r"'model.drafter_kind' must be one of \['standalone', 'eagle3', 'block', ",
        drafter_kind="eagle",
    )
    cfg = dataclasses.replace(
        eagle3_config(target_dir, head), drafter_kind="standalone", aux_layers=[1, 2, 3]
    )
    with pytest.raises(
        ValueError, match=r"'model.aux_layers' applies to model.drafter_kind=eagle3"
    ):
        load_model_pair(cfg)
    _refused(target_dir, tmp_path / "nowhere", r"model.drafter: no such folder", FileNotFoundError)
    (head / "model.safetensors").unlink()
    _refused(target_dir, head, r"no model.safetensors or pytorch_model.bin in", FileNotFoundError)


class _Payload:  # pickled into a .bin: loading must not run it
    def __reduce__(self):
        return (print, ("code ran",))


def test_a_pickle_with_code_is_refused(target_dir, tmp_path):
    head = _head(tmp_path, target_dir, fmt="bin")
    state = torch.load(head / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "x": _Payload()}, head / "pytorch_model.bin")
    _refused(
        target_dir,
        head,
        r"pytorch_model.bin: refused: the pickle holds objects other than "
        r"tensors \(torch.load weights_only=True: Weights only load failed",
    )


def test_a_flipped_byte_is_refused_naming_the_file(target_dir, tmp_path):
    head = _head(tmp_path, target_dir)
    raw = bytearray((head / "model.safetensors").read_bytes())
    raw[3] ^= 0xFF  # inside the header length
    (head / "model.safetensors").write_bytes(bytes(raw))
    _refused(target_dir, head, r"model.safetensors: unreadable safetensors file")


def test_a_speculators_config_of_another_algorithm_is_refused(target_dir, tmp_path):
    head = _head(tmp_path, target_dir, layout="speculators")
    cfg = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(cfg | {"speculators_model_type": "eagle"}))
    _refused(target_dir, head, r"speculators_model_type: expected 'eagle3', found 'eagle'")

"""Model loading: local checkpoints, tokenizer agreement, clear errors, batch size 1."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pairs.models import DRAFTERS, load_model_pair
from tests.tiny_models import build_tiny_pair, tiny_model_config, tiny_tokenizer
from tree.attention import check_batch_one


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_pair_loads_through_from_pretrained(tmp_path, arch):
    cfg = tiny_model_config(tmp_path, arch)
    pair = load_model_pair(cfg)
    assert pair.target.config.model_type == arch and pair.drafter.config.model_type == arch
    assert pair.target.dtype == torch.float32 and pair.target.device.type == "cpu"
    assert not pair.target.training  # eval mode: no dropout in decoding
    assert pair.target.config._attn_implementation == "sdpa"
    assert pair.eos_ids == frozenset({pair.tokenizer.eos_token_id})
    assert set(pair.ids) == {"target", "drafter", "target_config_sha256", "drafter_config_sha256"}
    assert set(pair.ids) == set(DRAFTERS["standalone"].manifest_fields)  # the registry's
    # The drafter is a noisy copy: same shapes, different weights.
    t, d = pair.target.lm_head.weight, pair.drafter.lm_head.weight
    assert t.shape == d.shape and not torch.equal(t, d)


def test_dtype_and_attention_come_from_config(tmp_path):
    cfg = dataclasses.replace(
        tiny_model_config(tmp_path, "llama"), dtype="bfloat16", attn_implementation="eager"
    )
    pair = load_model_pair(cfg)
    assert pair.target.dtype == torch.bfloat16 and pair.drafter.dtype == torch.bfloat16
    assert pair.target.config._attn_implementation == "eager"


def test_bad_dtype_is_refused_with_the_setting_named(tmp_path):
    cfg = dataclasses.replace(tiny_model_config(tmp_path, "llama"), dtype="fp8")
    with pytest.raises(ValueError, match=r"'model.dtype' must be one of .*Got 'fp8'"):
        load_model_pair(cfg)


def test_tokenizer_mismatch_names_the_differing_ids(tmp_path):
    other = tiny_tokenizer(extra_chars="é")  # one extra id at the end
    build_tiny_pair(tmp_path, "llama", drafter_tokenizer=other)
    cfg = tiny_model_config(tmp_path, "llama")
    with pytest.raises(
        ValueError,
        match=r"model.drafter: the tokenizer at .* differs .*id 103: target None vs drafter 'é'",
    ):
        load_model_pair(cfg)


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_missing_model_path_is_a_clear_error(tmp_path, which):
    cfg = dataclasses.replace(
        tiny_model_config(tmp_path, "llama"), **{which: str(tmp_path / "nowhere")}
    )
    with pytest.raises(FileNotFoundError, match=rf"model.{which}: no such folder '.*nowhere'"):
        load_model_pair(cfg)


def test_folder_without_config_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    cfg = dataclasses.replace(tiny_model_config(tmp_path, "llama"), target=str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match=r"model.target: no config.json in"):
        load_model_pair(cfg)


def test_batch_size_one_is_enforced():
    check_batch_one(torch.zeros(1, 5, dtype=torch.long), "x")
    with pytest.raises(ValueError, match=r"batch size 1 .* got \(2, 5\)"):
        check_batch_one(torch.zeros(2, 5, dtype=torch.long), "x")


def test_tiny_tokenizer_round_trips_text_and_keeps_specials_whole():
    tok = tiny_tokenizer()
    text = "def f(x):\n    return x  # ok"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and tok.unk_token_id not in ids
    assert tok("<|im_start|>a")["input_ids"] == [
        tok.convert_tokens_to_ids("<|im_start|>"),
        tok.convert_tokens_to_ids("a"),
    ]

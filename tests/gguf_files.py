"""Tiny llama checkpoints written as GGUF files with the `gguf` package's writer, as
llama.cpp's converter lays them out: its tensor names, q/k rows permuted for its rotary
layout, and the tokenizer as `tokenizer.ggml.*` metadata."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specrank.settings.paths import PROJECT_ROOT

POCKET_TOKENIZER = PROJECT_ROOT / "models" / "pocket" / "target"


def tiny_llama(seed: int = 0, tie: bool = False) -> LlamaForCausalLM:
    """Random weights, grouped-query attention (4 heads, 2 key/value heads), the pocket
    tokenizer's 1,024-token vocabulary."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        tie_word_embeddings=tie, bos_token_id=None, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: rotary halves interleaved within each head."""
    if n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _tokenizer(writer: gguf.GGUFWriter, folder: Path) -> None:
    """The folder's byte-level BPE tokenizer as llama.cpp's "gpt2" tokenizer metadata."""
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    data = json.loads((folder / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tok.get_vocab().items()}
    special = {a["id"] for a in data["added_tokens"] if a["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([by_id[i] for i in range(len(by_id))])
    writer.add_token_types([
        gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
        for i in range(len(by_id))
    ])  # fmt: skip
    merges = data["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)


def write_gguf(model: LlamaForCausalLM, path: Path, tokenizer_dir: Path = POCKET_TOKENIZER) -> Path:
    """`model` as a float32 GGUF file at `path`, with the tokenizer of `tokenizer_dir`."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _tokenizer(writer, tokenizer_dir)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if c.tie_word_embeddings and name == "lm_head.weight":
            continue  # a tied head is the embedding table: llama.cpp writes no output.weight
        w = tensor.detach().float().numpy()
        if name.endswith("q_proj.weight"):
            w = _permute(w, c.num_attention_heads, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = _permute(w, c.num_attention_heads, c.num_key_value_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

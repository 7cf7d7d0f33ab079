"""Tiny random block drafters for the tests: built from a config, saved in DFlash's layout
(`pairs.block.layout`), loaded back as a released one would be."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, Qwen3Config

from pairs.block.layout import BlockSpec, save_block_drafter
from pairs.block.module import BlockDrafterModule
from pairs.config import ModelConfig


def block_spec(target_dir: Path, *, block_size: int = 8, layer_ids: tuple[int, ...] = (1, 3, 4),
               layers: int = 1, mask_token_id: int | None = None,
               mixing: str = "shared") -> BlockSpec:  # fmt: skip
    """A drafter for the target at `target_dir`: its width, heads 4 / kv 2 (hd = width / 4)."""
    t = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    h = t.hidden_size
    layer = Qwen3Config(hidden_size=h, intermediate_size=2 * h, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=h // 4, num_hidden_layers=layers,
                        vocab_size=t.vocab_size, max_position_embeddings=4096,
                        rms_norm_eps=1e-6)  # fmt: skip
    mask = t.vocab_size - 1 if mask_token_id is None else mask_token_id
    return BlockSpec(layer, layer_ids, block_size, mask, t.num_hidden_layers, mixing)


def write_block(folder: Path, target_dir: Path, *, seed: int = 0, init_std: float = 0.25,
                **spec_kw) -> Path:  # fmt: skip
    """A random drafter of `block_spec(target_dir, **spec_kw)` saved under `folder`."""
    spec = block_spec(target_dir, **spec_kw)
    torch.manual_seed(seed)
    module = BlockDrafterModule(spec.layer, len(spec.target_layer_ids), spec.context_mixing)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, init_std)
            elif "norm" in name:
                p.fill_(1.0)
    save_block_drafter(folder, module, spec)
    return folder


def block_config(target_dir: Path, drafter_dir: Path, **kw) -> ModelConfig:
    kw.setdefault("drafter_kind", "block")
    return ModelConfig(name="tiny_block", target=str(target_dir), drafter=str(drafter_dir), **kw)

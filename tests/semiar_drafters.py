"""Tiny random semi-AR drafters for the tests, saved as their references save them: DSpark's
config in DeepSpec's layout (settings at the top level, own embedding and lm_head), Domino's
in SpecForge's (DFlash's places, Domino's settings under `dflash_config`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pairs.config import ModelConfig
from pairs.semiar.layout import READERS
from pairs.semiar.module import SemiARModule
from tests.block_drafters import block_spec


def semiar_config(kind: str, target_dir: Path, *, block_size: int = 8,
                  layer_ids: tuple[int, ...] = (1, 3, 4), head: str = "gated",
                  shift_label: bool = False, prefix: int = 0) -> dict:  # fmt: skip
    spec = block_spec(target_dir, block_size=block_size, layer_ids=layer_ids)
    fields = spec.layer.to_dict()
    for key in ("is_causal", "transformers_version", "dtype", "torch_dtype"):
        fields.pop(key, None)
    fields |= {"model_type": "qwen3", "num_target_layers": spec.num_target_layers,
               "block_size": block_size}  # fmt: skip
    if kind == "dspark":
        return fields | {"architectures": ["Qwen3DSparkModel"], "target_layer_ids": list(layer_ids),
                         "mask_token_id": spec.mask_token_id, "num_anchors": 16,
                         "markov_rank": 8, "markov_head_type": head,
                         "enable_confidence_head": True, "confidence_head_with_markov": True,
                         "tie_word_embeddings": False}  # fmt: skip
    return fields | {"architectures": ["DominoDraftModel"],
                     "dflash_config": {"mask_token_id": spec.mask_token_id,
                                       "target_layer_ids": list(layer_ids),
                                       "projector_type": "domino", "emb_dim": 16,
                                       "gru_hidden_dim": 12, "shift_label": shift_label,
                                       "pure_draft_prefix_len": prefix}}  # fmt: skip


def write_semiar(kind: str, folder: Path, target_dir: Path, *, seed: int = 0,
                 init_std: float = 0.25, copy_markov: float = 0.0, **kw) -> Path:  # fmt: skip
    """A random drafter of `kind` saved under `folder` in its reference's layout.
    `copy_markov` > 0: DSpark's W2 = copy_markov x W1, a Markov head that favours repeating
    the previous token (as the tiny 8-token targets do; random ones rarely get accepted)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(semiar_config(kind, target_dir, **kw)))
    spec = READERS[kind](folder)
    torch.manual_seed(seed)
    module = SemiARModule(spec)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, init_std)
    state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    if kind == "dspark":  # DeepSpec starts its own embedding and head as the target's copies
        target = load_file(target_dir / "model.safetensors")
        state["embed_tokens.weight"] = target["model.embed_tokens.weight"].float().clone()
        head = target.get("lm_head.weight", target["model.embed_tokens.weight"])
        state["lm_head.weight"] = head.float().clone()
        if copy_markov:
            w1 = state["markov_head.markov_w1.weight"]
            state["markov_head.markov_w2.weight"] = (copy_markov * w1).contiguous()
    save_file(state, folder / "model.safetensors")
    return folder


def semiar_model_config(kind: str, target_dir: Path, drafter_dir: Path, **kw) -> ModelConfig:
    return ModelConfig(name=f"tiny_{kind}", target=str(target_dir), drafter=str(drafter_dir),
                       drafter_kind=kind, **kw)  # fmt: skip

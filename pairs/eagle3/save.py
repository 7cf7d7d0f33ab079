"""Writing EAGLE-3 head checkpoints in each layout `pairs.eagle3.layout` reads (tests, the pocket head)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor
from transformers import LlamaConfig

from pairs.eagle3.layout import LAYER_FIELDS, LAYOUTS, WEIGHT_FILES, WEIGHT_FORMATS, HeadSpec


def layer_fields(c: LlamaConfig) -> dict:
    """The layer config as written in a head config.json (transformers 5 rope_parameters)."""
    # transformers 5 keeps rope settings in rope_parameters only; the older keys are read,
    # never written
    keys = [k for k in LAYER_FIELDS if k not in ("rope_theta", "rope_scaling")]
    return {"model_type": "llama", **{k: getattr(c, k) for k in keys}}


def head_config_dict(spec: HeadSpec, layout: str) -> dict:
    common = {
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.target_hidden_size,
        "norm_before_residual": spec.norm_before_residual,
    }
    if spec.aux_layer_ids is not None:
        common["eagle_aux_hidden_state_layer_ids"] = list(spec.aux_layer_ids)
    if layout == "speculators":
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer_fields(spec.layer),
            **common,
        }
    return {"architectures": ["LlamaForCausalLMEagle3"], **layer_fields(spec.layer), **common}


def file_name(key: str, layout: str, n_layers: int, prefix: bool) -> str:
    """A canonical key as `layout` spells it (optionally behind `model.`)."""
    m = re.match(r"^layers\.(\d+)\.(.+)$", key)
    if m:
        if layout == "eagle3" and n_layers != 1:
            raise ValueError(
                f"layout 'eagle3' (one unindexed midlayer) cannot hold {n_layers} layers"
            )
        stem = {
            "eagle3": "midlayer",
            "eagle3_layers": f"midlayer.{m.group(1)}",
            "speculators": f"layers.{m.group(1)}",
        }[layout]
        key = f"{stem}.{m.group(2)}"
    return f"model.{key}" if prefix and key not in ("d2t", "t2d") else key


def save_head(
    folder: Path,
    state: dict[str, Tensor],
    spec: HeadSpec,
    layout: str = "eagle3",
    fmt: str = "safetensors",
    prefix: bool = False,
) -> Path:
    """Write config.json and one weights file in `layout` / `fmt`. Returns the weights file."""
    if layout not in LAYOUTS or fmt not in WEIGHT_FORMATS:
        raise ValueError(
            f"save_head: layout must be one of {list(LAYOUTS)} and fmt one of "
            f"{list(WEIGHT_FORMATS)}; got {layout!r}, {fmt!r}"
        )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(head_config_dict(spec, layout), indent=2) + "\n")
    named = {
        file_name(k, layout, spec.n_layers, prefix): v.detach().contiguous().cpu()
        for k, v in state.items()
    }
    out = folder / WEIGHT_FILES[fmt]
    if fmt == "safetensors":
        save_file(named, out)
    else:
        torch.save(named, out)
    return out

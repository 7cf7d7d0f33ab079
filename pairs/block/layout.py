"""Block drafter checkpoints on disk: DFlash's layout (z-lab/dflash, read at commit
10129599dffb338ff38cfd235a53ca6d3667b4dd), read without executing code.

    config.json  a Qwen3 decoder config (`model_type: qwen3`; `architectures:
                 ["DFlashDraftModel"]`) whose own settings sit under `dflash_config`, each
                 also read from the top level as the reference does:
                   target_layer_ids  the target layers whose states feed the drafter, in the
                                     OUTPUT convention: id i = `hidden_states[i + 1]`, the state
                                     leaving decoder layer i (the reference's `layer_id + 1`)
                   block_size        positions per block: the bonus token and block_size - 1
                                     mask placeholders (default 16, the reference's)
                   mask_token_id     the placeholder's id in the target's vocabulary
                   context_mixing    (this project's key) shared: DFlash's one `fc` over the
                                     concatenated states (default); per_layer: DFlare's
                                     per-draft-layer mixing (`pairs.block.module`), keys
                                     `fuse` and `layers.{i}.context_{k,v}_proj` instead of `fc`
                 `num_target_layers` (optional) is checked against the target.
    weights      model.safetensors: `fc.weight`, `hidden_norm.weight`, per layer
                 `layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `.self_attn.{q,k}_norm.weight`,
                 `.mlp.{gate,up,down}_proj.weight`, `.input_layernorm.weight`,
                 `.post_attention_layernorm.weight`; `norm.weight`. No embedding and no
                 lm_head: the drafter uses the target's.

Refused by name: DFlash2 (`DFlash2DraftModel`, or a `dflash_config` with its candidate
selector's or convolutions' keys), whose selector conditions each draft token on its
predecessor (a later step); causal or sliding-window drafter attention; logit
soft-capping and output multipliers (later releases' options, not supported yet).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import Qwen3Config

from pairs.block.module import BlockDrafterModule
from pairs.eagle3.layout import refuse

DRAFTER_SETTING = "model.drafter"

WEIGHTS = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
DEFAULT_BLOCK_SIZE = 16  # the reference's default
CONTEXT_MIXING = ("shared", "per_layer")  # DFlash's one fc | DFlare's per-draft-layer mixing
# The DFlash2 variant: its architecture and the dflash_config keys only it has
DFLASH2 = "DFlash2DraftModel"
DFLASH2_KEYS = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")
UNSUPPORTED = {"final_logit_softcapping": None, "output_multiplier": 1.0,
               "input_embedding_scale": 1.0}  # fmt: skip


def _refuse(path: Path, what: str) -> ValueError:
    return refuse(DRAFTER_SETTING, path, what)


@dataclass(frozen=True)
class BlockSpec:
    """What a block drafter's config.json declares."""

    layer: Qwen3Config  # the drafter's decoder layers (hidden size = the target's)
    target_layer_ids: tuple[int, ...]  # output convention: hidden_states[i + 1], as written
    block_size: int
    mask_token_id: int
    num_target_layers: int | None
    context_mixing: str = "shared"  # CONTEXT_MIXING

    @property
    def capture_ids(self) -> tuple[int, ...]:
        """The same layers in the capture's input convention (the state entering layer i + 1)."""
        return tuple(i + 1 for i in self.target_layer_ids)


def _setting(raw: dict, name: str, default=None):
    """A drafter setting: `dflash_config` first, then the top level (the reference's order)."""
    inner = raw.get("dflash_config") or {}
    return inner.get(name, raw.get(name, default))


def read_block_config(folder: Path) -> BlockSpec:
    """The drafter's config.json; refuses what this decoder cannot run, naming the key."""
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise _refuse(path, f"expected a readable JSON drafter config ({e})") from e
    arch = list(raw.get("architectures") or [])
    inner = raw.get("dflash_config") or {}
    if DFLASH2 in arch or any(k in inner for k in DFLASH2_KEYS):
        raise _refuse(path, f"architectures {arch}: the DFlash2 variant is not supported (its "
                           "candidate selector conditions each draft token on its predecessor); "
                           f"expected {ARCHITECTURE}")  # fmt: skip
    if arch and arch != [ARCHITECTURE]:
        raise _refuse(path, f"architectures: expected ['{ARCHITECTURE}'], found {arch}")
    if raw.get("model_type", "qwen3") != "qwen3":
        raise _refuse(path, f"model_type: expected 'qwen3' (DFlash's layers), found "
                           f"{raw.get('model_type')!r}")  # fmt: skip
    ids = _setting(raw, "target_layer_ids")
    if not (isinstance(ids, list) and ids and all(type(i) is int for i in ids)):
        raise _refuse(path, f"dflash_config.target_layer_ids: expected a non-empty list of ints, "
                           f"found {ids!r}")  # fmt: skip
    if ids != sorted(set(ids)):
        raise _refuse(path, f"dflash_config.target_layer_ids: expected distinct ascending ids "
                           f"(the fc columns follow the capture's layer order), found {ids}")  # fmt: skip
    mask = _setting(raw, "mask_token_id")
    if type(mask) is not int or mask < 0:
        raise _refuse(path, f"dflash_config.mask_token_id: expected an id >= 0, found {mask!r}")
    size = _setting(raw, "block_size", DEFAULT_BLOCK_SIZE)
    if type(size) is not int or size < 2:
        raise _refuse(path, f"block_size: expected an int >= 2, found {size!r}")
    mixing = _setting(raw, "context_mixing", "shared")
    if mixing not in CONTEXT_MIXING:
        raise _refuse(path, f"dflash_config.context_mixing: expected one of {list(CONTEXT_MIXING)}, "
                           f"found {mixing!r}")  # fmt: skip
    _refuse_unsupported(raw, path)
    layer = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("dflash_config", "auto_map")})
    layer.is_causal = False
    n_target = raw.get("num_target_layers")
    n_target = None if n_target is None else int(n_target)
    return BlockSpec(layer, tuple(ids), size, mask, n_target, mixing)


def _refuse_unsupported(raw: dict, path: Path) -> None:
    if raw.get("is_causal") or _setting(raw, "is_causal"):
        raise _refuse(path, "is_causal: true: causal drafter attention is not supported "
                           "(DFlash's block attends both ways; expected false)")  # fmt: skip
    sliding = [t for t in raw.get("layer_types") or [] if t != "full_attention"]
    if sliding or raw.get("use_sliding_window"):
        raise _refuse(path, f"layer_types {sorted(set(sliding)) or 'sliding'}: sliding-window "
                           "drafter attention is not supported (expected full_attention)")  # fmt: skip
    for key, default in UNSUPPORTED.items():
        value = _setting(raw, key, default)
        if value != default:
            raise _refuse(path, f"{key}: {value!r} is not supported (expected {default!r})")


def block_shapes(spec: BlockSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of a drafter of `spec`, by name: the module's own state dict, unallocated."""
    with torch.device("meta"):
        module = BlockDrafterModule(spec.layer, len(spec.target_layer_ids), spec.context_mixing)
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def read_block_weights(folder: Path, spec: BlockSpec) -> dict[str, Tensor]:
    """The weights, refused unless every key of `spec`'s drafter is there with its shape."""
    path = folder / WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"model.drafter: no {WEIGHTS} in '{folder}' (expected a block "
                                "drafter folder: config.json and model.safetensors)")  # fmt: skip
    try:
        state = load_file(path)
    except SafetensorError as e:
        raise _refuse(path, f"unreadable safetensors file ({e})") from e
    want = block_shapes(spec)
    for key, shape in want.items():
        if key not in state:
            raise _refuse(path, f"lacks key '{key}' (expected shape {list(shape)}) for a "
                               f"{spec.layer.num_hidden_layers}-layer block drafter")  # fmt: skip
    for key, tensor in state.items():
        if key not in want:
            raise _refuse(path, f"unexpected key '{key}' (shape {list(tensor.shape)}): not part "
                               f"of a block drafter (expected {len(want)} keys such as "
                               "'fc.weight', 'layers.0.self_attn.q_proj.weight')")  # fmt: skip
        if tuple(tensor.shape) != want[key]:
            raise _refuse(path, f"key '{key}': expected shape {list(want[key])}, found "
                               f"{list(tensor.shape)}")  # fmt: skip
    return state


def save_block_drafter(folder: Path, module: BlockDrafterModule, spec: BlockSpec) -> None:
    """config.json and model.safetensors in the reference layout (tests, the pocket drafter)."""
    folder.mkdir(parents=True, exist_ok=True)
    fields = spec.layer.to_dict()
    for key in ("is_causal", "transformers_version", "dtype", "torch_dtype"):
        fields.pop(key, None)
    config = {**fields, "architectures": [ARCHITECTURE], "model_type": "qwen3",
              "block_size": spec.block_size,
              "dflash_config": {"mask_token_id": spec.mask_token_id,
                                "target_layer_ids": list(spec.target_layer_ids)}}  # fmt: skip
    if spec.num_target_layers is not None:
        config["num_target_layers"] = spec.num_target_layers
    if spec.context_mixing != "shared":  # DFlash's own layout has no such key
        config["dflash_config"]["context_mixing"] = spec.context_mixing
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    save_file(state, folder / WEIGHTS)

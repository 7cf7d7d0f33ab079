"""Block drafter checkpoints on disk: DFlash's layout (z-lab/dflash `dflash/model.py`, read at
commit 44947fbf71114e241c96de194f4b382b5dd330d0, where the file was last changed by 7d2ea1e),
read without executing code.

    config.json  a Qwen3 decoder config (`model_type: qwen3`; `architectures:
                 ["DFlashDraftModel"]`) with the drafter's settings where the reference reads
                 each one (`read_block_config`):
                   block_size        top level only, no default: positions per block, the
                                     bonus token and block_size - 1 mask placeholders
                   target_layer_ids  `dflash_config` only: the target layers whose states feed
                                     the drafter, in the OUTPUT convention: id i =
                                     `hidden_states[i + 1]`, the state leaving decoder layer i
                                     (the reference's `layer_id + 1`); absent, derived from
                                     `num_target_layers` and the drafter's layer count as the
                                     reference's `build_target_layer_ids` does
                   mask_token_id     `dflash_config` only: the placeholder's id in the
                                     target's vocabulary
                   context_mixing    (this project's key, `dflash_config`) shared: DFlash's one
                                     `fc` over the concatenated states (default); per_layer:
                                     DFlare's per-draft-layer mixing (`pairs.block.module`), keys
                                     `fuse` and `layers.{i}.context_{k,v}_proj` instead of `fc`
                 A key found in the other place too must hold the same value: the reference
                 would read one of them and ignore the other, so a file whose two places
                 disagree is refused, both named. `num_target_layers` is checked against the
                 target.
    weights      model.safetensors: `fc.weight`, `hidden_norm.weight`, per layer
                 `layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `.self_attn.{q,k}_norm.weight`,
                 `.mlp.{gate,up,down}_proj.weight`, `.input_layernorm.weight`,
                 `.post_attention_layernorm.weight`; `norm.weight`. No embedding and no
                 lm_head: the drafter uses the target's.

Refused by name: DFlash2 (`DFlash2DraftModel`, or its candidate selector's or convolutions'
keys in either place, whatever the architecture says), whose selector conditions each draft
token on its predecessor (a later step); causal or sliding-window drafter attention; logit
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
from specrank.settings.errors import Refusal

DRAFTER_SETTING = "model.drafter"

WEIGHTS = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
# Where DFlash's reference reads each setting (`DFlashDraftModel.__init__`)
TOP, INNER = "top level", "dflash_config"
PLACES = {"block_size": TOP, "target_layer_ids": INNER, "mask_token_id": INNER}
CONTEXT_MIXING = ("shared", "per_layer")  # DFlash's one fc | DFlare's per-draft-layer mixing
# The DFlash2 variant: its architecture and the dflash_config keys only it has
DFLASH2 = "DFlash2DraftModel"
DFLASH2_KEYS = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")
UNSUPPORTED = {"final_logit_softcapping": None, "output_multiplier": 1.0,
               "input_embedding_scale": 1.0}  # fmt: skip


def refusal(setting: str, path: Path, what: str) -> Refusal:
    """A refused drafter file: the setting, the file, what was expected and found."""
    return Refusal(f"{setting}: {path}: {what}")


def _refuse(path: Path, what: str) -> Refusal:
    return refusal(DRAFTER_SETTING, path, what)


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


_MISSING = object()


def _both(raw: dict, name: str) -> tuple[object, object]:
    """`name` at the top level and under `dflash_config` (_MISSING where absent)."""
    return raw.get(name, _MISSING), (raw.get("dflash_config") or {}).get(name, _MISSING)


def _setting(raw: dict, path: Path, name: str, default=None):
    """A setting either place may hold (this project's keys, options refused when set)."""
    top, inner = _both(raw, name)
    _agree(path, name, top, inner)
    return default if top is _MISSING and inner is _MISSING else (
        inner if inner is not _MISSING else top)  # fmt: skip


def _agree(path: Path, name: str, top, inner, read: str | None = None) -> None:
    if top is not _MISSING and inner is not _MISSING and top != inner:
        which = f"the reference reads the {read} one only" if read else "expected one value"
        raise _refuse(path, f"{name}: the top level holds {top!r} and dflash_config.{name} "
                           f"{inner!r}; {which}, so the two places must agree")  # fmt: skip


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's layer ids when a config names none (its `build_target_layer_ids`)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _name(name: str, place: str) -> str:
    return f"top-level {name}" if place == TOP else f"dflash_config.{name}"


def placed(raw: dict, path: Path, name: str):
    """A DFlash setting from the place the reference reads it (`PLACES`), the other place
    refused when it disagrees; layer ids absent there are derived as the reference does."""
    top, inner = _both(raw, name)
    place = PLACES[name]
    value, other = (top, inner) if place == TOP else (inner, top)
    elsewhere = _name(name, INNER if place == TOP else TOP)
    if value is _MISSING and name == "target_layer_ids":
        n_target = raw.get("num_target_layers")
        if type(n_target) is not int or n_target < 1:
            raise _refuse(path, "dflash_config.target_layer_ids: absent, and no num_target_layers "
                               "to derive them from as the reference does (its "
                               "build_target_layer_ids)")  # fmt: skip
        value = build_target_layer_ids(n_target, int(raw.get("num_hidden_layers", 1)))
    if value is _MISSING:
        found = f"only {elsewhere} is set" if other is not _MISSING else "neither place sets it"
        raise _refuse(path, f"{_name(name, place)}: absent ({found}); DFlash's reference reads "
                           "it there only, with no default")  # fmt: skip
    if other is not _MISSING and other != value:
        raise _refuse(path, f"{_name(name, place)} is {value!r} (where the reference reads it) "
                           f"but {elsewhere} is {other!r}: the two places must agree")  # fmt: skip
    return value


def _refuse_dflash2(raw: dict, path: Path) -> None:
    """DFlash2, by its architecture or by its keys (a renamed file is refused by its cause)."""
    arch = list(raw.get("architectures") or [])
    inner = raw.get("dflash_config") or {}
    keys = [f"dflash_config.{k}" for k in DFLASH2_KEYS if k in inner]
    keys += [k for k in DFLASH2_KEYS if k in raw]
    if DFLASH2 in arch or keys:
        named = f"keys {keys}" if keys else f"architectures {arch}"
        raise _refuse(path, f"{named}: the DFlash2 variant is not supported (its candidate "
                           "selector and convolutions condition each draft token on its "
                           f"predecessor), whatever the architectures say ({arch}); expected "
                           f"{ARCHITECTURE} without them")  # fmt: skip


def read_block_config(folder: Path) -> BlockSpec:
    """The drafter's config.json; refuses what this decoder cannot run, naming the key."""
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise _refuse(path, f"expected a readable JSON drafter config ({e})") from e
    _refuse_dflash2(raw, path)
    arch = list(raw.get("architectures") or [])
    if arch and arch != [ARCHITECTURE]:
        raise _refuse(path, f"architectures: expected ['{ARCHITECTURE}'], found {arch}")
    if raw.get("model_type", "qwen3") != "qwen3":
        raise _refuse(path, f"model_type: expected 'qwen3' (DFlash's layers), found "
                           f"{raw.get('model_type')!r}")  # fmt: skip
    ids = placed(raw, path, "target_layer_ids")
    mask = placed(raw, path, "mask_token_id")
    size = placed(raw, path, "block_size")
    mixing = _setting(raw, path, "context_mixing", "shared")
    return block_spec_of(raw, path, ids, mask, size, mixing)


def block_spec_of(raw: dict, path: Path, ids, mask, size, mixing: str) -> BlockSpec:
    """The settings checked, and the decoder layers' config."""
    if not (isinstance(ids, list) and ids and all(type(i) is int for i in ids)):
        raise _refuse(path, f"dflash_config.target_layer_ids: expected a non-empty list of ints, "
                           f"found {ids!r}")  # fmt: skip
    if ids != sorted(set(ids)):
        raise _refuse(path, f"dflash_config.target_layer_ids: expected distinct ascending ids "
                           f"(the fc columns follow the capture's layer order), found {ids}")  # fmt: skip
    if type(mask) is not int or mask < 0:
        raise _refuse(path, f"dflash_config.mask_token_id: expected an id >= 0, found {mask!r}")
    if type(size) is not int or size < 2:
        raise _refuse(path, f"block_size: expected an int >= 2, found {size!r}")
    if mixing not in CONTEXT_MIXING:
        raise _refuse(path, f"dflash_config.context_mixing: expected one of {list(CONTEXT_MIXING)}, "
                           f"found {mixing!r}")  # fmt: skip
    refuse_unsupported(raw, path)
    layer = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("dflash_config", "auto_map")})
    layer.is_causal = False
    n_target = raw.get("num_target_layers")
    n_target = None if n_target is None else int(n_target)
    return BlockSpec(layer, tuple(ids), size, mask, n_target, mixing)


def refuse_unsupported(raw: dict, path: Path) -> None:
    if raw.get("is_causal") or _setting(raw, path, "is_causal"):
        raise _refuse(path, "is_causal: true: causal drafter attention is not supported "
                           "(DFlash's block attends both ways; expected false)")  # fmt: skip
    sliding = [t for t in raw.get("layer_types") or [] if t != "full_attention"]
    if sliding or raw.get("use_sliding_window"):
        raise _refuse(path, f"layer_types {sorted(set(sliding)) or 'sliding'}: sliding-window "
                           "drafter attention is not supported (expected full_attention)")  # fmt: skip
    for key, default in UNSUPPORTED.items():
        value = _setting(raw, path, key, default)
        if value != default:
            raise _refuse(path, f"{key}: {value!r} is not supported (expected {default!r})")


def block_shapes(spec: BlockSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of a drafter of `spec`, by name: the module's own state dict, unallocated."""
    with torch.device("meta"):
        module = BlockDrafterModule(spec.layer, len(spec.target_layer_ids), spec.context_mixing)
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def read_checked_weights(
    folder: Path, want: dict[str, tuple[int, ...]], what: str, rename=lambda key: key
) -> dict[str, Tensor]:
    """`folder`'s weights, refused unless they hold exactly `want`'s keys (after `rename`)
    with their shapes; `what` names the drafter in the messages (block and semi-AR kinds)."""
    path = folder / WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"model.drafter: no {WEIGHTS} in '{folder}' (expected {what}'s "
                                "folder: config.json and model.safetensors)")  # fmt: skip
    try:
        state = {rename(k): v for k, v in load_file(path).items()}
    except SafetensorError as e:
        raise _refuse(path, f"unreadable safetensors file ({e})") from e
    for key, shape in want.items():
        if key not in state:
            raise _refuse(path, f"lacks key '{key}' (expected shape {list(shape)}) for {what}")
    for key, tensor in state.items():
        if key not in want:
            raise _refuse(path, f"unexpected key '{key}' (shape {list(tensor.shape)}): not part "
                               f"of {what} (expected {len(want)} keys)")  # fmt: skip
        if tuple(tensor.shape) != want[key]:
            raise _refuse(path, f"key '{key}': expected shape {list(want[key])}, found "
                               f"{list(tensor.shape)}")  # fmt: skip
    return state


def read_block_weights(folder: Path, spec: BlockSpec) -> dict[str, Tensor]:
    """The weights, refused unless every key of `spec`'s drafter is there with its shape."""
    what = f"a {spec.layer.num_hidden_layers}-layer block drafter"
    return read_checked_weights(folder, block_shapes(spec), what)


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

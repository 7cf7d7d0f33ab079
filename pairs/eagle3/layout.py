"""EAGLE-3 head checkpoints on disk: the config variants and weight key layouts in use.

Read without executing code (config.json as JSON; `model.safetensors`, or
`pytorch_model.bin` through `torch.load(weights_only=True)`) into one canonical form.

    config    plain EAGLE-3 (SafeAILab/EAGLE, SGLang, vLLM): the layer's Llama fields at the
              top level, `draft_vocab_size`, aux ids (if any) at the top level or under
              `eagle_config`; or speculators: the layer config nested under
              `transformer_layer_config`, `draft_vocab_size`, `target_hidden_size`,
              `eagle_aux_hidden_state_layer_ids`, `norm_before_residual`
    weights   `fc.weight`; per layer `self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`,
              `input_layernorm`, `post_attention_layernorm` (the first layer also
              `hidden_norm`); `norm.weight`; optional `lm_head.weight`, `embed_tokens.weight`,
              `d2t`, `t2d`. Layers are named `midlayer.` (one layer), `midlayer.{i}.` or
              `layers.{i}.`; any name may carry a `model.` prefix
    canonical `layers.{i}.` without prefix: the `pairs.eagle3.head.Eagle3Head` state-dict names

`d2t[i]` is the offset of draft id i: its target id is `i + d2t[i]`; `t2d` marks the
target ids the draft vocabulary holds.
"""

from __future__ import annotations

import json
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor
from transformers import LlamaConfig

LAYOUTS = ("eagle3", "eagle3_layers", "speculators")  # midlayer. | midlayer.{i}. | layers.{i}.
WEIGHT_FORMATS = ("safetensors", "bin")
WEIGHT_FILES = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin"}
# Layer fields read from a head config (anything else there -- architectures, token ids,
# dtype -- does not shape the computation).
LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "rms_norm_eps",
    "hidden_act",
    "max_position_embeddings",
    "vocab_size",
    "attention_bias",
    "mlp_bias",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
)
REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
OPTIONAL_KEYS = ("lm_head.weight", "embed_tokens.weight", "d2t", "t2d")
_LAYER_NAME = re.compile(r"^(midlayer|layers)(?:\.(\d+))?\.(.+)$")


@dataclass(frozen=True)
class HeadSpec:
    """What a head's config.json declares, whichever variant wrote it."""

    layer: LlamaConfig  # the head's decoder layer(s); vocab_size = the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int  # width of each aux hidden state (the head's own width if unset)
    aux_layer_ids: tuple[int, ...] | None  # as written (read per model.aux_layer_convention)
    norm_before_residual: bool  # the first layer's residual is hidden_norm(fused), not fused
    layout: str  # "eagle3" (plain) or "speculators": which variant the config is

    @property
    def n_layers(self) -> int:
        return self.layer.num_hidden_layers


def refuse(setting: str, path: Path, what: str) -> ValueError:
    return ValueError(f"{setting}: {path}: {what}")


def layer_config(fields: dict, path: Path, setting: str) -> LlamaConfig:
    """The head layer's LlamaConfig from a config dict (plain top level or speculators' nested one)."""
    model_type = fields.get("model_type", "llama")
    if model_type != "llama":
        raise refuse(
            setting,
            path,
            f"layer model_type: expected 'llama' (EAGLE-3 heads are "
            f"Llama decoder layers), found {model_type!r}",
        )
    missing = [k for k in REQUIRED_FIELDS if k not in fields]
    if missing:
        raise refuse(
            setting,
            path,
            f"the head config lacks {missing} (expected the layer's {list(REQUIRED_FIELDS)})",
        )
    kw = {k: fields[k] for k in LAYER_FIELDS if fields.get(k) is not None}
    kw.setdefault("num_hidden_layers", 1)
    return LlamaConfig(**kw)


def read_head_config(folder: Path, setting: str = "model.drafter") -> HeadSpec:
    """The head's config.json in either variant; refuses settings this decoder cannot run."""
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise refuse(setting, path, f"expected a readable JSON head config ({e})") from e
    if not isinstance(raw, dict):
        raise refuse(setting, path, f"expected a JSON object, found {type(raw).__name__}")
    kind = raw.get("speculators_model_type")
    if kind is not None and kind != "eagle3":
        raise refuse(setting, path, f"speculators_model_type: expected 'eagle3', found {kind!r}")
    if "transformer_layer_config" in raw or kind == "eagle3":
        layout, fields = "speculators", raw.get("transformer_layer_config")
        if not isinstance(fields, dict):
            raise refuse(
                setting,
                path,
                f"speculators layout: expected a transformer_layer_config object, found {fields!r}",
            )
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
    else:
        layout, fields = "eagle3", raw
        eagle = raw.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise refuse(
                setting,
                path,
                "eagle_config.use_aux_hidden_state: expected true (an "
                "EAGLE-3 head fed by aux hidden states), found false",
            )
        aux = raw.get(
            "eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids")
        )
    if raw.get("norm_before_fc"):
        raise refuse(setting, path, "norm_before_fc: true is not supported (expected false)")
    layer = layer_config(fields, path, setting)
    draft_vocab = raw.get("draft_vocab_size") or layer.vocab_size
    target_hidden = raw.get("target_hidden_size") or fields.get("target_hidden_size")
    if aux is not None and not (isinstance(aux, list) and all(isinstance(i, int) for i in aux)):
        raise refuse(
            setting,
            path,
            f"eagle_aux_hidden_state_layer_ids: expected a list of ints, found {aux!r}",
        )
    return HeadSpec(
        layer=layer,
        draft_vocab_size=int(draft_vocab),
        target_hidden_size=int(target_hidden or layer.hidden_size),
        aux_layer_ids=None if aux is None else tuple(aux),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        layout=layout,
    )


def pickle_protocol(path: Path) -> int | None:
    """The pickle protocol of a torch checkpoint (zip or legacy format); None if unknown.

    Protocol 2+ pickles start with PROTO (0x80) and the protocol byte: the zip format's
    `*/data.pkl` member, or the legacy file's first pickle (its magic number).
    """
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            head = f.read(2)
    else:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith("data.pkl")]
            head = z.read(names[0])[:2] if names else b""  # data.pkl: small, tensors apart
    return head[1] if len(head) == 2 and head[0] == 0x80 else None


def read_head_weights(
    folder: Path, setting: str = "model.drafter"
) -> tuple[dict[str, Tensor], Path]:
    """The head's tensors by their names in the file, and the file read."""
    st, pt = folder / WEIGHT_FILES["safetensors"], folder / WEIGHT_FILES["bin"]
    if st.is_file():
        try:
            return load_file(st), st
        except SafetensorError as e:
            raise refuse(setting, st, f"unreadable safetensors file ({e})") from e
    if pt.is_file():
        protocol = pickle_protocol(pt)
        if protocol is not None and protocol > 2:
            # torch's weights-only unpickler reads protocol 2 only (the one torch.save
            # writes by default); a protocol-4 file fails there however safe its contents.
            raise refuse(setting, pt,
                f"saved with pickle protocol {protocol}, which torch.load(weights_only=True) "
                "cannot read (it reads protocol 2, torch.save's default); re-save the state "
                "dict with torch.save(state, path), or convert it to model.safetensors "
                "(safetensors.torch.save_file(state, path))")  # fmt: skip
        try:  # weights_only: tensors and plain containers only, no pickled code runs
            state = torch.load(pt, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise refuse(
                setting,
                pt,
                "refused: the pickle holds objects other than tensors "
                f"(torch.load weights_only=True: {str(e).splitlines()[0]})",
            ) from e
        if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
            raise refuse(setting, pt, "expected a flat dict of tensors (a state dict)")
        return state, pt
    raise FileNotFoundError(
        f"{setting}: no {WEIGHT_FILES['safetensors']} or {WEIGHT_FILES['bin']} in '{folder}' "
        f"(expected an EAGLE-3 head folder: config.json and one weights file)"
    )


def canonical_names(
    raw: dict[str, Tensor], spec: HeadSpec, path: Path, setting: str = "model.drafter"
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(tensors by canonical name, canonical name -> the file's name). Refuses ambiguous files."""
    out: dict[str, Tensor] = {}
    origin: dict[str, str] = {}
    styles: set[str] = set()
    for name, tensor in raw.items():
        key = name.removeprefix("model.")
        m = _LAYER_NAME.match(key)
        if m and not (m.group(1) == "layers" and m.group(2) is None):
            styles.add(m.group(1) if m.group(2) is None else f"{m.group(1)}.{{i}}")
            key = f"layers.{int(m.group(2) or 0)}.{m.group(3)}"
        if key in out:
            raise refuse(setting, path, f"keys '{origin[key]}' and '{name}' name the same tensor")
        out[key], origin[key] = tensor, name
    if len(styles) > 1:
        raise refuse(
            setting,
            path,
            f"layers are named in several styles {sorted(styles)}; "
            "expected one of 'midlayer.', 'midlayer.{i}.', 'layers.{i}.'",
        )
    if styles == {"midlayer"} and spec.n_layers != 1:
        raise refuse(
            setting,
            path,
            f"an unindexed 'midlayer.' holds one layer, but the config "
            f"declares num_hidden_layers={spec.n_layers}",
        )
    return out, origin


def expected_shapes(spec: HeadSpec, n_aux: int) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(required, optional) canonical keys with their shapes, for a head fed `n_aux` aux states."""
    c = spec.layer
    h, inter, hd = c.hidden_size, c.intermediate_size, c.head_dim
    nq, nkv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    req: dict[str, tuple] = {"fc.weight": (h, n_aux * spec.target_hidden_size), "norm.weight": (h,)}
    for i in range(spec.n_layers):
        p, d_in = (
            f"layers.{i}.",
            2 * h if i == 0 else h,
        )  # the first layer reads [embedding | hidden]
        req |= {
            p + "self_attn.q_proj.weight": (nq, d_in),
            p + "self_attn.k_proj.weight": (nkv, d_in),
            p + "self_attn.v_proj.weight": (nkv, d_in),
            p + "self_attn.o_proj.weight": (h, nq),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if i == 0:
            req[p + "hidden_norm.weight"] = (h,)
        if c.attention_bias:
            req |= {
                p + "self_attn.q_proj.bias": (nq,),
                p + "self_attn.k_proj.bias": (nkv,),
                p + "self_attn.v_proj.bias": (nkv,),
                p + "self_attn.o_proj.bias": (h,),
            }
        if c.mlp_bias:
            req |= {
                p + "mlp.gate_proj.bias": (inter,),
                p + "mlp.up_proj.bias": (inter,),
                p + "mlp.down_proj.bias": (h,),
            }
    opt = {
        "lm_head.weight": (spec.draft_vocab_size, h),
        "embed_tokens.weight": (c.vocab_size, h),
        "d2t": (spec.draft_vocab_size,),
        "t2d": (c.vocab_size,),
    }
    return req, opt


_WHY = {
    "fc.weight": "hidden_size x (aux layers x target hidden size)",
    "lm_head.weight": "draft_vocab_size x hidden_size",
    "embed_tokens.weight": "the target's vocabulary x hidden_size",
    "d2t": "one offset per draft id",
    "t2d": "one flag per target id",
}


def check_head_weights(
    state: dict[str, Tensor],
    origin: dict[str, str],
    spec: HeadSpec,
    n_aux: int,
    path: Path,
    setting: str = "model.drafter",
) -> None:
    """Every required key present with its shape, optional ones shaped right, nothing else."""
    req, opt = expected_shapes(spec, n_aux)
    for key, shape in req.items():
        if key not in state:
            raise refuse(
                setting,
                path,
                f"lacks key '{_spelled(key, origin)}' (expected shape "
                f"{list(shape)}) for a {spec.n_layers}-layer EAGLE-3 head",
            )
    for key, tensor in state.items():
        shape = req.get(key, opt.get(key))
        if shape is None:
            raise refuse(
                setting,
                path,
                f"unexpected key '{origin[key]}' (shape "
                f"{list(tensor.shape)}): not part of a {spec.n_layers}-layer EAGLE-3 head "
                f"(expected {len(req)} keys such as 'fc.weight', "
                f"'midlayer.self_attn.q_proj.weight', and optionally {list(OPTIONAL_KEYS)})",
            )
        if tuple(tensor.shape) != shape:
            why = f" ({_WHY[key]})" if key in _WHY else ""
            raise refuse(
                setting,
                path,
                f"key '{origin[key]}': expected shape {list(shape)}{why}, "
                f"found {list(tensor.shape)}",
            )
        want_float = key not in ("d2t", "t2d")
        if want_float != tensor.is_floating_point():
            kind = "floating point" if want_float else "integer or bool"
            raise refuse(
                setting, path, f"key '{origin[key]}': expected {kind} values, found {tensor.dtype}"
            )
    check_vocab_map(state.get("d2t"), state.get("t2d"), spec, path, setting)


def _spelled(key: str, origin: dict[str, str]) -> str:
    """A missing canonical key as the file would spell it (its layer style and prefix)."""
    m = re.match(r"^layers\.(\d+)\.(.+)$", key)
    for canon, name in origin.items() if m else ():
        mk = re.match(rf"^layers\.{m.group(1)}\.(.+)$", canon)
        if mk:
            return name[: len(name) - len(mk.group(1))] + m.group(2)
    return key


def draft_token_ids(d2t: Tensor | None, draft_vocab: int) -> Tensor | None:
    """Target id of every draft id (`i + d2t[i]`); None when the draft vocabulary is the target's."""
    return None if d2t is None else torch.arange(draft_vocab) + d2t.long()


def check_vocab_map(
    d2t: Tensor | None,
    t2d: Tensor | None,
    spec: HeadSpec,
    path: Path,
    setting: str = "model.drafter",
) -> None:
    vocab, n = spec.layer.vocab_size, spec.draft_vocab_size
    if d2t is None:
        if n != vocab:
            raise refuse(
                setting,
                path,
                f"draft_vocab_size {n} differs from vocab_size {vocab} but "
                "the weights hold no 'd2t' (expected the draft-to-target id map)",
            )
        return
    ids = draft_token_ids(d2t, n)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != n:
        raise refuse(
            setting,
            path,
            f"'d2t' maps draft ids to target ids {int(ids.min())}.."
            f"{int(ids.max())} ({ids.unique().numel()} distinct); expected {n} distinct "
            f"ids in [0, {vocab})",
        )
    if t2d is not None:
        flags = t2d.bool()
        if int(flags.sum()) != n or not bool(flags[ids].all()):
            raise refuse(
                setting,
                path,
                f"'t2d' marks {int(flags.sum())} target ids, expected "
                f"exactly the {n} that 'd2t' maps to",
            )

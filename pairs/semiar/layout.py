"""Semi-autoregressive drafter checkpoints on disk, read without executing code: each kind in
its reference's layout, each setting where that reference reads it.

    dspark  deepseek-ai/DeepSpec `deepspec/modeling/dspark/` (read at commit
            afdfa7c9382a3341a3e6f17756dd816da79f132c): `architectures: ["Qwen3DSparkModel"]`,
            a Qwen3 config whose settings sit at the TOP LEVEL (its `build_draft_config`):
            block_size, target_layer_ids (output convention; -1 = the embedding output; the
            target's last layer refused, as its evaluator does), mask_token_id,
            markov_rank, markov_head_type (`vanilla` | `gated`), enable_confidence_head,
            confidence_head_with_markov. A `dflash_config` holding one of them with another
            value is refused. Weights: the backbone's (`pairs.block.layout`), `embed_tokens`,
            `lm_head`, `markov_head.*`, `confidence_head.proj.*`. Our key
            `shared_with_target` (a list of `embed_tokens`, `lm_head`) says the file leaves
            those out because they are the target's, unchanged (a recipe that keeps them
            frozen copies ships 2 x vocab x hidden fewer weights); the loader fills them from
            the target (`pairs.semiar.drafter.attach_semiar`). Without the key a file lacking
            them is refused by name; with it, a file holding them too.
    domino  sgl-project/SpecForge `specforge/modeling/draft/domino.py` (read at commit
            a6b6b0230009d15ec2a97a57384e6f53f0f96946): `architectures: ["DominoDraftModel"]`,
            DFlash's places (block_size at the top level; ids and mask under `dflash_config`,
            `pairs.block.layout.placed`) and under `dflash_config`: projector_type (absent or
            `domino`), emb_dim, gru_hidden_dim, shift_label, pure_draft_prefix_len. Weights:
            the backbone's, `prefix_gru.weight_{ih,hh}_l0`, `embed_proj.{0,2}.weight` (early
            checkpoints' `logit_head.` prefix read as SpecForge's load hook reads it).

Refused by name: DSpark's `rnn` head, a DSpark without a Markov head (markov_rank 0) and other
backbones (Gemma4DSparkModel); a Domino projector_type other than `domino` and DSpark's or
attention_mode keys in a Domino file; what `pairs.block.layout` refuses of the backbone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from pairs.block.layout import (
    DRAFTER_SETTING,
    WEIGHTS,
    BlockSpec,
    block_spec_of,
    placed,
    read_checked_weights,
    refusal,
)
from specrank.settings.errors import Refusal

KINDS = {"dspark": "Qwen3DSparkModel", "domino": "DominoDraftModel"}
OTHER_BACKBONES = ("Gemma4DSparkModel",)
MARKOV_HEADS = ("vanilla", "gated")  # DeepSpec's `rnn` is refused by name
DSPARK_KEYS = ("block_size", "target_layer_ids", "mask_token_id", "markov_rank",
               "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")  # fmt: skip
NOT_DOMINO = ("markov_rank", "markov_head_type", "enable_confidence_head",
              "confidence_head_with_markov", "confidence_head_alpha", "attention_mode")  # fmt: skip
SHARED_KEY = "shared_with_target"  # ours: weights left out of the file, the target's
SHAREABLE = ("embed_tokens", "lm_head")
LEGACY_PREFIX = "logit_head."  # SpecForge's early Domino checkpoints nest the head under it


def _refuse(path: Path, what: str) -> Refusal:
    return refusal(DRAFTER_SETTING, path, what)


@dataclass(frozen=True)
class SemiARSpec:
    """What a semi-AR drafter's config.json declares."""

    kind: str  # dspark | domino
    block: BlockSpec  # the DFlash backbone
    variant: str  # dspark: the Markov head type; domino: "gru"
    rank: int  # dspark: markov_rank; domino: gru_hidden_dim
    vocab_size: int
    shift: bool  # True: block row k drafts the token at r + k + 1 (dspark; domino shift_label)
    plain_rows: int = 0  # domino's pure_draft_prefix_len: first drafted rows left uncorrected
    emb_dim: int = 0  # domino's embed_proj width
    confidence: str = "none"  # dspark: none | hidden | hidden+markov
    shared_with_target: tuple[str, ...] = ()  # dspark: SHAREABLE modules the file leaves out

    @property
    def depth(self) -> int:
        """Drafted positions a block reaches: the rows' count."""
        return self.block.block_size if self.kind == "dspark" else self.block.block_size - 1

    @property
    def conditions_on(self) -> str:
        """What a node's children rows condition on beyond the block (the manifest's words)."""
        if self.kind == "dspark":
            gate = " and the row's hidden state" if self.variant == "gated" else ""
            return f"the node's own token (Markov head, {self.variant}){gate}"
        return "a GRU state over the node's path from the root (Domino)"


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise _refuse(path, f"expected a readable JSON drafter config ({e})") from e


def _arch(raw: dict, path: Path, kind: str) -> None:
    arch = list(raw.get("architectures") or [])
    other = [a for a in arch if a in OTHER_BACKBONES]
    if other:
        raise _refuse(path, f"architectures {arch}: the {other[0]} backbone is not supported "
                           f"(expected ['{KINDS[kind]}'])")  # fmt: skip
    if arch != [KINDS[kind]]:
        raise _refuse(path, f"architectures: model.drafter_kind={kind} expects "
                           f"['{KINDS[kind]}'], found {arch}")  # fmt: skip
    if raw.get("model_type", "qwen3") != "qwen3":
        raise _refuse(path, f"model_type: expected 'qwen3', found {raw.get('model_type')!r}")


def _int(path: Path, name: str, value, low: int) -> int:
    if type(value) is not int or value < low:
        raise _refuse(path, f"{name}: expected an int >= {low}, found {value!r}")
    return value


def read_dspark_config(folder: Path) -> SemiARSpec:
    """DeepSpec's layout: every setting at the top level (see the module doc)."""
    path = folder / "config.json"
    raw = _json(path)
    _arch(raw, path, "dspark")
    inner = raw.get("dflash_config") or {}
    for key in DSPARK_KEYS:
        if key not in raw:
            raise _refuse(path, f"{key}: absent; DeepSpec's Qwen3DSparkModel reads it from the "
                               "top level, with no default")  # fmt: skip
        if key in inner and inner[key] != raw[key]:
            raise _refuse(path, f"{key}: the top level (where DeepSpec reads it) holds "
                               f"{raw[key]!r} but dflash_config.{key} {inner[key]!r}: the two "
                               "places must agree")  # fmt: skip
    rank = _int(path, "markov_rank", raw["markov_rank"], 0)
    head = str(raw["markov_head_type"]).lower()
    if rank == 0:
        raise _refuse(path, "markov_rank: 0 (no Markov head) is not supported: this kind's "
                           "children condition on the node through its Markov head")  # fmt: skip
    if head not in MARKOV_HEADS:
        raise _refuse(path, f"markov_head_type: {head!r} is not supported (expected one of "
                           f"{list(MARKOV_HEADS)}; the rnn head carries a state across the "
                           "block, not read here)")  # fmt: skip
    confidence = "none"
    if raw["enable_confidence_head"]:
        confidence = "hidden+markov" if raw["confidence_head_with_markov"] else "hidden"
    ids = raw["target_layer_ids"]  # -1, the embedding output, is capture id 0
    size = _int(path, "block_size", raw["block_size"], 1)
    block = block_spec_of(raw, path, ids, raw["mask_token_id"], max(size, 2), "shared")
    block = BlockSpec(block.layer, block.target_layer_ids, size, block.mask_token_id,
                      block.num_target_layers)  # fmt: skip
    vocab = _int(path, "vocab_size", raw.get("vocab_size"), 1)
    shared = raw.get(SHARED_KEY, [])
    if not isinstance(shared, list) or any(s not in SHAREABLE for s in shared):
        raise _refuse(path, f"{SHARED_KEY}: expected a list of {list(SHAREABLE)} (the modules "
                           f"the file leaves out, the target's), found {shared!r}")  # fmt: skip
    return SemiARSpec("dspark", block, head, rank, vocab, True, confidence=confidence,
                      shared_with_target=tuple(shared))  # fmt: skip


def read_domino_config(folder: Path) -> SemiARSpec:
    """SpecForge's layout: DFlash's places, Domino's settings under `dflash_config`."""
    path = folder / "config.json"
    raw = _json(path)
    _arch(raw, path, "domino")
    inner = raw.get("dflash_config") or {}
    if inner.get("projector_type", "domino") != "domino":
        raise _refuse(path, f"dflash_config.projector_type: {inner['projector_type']!r}: "
                           "DominoDraftModel requires 'domino'")  # fmt: skip
    foreign = [k for k in (*NOT_DOMINO, SHARED_KEY) if k in inner or k in raw]
    if foreign:
        raise _refuse(path, f"keys {foreign}: not Domino's settings (DSpark's or other "
                           "projectors'); not honoured here, so refused")  # fmt: skip
    for key in ("emb_dim", "gru_hidden_dim"):
        if key not in inner:
            raise _refuse(path, f"dflash_config.{key}: absent; DominoDraftModel requires it")
    emb = _int(path, "dflash_config.emb_dim", inner["emb_dim"], 1)
    gru = _int(path, "dflash_config.gru_hidden_dim", inner["gru_hidden_dim"], 1)
    shift = inner.get("shift_label", False)
    if type(shift) is not bool:
        raise _refuse(path, f"dflash_config.shift_label: expected true or false, found {shift!r}")
    prefix = _int(path, "dflash_config.pure_draft_prefix_len",
                  inner.get("pure_draft_prefix_len", 0), 0)  # fmt: skip
    ids = placed(raw, path, "target_layer_ids")
    block = block_spec_of(raw, path, ids, placed(raw, path, "mask_token_id"),
                          placed(raw, path, "block_size"), "shared")  # fmt: skip
    if prefix > block.block_size - 2:
        raise _refuse(path, f"dflash_config.pure_draft_prefix_len: {prefix} leaves no corrected "
                           f"row in a block of {block.block_size}")  # fmt: skip
    vocab = _int(path, "vocab_size", raw.get("vocab_size"), 1)
    return SemiARSpec("domino", block, "gru", gru, vocab, shift, prefix, emb)


READERS = {"dspark": read_dspark_config, "domino": read_domino_config}


def semiar_shapes(spec: SemiARSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of a drafter of `spec`, by name: the module's own state dict, unallocated."""
    from pairs.semiar.module import SemiARModule

    with torch.device("meta"):
        module = SemiARModule(spec)
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def read_semiar_weights(folder: Path, spec: SemiARSpec) -> dict[str, Tensor]:
    """The weights, refused unless every key of `spec`'s drafter is there with its shape
    (older checkpoints' `logit_head.` prefix read as the reference does)."""
    what = f"a {spec.kind} drafter ({spec.variant})"
    want = semiar_shapes(spec)
    for name in SHAREABLE if spec.kind == "dspark" else ():
        key = f"{name}.weight"
        if name in spec.shared_with_target:
            want.pop(key)
        elif key not in _keys(folder):
            raise _refuse(folder / WEIGHTS, f"lacks key '{key}' (expected shape "
                         f"{list(want[key])}) for {what}, and config.json's {SHARED_KEY} does "
                         f"not name '{name}' (add {SHARED_KEY}: [\"{name}\", ...] to fill it "
                         "from the target, for a drafter whose copy is the target's)")  # fmt: skip
    return read_checked_weights(folder, want, what, lambda key: key.removeprefix(LEGACY_PREFIX))


def _keys(folder: Path) -> set[str]:
    """The weight names of `folder`'s file (unreadable: none; `read_checked_weights` refuses)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(folder / WEIGHTS), "pt") as f:
            return {k.removeprefix(LEGACY_PREFIX) for k in f.keys()}  # noqa: SIM118
    except (OSError, SafetensorError):
        return set()


def semiar_config(spec: SemiARSpec, extra: dict | None = None) -> dict:
    """config.json of a drafter of `spec` in its reference's layout (the inverse of `READERS`);
    `extra`: further top-level keys (e.g. DeepSpec's `num_anchors`, read by its trainer)."""
    fields = spec.block.layer.to_dict()
    for key in ("is_causal", "transformers_version", "dtype", "torch_dtype", "architectures"):
        fields.pop(key, None)
    b = spec.block
    fields |= {"model_type": "qwen3", "architectures": [KINDS[spec.kind]],
               "block_size": b.block_size, "vocab_size": spec.vocab_size,
               "tie_word_embeddings": False}  # fmt: skip
    if b.num_target_layers is not None:
        fields["num_target_layers"] = b.num_target_layers
    if spec.kind == "dspark":
        fields |= {"target_layer_ids": list(b.target_layer_ids), "mask_token_id": b.mask_token_id,
                   "markov_rank": spec.rank, "markov_head_type": spec.variant,
                   "enable_confidence_head": spec.confidence != "none",
                   "confidence_head_with_markov": spec.confidence == "hidden+markov"}  # fmt: skip
        if spec.shared_with_target:
            fields[SHARED_KEY] = list(spec.shared_with_target)
    else:
        fields["dflash_config"] = {
            "mask_token_id": b.mask_token_id, "target_layer_ids": list(b.target_layer_ids),
            "projector_type": "domino", "emb_dim": spec.emb_dim, "gru_hidden_dim": spec.rank,
            "shift_label": spec.shift, "pure_draft_prefix_len": spec.plain_rows,
        }  # fmt: skip
    return fields | (extra or {})


def save_semiar_drafter(folder: Path, module: nn.Module, spec: SemiARSpec,
                        extra: dict | None = None) -> None:  # fmt: skip
    """config.json and model.safetensors in `spec.kind`'s reference layout (the pocket
    drafters); read back, they give `spec` (`READERS`). `spec.shared_with_target`'s modules
    are left out of the file (the loader fills them from the target)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(semiar_config(spec, extra), indent=2) + "\n")
    shared = tuple(f"{name}." for name in spec.shared_with_target)
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()
             if not k.startswith(shared) or not shared}  # fmt: skip
    save_file(state, folder / WEIGHTS)

"""The pocket semi-autoregressive drafters (DSpark, Domino): the pocket block drafter's DFlash
backbone, data, schedule and export (`recipes.pocket.block`) with a kind's correction head,
trained teacher-forced and saved in its reference's layout (`pairs.semiar`).

    python -m decode.train_pocket.dspark     # DeepSpec's DSpark: Markov head, confidence head
    python -m decode.train_pocket.domino     # SpecForge's Domino: prefix GRU, embed_proj

Rows: an anchor a gives the block's D drafted rows; row j drafts the token at a + j + 1 and
its label is the target's row at a + j (`recipes.pocket.block.Window`). DSpark's block is
[x_a, mask x (bs - 1)] embedded by its own embedding, all bs rows through its own lm_head
(both frozen copies of the target's, as DeepSpec initialises and freezes them); Domino's is
DFlash's (rows 1 .. bs - 1, the target's embedding and lm_head). Paths are teacher-forced as
both references train: row j's node is the data token x_{a + j}, its path x_a .. x_{a + j}
(`SemiARModule.path_bias`, equal to drafting node by node: tests/test_semiar_pocket.py).
The backbone is initialised as the block recipe's (same seed, same draws); the heads as the
references' Hugging Face init (normal, std 0.02), so training starts from the backbone alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pairs.block.layout import BlockSpec
from pairs.semiar.layout import SemiARSpec, save_semiar_drafter
from pairs.semiar.module import SemiARModule
from recipes.pocket import train
from recipes.pocket.block import (
    LABELS,
    Window,
    agreement,
    backbone_layer,
    block_hidden,
    export,
    heldout_windows,
    make_data,
    recipe_facts,
    start,
)
from recipes.pocket.config import PocketSemiARConfig
from recipes.pocket.eagle3 import TrainingData
from recipes.pocket.semiar_card import write_card
from recipes.pocket.train import Log

HEAD_INIT_STD = 0.02  # the references' initializer_range (Hugging Face's _init_weights)
BACKBONE = ("fc", "hidden_norm", "layers", "norm")  # the DFlash backbone's top-level names
HEADS = ("markov_head", "confidence_head", "prefix_gru", "embed_proj")


def make_semiar_spec(pc: PocketSemiARConfig, kind: str, target) -> SemiARSpec:
    """The drafter's spec: the block recipe's backbone layer and the kind's head settings."""
    t = target.config
    block = BlockSpec(backbone_layer(pc, target), tuple(pc.target_layer_ids), pc.block_size,
                      int(t.pad_token_id), t.num_hidden_layers)  # fmt: skip
    if kind == "dspark":
        confidence = "hidden+markov" if pc.confidence_with_markov else "hidden"
        return SemiARSpec("dspark", block, pc.markov_head_type, pc.markov_rank, t.vocab_size,
                          True, confidence=confidence)  # fmt: skip
    return SemiARSpec("domino", block, "gru", pc.gru_hidden_dim, t.vocab_size, False,
                      pc.pure_draft_prefix_len, pc.emb_dim)  # fmt: skip


def build_module(spec: SemiARSpec, target, seed: int) -> SemiARModule:
    """The backbone as the block recipe draws it, the heads at the references' init; DSpark's
    own embedding and lm_head frozen copies of the target's."""
    torch.manual_seed(seed)
    module = SemiARModule(spec)
    backbone = {id(p) for name, p in module.named_parameters() if _in_backbone(name)}
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear | nn.Embedding) and id(m.weight) not in backbone:
                m.weight.normal_(0.0, HEAD_INIT_STD)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
        if spec.kind == "dspark":
            module.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
            module.lm_head.weight.copy_(target.get_output_embeddings().weight)
            module.embed_tokens.requires_grad_(False)
            module.lm_head.requires_grad_(False)
    return module


def _in_backbone(name: str) -> bool:
    return name.split(".")[0] in BACKBONE


@dataclass
class Rows:
    """A window's teacher-forced rows: [A, D, V] logits before and after the correction, the
    rows' hidden states [A, D, H] and their nodes' tokens [A, D]."""

    base: torch.Tensor
    final: torch.Tensor
    hidden: torch.Tensor
    prev: torch.Tensor


def teacher_forced(module: SemiARModule, spec: SemiARSpec, target, win: Window) -> Rows:
    """Every anchor's D rows, each corrected from its data path (see the module doc)."""
    own = spec.kind == "dspark"
    embed = module.embed_tokens if own else target.get_input_embeddings()
    hidden = block_hidden(module, embed, win.feats, win.x, win.anchors, spec.block)
    d = spec.depth
    rows = hidden[:, :d] if spec.shift else hidden[:, 1 : d + 1]
    base = (module.lm_head if own else target.get_output_embeddings())(rows)
    prev = win.x[win.rows]  # row j's node: x_{a + j}, the root first
    bias = module.path_bias(rows, prev, None if own else target.get_input_embeddings())
    return Rows(base, base + bias, rows, prev)


def check_labels(pc: PocketSemiARConfig, section: str) -> None:
    if pc.labels not in LABELS:
        raise ValueError(f"{section}.labels: expected one of {list(LABELS)}, found {pc.labels!r}")


def semiar_agreement(module, spec: SemiARSpec, target, data: TrainingData,
                     which: str = "final") -> dict:  # fmt: skip
    """Held-out teacher-forced agreement (`recipes.pocket.block.agreement`) of the corrected
    rows, or with `which="base"` of the backbone's rows alone."""

    def logits_of(win: Window) -> torch.Tensor:
        return getattr(teacher_forced(module, spec, target, win), which)

    return agreement(module, logits_of, heldout_windows(target, spec.block, spec.depth, data, 8192))


Finish = Callable[[SemiARModule, SemiARSpec, object, TrainingData], dict]


def run(pc: PocketSemiARConfig, kind: str, make_loss, log: Log = print,
        finish: Finish | None = None, measure: Callable[[Path], dict] | None = None,
        extra: dict | None = None) -> dict:  # fmt: skip
    """Data, training, `finish` (after training: DSpark's calibration, its facts), export in
    the kind's layout (`extra`: further config keys), `measure(out)` (the decode entry's
    held-out tau), then `recipe.json` and `MODEL_CARD.md` beside the drafter."""
    section = f"pocket_{kind}"
    check_labels(pc, section)
    target, tok, out, t0 = start(pc, section)
    spec = make_semiar_spec(pc, kind, target)
    module = build_module(spec, target, pc.seed)
    loss = make_loss(module, spec, target, pc)  # its settings refused before the data is made
    data, data_minutes = make_data(pc, target, tok, t0, log)
    res = train.train_loop(module, loss, data.streams,
                           lambda: semiar_agreement(module, spec, target, data), pc.train,
                           pc.seed, log)  # fmt: skip
    module.eval()
    done = {"val_base": semiar_agreement(module, spec, target, data, "base")}
    done |= finish(module, spec, target, data) if finish else {}
    module.eval()
    sizes = export(module, lambda o, m: save_semiar_drafter(o, m, spec, extra), out,
                   pc.export_dtype)  # fmt: skip
    facts = recipe_facts(pc, module, spec.block, spec.depth, data, data_minutes, res,
                         sizes) | done  # fmt: skip
    facts |= {"kind": kind, "depth": spec.depth, "trainable": _trainable(module),
              "heads": _params(module, HEADS), "backbone": _params(module, BACKBONE)}  # fmt: skip
    if measure is not None:
        facts["heldout"] = measure(out)
    write_card(out, facts)
    log(f"{kind} drafter: {facts['params']:,} parameters, {sum(sizes.values()):,} bytes in {out}")
    return facts


def _trainable(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _params(module: nn.Module, names: tuple[str, ...]) -> int:
    return sum(p.numel() for n, p in module.named_parameters() if n.split(".")[0] in names)

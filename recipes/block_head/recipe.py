"""The block-family recipe for a real target: a DFlash block drafter, DSpark or Domino
(`model.drafter_kind`) trained on the EAGLE-3 recipe's capture and written into
`model.drafter` (`python -m decode.train_head model=smollm2_block|_dspark|_domino`).

Data: the capture of the target (`recipes.eagle3.recipe.captured`: reused when present,
made by the same code when not), whose states are the drafter's context: the drafter's
`target_layer_ids` (output convention) are the capture's aux layers minus one, so one capture
serves the EAGLE-3 head and all three kinds. No target forward while training: the frozen
embedding and lm_head are taken from the target's weights (`windows.FrozenTarget`).

Model: the pocket recipes' (`recipes.pocket.block`, `.semiar`): one Qwen3 decoder layer at
the target's width (its heads, kv heads and MLP size by default), `fc` over the captured
states; DSpark adds DeepSpec's Markov and confidence heads (its embedding and lm_head frozen
copies of the target's, shipped without them: `shared_with_target`), Domino SpecForge's
prefix GRU and embed_proj. With `block_head.backbone_init` a DSpark or Domino backbone starts
from a trained block drafter (the heads from the references' init).

Training: `recipes.resume.fit_resumable` (resumable; checkpoints in `head.work_dir/<model.name>/`),
losses `recipes.block_head.losses`; held-out teacher-forced agreement on the capture's
held-out windows; DSpark's confidence calibrated by sequential temperature scaling on
alternate held-out windows (`recipes.pocket.dspark.sts_fit`), reported on the others.
"""

from __future__ import annotations

import platform
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from pairs.block.layout import BlockSpec, read_block_config, read_block_weights, save_block_drafter
from pairs.block.module import BlockDrafterModule
from pairs.config import ModelConfig
from pairs.semiar.layout import MARKOV_HEADS, SemiARSpec, save_semiar_drafter
from recipes import resume
from recipes.block_head.card import write_card
from recipes.block_head.config import BlockHeadConfig
from recipes.block_head.losses import KindLoss, captured_confidence_data
from recipes.block_head.windows import Captured, FrozenTarget, captured_agreement
from recipes.eagle3 import data
from recipes.eagle3.config import HeadRecipeConfig
from recipes.eagle3.recipe import captured, load_capture_target
from recipes.pocket import train
from recipes.pocket.block import backbone_layer, export, trained_context
from recipes.pocket.dspark import sts_fit, sts_scores
from recipes.pocket.semiar import BACKBONE, HEADS, build_module
from specrank.settings.checks import check_choice
from specrank.settings.errors import Refusal
from specrank.settings.paths import project_path

BLOCK_KINDS = ("block", "dspark", "domino")


def check_block_head(bc: BlockHeadConfig, kind: str) -> None:
    """The settings the recipe reads, before the target loads."""
    check_choice("model.drafter_kind", kind, list(BLOCK_KINDS))
    check_choice("block_head.markov_head_type", bc.markov_head_type, list(MARKOV_HEADS))
    if bc.block_size < 2:
        raise Refusal(f"block_head.block_size: expected >= 2, found {bc.block_size}")
    if kind == "domino" and not 0 <= bc.pure_draft_prefix_len < bc.block_size - 2:
        raise Refusal(f"block_head.pure_draft_prefix_len: expected 0 .. {bc.block_size - 3} "
                      f"(a corrected row left), found {bc.pure_draft_prefix_len}")  # fmt: skip
    if bc.backbone_init and kind == "block":
        raise Refusal("block_head.backbone_init: for dspark and domino only (the block drafter "
                      "is the backbone)")  # fmt: skip


def layer_ids(bc: BlockHeadConfig, aux: tuple[int, ...]) -> list[int]:
    """The drafter's target_layer_ids: the capture's states (aux, input convention) - 1."""
    have = [a - 1 for a in aux]
    if bc.target_layer_ids is not None and list(bc.target_layer_ids) != have:
        raise Refusal(f"block_head.target_layer_ids={list(bc.target_layer_ids)}: the capture "
                      f"holds the states leaving layers {have} (head.aux_layers {list(aux)}); "
                      "set them, or null")  # fmt: skip
    return have


def mask_id(bc: BlockHeadConfig, tok) -> int:
    if bc.mask_token_id is not None:
        return bc.mask_token_id
    if tok.unk_token_id is None:
        raise Refusal("block_head.mask_token_id: null, and the tokenizer has no unk token: set "
                      "a token id the training text never holds")  # fmt: skip
    return int(tok.unk_token_id)


def make_kind_spec(kind: str, bc: BlockHeadConfig, target, ids: list[int], mask: int):
    t = target.config
    arch = SimpleNamespace(intermediate=bc.intermediate or t.intermediate_size,
                           heads=bc.heads or t.num_attention_heads,
                           kv_heads=bc.kv_heads or t.num_key_value_heads)  # fmt: skip
    block = BlockSpec(backbone_layer(arch, target), tuple(ids), bc.block_size, mask,
                      t.num_hidden_layers)  # fmt: skip
    if kind == "block":
        return block
    if kind == "dspark":
        confidence = "hidden+markov" if bc.confidence_with_markov else "hidden"
        return SemiARSpec("dspark", block, bc.markov_head_type, bc.markov_rank, t.vocab_size,
                          True, confidence=confidence,
                          shared_with_target=("embed_tokens", "lm_head"))  # fmt: skip
    return SemiARSpec("domino", block, "gru", bc.gru_hidden_dim, t.vocab_size, False,
                      bc.pure_draft_prefix_len, bc.emb_dim)  # fmt: skip


def init_backbone(module, spec: SemiARSpec, folder: str, log) -> None:
    """The backbone's weights from a trained block drafter of the same shape (refused else)."""
    path = project_path(folder)
    got = read_block_config(path)
    want = spec.block
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_hidden_layers",
    )
    shape = [getattr(x.layer, k) for k in keys for x in (got, want)]
    if shape[0::2] != shape[1::2] or got.target_layer_ids != want.target_layer_ids \
            or got.mask_token_id != want.mask_token_id:  # fmt: skip
        raise Refusal(f"block_head.backbone_init: {path} is a block drafter of another shape "
                      f"(layer, target_layer_ids or mask token) than this {spec.kind}'s")  # fmt: skip
    state = {k: v.float() for k, v in read_block_weights(path, got).items()}
    missing, unexpected = module.load_state_dict(state, strict=False)
    if unexpected or any(k.split(".")[0] in BACKBONE for k in missing):
        raise Refusal(f"block_head.backbone_init: {path}'s weights do not fill the backbone")
    log(f"backbone from {path}")


def build(kind: str, spec, frozen: FrozenTarget, seed: int, bc: BlockHeadConfig, log):
    if kind == "block":
        torch.manual_seed(seed)
        return BlockDrafterModule(spec.layer, len(spec.target_layer_ids), "shared")
    module = build_module(spec, frozen, seed)
    if bc.backbone_init:
        init_backbone(module, spec, bc.backbone_init, log)
    return module


def calibrate_confidence(loss: KindLoss, val: Captured, bins: int) -> dict:
    """Sequential temperature scaling fitted on even held-out windows, reported on odd ones."""
    fit = [
        np.concatenate(x)
        for x in captured_confidence_data(loss, val.heldout(loss.depth, slice(0, None, 2)))
    ]
    rep = [
        np.concatenate(x)
        for x in captured_confidence_data(loss, val.heldout(loss.depth, slice(1, None, 2)))
    ]
    temps = sts_fit(*fit, bins)
    ones = np.ones_like(temps)
    return {"temperatures": temps.tolist(), "fit_blocks": len(fit[0]),
            "report_blocks": len(rep[0]), "bins": bins,
            "before": sts_scores(*rep, ones, bins), "after": sts_scores(*rep, temps, bins)}  # fmt: skip


def _params(module, names=None, trainable=False) -> int:
    return sum(p.numel() for n, p in module.named_parameters()
               if (names is None or n.split(".")[0] in names) and (p.requires_grad or not trainable))  # fmt: skip


def run(hc: HeadRecipeConfig, bc: BlockHeadConfig, model: ModelConfig, log) -> dict:
    """Capture (reused), training, calibration (dspark) and export into `model.drafter`."""
    kind = model.drafter_kind
    check_block_head(bc, kind)
    target, tok = load_capture_target(hc, model)
    cap = captured(target, tok, hc, model, log)
    ids = layer_ids(bc, cap.aux)
    spec = make_kind_spec(kind, bc, target, ids, mask_id(bc, tok))
    frozen = FrozenTarget(target)
    del target
    module = build(kind, spec, frozen, hc.seed, bc, log)
    loss = KindLoss(kind, module, spec, frozen, bc)
    trn = Captured(data.load_shards(cap.shards["train"]), cap.mask[cap.trn], cap.draft)
    val = Captured(data.load_shards(cap.shards["val"]), cap.mask[cap.val], cap.draft)
    cfg, depth = bc.train, loss.depth
    opt = train._optimizer(module, train.TrainConfig(lr=cfg.lr, weight_decay=0.0))

    def loss_at(step: int, progress: float) -> torch.Tensor:
        return loss(trn.training_batch(hc.seed, step, cfg.batch, bc.anchors, depth), progress)

    def evaluate(which: str = "final") -> dict:
        return captured_agreement(module, lambda w: loss.logits(w, which), val.heldout(depth))

    work = project_path(hc.work_dir) / model.name
    state = resume.fit_resumable(module, opt, loss_at, evaluate, cfg, work / resume.CKPT, log)
    done = {"val": evaluate()}
    if kind != "block":
        done["val_base"] = evaluate("base")
    if kind == "dspark":
        done["sts"] = calibrate_confidence(loss, val, bc.calibration_bins)
    out = project_path(model.drafter)
    if kind == "block":
        save = lambda o, m: save_block_drafter(o, m, spec)  # noqa: E731
    else:
        extra = {"num_anchors": bc.anchors} if kind == "dspark" else None
        save = lambda o, m: save_semiar_drafter(o, m, spec, extra)  # noqa: E731
    sizes = export(module, save, out, hc.export_dtype)
    length = int(cap.ids.shape[1])
    facts = {
        "kind": kind, "model": model.name, "target": model.target, "drafter": model.drafter,
        "config": vars(bc) | {"train": vars(cfg)} | {"target_layer_ids": ids},
        "head": {"seed": hc.seed, "threads": hc.threads, "export_dtype": hc.export_dtype,
                 "capture": str(cap.folder.relative_to(project_path("."))
                                if cap.folder.is_relative_to(project_path(".")) else cap.folder),
                 "aux_layers": list(cap.aux), "draft_vocab": len(cap.draft),
                 "target_top_k": hc.corpus.target_top_k},
        "mask_token_id": int(spec.mask_token_id if kind == "block" else spec.block.mask_token_id),
        "depth": depth, "hidden": int(frozen.config.hidden_size),
        "context_window": trained_context(length - 1, depth),  # windows of L = seq_len + 1
        "params": _params(module), "trainable": _params(module, trainable=True),
        "heads": _params(module, HEADS), "backbone": _params(module, BACKBONE),
        "data": {"tokens": int(cap.ids.size), "windows": len(cap.ids), "window": length,
                 "train_windows": len(cap.trn), "val_windows": len(cap.val),
                 "assistant_tokens": int(cap.mask[cap.trn].sum()), "capture_minutes": cap.minutes},
        "train": {"steps": state["step"], "minutes": state["seconds"] / 60,
                  "ms_per_step": 1000 * state["seconds"] / max(state["step"], 1),
                  "tokens": state["step"] * cfg.batch * length, "history": state["history"]},
        "sizes": sizes, "python": platform.python_version(), "torch": torch.__version__,
    } | done  # fmt: skip
    write_card(Path(out), facts)
    log(f"{kind} drafter: {facts['params']:,} parameters, {sum(sizes.values()):,} bytes in {out}")
    return facts

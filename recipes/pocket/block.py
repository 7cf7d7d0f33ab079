"""The pocket block drafter: DFlash's recipe on the pocket target (`models/pocket/block/`).

    python -m decode.pocket.block                                       # train and ship
    python -m decode.pocket.block pocket_block.position_weights=dpace   # D-PACE's weights
    python -m decode.pocket.block pocket_block=dcore                    # the DCore recipe

Data: the pocket EAGLE-3 head's (`recipes.pocket.eagle3.training_data`): CPython
standard-library text and the target's own T=1 continuations of prompts from it, the
training side of the corpus' split only.

Model (`pairs.block`, DFlash's layout): one Qwen3 decoder layer of the target's width; one
shared `fc` over the states leaving target layers `target_layer_ids` (or, with
`context_mixing=per_layer`, DFlare's per-draft-layer mixture of them); the target's
embedding and lm_head, frozen. The pocket vocabulary has no mask token, so an id is
reserved: the pad id (0), which training text never holds as a target and the target never
emits; the block's placeholders are its (frozen) embedding row.

Training: per window, `anchors` positions a at random; block a is [x_a, mask x (bs - 1)]
at positions a .. a + bs - 1 over the context of positions [0, a) of the same window. All
of a window's blocks run in one forward, each attending to its context and to itself only.
Loss: cross-entropy at block row k (k = 1 .. bs - 1) against the target's own row at position
a + k - 1 (`labels=target`: the pocket corpus' text is not target-generated, as DFlash's
training data is, so its labels are the target's distribution), or against the window's
token x_{a+k} (`labels=data`, DFlash's hard labels); each row weighted:
  decayed  DFlash's decayed cross-entropy, w_k = exp(-(k - 1) / decay_gamma), mean 1
  dpace    D-PACE's w_j = sum_{m >= j} prod_{i <= m} q_i, q_i the drafter's mean probability
           of the gold token (the target's argmax, or the data token) at row i, smoothed over steps by a moving average
           (`dpace_smoothing`), mean 1: a row counts as much as the acceptance that reaches it
Validation: per row k, the share of held-out anchors whose drafter argmax is the target's
argmax at that position (teacher-forced), and the mean leading run of such matches (a
greedy chain's accepted drafts, teacher-forced).
"""

from __future__ import annotations

import logging
import math
import platform
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import Qwen3Config

import specrank.config  # noqa: F401  (registers the root schema)
from pairs.block.layout import CONTEXT_MIXING, BlockSpec, save_block_drafter
from pairs.block.module import BlockDrafterModule
from recipes.pocket import corpus, train
from recipes.pocket.block_card import write_card
from recipes.pocket.config import PocketBlockConfig
from recipes.pocket.eagle3 import TrainingData, load_target, target_view, training_data
from recipes.pocket.train import Log
from specrank.cli import exits_on_refusal
from specrank.paths import CONF_DIR

log = logging.getLogger("recipes.pocket.block")
POSITION_WEIGHTS = ("decayed", "dpace")
LABELS = ("target", "data")


def make_block_spec(pc: PocketBlockConfig, target) -> BlockSpec:
    if pc.context_mixing not in CONTEXT_MIXING:
        raise ValueError(f"pocket_block.context_mixing: expected one of {list(CONTEXT_MIXING)}, "
                         f"found {pc.context_mixing!r}")  # fmt: skip
    t = target.config
    layer = Qwen3Config(
        hidden_size=t.hidden_size, intermediate_size=pc.intermediate,
        num_attention_heads=pc.heads, num_key_value_heads=pc.kv_heads,
        head_dim=t.hidden_size // pc.heads, num_hidden_layers=1, vocab_size=t.vocab_size,
        max_position_embeddings=t.max_position_embeddings, rms_norm_eps=t.rms_norm_eps,
        rope_parameters=dict(t.rope_parameters),
    )  # fmt: skip
    return BlockSpec(layer, tuple(pc.target_layer_ids), pc.block_size, int(t.pad_token_id),
                     t.num_hidden_layers, pc.context_mixing)  # fmt: skip


def block_batch(anchors: torch.Tensor, size: int, length: int, mask_id: int, x: torch.Tensor):
    """One window's blocks: (ids [A*bs], positions [A*bs], mask [A*bs, length + A*bs])."""
    offs = torch.arange(size)
    positions = (anchors[:, None] + offs).reshape(-1)
    ids = torch.full((len(anchors), size), mask_id, dtype=torch.long)
    ids[:, 0] = x[anchors]
    block = torch.arange(len(anchors)).repeat_interleave(size)
    ctx = torch.arange(length)[None] < anchors.repeat_interleave(size)[:, None]  # [0, a)
    return ids.reshape(-1), positions, torch.cat([ctx, block[:, None] == block[None]], 1)


def block_logits(module: BlockDrafterModule, target, feats: torch.Tensor, x: torch.Tensor,
                 anchors: torch.Tensor, spec: BlockSpec) -> torch.Tensor:  # fmt: skip
    """Rows 1 .. bs - 1 of every anchor's block: [A, bs - 1, V] logits."""
    length, bs = feats.shape[0], spec.block_size
    ids, positions, mask = block_batch(anchors, bs, length, spec.mask_token_id, x)
    ctx = module.context(feats, torch.arange(length))
    embeds = target.get_input_embeddings()(ids)
    hidden = module(embeds, positions, ctx, mask)
    return target.get_output_embeddings()(hidden).view(len(anchors), bs, -1)[:, 1:]


def decayed_weights(size: int, gamma: float) -> torch.Tensor:
    w = torch.exp(-torch.arange(size - 1, dtype=torch.float32) / gamma)
    return w / w.mean()


def dpace_weights(confidence: torch.Tensor) -> torch.Tensor:
    """w_j = sum_{m >= j} prod_{i <= m} q_i, normalised to mean 1 (D-PACE)."""
    reach = torch.cumprod(confidence, 0)
    w = reach.flip(0).cumsum(0).flip(0)
    return w / w.mean()


class BlockLoss:
    """The training loss of a batch of windows, with D-PACE's smoothed confidences as state."""

    def __init__(self, module, target, spec: BlockSpec, pc: PocketBlockConfig) -> None:
        if pc.position_weights not in POSITION_WEIGHTS:
            raise ValueError(f"pocket_block.position_weights: expected one of "
                             f"{list(POSITION_WEIGHTS)}, found {pc.position_weights!r}")  # fmt: skip
        if pc.labels not in LABELS:
            raise ValueError(f"pocket_block.labels: expected one of {list(LABELS)}, found "
                             f"{pc.labels!r}")  # fmt: skip
        self.module, self.target, self.spec, self.pc = module, target, spec, pc
        self.confidence = torch.full((spec.block_size - 1,), 0.5)
        self.rng = torch.Generator().manual_seed(pc.seed)

    def weights(self) -> torch.Tensor:
        if self.pc.position_weights == "dpace":
            return dpace_weights(self.confidence)
        return decayed_weights(self.spec.block_size, self.pc.decay_gamma)

    def __call__(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        feats, logp = target_view(self.target, x, self.spec.capture_ids)
        bs, length = self.spec.block_size, x.shape[1]
        w, total, gold_p = self.weights(), torch.zeros(()), []
        for b in range(x.shape[0]):
            anchors = torch.randint(1, length - bs + 1, (self.pc.anchors,), generator=self.rng)
            logits = block_logits(self.module, self.target, feats[b], x[b], anchors, self.spec)
            rows = anchors[:, None] + torch.arange(bs - 1)  # the position predicting row k's token
            held = m[b][rows].float()  # m aligns with x[1:]: the token at row k is trained on
            logq = logits.float().log_softmax(-1)  # [A, bs - 1, V]
            if self.pc.labels == "target":  # the target's own row at that position
                ce = -(logp[b][rows].exp() * logq).sum(-1)
                gold = logp[b][rows].argmax(-1)
            else:  # the window's next tokens
                gold = x[b][rows + 1]
                ce = -logq.gather(-1, gold[..., None])[..., 0]
            total = total + (ce * held * w).sum() / held.sum().clamp(min=1)
            q_gold = logq.detach().gather(-1, gold[..., None])[..., 0].exp()
            gold_p.append((q_gold * held).sum(0) / held.sum(0).clamp(min=1))
        s = self.pc.dpace_smoothing
        self.confidence = s * self.confidence + (1 - s) * torch.stack(gold_p).mean(0)
        return total / x.shape[0]


@torch.no_grad()
def agreement(module, target, spec: BlockSpec, data: TrainingData, max_tokens: int) -> dict:
    """Held-out, teacher-forced: per row, drafter argmax == target argmax; the leading run."""
    module.eval()
    bs, hits, runs, n = spec.block_size, torch.zeros(spec.block_size - 1), [], 0
    for x, m in train.val_windows(data.val_ids, data.val_mask, 128, max_tokens):
        feats, logp = target_view(target, x, spec.capture_ids)
        anchors = torch.arange(1, x.shape[1] - bs + 1, bs)
        anchors = anchors[m[0][anchors].bool()]  # the anchor's next token is a trained one
        if not len(anchors):
            continue
        got = block_logits(module, target, feats[0], x[0], anchors, spec).argmax(-1)
        want = logp[0].argmax(-1)[anchors[:, None] + torch.arange(bs - 1)]
        same = got == want
        hits += same.float().sum(0)
        runs.append(same.long().cumprod(1).sum(1))
        n += len(anchors)
    module.train()
    out = {f"agree_row{k + 1}": float(h) / max(n, 1) for k, h in enumerate(hits)}
    return out | {"chain_run": float(torch.cat(runs).float().mean()) if runs else math.nan}


def export(module: BlockDrafterModule, spec: BlockSpec, out: Path, dtype: str) -> dict[str, int]:
    """config.json + model.safetensors in DFlash's layout (`dtype` weights); their sizes."""
    cast = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    save_block_drafter(out, module.to(cast), spec)
    module.float()
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the folder is shared
    return {p.name: p.stat().st_size for p in (out / "config.json", out / "model.safetensors")}


def run(pc: PocketBlockConfig, log: Log = print) -> dict:
    """Data, training and export; writes `recipe.json` and `MODEL_CARD.md` beside the drafter."""
    if pc.export_dtype not in ("float16", "bfloat16"):
        raise ValueError(f"pocket_block.export_dtype: expected float16 or bfloat16, found "
                         f"{pc.export_dtype!r}")  # fmt: skip
    torch.set_num_threads(pc.threads)
    t0 = time.time()
    target_dir, out = corpus.resolve(pc.target), corpus.resolve(pc.out_dir)
    target, tok = load_target(target_dir)
    spec = make_block_spec(pc, target)
    torch.manual_seed(pc.seed)
    module = BlockDrafterModule(spec.layer, len(spec.target_layer_ids), spec.context_mixing)
    loss = BlockLoss(module, target, spec, pc)  # the settings refused before the data is made
    data = training_data(pc, target, tok)
    data_minutes = (time.time() - t0) / 60
    log(f"data: {len(data.streams.code_ids)} text tokens, {len(data.streams.chat_ids)} "
        f"rollout tokens, {data_minutes:.1f} min")  # fmt: skip
    res = train.train_loop(module, loss, data.streams,
                           lambda: agreement(module, target, spec, data, 8192), pc.train,
                           pc.seed, log)  # fmt: skip
    module.eval()
    sizes = export(module, spec, out, pc.export_dtype)
    facts = {
        "config": {k: getattr(pc, k) for k in pc.__dataclass_fields__ if k != "train"}
        | {"train": vars(pc.train)},
        "mask_token_id": spec.mask_token_id, "hidden": spec.layer.hidden_size,
        "params": sum(p.numel() for p in module.parameters()),
        "data": {"text_tokens": len(data.streams.code_ids),
                 "rollout_tokens": len(data.streams.chat_ids),
                 "rollout_prompts": len(data.prompts), "minutes": data_minutes},
        "train": res, "val": res["history"][-1] if res["history"] else {}, "sizes": sizes,
        "python": platform.python_version(), "torch": torch.__version__,
    }  # fmt: skip
    write_card(out, facts)
    log(f"block drafter: {facts['params']:,} parameters, {sum(sizes.values()):,} bytes in {out}")
    return facts


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="pocket")
@exits_on_refusal
def main(cfg: DictConfig) -> None:
    run(OmegaConf.to_object(cfg.pocket_block), log.info)

"""The pocket block drafter: DFlash's recipe on the pocket target (`models/pocket/block/`).

    python -m decode.train_pocket.block                                       # train and ship
    python -m decode.train_pocket.block pocket_block.position_weights=dpace   # D-PACE's weights
    python -m decode.train_pocket.block pocket_block=dcore                    # the DCore recipe

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
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import Qwen3Config

import specrank.settings.config  # noqa: F401  (registers the root schema)
from pairs.block.layout import CONTEXT_MIXING, BlockSpec, save_block_drafter
from pairs.block.module import BlockDrafterModule
from recipes.pocket import corpus, train
from recipes.pocket.block_card import write_card
from recipes.pocket.config import PocketBlockConfig
from recipes.pocket.eagle3 import TrainingData, load_target, target_view, training_data
from recipes.pocket.train import Log
from specrank.settings.cli import exits_on_refusal
from specrank.settings.paths import CONF_DIR

log = logging.getLogger("recipes.pocket.block")
POSITION_WEIGHTS = ("decayed", "dpace")
LABELS = ("target", "data")


def backbone_layer(pc, target) -> Qwen3Config:
    """The drafter's decoder layers at the target's width (`pc`: any pocket block-kind config)."""
    t = target.config
    return Qwen3Config(
        hidden_size=t.hidden_size, intermediate_size=pc.intermediate,
        num_attention_heads=pc.heads, num_key_value_heads=pc.kv_heads,
        head_dim=t.hidden_size // pc.heads, num_hidden_layers=1, vocab_size=t.vocab_size,
        max_position_embeddings=t.max_position_embeddings, rms_norm_eps=t.rms_norm_eps,
        rope_parameters=dict(t.rope_parameters),
    )  # fmt: skip


def make_block_spec(pc: PocketBlockConfig, target) -> BlockSpec:
    if pc.context_mixing not in CONTEXT_MIXING:
        raise ValueError(f"pocket_block.context_mixing: expected one of {list(CONTEXT_MIXING)}, "
                         f"found {pc.context_mixing!r}")  # fmt: skip
    t = target.config
    return BlockSpec(backbone_layer(pc, target), tuple(pc.target_layer_ids), pc.block_size,
                     int(t.pad_token_id), t.num_hidden_layers, pc.context_mixing)  # fmt: skip


def block_batch(anchors: torch.Tensor, size: int, length: int, mask_id: int, x: torch.Tensor):
    """One window's blocks: (ids [A*bs], positions [A*bs], mask [A*bs, length + A*bs])."""
    offs = torch.arange(size)
    positions = (anchors[:, None] + offs).reshape(-1)
    ids = torch.full((len(anchors), size), mask_id, dtype=torch.long)
    ids[:, 0] = x[anchors]
    block = torch.arange(len(anchors)).repeat_interleave(size)
    ctx = torch.arange(length)[None] < anchors.repeat_interleave(size)[:, None]  # [0, a)
    return ids.reshape(-1), positions, torch.cat([ctx, block[:, None] == block[None]], 1)


def block_hidden(module: BlockDrafterModule, embed, feats: torch.Tensor, x: torch.Tensor,
                 anchors: torch.Tensor, spec: BlockSpec) -> torch.Tensor:  # fmt: skip
    """Every row of every anchor's block, `embed` embedding its ids: [A, bs, H] hidden states."""
    length, bs = feats.shape[0], spec.block_size
    ids, positions, mask = block_batch(anchors, bs, length, spec.mask_token_id, x)
    ctx = module.context(feats, torch.arange(length))
    return module(embed(ids), positions, ctx, mask).view(len(anchors), bs, -1)


def block_logits(module: BlockDrafterModule, target, feats: torch.Tensor, x: torch.Tensor,
                 anchors: torch.Tensor, spec: BlockSpec) -> torch.Tensor:  # fmt: skip
    """Rows 1 .. bs - 1 of every anchor's block: [A, bs - 1, V] logits."""
    hidden = block_hidden(module, target.get_input_embeddings(), feats, x, anchors, spec)
    return target.get_output_embeddings()(hidden[:, 1:])


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
        bs = self.spec.block_size
        w, total, gold_p = self.weights(), torch.zeros(()), []
        for win in training_windows(
            self.target, self.spec, x, m, bs - 1, self.pc.anchors, self.rng
        ):
            logits = block_logits(self.module, self.target, win.feats, win.x, win.anchors,
                                  self.spec)  # fmt: skip
            logq = logits.float().log_softmax(-1)  # [A, bs - 1, V]
            ce, gold = row_ce(logq, win, self.pc.labels)
            total = total + (ce * win.held * w).sum() / win.held.sum().clamp(min=1)
            q_gold = logq.detach().gather(-1, gold[..., None])[..., 0].exp()
            gold_p.append((q_gold * win.held).sum(0) / win.held.sum(0).clamp(min=1))
        s = self.pc.dpace_smoothing
        self.confidence = s * self.confidence + (1 - s) * torch.stack(gold_p).mean(0)
        return total / x.shape[0]


@dataclass
class Window:
    """One training window's anchors and what their rows are trained on: row j of anchor a
    drafts the token at a + j + 1, whose target row is logp[a + j] (`rows`)."""

    feats: torch.Tensor  # [L, k*H] the target's states
    logp: torch.Tensor  # [L, V] the target's log-rows
    x: torch.Tensor  # [L] the window's tokens
    anchors: torch.Tensor  # [A]
    rows: torch.Tensor  # [A, D] a + j
    held: torch.Tensor  # [A, D] 1 where the token at a + j + 1 is trained on

    def labels(self) -> torch.Tensor:
        """[A, D, V] the target's rows at `rows`."""
        return self.logp[self.rows]


def trained_context(seq_len: int, depth: int) -> int:
    """The most context positions any trained block attended to: a window holds seq_len + 1
    tokens, an anchor a is at most seq_len - depth (its `depth` rows fit), its context [0, a).
    Drafting over more is beyond training (`model.drafter_window` cuts it; the card says it)."""
    return seq_len - depth


def training_windows(target, spec: BlockSpec, x: torch.Tensor, m: torch.Tensor, depth: int,
            n_anchors: int, rng: torch.Generator):  # fmt: skip
    """Each window of a batch with `n_anchors` random anchors whose `depth` rows fit in it."""
    feats, logp = target_view(target, x, spec.capture_ids)
    length = x.shape[1]
    for b in range(x.shape[0]):
        anchors = torch.randint(1, length - depth, (n_anchors,), generator=rng)
        rows = anchors[:, None] + torch.arange(depth)  # the position predicting row j's token
        held = m[b][rows].float()  # m aligns with x[1:]: the token at row j is trained on
        yield Window(feats[b], logp[b], x[b], anchors, rows, held)


def row_ce(logq: torch.Tensor, win: Window, labels: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy [A, D] of draft log-rows `logq` against the labels (`labels=target`: the
    target's rows; `data`: the window's next tokens), and the gold token [A, D] (the target's
    argmax, or the data token)."""
    if labels == "target":
        p = win.labels().exp()
        return -(p * logq).sum(-1), p.argmax(-1)
    gold = win.x[win.rows + 1]
    return -logq.gather(-1, gold[..., None])[..., 0], gold


def heldout_windows(target, spec: BlockSpec, depth: int, data: TrainingData, max_tokens: int):
    """The validation text's windows, anchors every depth + 1 positions whose first drafted
    token is a trained one (a fixed held-out set)."""
    for x, m in train.val_windows(data.val_ids, data.val_mask, 128, max_tokens):
        feats, logp = target_view(target, x, spec.capture_ids)
        anchors = torch.arange(1, x.shape[1] - depth, depth + 1)
        anchors = anchors[m[0][anchors].bool()]
        if len(anchors):
            rows = anchors[:, None] + torch.arange(depth)
            yield Window(feats[0], logp[0], x[0], anchors, rows, m[0][rows].float())


@torch.no_grad()
def agreement(module, logits_of, wins) -> dict:
    """Held-out, teacher-forced: per row, drafter argmax (`logits_of(window)` [A, D, V]) ==
    target argmax; the mean leading run of such matches."""
    module.eval()
    hits, runs, n = 0.0, [], 0
    for win in wins:
        same = logits_of(win).argmax(-1) == win.logp.argmax(-1)[win.rows]
        hits = hits + same.float().sum(0)
        runs.append(same.long().cumprod(1).sum(1))
        n += len(win.anchors)
    module.train()
    out = {f"agree_row{k + 1}": float(h) / max(n, 1) for k, h in enumerate(hits)} if n else {}
    return out | {"chain_run": float(torch.cat(runs).float().mean()) if runs else math.nan}


def block_agreement(module, target, spec: BlockSpec, data: TrainingData) -> dict:
    def logits_of(win: Window) -> torch.Tensor:
        return block_logits(module, target, win.feats, win.x, win.anchors, spec)

    return agreement(
        module, logits_of, heldout_windows(target, spec, spec.block_size - 1, data, 8192)
    )


def export(module, save, out: Path, dtype: str) -> dict[str, int]:
    """`save(out, module)` with `dtype` weights (config.json + model.safetensors in the kind's
    reference layout); their sizes. The module is float32 again after."""
    cast = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    save(out, module.to(cast))
    module.float()
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the folder is shared
    return {p.name: p.stat().st_size for p in (out / "config.json", out / "model.safetensors")}


def start(pc, section: str):
    """(frozen target, tokenizer, output folder, start time) of a pocket block-kind recipe,
    its export dtype checked (`section`: its settings' name) and torch on `pc.threads`."""
    if pc.export_dtype not in ("float16", "bfloat16"):
        raise ValueError(f"{section}.export_dtype: expected float16 or bfloat16, found "
                         f"{pc.export_dtype!r}")  # fmt: skip
    torch.set_num_threads(pc.threads)
    t0 = time.time()
    target, tok = load_target(corpus.resolve(pc.target))
    return target, tok, corpus.resolve(pc.out_dir), t0


def make_data(pc, target, tok, t0: float, log: Log) -> tuple[TrainingData, float]:
    """The pocket EAGLE-3 head's data (`training_data`) and the minutes since `t0`."""
    data = training_data(pc, target, tok)
    minutes = (time.time() - t0) / 60
    log(f"data: {len(data.streams.code_ids)} text tokens, {len(data.streams.chat_ids)} "
        f"rollout tokens, {minutes:.1f} min")  # fmt: skip
    return data, minutes


def recipe_facts(pc, module, spec: BlockSpec, depth: int, data: TrainingData,
                 data_minutes: float, res: dict, sizes: dict[str, int]) -> dict:  # fmt: skip
    """What `recipe.json` and the card record of a trained and exported block-kind drafter
    (`depth`: the rows a block drafts)."""
    return {
        "config": {k: getattr(pc, k) for k in pc.__dataclass_fields__ if k != "train"}
        | {"train": vars(pc.train)},
        "mask_token_id": spec.mask_token_id, "hidden": spec.layer.hidden_size,
        "context_window": trained_context(pc.train.seq_len, depth),
        "params": sum(p.numel() for p in module.parameters()),
        "data": {"text_tokens": len(data.streams.code_ids),
                 "rollout_tokens": len(data.streams.chat_ids),
                 "rollout_prompts": len(data.prompts), "minutes": data_minutes},
        "train": res, "val": res["history"][-1] if res["history"] else {}, "sizes": sizes,
        "python": platform.python_version(), "torch": torch.__version__,
    }  # fmt: skip


def run(pc: PocketBlockConfig, log: Log = print) -> dict:
    """Data, training and export; writes `recipe.json` and `MODEL_CARD.md` beside the drafter."""
    target, tok, out, t0 = start(pc, "pocket_block")
    spec = make_block_spec(pc, target)
    torch.manual_seed(pc.seed)
    module = BlockDrafterModule(spec.layer, len(spec.target_layer_ids), spec.context_mixing)
    loss = BlockLoss(module, target, spec, pc)  # the settings refused before the data is made
    data, data_minutes = make_data(pc, target, tok, t0, log)
    res = train.train_loop(module, loss, data.streams,
                           lambda: block_agreement(module, target, spec, data), pc.train,
                           pc.seed, log)  # fmt: skip
    module.eval()
    sizes = export(module, lambda o, m: save_block_drafter(o, m, spec), out, pc.export_dtype)
    facts = recipe_facts(pc, module, spec, spec.block_size - 1, data, data_minutes, res, sizes)
    write_card(out, facts)
    log(f"block drafter: {facts['params']:,} parameters, {sum(sizes.values()):,} bytes in {out}")
    return facts


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="pocket")
@exits_on_refusal
def main(cfg: DictConfig) -> None:
    run(OmegaConf.to_object(cfg.pocket_block), log.info)

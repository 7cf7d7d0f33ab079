"""Training loops: the target on next-token cross-entropy, the drafter on KL to the target."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from recipes.pocket.config import NetConfig, TrainConfig

Log = Callable[[str], None]


def make_llama(net: NetConfig, tok: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    """A randomly initialised LlamaForCausalLM of shape `net` over `tok`'s vocabulary."""
    if net.hidden % net.heads or net.heads % net.kv_heads:
        raise ValueError(
            f"pocket net: expected hidden divisible by heads and heads by kv_heads, "
            f"found hidden={net.hidden}, heads={net.heads}, kv_heads={net.kv_heads}"
        )
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=net.hidden,
        intermediate_size=net.intermediate,
        num_hidden_layers=net.layers,
        num_attention_heads=net.heads,
        num_key_value_heads=net.kv_heads,
        max_position_embeddings=net.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def init_from_target(drafter: LlamaForCausalLM, target: LlamaForCausalLM) -> LlamaForCausalLM:
    """Copy the target's embeddings, first layers and final norm into a shallower drafter."""
    dc, tc = drafter.config, target.config
    if (dc.hidden_size, dc.intermediate_size, dc.num_attention_heads, dc.num_key_value_heads) != (
        tc.hidden_size, tc.intermediate_size, tc.num_attention_heads, tc.num_key_value_heads,
    ) or dc.num_hidden_layers > tc.num_hidden_layers:  # fmt: skip
        raise ValueError(
            "pocket.drafter_init=target_layers: expected the drafter's width, MLP and heads equal "
            f"to the target's and no more layers, found drafter {dc.num_hidden_layers}x"
            f"{dc.hidden_size} ({dc.intermediate_size}, {dc.num_attention_heads} heads) vs target "
            f"{tc.num_hidden_layers}x{tc.hidden_size} ({tc.intermediate_size}, "
            f"{tc.num_attention_heads} heads)"
        )
    drafter.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    drafter.model.norm.load_state_dict(target.model.norm.state_dict())
    for d_layer, t_layer in zip(drafter.model.layers, target.model.layers, strict=False):
        d_layer.load_state_dict(t_layer.state_dict())
    drafter.tie_weights()
    return drafter


@dataclass
class Streams:
    """Token streams of one split: code and chat, ids [n] and loss masks [n]."""

    code_ids: np.ndarray
    code_mask: np.ndarray
    chat_ids: np.ndarray
    chat_mask: np.ndarray


def sample_batch(
    s: Streams, batch: int, seq_len: int, code_share: float, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: ids [batch, seq_len + 1] (int64), loss mask of the targets [batch, seq_len]."""
    rows, masks = [], []
    for _ in range(batch):
        code = rng.random() < code_share
        ids, mask = (s.code_ids, s.code_mask) if code else (s.chat_ids, s.chat_mask)
        if len(ids) <= seq_len + 1:
            raise ValueError(
                f"pocket: a token stream holds {len(ids)} tokens, expected more than seq_len + 1 = "
                f"{seq_len + 1}; lower pocket.*_train.seq_len or add text"
            )
        start = int(rng.integers(0, len(ids) - seq_len - 1))
        rows.append(ids[start : start + seq_len + 1].astype(np.int64))
        masks.append(mask[start + 1 : start + seq_len + 1])
    return torch.from_numpy(np.stack(rows)), torch.from_numpy(np.stack(masks))


def val_windows(ids: np.ndarray, mask: np.ndarray, seq_len: int, max_tokens: int):
    """Consecutive, non-overlapping windows from the start of a stream (a fixed validation set)."""
    n = min(len(ids) - 1, max_tokens) // seq_len
    for i in range(n):
        lo = i * seq_len
        x = torch.from_numpy(ids[lo : lo + seq_len + 1].astype(np.int64))[None]
        m = torch.from_numpy(mask[lo + 1 : lo + seq_len + 1])[None]
        yield x, m


def lr_at(step: int, progress: float, cfg: TrainConfig) -> float:
    """Linear warm-up over `cfg.warmup` steps, then cosine to `lr * min_lr_ratio` at progress 1."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def progress_of(step: int, seconds: float, cfg: TrainConfig) -> float:
    """Share of the run done: by steps, or by wall time when `max_minutes` binds first.

    The cosine follows this, so a slow (shared) CPU still gets a fully decayed schedule.
    """
    return max(step / cfg.steps, seconds / (60 * cfg.max_minutes))


def masked_ce(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # logits: [b, t, V], targets/mask: [b, t]
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    m = mask.flatten().float()
    return (nll * m).sum() / m.sum().clamp_min(1)


@torch.no_grad()
def evaluate_ce(model: LlamaForCausalLM, ids, mask, seq_len: int, max_tokens: int) -> float:
    """Mean next-token cross-entropy (nats) over the masked tokens of the first `max_tokens`."""
    model.eval()
    tot, n = 0.0, 0.0
    for x, m in val_windows(ids, mask, seq_len, max_tokens):
        logits = model(input_ids=x[:, :-1]).logits
        nll = F.cross_entropy(logits.float()[0], x[0, 1:], reduction="none")
        tot += float((nll * m[0]).sum())
        n += float(m.sum())
    model.train()
    return tot / max(n, 1.0)


def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": rest, "weight_decay": 0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def train_loop(
    model: LlamaForCausalLM,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    train: Streams,
    evaluate: Callable[[], dict[str, float]],
    cfg: TrainConfig,
    seed: int,
    log: Log,
) -> dict:
    """AdamW with warm-up + cosine; `loss_fn(ids, mask)` -> scalar; ends at `cfg.steps` or
    `cfg.max_minutes`, whichever comes first (see `progress_of`)."""
    rng = np.random.default_rng(seed)
    opt = _optimizer(model, cfg)
    model.train()
    t0 = time.time()
    history: list[dict] = []
    step = 0
    for step in range(cfg.steps):
        progress = progress_of(step, time.time() - t0, cfg)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, progress, cfg)
        x, m = sample_batch(train, cfg.batch, cfg.seq_len, cfg.code_share, rng)
        loss = loss_fn(x, m)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = time.time() - t0
        done = progress_of(step + 1, elapsed, cfg) >= 1.0
        if (step + 1) % cfg.eval_every == 0 or done:
            row = {"step": step + 1, "minutes": elapsed / 60, "train_loss": float(loss.detach())}
            row.update(evaluate())
            history.append(row)
            log(
                " ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                )
            )
        if done:
            if step + 1 < cfg.steps:
                log(f"stopping at step {step + 1}: max_minutes={cfg.max_minutes} reached")
            break
    tokens = (step + 1) * cfg.batch * cfg.seq_len
    return {
        "steps": step + 1,
        "tokens": tokens,
        "minutes": (time.time() - t0) / 60,
        "history": history,
    }


def train_target(
    model: LlamaForCausalLM, train: Streams, val: Streams, cfg: TrainConfig, seed: int, log: Log
) -> dict:
    def loss_fn(x, m):
        return masked_ce(model(input_ids=x[:, :-1]).logits, x[:, 1:], m)

    def evaluate():
        return {
            "val_code": evaluate_ce(model, val.code_ids, val.code_mask, cfg.seq_len, 32_768),
            "val_chat": evaluate_ce(model, val.chat_ids, val.chat_mask, cfg.seq_len, 32_768),
        }

    return train_loop(model, loss_fn, train, evaluate, cfg, seed, log)


@torch.no_grad()
def top1_agreement(drafter, target, ids, mask, seq_len: int, max_tokens: int) -> float:
    """Share of masked positions where the drafter's argmax equals the target's (teacher forcing)."""
    drafter.eval()
    hit, n = 0.0, 0.0
    for x, m in val_windows(ids, mask, seq_len, max_tokens):
        a = drafter(input_ids=x[:, :-1]).logits.argmax(-1)
        b = target(input_ids=x[:, :-1]).logits.argmax(-1)
        hit += float(((a == b) & m).sum())
        n += float(m.sum())
    drafter.train()
    return hit / max(n, 1.0)


def distill_drafter(
    drafter: LlamaForCausalLM,
    target: LlamaForCausalLM,
    train: Streams,
    val: Streams,
    cfg: TrainConfig,
    seed: int,
    log: Log,
) -> dict:
    """Forward KL(p_target || q_drafter) at every position of each window."""
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)

    def loss_fn(x, m):
        inp = x[:, :-1]
        with torch.no_grad():
            logp = F.log_softmax(target(input_ids=inp).logits.float(), -1)
        logq = F.log_softmax(drafter(input_ids=inp).logits.float(), -1)
        return (logp.exp() * (logp - logq)).sum(-1).mean()

    def evaluate():
        return {
            "agree_code": top1_agreement(
                drafter, target, val.code_ids, val.code_mask, cfg.seq_len, 16_384
            ),
            "agree_chat": top1_agreement(
                drafter, target, val.chat_ids, val.chat_mask, cfg.seq_len, 16_384
            ),
        }

    return train_loop(drafter, loss_fn, train, evaluate, cfg, seed, log)

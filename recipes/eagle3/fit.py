"""The head recipe: capture (`recipes.eagle3.data`), training-time-test training on the
captured windows, export into `model.drafter`, and its card.

Training is EAGLE-3's training-time test (`recipes.pocket.eagle3.ttt_steps`: step k feeds
each position's step-(k - 1) output, as a depth-k node sees in tree drafting). The loss is
the cross-entropy from the target's captured top-k row over the draft vocabulary
(renormalised over those k: the mass past them is a rounding error for a chat model's rows)
to the head's, at the positions `rows` marks, step k weighted `ttt_decay ** k`. The draft
lm_head is evaluated at those positions only: the head's largest matrix, skipped where no
loss is taken.

Resumable: a checkpoint (weights as safetensors, optimizer state read back with
`weights_only=True`, step and elapsed time as JSON) is renamed into place at most every
`checkpoint_minutes`; a rerun continues from it with the same batches (step s draws its
windows from a generator seeded by (seed, s)) and the same schedule.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pairs.eagle3.head import Eagle3Head
from recipes.eagle3.config import HeadRecipeConfig
from recipes.pocket import train
from recipes.pocket.eagle3 import ttt_steps

CKPT = "checkpoint"


def window_loss(head: Eagle3Head, w: dict[str, torch.Tensor], steps: int, decay: float):
    """(loss, per-step hits, per-step counted positions) of a batch of captured windows."""
    x, feats = w["ids"], w["aux"].float()
    n = x.shape[1] - steps - 2
    loss = torch.zeros(())
    hits, counts = [], []
    for k, hidden in ttt_steps(head, feats, x, steps):
        rows = w["rows"][:, k + 1 : k + 1 + n].bool()
        p = w["top_v"][:, k + 1 : k + 1 + n][rows].float().softmax(-1)  # renormalised top-k
        idx = w["top_i"][:, k + 1 : k + 1 + n][rows].long()
        logq = head.logits(hidden[rows]).float().log_softmax(-1)
        loss = loss - decay**k * (p * logq.gather(-1, idx)).sum(-1).mean()
        hits.append(int((logq.argmax(-1) == idx[:, 0]).sum()))
        counts.append(int(rows.sum()))
    return loss, hits, counts


def _batch(arrays: dict[str, np.ndarray], idx: np.ndarray) -> dict[str, torch.Tensor]:
    out = {k: torch.from_numpy(v[idx]) for k, v in arrays.items()}
    out["ids"] = out["ids"].long()
    return out


@torch.no_grad()
def head_agreement(head: Eagle3Head, arrays, steps: int, batch: int) -> dict[str, float]:
    """Per TTT step: the share of loss positions where the head's argmax is the target's."""
    head.eval()
    hit, tot = np.zeros(steps + 1), np.zeros(steps + 1)
    for lo in range(0, len(arrays["ids"]), batch):
        _, h, c = window_loss(
            head, _batch(arrays, np.arange(lo, min(lo + batch, len(arrays["ids"])))), steps, 1.0
        )
        hit += h
        tot += c
    head.train()
    return {f"agree_step{k}": float(a) for k, a in enumerate(hit / np.maximum(tot, 1))}


def _save_checkpoint(work: Path, head, opt, state: dict) -> None:
    tmp = work / f".{CKPT}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in head.state_dict().items()}, str(tmp / "head.safetensors")
    )
    torch.save(opt.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state))
    old = work / f".{CKPT}.old"
    shutil.rmtree(old, ignore_errors=True)
    if (work / CKPT).exists():
        (work / CKPT).rename(old)
    tmp.rename(work / CKPT)
    shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(work: Path, head, opt) -> dict | None:
    folder = work / CKPT
    if not (folder / "state.json").is_file():
        return None
    head.load_state_dict(load_file(str(folder / "head.safetensors")))
    opt.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    return json.loads((folder / "state.json").read_text())


def fit_head(head: Eagle3Head, arrays, val, hc: HeadRecipeConfig, work: Path, log) -> dict:
    """Train `head` on captured windows, resuming from `work`'s checkpoint; the run's facts."""
    cfg = hc.train
    opt = train._optimizer(head, train.TrainConfig(lr=cfg.lr, weight_decay=0.0))
    state = _load_checkpoint(work, head, opt) or {"step": 0, "seconds": 0.0, "history": []}
    if state["step"]:
        log(f"resuming at step {state['step']} ({state['seconds'] / 60:.1f} min done)")
    head.train()
    start, saved = time.time() - state["seconds"], time.time()
    n = len(arrays["ids"])
    step = state["step"]
    while True:
        seconds = time.time() - start
        progress = max(step / cfg.steps, seconds / (60 * cfg.max_minutes))
        if progress >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = train.lr_at(step, progress, cfg)
        idx = np.random.default_rng([hc.seed, step]).choice(n, cfg.batch, replace=False)
        loss, _, _ = window_loss(head, _batch(arrays, idx), hc.ttt_steps, hc.ttt_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        if step % cfg.eval_every == 0:
            row = {
                "step": step,
                "minutes": (time.time() - start) / 60,
                "train_loss": float(loss.detach()),
            }
            row |= head_agreement(head, val, hc.ttt_steps, cfg.batch)
            state["history"].append(row)
            log(
                " ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                )
            )
        if time.time() - saved > 60 * cfg.checkpoint_minutes:
            state |= {"step": step, "seconds": time.time() - start}
            _save_checkpoint(work, head, opt, state)
            saved = time.time()
    head.eval()
    final = head_agreement(head, val, hc.ttt_steps, cfg.batch)
    state |= {"step": step, "seconds": time.time() - start}
    _save_checkpoint(work, head, opt, state)
    tokens = step * cfg.batch * arrays["ids"].shape[1]
    return {"steps": step, "tokens": tokens, "minutes": state["seconds"] / 60,
            "history": state["history"], "val_agreement": final}  # fmt: skip

"""The head recipe: capture (`recipes.eagle3.data`), training-time-test training on the
captured windows, export into `model.drafter`, and its card.

Training is EAGLE-3's training-time test (`recipes.pocket.eagle3.ttt_steps`: step k feeds
each position's step-(k - 1) output, as a depth-k node sees in tree drafting). The loss is
the cross-entropy from the target's captured top-k row over the draft vocabulary
(renormalised over those k: the mass past them is a rounding error for a chat model's rows)
to the head's, at the positions `rows` marks, step k weighted `ttt_decay ** k`. The draft
lm_head is evaluated at those positions only: the head's largest matrix, skipped where no
loss is taken.

Resumable: `recipes.resume` (the checkpoint and loop the block-family recipe shares); a rerun
continues from the checkpoint with the same batches (step s draws its windows from a generator
seeded by (seed, s)) and the same schedule.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pairs.eagle3.head import Eagle3Head
from recipes import resume
from recipes.eagle3.config import HeadRecipeConfig
from recipes.pocket import train
from recipes.pocket.eagle3 import ttt_steps


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


def fit_head(head: Eagle3Head, arrays, val, hc: HeadRecipeConfig, work: Path, log) -> dict:
    """Train `head` on captured windows, resuming from `work`'s checkpoint; the run's facts."""
    cfg = hc.train
    opt = train._optimizer(head, train.TrainConfig(lr=cfg.lr, weight_decay=0.0))
    n = len(arrays["ids"])

    def loss_at(step: int, progress: float) -> torch.Tensor:
        idx = np.random.default_rng([hc.seed, step]).choice(n, cfg.batch, replace=False)
        return window_loss(head, _batch(arrays, idx), hc.ttt_steps, hc.ttt_decay)[0]

    state = resume.fit_resumable(head, opt, loss_at, lambda: head_agreement(head, val, hc.ttt_steps, cfg.batch),
                       cfg, work / resume.CKPT, log)  # fmt: skip
    final = head_agreement(head, val, hc.ttt_steps, cfg.batch)
    head.eval()
    tokens = state["step"] * cfg.batch * arrays["ids"].shape[1]
    return {"steps": state["step"], "tokens": tokens, "minutes": state["seconds"] / 60,
            "history": state["history"], "val_agreement": final}  # fmt: skip

"""Training and held-out blocks from the EAGLE-3 recipe's capture (`recipes.eagle3.data`):
no target forward, only the captured arrays and the target's frozen embedding and lm_head.

A capture's window holds ids [L], the states leaving the drafter's target layers (`aux`,
[L, k*H]: the states entering the capture's aux layers, the same tensors), the target's
top-k log-probs over the draft vocabulary (`top_v`, `top_i` as draft ids) and `rows` (the
target's argmax at p is in the draft vocabulary and token p + 1 is an assistant token); the
recipe's windows.npz gives the loss mask (assistant tokens).

Anchors: positions a with an assistant token at a + 1 whose D rows fit in the window (a + D
<= L - 1), so the context [0, a) of a trained block is at most L - 1 - D positions
(`recipes.pocket.block.trained_context` of L - 1). Row j of anchor a drafts the token at
a + j + 1 and is trained where that token is an assistant token (`held`).

Labels: the window's tokens (DFlash's hard labels: the replies are the target's own greedy
text). DSpark's distribution matching uses the captured top-k target row, mapped from draft
ids back to target ids through the capture's draft vocabulary and renormalised over those k
tokens (the approximation: the target's mass outside its top k over the draft vocabulary is
dropped; for a chat model's rows it is a rounding error, as the EAGLE-3 recipe's loss takes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


class FrozenTarget(nn.Module):
    """The target's embedding and lm_head only (frozen), as the block recipes' `target` reads
    them (`get_input_embeddings`, `get_output_embeddings`, `config`)."""

    def __init__(self, target) -> None:
        super().__init__()
        self.config = target.config
        self.embed = nn.Embedding.from_pretrained(
            target.get_input_embeddings().weight.detach().float().clone()
        )
        out = target.get_output_embeddings().weight.detach().float()
        self.head = nn.Linear(out.shape[1], out.shape[0], bias=False)
        self.head.weight = nn.Parameter(out.clone(), requires_grad=False)
        self.requires_grad_(False)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head


@dataclass
class CapturedWindow:
    """One window's blocks (the attributes `recipes.pocket.block` and `.semiar` read:
    feats, x, anchors, rows, held) and their labels."""

    feats: torch.Tensor  # [L, k*H] float32
    x: torch.Tensor  # [L]
    anchors: torch.Tensor  # [A]
    rows: torch.Tensor  # [A, D] a + j: the position whose target row drafts row j's token
    held: torch.Tensor  # [A, D] 1 where the token at a + j + 1 is an assistant token
    top_p: torch.Tensor  # [A, D, k] the target's row at a + j over its top k, renormalised
    top_t: torch.Tensor  # [A, D, k] those k tokens as target ids, the argmax first
    valid: torch.Tensor  # [A, D] the captured `rows`: top_t[..., 0] is the target's argmax


class Captured:
    """Captured windows (one split's shards) with their loss mask, as tensors."""

    def __init__(self, arrays: dict[str, np.ndarray], mask: np.ndarray, draft: np.ndarray):
        self.ids = torch.from_numpy(arrays["ids"].astype(np.int64))
        self.aux = torch.from_numpy(arrays["aux"])
        self.top_v = torch.from_numpy(arrays["top_v"])
        self.top_i = torch.from_numpy(arrays["top_i"].astype(np.int64))
        self.valid = torch.from_numpy(arrays["rows"].astype(bool))
        self.mask = torch.from_numpy(mask.astype(bool))
        self.draft = torch.from_numpy(draft.astype(np.int64))
        if self.mask.shape != self.ids.shape:
            raise ValueError(f"capture: loss mask {tuple(self.mask.shape)} does not match the "
                             f"shards' windows {tuple(self.ids.shape)}")  # fmt: skip

    def __len__(self) -> int:
        return len(self.ids)

    def candidates(self, w: int, depth: int) -> torch.Tensor:
        """Anchors of window `w` (module doc): a in [1, L - 1 - depth], token a + 1 trained."""
        length = self.ids.shape[1]
        a = torch.arange(1, length - depth)
        return a[self.mask[w, a + 1]]

    def window(self, w: int, anchors: torch.Tensor, depth: int) -> CapturedWindow:
        rows = anchors[:, None] + torch.arange(depth)
        top_p = self.top_v[w][rows].float().softmax(-1)
        top_t = self.draft[self.top_i[w][rows]]
        return CapturedWindow(self.aux[w].float(), self.ids[w], anchors, rows,
                              self.mask[w][rows + 1].float(), top_p, top_t,
                              self.valid[w][rows])  # fmt: skip

    def training_batch(self, seed: int, step: int, batch: int, n_anchors: int, depth: int):
        """Step `step`'s windows, each with up to `n_anchors` random anchors: the same draws
        for the same (seed, step), so a resumed run trains on the same batches."""
        rng = np.random.default_rng([seed, step])
        for w in rng.choice(len(self), batch, replace=False):
            cand = self.candidates(int(w), depth)
            if len(cand):
                pick = rng.choice(len(cand), min(n_anchors, len(cand)), replace=False)
                yield self.window(int(w), cand[np.sort(pick)], depth)

    def heldout(self, depth: int, which: slice = slice(None)):
        """Every window's blocks at anchors every depth + 1 positions (a fixed held-out set)."""
        for w in range(len(self))[which]:
            cand = self.candidates(w, depth)
            keep, last = [], -depth - 1
            for a in cand.tolist():
                if a - last > depth:
                    keep.append(a)
                    last = a
            if keep:
                yield self.window(w, torch.tensor(keep), depth)


def captured_agreement(module: nn.Module, logits_of, wins) -> dict:
    """Held-out, teacher-forced: per row, the share of rows whose drafter argmax is the
    target's (captured; rows whose target argmax lies outside the draft vocabulary are not
    counted, and end a leading run); the mean leading run of matches (a greedy chain's
    accepted drafts, teacher-forced)."""
    module.eval()
    hits, counts, runs = 0.0, 0.0, []
    for win in wins:
        same = (logits_of(win).argmax(-1) == win.top_t[..., 0]) & win.valid
        hits = hits + same.float().sum(0)
        counts = counts + win.valid.float().sum(0)
        runs.append(same.long().cumprod(1).sum(1))
    module.train()
    if not runs:
        return {"chain_run": math.nan}
    share = (hits / counts.clamp(min=1)).tolist()
    return {f"agree_row{k + 1}": float(s) for k, s in enumerate(share)} | {
        "chain_run": float(torch.cat(runs).float().mean())
    }

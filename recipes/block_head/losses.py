"""The three kinds' objectives on captured windows (`recipes.block_head.windows`), each the
pocket recipe's (`recipes.pocket.block`, `.dspark`, `.domino`) with the captured labels:

  block   DFlash's decayed cross-entropy: row k (k = 1 .. bs - 1) against the data token,
          weighted exp(-(k - 1) / decay_gamma), mean 1
  dspark  DeepSpec's: ce_alpha x that cross-entropy of the corrected row + l1_alpha x
          sum |q - p| + confidence_alpha x BCE(confidence logit, 1 - TV(q, p)), p the captured
          top-k target row (renormalised over its k tokens), q the drafter's full row: on p's
          support sum_S |q - p| + (1 - q(S)) is sum_v |q(v) - p(v)| exactly, for that p
  domino  SpecForge's curriculum: (1 - lambda) x CE(final rows) + lambda x CE(base rows),
          lambda falling linearly from lambda_base_start to 0 over lambda_base_decay_ratio of
          the run (its progress: steps or wall time, as the schedule's)
"""

from __future__ import annotations

import torch

from recipes.block_head.config import BlockHeadConfig
from recipes.block_head.windows import CapturedWindow
from recipes.pocket.block import block_logits, decayed_weights, row_ce
from recipes.pocket.domino import lambda_base
from recipes.pocket.dspark import l1_terms
from recipes.pocket.semiar import teacher_forced


def ce(logq: torch.Tensor, win: CapturedWindow) -> torch.Tensor:
    """[A, D] cross-entropy of log-rows `logq` [A, D, V] against the data tokens."""
    return row_ce(logq, win, "data")[0]


def support_terms(logq: torch.Tensor, win: CapturedWindow, confidence: torch.Tensor):
    """(L1 [A, D], acceptance 1 - TV detached, confidence BCE) against the captured top-k row."""
    q = logq.gather(-1, win.top_t).exp()
    return l1_terms((q - win.top_p).abs().sum(-1) + (1.0 - q.sum(-1)).clamp(min=0.0), confidence)


class KindLoss:
    """`loss(wins, progress)`: a batch's objective; `logits(win)`: the rows agreement reads
    (`which`: dspark / domino's `final` corrected rows, or the backbone's `base` rows)."""

    def __init__(self, kind: str, module, spec, frozen, bc: BlockHeadConfig) -> None:
        self.kind, self.module, self.spec, self.frozen, self.bc = kind, module, spec, frozen, bc
        self.depth = spec.block_size - 1 if kind == "block" else spec.depth
        self.w = decayed_weights(self.depth + 1, bc.decay_gamma)  # one weight a drafted row
        self.lam = bc.lambda_base_start

    def logits(self, win: CapturedWindow, which: str = "final") -> torch.Tensor:
        if self.kind == "block":
            return block_logits(self.module, self.frozen, win.feats, win.x, win.anchors,
                                self.spec)  # fmt: skip
        return getattr(teacher_forced(self.module, self.spec, self.frozen, win), which)

    def terms(self, win: CapturedWindow, progress: float) -> torch.Tensor:
        bc = self.bc
        if self.kind == "block":
            return ce(self.logits(win).float().log_softmax(-1), win)
        r = teacher_forced(self.module, self.spec, self.frozen, win)
        logq = r.final.float().log_softmax(-1)
        if self.kind == "dspark":
            l1, _, bce = support_terms(logq, win, self.module.confidence(r.hidden, r.prev))
            return bc.ce_alpha * ce(logq, win) + bc.l1_alpha * l1 + bc.confidence_alpha * bce
        self.lam = lambda_base(progress, bc.lambda_base_start, bc.lambda_base_decay_ratio)
        base = ce(r.base.float().log_softmax(-1), win)
        return (1.0 - self.lam) * ce(logq, win) + self.lam * base

    def __call__(self, wins, progress: float) -> torch.Tensor:
        total, n = torch.zeros(()), 0
        for win in wins:
            t = self.terms(win, progress)
            total = total + (t * win.held * self.w).sum() / win.held.sum().clamp(min=1)
            n += 1
        return total / max(n, 1)


@torch.no_grad()
def captured_confidence_data(loss: KindLoss, wins):
    """DSpark's held-out blocks whose every row is trained: (logits [N, D], 1 - TV [N, D])."""
    zs, accepts = [], []
    for win in wins:
        keep = win.held.bool().all(1)
        r = teacher_forced(loss.module, loss.spec, loss.frozen, win)
        logq = r.final.float().log_softmax(-1)
        z = loss.module.confidence(r.hidden, r.prev)
        _, accept, _ = support_terms(logq, win, z)
        zs.append(z[keep].numpy())
        accepts.append(accept[keep].numpy())
    return zs, accepts

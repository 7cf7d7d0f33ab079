"""The pocket Domino drafter: SpecForge's curriculum on the pocket target
(`models/pocket/domino/`, `recipes.pocket.semiar`).

    python -m decode.train_pocket.domino                       # train and ship

Read from sgl-project/SpecForge at commit a6b6b0230009d15ec2a97a57384e6f53f0f96946
(`specforge/modeling/draft/domino.py`, `specforge/algorithms/common/dflash_family_model.py`
`OnlineDominoModel`, `specforge/training/strategies/base.py` `linear_lambda_base`,
`configs/qwen3-8b-domino.json`); the code here is our own.

Loss, per drafted row k = 1 .. bs - 1 (shift_label false: DFlash's rows), each weighted by
DFlash's decay exp(-(k - 1) / gamma) as SpecForge's:
  (1 - lambda) x CE(final rows)  +  lambda x CE(base rows)
base: the backbone's rows through the target's lm_head; final: plus Domino's correction
embed_proj([h_k ; GRU state after the path's tokens]) on rows past pure_draft_prefix_len.
lambda (SpecForge's `linear_lambda_base`) falls linearly from lambda_base_start to 0 over the
first lambda_base_decay_ratio of the run, then stays 0: the backbone learns its rows first,
the correction then takes the whole objective. The run's share done is the block recipe's
(`recipes.pocket.train.progress_of`: steps or wall time, whichever binds), so a run stopped
by its time cap still completes the curriculum.
"""

from __future__ import annotations

import time

import torch

from recipes.pocket import train
from recipes.pocket.block import decayed_weights, row_ce, training_windows
from recipes.pocket.config import PocketDominoConfig
from recipes.pocket.semiar import run as run_semiar
from recipes.pocket.semiar import teacher_forced


def lambda_base(progress: float, start: float, decay_ratio: float) -> float:
    """The base CE's weight at `progress` (the run's share done): SpecForge's linear decay from
    `start` to 0 over the first `decay_ratio` of the run, clamped to [0, 1]."""
    return max(0.0, min(1.0, start * (1.0 - min(progress / decay_ratio, 1.0))))


class DominoLoss:
    """SpecForge's Domino objective on a batch of windows (see the module doc)."""

    def __init__(self, module, spec, target, pc: PocketDominoConfig) -> None:
        if not 0.0 <= pc.lambda_base_start <= 1.0:
            raise ValueError(f"pocket_domino.lambda_base_start: expected a weight in [0, 1], "
                             f"found {pc.lambda_base_start}")  # fmt: skip
        if not 0.0 < pc.lambda_base_decay_ratio <= 1.0:
            raise ValueError(f"pocket_domino.lambda_base_decay_ratio: expected a share in (0, 1], "
                             f"found {pc.lambda_base_decay_ratio}")  # fmt: skip
        if not 0 <= pc.pure_draft_prefix_len < spec.depth:
            raise ValueError(f"pocket_domino.pure_draft_prefix_len: expected 0 .. "
                             f"{spec.depth - 1} (a corrected row left), found "
                             f"{pc.pure_draft_prefix_len}")  # fmt: skip
        self.module, self.spec, self.target, self.pc = module, spec, target, pc
        self.w = decayed_weights(spec.depth + 1, pc.decay_gamma)
        self.rng = torch.Generator().manual_seed(pc.seed)
        self.steps, self.t0, self.lam = 0, None, pc.lambda_base_start

    def weight(self) -> float:
        """lambda at this step, and the step counted (called once a step, as the loss is)."""
        if self.t0 is None:
            self.t0 = time.time()
        progress = train.progress_of(self.steps, time.time() - self.t0, self.pc.train)
        self.steps += 1
        self.lam = lambda_base(progress, self.pc.lambda_base_start,
                               self.pc.lambda_base_decay_ratio)  # fmt: skip
        return self.lam

    def __call__(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        lam, total = self.weight(), torch.zeros(())
        depth, n = self.spec.depth, self.pc.anchors
        for win in training_windows(self.target, self.spec.block, x, m, depth, n, self.rng):
            r = teacher_forced(self.module, self.spec, self.target, win)
            final, _ = row_ce(r.final.float().log_softmax(-1), win, self.pc.labels)
            base, _ = row_ce(r.base.float().log_softmax(-1), win, self.pc.labels)
            terms = (1.0 - lam) * final + lam * base
            total = total + (terms * win.held * self.w).sum() / win.held.sum().clamp(min=1)
        return total / x.shape[0]


def run(pc: PocketDominoConfig, log=print, measure=None) -> dict:
    """Train and ship (`recipes.pocket.semiar.run`); `measure`: the held-out tau."""
    return run_semiar(pc, "domino", DominoLoss, log, None, measure)

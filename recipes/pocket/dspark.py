"""The pocket DSpark drafter: DeepSpec's losses and its confidence head's post-hoc
calibration on the pocket target (`models/pocket/dspark/`, `recipes.pocket.semiar`).

    python -m decode.train_pocket.dspark                                  # train, calibrate, ship
    python -m decode.train_pocket.dspark pocket_dspark.markov_head_type=gated

Read from deepseek-ai/DeepSpec at commit afdfa7c9382a3341a3e6f17756dd816da79f132c
(`deepspec/modeling/dspark/loss.py`, `markov_head.py`, `config/dspark/dspark_qwen3_8b.py`,
the paper `DSpark_paper.pdf` for the calibration); the code here is our own.

Loss, per block row k = 0 .. D - 1 (row k drafts the token at a + k + 1), every term weighted
by DeepSpec's decay w_k = exp(-k / gamma) (mean 1 here; its weighted mean is the same):
  ce_alpha         x  cross-entropy of the corrected row (labels as the block recipe's)
  l1_alpha         x  sum_v |q(v) - p(v)| = 2 TV(q, p), p the target's row (distribution
                      matching: the acceptance rate of sampling verification is 1 - TV)
  confidence_alpha x  BCE of the confidence head's logit towards 1 - TV(q, p) (detached)
Calibration (the paper's Sequential Temperature Scaling, its Sec. 3.2.1): one temperature a
block position, fitted left to right on held-out blocks: at position k a 1-D grid search for
the T_k whose cumulative product prod_{i <= k} sigmoid(z_i / T_i) has the least expected
calibration error against the blocks' prefix acceptance prod_{i <= k} (1 - TV_i), positions
before k kept at their fitted temperatures. Fitted on alternate held-out windows, reported on
the others; the temperatures go to `recipe.json` and the card (DeepSpec's layout has no key
for them, and decoding here does not read the confidence head).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from pairs.semiar.layout import MARKOV_HEADS
from recipes.pocket.block import decayed_weights, heldout_windows, row_ce, training_windows
from recipes.pocket.config import PocketDSparkConfig
from recipes.pocket.semiar import run as run_semiar
from recipes.pocket.semiar import teacher_forced

STS_GRID = np.exp(np.linspace(math.log(0.05), math.log(20.0), 241))  # temperatures searched


def dspark_weights(depth: int, gamma: float) -> torch.Tensor:
    """DeepSpec's decay over rows 0 .. depth - 1, exp(-k / gamma), normalised to mean 1."""
    return decayed_weights(depth + 1, gamma)


def dspark_terms(logq: torch.Tensor, p: torch.Tensor, confidence: torch.Tensor):
    """(L1 [..], acceptance 1 - TV [..] detached, confidence BCE [..]) of draft log-rows
    `logq` against target rows `p` [.., V], the confidence head's logits `confidence` [..]."""
    return l1_terms((logq.exp() - p).abs().sum(-1), confidence)


def l1_terms(l1: torch.Tensor, confidence: torch.Tensor):
    """(L1, acceptance 1 - TV = 1 - L1 / 2 detached, the confidence head's BCE towards it)."""
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    bce = F.binary_cross_entropy_with_logits(confidence, accept, reduction="none")
    return l1, accept, bce


class DSparkLoss:
    """DeepSpec's DSpark objective on a batch of windows (see the module doc)."""

    def __init__(self, module, spec, target, pc: PocketDSparkConfig) -> None:
        if pc.markov_head_type not in MARKOV_HEADS:
            raise ValueError(f"pocket_dspark.markov_head_type: expected one of "
                             f"{list(MARKOV_HEADS)}, found {pc.markov_head_type!r}")  # fmt: skip
        for name in ("ce_alpha", "l1_alpha", "confidence_alpha"):
            if not getattr(pc, name) >= 0:
                raise ValueError(f"pocket_dspark.{name}: expected >= 0, found {getattr(pc, name)}")
        self.module, self.spec, self.target, self.pc = module, spec, target, pc
        self.w = dspark_weights(spec.depth, pc.decay_gamma)
        self.rng = torch.Generator().manual_seed(pc.seed)

    def __call__(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        pc, total = self.pc, torch.zeros(())
        depth, rng = self.spec.depth, self.rng
        for win in training_windows(self.target, self.spec.block, x, m, depth, pc.anchors, rng):
            r = teacher_forced(self.module, self.spec, self.target, win)
            logq = r.final.float().log_softmax(-1)
            ce, _ = row_ce(logq, win, pc.labels)
            l1, _, bce = dspark_terms(
                logq, win.labels().exp(), self.module.confidence(r.hidden, r.prev)
            )
            terms = pc.ce_alpha * ce + pc.l1_alpha * l1 + pc.confidence_alpha * bce
            total = total + (terms * win.held * self.w).sum() / win.held.sum().clamp(min=1)
        return total / x.shape[0]


# -- sequential temperature scaling -----------------------------------------------------------


def ece(pred: np.ndarray, target: np.ndarray, bins: int) -> float:
    """Expected calibration error: equal-width bins of `pred`, |mean pred - mean target|
    weighted by the bins' shares (targets may be soft)."""
    idx = np.clip((pred * bins).astype(int), 0, bins - 1)
    count = np.bincount(idx, minlength=bins)
    gap = np.abs(np.bincount(idx, pred, bins) - np.bincount(idx, target, bins))
    return float(gap.sum() / max(count.sum(), 1))


def prefix_nll(pred: np.ndarray, target: np.ndarray) -> float:
    """Mean binary cross-entropy of predicted prefix probabilities against (soft) targets."""
    p = np.clip(pred, 1e-7, 1 - 1e-7)
    return float(-(target * np.log(p) + (1 - target) * np.log1p(-p)).mean())


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def sts_fit(logits: np.ndarray, accept: np.ndarray, bins: int, grid=STS_GRID) -> np.ndarray:
    """Per-position temperatures [D] of confidence `logits` [N, D] against per-step acceptance
    `accept` [N, D], fitted left to right (the module doc)."""
    target = np.cumprod(accept, 1)
    temps, before = np.ones(logits.shape[1]), np.ones(len(logits))
    for k in range(logits.shape[1]):
        errs = [ece(before * _sigmoid(logits[:, k] / t), target[:, k], bins) for t in grid]
        temps[k] = grid[int(np.argmin(errs))]
        before = before * _sigmoid(logits[:, k] / temps[k])
    return temps


def sts_scores(logits: np.ndarray, accept: np.ndarray, temps: np.ndarray, bins: int) -> dict:
    """Per position: ECE and NLL of the cumulative product at temperatures `temps`."""
    pred = np.cumprod(_sigmoid(logits / temps), 1)
    target = np.cumprod(accept, 1)
    d = logits.shape[1]
    return {"ece": [ece(pred[:, k], target[:, k], bins) for k in range(d)],
            "nll": [prefix_nll(pred[:, k], target[:, k]) for k in range(d)],
            "pred_mean": pred.mean(0).tolist(), "target_mean": target.mean(0).tolist()}  # fmt: skip


@torch.no_grad()
def confidence_data(module, spec, target, data, max_tokens: int):
    """Held-out blocks whose every row is trained on: (logits [N, D], 1 - TV [N, D]) per window."""
    out = []
    for win in heldout_windows(target, spec.block, spec.depth, data, max_tokens):
        keep = win.held.bool().all(1)
        r = teacher_forced(module, spec, target, win)
        logq = r.final.float().log_softmax(-1)
        _, accept, _ = dspark_terms(logq, win.labels().exp(), torch.zeros(logq.shape[:-1]))
        z = module.confidence(r.hidden, r.prev)
        out.append((z[keep].numpy(), accept[keep].numpy()))
    return out


def calibrate(module, spec, target, data, pc: PocketDSparkConfig) -> dict:
    """STS fitted on even held-out windows, reported on odd ones: the card's `sts` facts."""
    parts = confidence_data(module, spec, target, data, pc.calibration_tokens)
    fit = [np.concatenate(x) for x in zip(*parts[0::2], strict=True)]
    rep = [np.concatenate(x) for x in zip(*parts[1::2], strict=True)]
    temps = sts_fit(*fit, pc.calibration_bins)
    ones = np.ones_like(temps)
    return {"sts": {"temperatures": temps.tolist(), "fit_blocks": len(fit[0]),
                    "report_blocks": len(rep[0]), "bins": pc.calibration_bins,
                    "before": sts_scores(*rep, ones, pc.calibration_bins),
                    "after": sts_scores(*rep, temps, pc.calibration_bins)}}  # fmt: skip


def run(pc: PocketDSparkConfig, log=print, measure=None) -> dict:
    """Train, calibrate and ship (`recipes.pocket.semiar.run`); `measure`: the held-out tau."""

    def finish(module, spec, target, data) -> dict:
        return calibrate(module, spec, target, data, pc)

    return run_semiar(pc, "dspark", DSparkLoss, log, finish, measure,
                      extra={"num_anchors": pc.anchors})  # fmt: skip

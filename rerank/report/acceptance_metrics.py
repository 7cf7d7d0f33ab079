"""AUROC, Brier score, ECE and log-loss of acceptance estimators, with paired prompt-bootstrap
intervals (`rerank.report.acceptance` reports them).

Every figure is a mean over candidates (each first-level candidate of the set weighs the
same), and every resample draws prompts with replacement with the weights
`specrank.statistics.bootstrap.resample_weights` gives the run's round-weighted figures (prompts sorted,
the run's seed), keeping a prompt's candidates together. Each statistic is a ratio of
per-prompt sums, so a resample is two matrix products, and every estimator is resampled
with the same weights: the difference of two estimators is paired.

- Brier score: mean (s - y)^2; log-loss: mean -(y log s + (1 - y) log(1 - s)) with s clipped
  to [CLIP, 1 - CLIP]. Both against a label y in [0, 1]: the realized event (0/1) or the
  exact p(c) (a soft label).
- ECE: ECE_BINS equal-width bins of the prediction on [0, 1], as
  `sklearn.calibration.calibration_curve(strategy="uniform")` bins (a value on an inner
  edge goes to the lower bin; 0 to the first, 1 to the last): the sum over bins of
  |sum of (s - y) in the bin| over the candidates, i.e. sum_k (n_k / n) |mean s - mean y|.
- AUROC of the event: the share of (event, non-event) pairs the estimator orders right,
  ties counting one half, as `sklearn.metrics.roc_auc_score`. Over prompt weights w it is
  w C w / ((w . positives)(w . negatives)), where C[p, q] counts the pairs of a positive of
  prompt p and a negative of prompt q (`concordance`): one matrix per estimator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from calibrate.isotonic import PROB_FLOOR
from specrank.runtime.jit import njit
from specrank.statistics.bootstrap import resample_weights

ECE_BINS = 15
CLIP = PROB_FLOOR  # log-loss clips predictions to [CLIP, 1 - CLIP]
METRICS = ("auroc", "brier", "ece", "log_loss")
LOWER_IS_BETTER = {"auroc": False, "brier": True, "ece": True, "log_loss": True}


def ece_bin(pred: np.ndarray, n_bins: int = ECE_BINS) -> np.ndarray:
    """Bin of each prediction: `calibration_curve(strategy="uniform")`'s assignment."""
    inner = np.linspace(0.0, 1.0, n_bins + 1)[1:-1]
    return np.searchsorted(inner, pred)


@njit()
def concordance(score: np.ndarray, event: np.ndarray, prompt: np.ndarray, n_prompts: int
                ) -> np.ndarray:  # fmt: skip
    """C[p, q]: pairs of a positive of prompt p and a negative of prompt q that `score`
    orders right (positive above), ties counting 1/2. One sweep in score order. [P, P]"""
    order = np.argsort(score, kind="mergesort")
    out = np.zeros((n_prompts, n_prompts))
    below = np.zeros(n_prompts)  # negatives under the current tie group, per prompt
    group = np.zeros(n_prompts)  # negatives in the current tie group, per prompt
    n, i = order.size, 0
    while i < n:
        j = i
        while j < n and score[order[j]] == score[order[i]]:
            j += 1
        for k in range(i, j):
            if not event[order[k]]:
                group[prompt[order[k]]] += 1.0
        for k in range(i, j):
            if event[order[k]]:
                p = prompt[order[k]]
                for q in range(n_prompts):
                    out[p, q] += below[q] + 0.5 * group[q]
        for k in range(i, j):
            if not event[order[k]]:
                q = prompt[order[k]]
                below[q] += group[q]
                group[q] = 0.0
        i = j
    return out


@dataclass
class PromptWeights:
    """The candidates' prompts as codes 0..P-1 (prompts sorted) and the resample weights."""

    code: np.ndarray  # [n] prompt code of each candidate
    point: np.ndarray  # [1, P] all ones
    draws: np.ndarray  # [B, P] multinomial counts

    @classmethod
    def of(cls, prompt_ids: np.ndarray, n_resamples: int, seed: int) -> PromptWeights:
        code, prompts = pd.factorize(np.asarray(prompt_ids, dtype=object), sort=True)
        draws = resample_weights(len(prompts), n_resamples, seed)
        return cls(code.astype(np.int64), np.ones((1, len(prompts))), draws)

    @property
    def n_prompts(self) -> int:
        return self.point.shape[1]

    def sums(self, values: np.ndarray) -> np.ndarray:
        """Per-prompt sums of per-candidate `values`. [P]"""
        return np.bincount(self.code, values, minlength=self.n_prompts)

    def binned_sums(self, values: np.ndarray, bins: np.ndarray, n_bins: int) -> np.ndarray:
        """Per-prompt sums of `values` within each bin (`bins` in 0..n_bins-1). [P, n_bins]"""
        at = self.code * n_bins + bins
        return np.bincount(at, values, minlength=self.n_prompts * n_bins).reshape(-1, n_bins)


def _clipped(pred: np.ndarray) -> np.ndarray:
    return np.clip(np.asarray(pred, np.float64), 0.0, 1.0)


def loss_sums(pred: np.ndarray, label: np.ndarray, weights: PromptWeights,
              n_bins: int = ECE_BINS) -> dict[str, np.ndarray]:  # fmt: skip
    """Per-prompt sums behind the Brier score, log-loss and ECE of `pred` against `label`."""
    s, y = _clipped(pred), np.asarray(label, np.float64)
    c = np.clip(s, CLIP, 1.0 - CLIP)
    return {
        "brier": weights.sums((s - y) ** 2),
        "log_loss": weights.sums(-(y * np.log(c) + (1.0 - y) * np.log1p(-c))),
        "ece": weights.binned_sums(s - y, ece_bin(s, n_bins), n_bins),
    }


def _ratio(w: np.ndarray, sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return (w @ sums) / (w @ counts)


def loss_values(sums: dict[str, np.ndarray], counts: np.ndarray, w: np.ndarray
                ) -> dict[str, np.ndarray]:  # fmt: skip
    """Each loss under prompt weights `w` ([B, P]): [B] per metric."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ece = np.abs(w @ sums["ece"]).sum(axis=1) / (w @ counts)
    return {"brier": _ratio(w, sums["brier"], counts),
            "log_loss": _ratio(w, sums["log_loss"], counts), "ece": ece}  # fmt: skip


def auroc_values(matrix: np.ndarray, positives: np.ndarray, negatives: np.ndarray,
                 w: np.ndarray) -> np.ndarray:  # fmt: skip
    """AUROC under prompt weights `w` ([B, P]) from `concordance`'s matrix: [B] (NaN where a
    resample holds no positive or no negative)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return ((w @ matrix) * w).sum(axis=1) / ((w @ positives) * (w @ negatives))


Draws = dict[tuple[str, str], tuple[float, np.ndarray]]  # (metric, label) -> (point, [B])


def metric_draws(pred: np.ndarray, event: np.ndarray, labels: dict[str, np.ndarray],
                 weights: PromptWeights) -> Draws:  # fmt: skip
    """(metric, label) -> (point, resampled [B]) for one estimator: AUROC of the event, and
    the Brier score, ECE and log-loss against each of `labels` (name -> label)."""
    counts = weights.sums(np.ones(len(pred)))
    event = np.asarray(event, bool)
    matrix = concordance(_clipped(pred), event, weights.code, weights.n_prompts)
    pos = weights.sums(event.astype(np.float64))
    out = {("auroc", "event"): (
        float(auroc_values(matrix, pos, counts - pos, weights.point)[0]),
        auroc_values(matrix, pos, counts - pos, weights.draws),
    )}  # fmt: skip
    for label, y in labels.items():
        sums = loss_sums(pred, y, weights)
        point = loss_values(sums, counts, weights.point)
        draws = loss_values(sums, counts, weights.draws)
        out |= {(metric, label): (float(point[metric][0]), draws[metric]) for metric in point}
    return out

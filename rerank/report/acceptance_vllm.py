"""vLLM's acceptance estimator at depth 1: a logistic model on the drafter's confidence.

Read from vLLM's code (`vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py`, the
`OnlineAcceptanceEstimator` behind adaptive verification), pinned:

- vllm-project/vllm@322dc44b0f9c1326aec8916540e62cea4e397e76 (`VLLM_SOURCE`): the feature is
  logit(q) of the drafted token, log q - log(1 - q) of the drafter's temperature-scaled
  distribution, clamped to [-40, 40]; the model is p_k = sigmoid(w * feature + b_k), one
  slope shared by the draft positions and an intercept per position; it is fitted online
  by one damped Newton-IRLS step every 100 decode steps on that window's graded drafts
  (IRLS weights from the predictions made at draft time, ridge 1e-3, each step scaled by
  n / (n + 50) for its n observations, a slope step that would make the slope negative
  dropped), starting from w = 0, b = 1.5.
- ZKBig/vllm@1476a49eeb449a7b5d990efbba999e442789ef0f: the same model on logit(max q), a
  function of the prefix alone, starting from w = 0.5, b = -0.2. For the drafter's top
  first-level candidate (the chain's first token under greedy drafting) it is the same
  feature as logit(q(c)).
- An earlier revision of the same file (its commit not pinned here) used the top-2 logit
  margin m1 - m2 under greedy drafting, clamped at 40: for a first-level candidate c,
  log q(c) - log q(c') with c' its best sibling (`margin_top_sibling`; 40 without one),
  which for the top candidate is the drafter's top-2 margin when the pool's first level
  holds its two best tokens.

At depth 1 there is one position, so one slope and one intercept. Two fits of it:
- `crossfit_logistic`: fitted on the training half (`sklearn`'s LogisticRegression with
  C = 1 / ridge, the same L2 scale), predicting the held-out half, on the run's halves;
  against the law's label (the greedy label at T=0, the exact p(c) as a soft label at T>0:
  the label the rerankers are fitted on);
- `online_refit`: vLLM's own online fit, over the prompts in recording order, against the
  realized event (what a server sees): each round is predicted before its label joins the
  fit, so the prediction is held out in the prequential sense.

DSpark's trained confidence head is evaluated beside these (`rerank.report.acceptance`,
`dspark_confidence`), as recorded: trace schema v4's `draft_confidence` holds the calibrated
sigmoid of its block row 1 logit (`pairs.semiar.drafter`), the estimate for the block's
first draft token, the drafter's top first-level candidate (the `top` set). A store whose
drafter has no confidence head (every other kind, synthetic traces, a v3 store) records
none, and the report says so (`DSPARK_NOTE`).
"""

from __future__ import annotations

import numpy as np
from sklearn.linear_model import LogisticRegression

VLLM_SOURCE = ("vllm-project/vllm@322dc44b0f9c1326aec8916540e62cea4e397e76 "
               "vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py")  # fmt: skip
MAX_LOG_ODDS = 40.0  # vLLM's clamp of the feature (_MAX_MARGIN, _MAX_LOG_ODDS)
REFIT_INTERVAL = 100  # decode steps (here: rounds) between two refits
DAMPING = 50.0  # a refit's step is scaled by n / (n + DAMPING)
RIDGE = 1e-3  # L2 on the Newton solve (sklearn: C = 1 / RIDGE)
INITIAL = (0.0, 1.5)  # (slope, intercept) before the first refit
DSPARK_NOTE = ("DSpark's calibrated confidence: not evaluated: this store's drafter records no "
               "confidence (the trace's draft_confidence is null on the law's rounds: a "
               "drafter without a confidence head, or a v3 store)")  # fmt: skip
DSPARK_PRESENT = ("dspark_confidence: DSpark's calibrated confidence of its first draft token "
                  "as recorded (the trace's draft_confidence, sigmoid(z_1 / T_1)), on the "
                  "drafter's top candidate, nothing fitted")  # fmt: skip


def logit_q_feature(q: np.ndarray) -> np.ndarray:
    """log q - log(1 - q), clamped to [-MAX_LOG_ODDS, MAX_LOG_ODDS] (q = 1 gives the top)."""
    q = np.clip(np.asarray(q, np.float64), 0.0, 1.0)
    with np.errstate(divide="ignore"):
        return np.clip(np.log(q) - np.log1p(-q), -MAX_LOG_ODDS, MAX_LOG_ODDS)


def margin_feature(margin_top_sibling: np.ndarray) -> np.ndarray:
    """log q(c) - log q(best sibling), clamped; MAX_LOG_ODDS where c has no sibling."""
    m = np.asarray(margin_top_sibling, np.float64)
    return np.clip(np.where(np.isnan(m), MAX_LOG_ODDS, m), -MAX_LOG_ODDS, MAX_LOG_ODDS)


def fit_logistic(x: np.ndarray, label: np.ndarray) -> LogisticRegression | float:
    """The logistic model of `label` (0/1 or a probability: a soft label, as two weighted
    rows) on the columns of `x`; the mean label where it holds one class only."""
    y = np.asarray(label, np.float64)
    if y.size == 0:
        return float("nan")
    if np.all(y == y[0]):
        return float(y[0])
    soft = (y > 0) & (y < 1)
    if not soft.any():
        return LogisticRegression(C=1.0 / RIDGE).fit(x, y.astype(np.int8))
    rows = np.concatenate([x, x])
    targets = np.concatenate([np.ones(y.size, np.int8), np.zeros(y.size, np.int8)])
    return LogisticRegression(C=1.0 / RIDGE).fit(rows, targets, np.concatenate([y, 1.0 - y]))


def predict_logistic(model: LogisticRegression | float, x: np.ndarray) -> np.ndarray:
    if isinstance(model, float):
        return np.full(len(x), model)
    return model.predict_proba(x)[:, 1]


def crossfit_logistic(x: np.ndarray, label: np.ndarray, fold: np.ndarray) -> np.ndarray:
    """Each row's prediction by the model fitted on the other half's rows only. [n]"""
    x = np.asarray(x, np.float64).reshape(len(fold), -1)
    out = np.full(len(fold), np.nan)
    for half in (0, 1):
        held, train = fold == half, fold == 1 - half
        if held.any():
            if not train.any():
                raise ValueError(f"crossfit_logistic: half {1 - half} has no rows to fit on")
            out[held] = predict_logistic(fit_logistic(x[train], label[train]), x[held])
    return out


def _refit(w: float, b: float, f: np.ndarray, y: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    """One of vLLM's refits (`_refit_kernel`) from a window's features, events and the
    predictions made before them: the damped Newton-IRLS step of (slope, intercept)."""
    weight, resid, n = p * (1.0 - p), y - p, float(f.size)
    a = float(weight @ (f * f)) + RIDGE
    bb, c = float(weight @ f), float(weight.sum()) + RIDGE
    g0, g1 = float(resid @ f), float(resid.sum())
    with np.errstate(divide="ignore", invalid="ignore"):
        step_w = (g0 - bb * g1 / c) / (a - bb * bb / c) * n / (n + DAMPING)
    if not np.isfinite(step_w) or w + step_w < 0.0:
        step_w = 0.0
    step_b = (g1 - bb * step_w) / c * n / (n + DAMPING)
    return w + step_w, b + (step_b if np.isfinite(step_b) else 0.0)


def online_refit(feature: np.ndarray, event: np.ndarray, step: np.ndarray,
                 interval: int = REFIT_INTERVAL) -> np.ndarray:  # fmt: skip
    """vLLM's online estimator over rows in recording order: `step` numbers each row's round
    (non-decreasing; a round is a decode step), every row of a window of `interval` rounds
    is predicted with the coefficients of the refit before it. [n]"""
    step = np.asarray(step, np.int64)
    if step.size and np.any(np.diff(step) < 0):
        raise ValueError("online_refit: rows must come in recording order (step non-decreasing)")
    f, y = np.asarray(feature, np.float64), np.asarray(event, np.float64)
    window = step // interval
    bounds = np.flatnonzero(np.diff(window)) + 1
    out = np.empty(f.size)
    w, b = INITIAL
    for lo, hi in zip([0, *bounds], [*bounds, f.size], strict=True):
        p = 1.0 / (1.0 + np.exp(-(w * f[lo:hi] + b)))
        out[lo:hi] = p
        w, b = _refit(w, b, f[lo:hi], y[lo:hi], p)
    return out

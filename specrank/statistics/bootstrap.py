"""Paired prompt bootstrap of rule values (docs/method.md#reporting), vectorised.

Every resample draws prompts with replacement and keeps all rounds of a drawn
prompt together; every rule and budget is resampled jointly (one weight matrix
for all of them), so gains are paired. A resample is a row of multinomial
counts `W[b, p]`; any round-weighted mean over a resample is then
`(W @ per_prompt_sums) / (W @ per_prompt_rounds)`: two matrix products for
all resamples and all rules at once, no Python loop over resamples.

Why not scipy.stats.bootstrap: it resamples observations, not groups with
paired statistics over many columns, and loops in Python for vector statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import pandas as pd
from threadpoolctl import ThreadpoolController

WEIGHTINGS = ("round", "prompt", "task")


# paired prompt-bootstrap resamples (docs/method.md#reporting: 1,000-2,000)
DEFAULT_RESAMPLES = 2000


@dataclass
class PromptSums:
    """Per-prompt aggregates of per-round values: the bootstrap's sufficient statistics."""

    prompts: np.ndarray  # [n_prompts] prompt ids
    tasks: np.ndarray  # [n_prompts] task of each prompt
    sums: np.ndarray  # [n_prompts, n_cols] sum over the prompt's rounds
    rounds: np.ndarray  # [n_prompts] rounds of the prompt
    columns: list[str]

    @classmethod
    def from_rounds(cls, frame: pd.DataFrame, columns: list[str]) -> PromptSums:
        """`frame` has one row per round with `prompt_id`, `task` and the value columns."""
        for c in ["prompt_id", "task", *columns]:
            if c not in frame:
                raise KeyError(f"round table has no column '{c}'")
        grouped = frame.groupby("prompt_id", sort=True)
        tasks = grouped["task"].agg(["first", "nunique"])
        if (tasks["nunique"] > 1).any():
            bad = tasks.index[tasks["nunique"] > 1][:5].tolist()
            raise ValueError(f"prompts with more than one task label: {bad}")
        return cls(
            prompts=tasks.index.to_numpy(),
            tasks=tasks["first"].to_numpy(),
            sums=grouped[columns].sum().to_numpy(np.float64),
            rounds=grouped.size().to_numpy(np.float64),
            columns=list(columns),
        )


def resample_weights(n_prompts: int, n_resamples: int, seed: int) -> np.ndarray:
    """Multinomial prompt counts of each resample. [n_resamples, n_prompts] float64."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_prompts, np.full(n_prompts, 1.0 / n_prompts), size=n_resamples).astype(
        np.float64
    )


def weighted_means(stats: PromptSums, weighting: str, weights: np.ndarray | None) -> np.ndarray:
    """Mean of each column under a prompt weighting. [n_resamples or 1, n_cols].

    round : every round weighs the same (sums / rounds)
    prompt: every prompt weighs the same (mean of per-prompt means)
    task  : every task weighs the same (mean over tasks of round-weighted task means);
            resamples draw prompts within each task, so `weights` must come from
            `task_resample_weights`.
    `weights` None gives the point estimate (all counts 1).
    """
    w = np.ones((1, len(stats.prompts))) if weights is None else weights
    # On one thread: the products are small (2,000 x prompts x columns), and a woken OpenBLAS
    # worker spins before it sleeps again (perf, default job: 3.7 CPU s spinning beside 1.5
    # in the products). One thread also makes the sums' order, so the bits, the same on any
    # number of cores; against two threads the intervals moved by at most 1.5e-14.
    with _blas().limit(limits=1, user_api="blas"):
        return _weighted_means(stats, weighting, w)


@cache
def _blas() -> ThreadpoolController:
    """The process's thread pools, found once (threadpoolctl searches the loaded libraries)."""
    return ThreadpoolController()


def _weighted_means(stats: PromptSums, weighting: str, w: np.ndarray) -> np.ndarray:
    if weighting == "round":
        return (w @ stats.sums) / (w @ stats.rounds)[:, None]
    if weighting == "prompt":
        per_prompt = stats.sums / stats.rounds[:, None]
        return (w @ per_prompt) / w.sum(1, keepdims=True)
    if weighting == "task":
        means = []
        for task in np.unique(stats.tasks):
            m = stats.tasks == task
            means.append((w[:, m] @ stats.sums[m]) / (w[:, m] @ stats.rounds[m])[:, None])
        return np.mean(means, axis=0)
    raise ValueError(f"The 'weighting' must be one of {WEIGHTINGS}. Got {weighting!r} instead.")


def task_resample_weights(tasks: np.ndarray, n_resamples: int, seed: int) -> np.ndarray:
    """Counts that resample prompts within each task (task-equal intervals). [n_resamples, n_prompts]."""
    rng = np.random.default_rng(seed)
    w = np.zeros((n_resamples, len(tasks)))
    for task in np.unique(tasks):
        idx = np.flatnonzero(tasks == task)
        w[:, idx] = rng.multinomial(len(idx), np.full(len(idx), 1.0 / len(idx)), size=n_resamples)
    return w


MAX_NONFINITE_SHARE = 0.05  # above this share of undefined resamples an interval is NaN


@dataclass
class Interval:
    """A point estimate and its percentile interval, with what the interval rests on.

    `nonfinite` resamples gave no value (a share of a zero root gain, a budget beyond
    the pool, ...). Up to MAX_NONFINITE_SHARE of them the interval is taken over the
    others and the count is reported beside it; above it `low`/`high` are NaN and
    `reason` says why: the finite resamples alone would describe another statistic.
    """

    estimate: float
    low: float
    high: float
    nonfinite: int = 0
    resamples: int = 0
    reason: str = ""  # why low/high are NaN; "" when they are numbers

    def columns(self, key: str) -> dict[str, float | int | str]:
        """`key`, `key_lo`, `key_hi`, `key_nonfinite` and `key_note` (the reason) of a table row."""
        return {key: self.estimate, f"{key}_lo": self.low, f"{key}_hi": self.high,
                f"{key}_nonfinite": self.nonfinite, f"{key}_note": self.reason}  # fmt: skip


def fill_notes(frame: pd.DataFrame) -> pd.DataFrame:
    """Every `_note` column as text, "" where no reason is given (a row without that interval,
    or a CSV read back: `read_csv` reads empty notes as NaN)."""
    for c in frame.columns:
        if c.endswith("_note"):
            frame[c] = frame[c].astype("str").where(frame[c].notna(), "")
    return frame


def percentile_interval(
    point: float, draws: np.ndarray, level: float = 0.95, undefined: str = "undefined"
) -> Interval:
    """Percentile interval of the draws, counting the non-finite ones (`Interval`).

    `undefined` names what a non-finite resample means in the reason (e.g. "beyond the pool").
    """
    draws = np.asarray(draws, dtype=np.float64).reshape(-1)
    finite = draws[np.isfinite(draws)]
    n, bad = draws.size, draws.size - finite.size
    nan = float("nan")
    if n == 0:
        return Interval(float(point), nan, nan, 0, 0, "no resamples")
    if bad > MAX_NONFINITE_SHARE * n:
        reason = f"{bad} of {n} resamples {undefined} (over {MAX_NONFINITE_SHARE:.0%})"
        return Interval(float(point), nan, nan, bad, n, reason)
    lo, hi = np.percentile(finite, [50 * (1 - level), 50 * (1 + level)])
    return Interval(float(point), float(lo), float(hi), bad, n)


def ci_text(point: float, low: float, high: float, scale: float = 100.0, unit: str = "%") -> str:
    """`+4.9% [+4.4, +5.4]` for printed tables; `[n/a]` when the interval was not given
    (`Interval.reason`; the tables print the reasons below), `-` when the point is undefined."""
    if not np.isfinite(point):
        return "-"
    head = f"{scale * point:+6.1f}{unit}"
    if not (np.isfinite(low) and np.isfinite(high)):
        return f"{head} [n/a]"
    return f"{head} [{scale * low:+.1f}, {scale * high:+.1f}]"


def relative_gain(rule: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Gain in expected accepted tokens over the base rule: rule / base - 1."""
    return rule / base - 1.0


def emitted_gain(rule: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Gain in emitted tokens per round (accepted + continuation): (rule - base) / (base + 1)."""
    return (rule - base) / (base + 1.0)


def share_recovered(rule: np.ndarray, base: np.ndarray, top: np.ndarray) -> np.ndarray:
    """Share of the top rule's advantage over the base that a rule recovers (nan if none)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(top != base, (rule - base) / (top - base), np.nan)


def bootstrap_weights(stats: PromptSums, weighting: str, n_resamples: int, seed: int) -> np.ndarray:
    """Resample counts for a weighting (within-task resampling for task-equal means)."""
    if weighting == "task":
        return task_resample_weights(stats.tasks, n_resamples, seed)
    return resample_weights(len(stats.prompts), n_resamples, seed)


def bootstrap_means(
    stats: PromptSums, weighting: str, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Point estimates [n_cols] and resampled means [n_resamples, n_cols] of every column."""
    weights = bootstrap_weights(stats, weighting, n_resamples, seed)
    return weighted_means(stats, weighting, None)[0], weighted_means(stats, weighting, weights)

"""Budget elasticity between the budgets of one online run (seed 003's Eq. 1).

    d ln TPS = d ln tau + d ln eta,   eta = TPS / tau   (efficiency: rounds per second,
                                                         up to tokens counted past an EOS)

For each pair of consecutive budgets b1 < b2 decoded in the same run (`run.budgets`,
every prompt at every budget): TPS = 1000 * summed tokens / summed ms (tokens up to the
first EOS, as the groups table counts them), tau = summed emitted tokens / summed rounds
(the round-weighted mean of the round table's tau), and d ln X = ln X(b2) - ln X(b1).
d ln eta is defined as d ln TPS - d ln tau, so the identity holds exactly (to floating
point) on the reported numbers, and ln eta(b) = ln TPS(b) - ln tau(b) is reported at
each end. Intervals: paired prompt bootstrap -- one weight row per resample draws
prompts for both budgets at once, so each d ln is a paired difference.
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd

from specrank.statistics.bootstrap import percentile_interval, resample_weights

QUANTITIES = ("tps", "tau", "eta")


def _log_figures(prompts: pd.DataFrame, weights: np.ndarray) -> dict[str, np.ndarray]:
    """ln TPS, ln tau and ln eta under each weight row. Each [n]."""
    tps = 1000.0 * (weights @ prompts["tokens"].to_numpy()) / (weights @ prompts["ms"].to_numpy())
    tau = (weights @ prompts["emitted"].to_numpy()) / (weights @ prompts["rounds"].to_numpy())
    ln_tps, ln_tau = np.log(tps), np.log(tau)
    return {"tps": ln_tps, "tau": ln_tau, "eta": ln_tps - ln_tau}


def budget_elasticity(
    prompts_by_budget: dict[int, pd.DataFrame], n_resamples: int, seed: int
) -> pd.DataFrame:
    """One row per consecutive budget pair: the three log changes with paired intervals.

    prompts_by_budget: budget -> `decode.metrics.prompt_table` of that budget's
    decode (the same prompts at every budget). Empty with fewer than two budgets.
    """
    budgets = sorted(prompts_by_budget)
    if len(budgets) < 2:
        return pd.DataFrame()
    ids = prompts_by_budget[budgets[0]]["prompt_id"].tolist()
    aligned = {}
    for b in budgets:
        frame = prompts_by_budget[b].set_index("prompt_id")
        if sorted(frame.index) != sorted(ids):
            raise ValueError(
                f"budget_elasticity: budget {b} decoded other prompts than budget {budgets[0]}; "
                "every budget of a run must decode the same prompts"
            )
        aligned[b] = frame.loc[ids].reset_index()
    w = resample_weights(len(ids), n_resamples, seed)  # shared by every budget: paired
    ones = np.ones((1, len(ids)))
    point = {b: _log_figures(aligned[b], ones) for b in budgets}
    draws = {b: _log_figures(aligned[b], w) for b in budgets}
    rows = []
    for b1, b2 in itertools.pairwise(budgets):
        row: dict[str, float] = {"from_budget": b1, "to_budget": b2}
        for q in QUANTITIES:
            row[f"ln_{q}_from"], row[f"ln_{q}_to"] = point[b1][q][0], point[b2][q][0]
            d = point[b2][q][0] - point[b1][q][0]
            row |= percentile_interval(d, draws[b2][q] - draws[b1][q]).columns(f"d_ln_{q}")
        rows.append(row)
    return pd.DataFrame(rows)

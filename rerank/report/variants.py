"""The variant table: every learned rule side by side, at every law and budget.

For each learned first-factor rule (the cross-fitted rerankers and the
controls: `rank_control`, `iso_q1`): its held-out squared error and top-1
agreement (`rerank.fit.quality`), its gain over draft selection and over the
draft-rank control, each with its paired 95% interval over the run's shared
prompt resamples (`rerank.report.summary`, `rerank.report.comparisons`), and its share of
the root gain (the gain root selection makes, docs/method.md#rule-values). A figure the run did
not compute (no rank control, no root rule) is NaN.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from specrank.statistics.bootstrap import ci_text
from specrank.statistics.laws import law_name

CONTROL = "rank_control"
VARIANT_COLUMNS = [
    "law", "budget", "rule", "squared_error", "top1_agreement", "accepted",
    "gain", "gain_lo", "gain_hi", "gain_over_control", "gain_over_control_lo",
    "gain_over_control_hi", "share_root", "share_root_lo", "share_root_hi",
]  # fmt: skip


def variant_table(
    summary: pd.DataFrame,
    comparisons: pd.DataFrame,
    quality: pd.DataFrame,
    rules: list[str],
    weighting: str = "round",
) -> pd.DataFrame:
    """One row per (law, budget, learned rule): prediction quality, gains, root share."""
    s = summary[(summary["weighting"] == weighting) & summary["rule"].isin(rules)]
    c = comparisons[(comparisons["weighting"] == weighting) & (comparisons["b"] == CONTROL)]
    q = quality[quality["fold"].astype(str) == "all"].assign(
        law=lambda f: [law_name(t) for t in f["temperature"]]
    )
    rows = []
    for r in s.itertuples():
        qual = q[(q["law"] == r.law) & (q["predictor"] == r.rule)]
        comp = c[(c["law"] == r.law) & (c["budget"] == r.budget) & (c["a"] == r.rule)]
        nan = float("nan")
        rec = {
            "law": r.law,
            "budget": int(r.budget),
            "rule": r.rule,
            "squared_error": float(qual["squared_error"].iloc[0]) if len(qual) else nan,
            "top1_agreement": float(qual["top1_agreement"].iloc[0]) if len(qual) else nan,
            "accepted": r.accepted,
            "gain": r.gain,
            "gain_lo": r.gain_lo,
            "gain_hi": r.gain_hi,
        }
        for key in ("gain", "gain_lo", "gain_hi"):
            over = "gain_over_control" + key[4:]
            rec[over] = (
                0.0 if r.rule == CONTROL else (float(comp[key].iloc[0]) if len(comp) else nan)
            )
        for key in ("share_root", "share_root_lo", "share_root_hi"):
            rec[key] = float(getattr(r, key, nan))
        rows.append(rec)
    return pd.DataFrame(rows, columns=VARIANT_COLUMNS)


def variants_text(table: pd.DataFrame) -> str:
    """The variant table as printed after the results (one block per law and budget)."""
    lines = []
    header = (
        f"{'rule':<18}{'sq. error':>11}{'top-1':>8}{'gain vs draft [95% CI]':>28}"
        f"{'gain vs rank control':>28}{'root share':>12}"
    )
    for (law, budget), part in table.groupby(["law", "budget"], sort=False):
        lines += [f"\n== {law}, B={budget}: learned rules ==", header, "-" * len(header)]
        for r in part.itertuples():
            share = "-" if np.isnan(r.share_root) else f"{100 * r.share_root:.0f}%"
            sq = "-" if np.isnan(r.squared_error) else f"{r.squared_error:.4f}"
            top1 = "-" if np.isnan(r.top1_agreement) else f"{100 * r.top1_agreement:.0f}%"
            lines.append(
                f"{r.rule:<18}{sq:>11}{top1:>8}{ci_text(r.gain, r.gain_lo, r.gain_hi):>28}"
                f"{ci_text(r.gain_over_control, r.gain_over_control_lo, r.gain_over_control_hi):>28}"
                f"{share:>12}"
            )
    return "\n".join(lines)

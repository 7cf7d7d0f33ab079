"""Gain over draft selection vs budget by rule family, and the paired-comparison forest plot.

Both take the logged tables (`summary.csv`, `comparisons.csv`) as they are, so
that `notebooks/compare_runs.ipynb` draws the same figures from a run's artifacts.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib import transforms
from matplotlib.figure import Figure

from rerank.report.plot_style import budget_axis, group_rules, new_figure, padded_range, styles

PANEL_COLUMNS = 3


def gain_figure(
    summary: pd.DataFrame, law: str, weighting: str = "round", title: str = ""
) -> Figure:
    """Small multiples, one panel per rule family, of gain (%) vs budget with 95% bands.

    Each panel's y range comes from its own rules' intervals (a substitution at
    -70% no longer flattens the learned rules); the x ticks are the budgets
    evaluated; draft selection is the zero line.
    """
    sub = summary[(summary["law"] == law) & (summary["weighting"] == weighting)]
    if sub.empty:
        raise ValueError(f"summary has no rows for law={law!r}, weighting={weighting!r}")
    budgets = sorted(int(b) for b in sub["budget"].unique())
    groups = group_rules(summary["rule"])  # all laws: a rule keeps its style in every figure
    present = set(sub["rule"])
    groups = [(f, rules) for f, rules in groups if present & set(rules)]
    ncols = min(PANEL_COLUMNS, len(groups))
    nrows = math.ceil(len(groups) / ncols)
    fig = new_figure(4.6 * ncols, 3.7 * nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in axes.flat[len(groups) :]:
        ax.set_visible(False)
    for ax, (family, rules) in zip(axes.flat, groups, strict=False):
        style = styles(rules)
        lows, highs = [], []
        for rule in rules:
            r = sub[sub["rule"] == rule].sort_values("budget")
            if r.empty:
                continue
            x = r["budget"].to_numpy(float)
            y, lo, hi = (100 * r[c].to_numpy(float) for c in ("gain", "gain_lo", "gain_hi"))
            s = style[rule]
            ax.fill_between(x, lo, hi, color=s.color, alpha=0.13, lw=0)
            ax.plot(x, y, ms=5, lw=1.5, label=rule, **s.kwargs())
            lows.append(np.nanmin(np.concatenate([lo, y])))
            highs.append(np.nanmax(np.concatenate([hi, y])))
        ax.axhline(0, color="black", lw=0.9, zorder=1)
        if lows:
            ax.set_ylim(*padded_range(min(lows), max(highs)))
        budget_axis(ax, budgets)
        ax.grid(alpha=0.25)
        ax.set_title(family.title, fontsize=10)
        ax.set_xlabel("budget B (verified nodes)", fontsize=8)
        ax.set_ylabel("gain vs draft (%)", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(fontsize=7, loc="best", framealpha=0.85)
    fig.suptitle(
        title
        or f"{law}: gain in expected accepted tokens over draft selection (= 0)\n"
        f"{weighting}-weighted; bands: 95% paired prompt bootstrap",
        fontsize=11,
    )
    return fig


def comparison_forest(
    comparisons: pd.DataFrame, weighting: str = "round", title: str = ""
) -> Figure:
    """Forest plot: each pair a over b at each budget, gain of a over b (%) with its 95% interval.

    One panel per law, pairs in configured order, one row per budget within a
    pair (labelled `B=<b>`), under a header naming the pair; zero marked.
    """
    sub = comparisons[comparisons["weighting"] == weighting]
    if sub.empty:
        raise ValueError(f"comparisons have no rows for weighting={weighting!r}")
    laws = list(dict.fromkeys(sub["law"]))
    pairs = list(dict.fromkeys(zip(sub["a"], sub["b"], strict=True)))
    budgets = sorted(int(b) for b in sub["budget"].unique())
    bstyle = styles([str(b) for b in budgets])  # a budget keeps its colour and marker everywhere
    # rows from the top: a header per pair, then its budgets, then a gap
    step = len(budgets) + 2
    n_rows = step * len(pairs)
    row_height = 0.22 if len(budgets) <= 6 else 0.17  # a sweep: 13 budgets per pair
    fig = new_figure(4.8 * len(laws) + 1.6, row_height * n_rows + 1.4)
    axes = fig.subplots(1, len(laws), squeeze=False, sharey=True)[0]
    ticks, labels = [], []
    for p in range(len(pairs)):
        for k, budget in enumerate(budgets):
            ticks.append(-(p * step + 1 + k))
            labels.append(f"B={budget}")
    for ax, law in zip(axes, laws, strict=True):
        part = sub[sub["law"] == law]
        for p, (a, b) in enumerate(pairs):
            top = -p * step
            ax.text(0.01, top, f"{a} vs {b}", fontsize=8, fontweight="bold", va="center",
                    transform=transforms.blended_transform_factory(ax.transAxes, ax.transData))  # fmt: skip
            if p:
                ax.axhline(top + 1, color="grey", lw=0.5, alpha=0.5)
            for k, budget in enumerate(budgets):
                r = part[(part["a"] == a) & (part["b"] == b) & (part["budget"] == budget)]
                if r.empty:
                    continue
                g, lo, hi = (100 * float(r[c].iloc[0]) for c in ("gain", "gain_lo", "gain_hi"))
                s = bstyle[str(budget)]
                err = [[max(g - lo, 0.0)], [max(hi - g, 0.0)]] if np.isfinite(lo) else None
                ax.errorbar([g], [top - 1 - k], xerr=err, fmt=s.marker, color=s.color, ms=4,
                            lw=1.2, capsize=2)  # fmt: skip
        ax.axvline(0, color="black", lw=0.9)
        ax.set_ylim(-n_rows + 1, 1)
        ax.set_yticks(ticks, labels, fontsize=7)
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(law, fontsize=10)
        ax.set_xlabel("gain of a over b (%)", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        lo, hi = ax.get_xlim()
        ax.set_xlim(*padded_range(lo, hi))  # headroom right of the pair headers
    fig.suptitle(
        title
        or f"paired comparisons: relative gain of a over b in expected accepted tokens\n"
        f"{weighting}-weighted; 95% paired prompt-bootstrap intervals",
        fontsize=10,
    )
    return fig

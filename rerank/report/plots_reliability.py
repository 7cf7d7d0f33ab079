"""Reliability of out-of-fold first-level predictions: a binned table and its figure.

The bins are fixed edges shared by every predictor, finer near 0 where most
first-level candidates lie (a median prediction of about 0.03 at T=1, 0 at T=0),
so that the counts under the curve compare predictors bin by bin. The table is
logged (`reliability.csv`) and the figure is drawn from it, so the notebook
redraws it from a run's artifacts.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from rerank.report.plot_style import new_figure, styles

EDGES = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TICKS = (0.0, 0.01, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0)
RELIABILITY_COLUMNS = [
    "law",
    "predictor",
    "bin_low",
    "bin_high",
    "count",
    "mean_prediction",
    "mean_label",
]


def reliability_table(
    predictions: Mapping[str, np.ndarray], label: np.ndarray, law: str
) -> pd.DataFrame:
    """Per predictor and bin of `EDGES`: candidates, mean prediction and mean label."""
    edges = np.asarray(EDGES)
    rows = []
    for name, pred in predictions.items():
        pred = np.clip(np.asarray(pred, np.float64), 0.0, 1.0)
        # right-closed last bin: a prediction of exactly 1 belongs to [0.9, 1]
        idx = np.clip(np.searchsorted(edges, pred, side="right") - 1, 0, len(edges) - 2)
        count = np.bincount(idx, minlength=len(edges) - 1)
        sum_pred = np.bincount(idx, pred, minlength=len(edges) - 1)
        sum_label = np.bincount(idx, np.asarray(label, np.float64), minlength=len(edges) - 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_pred, mean_label = sum_pred / count, sum_label / count
        for k in range(len(edges) - 1):
            rows.append((law, name, edges[k], edges[k + 1], int(count[k]), mean_pred[k],
                         mean_label[k]))  # fmt: skip
    return pd.DataFrame(rows, columns=RELIABILITY_COLUMNS)


def _sqrt_axis(ax, axis: str) -> None:
    # sqrt on both axes keeps the diagonal straight and spreads out the bulk near 0
    scale = {"functions": (lambda v: np.sqrt(np.clip(v, 0, None)), np.square)}
    if axis == "x":
        ax.set_xscale("function", **scale)
        ax.set_xticks(TICKS, [f"{t:g}" for t in TICKS], fontsize=7)
        ax.set_xlim(0, 1)
    else:
        ax.set_yscale("function", **scale)
        ax.set_yticks(TICKS, [f"{t:g}" for t in TICKS], fontsize=7)
        ax.set_ylim(0, 1)


def reliability_figure(table: pd.DataFrame, law: str, title: str = "") -> Figure:
    """Mean label vs mean prediction per bin (one line per predictor), bin counts underneath."""
    sub = table[table["law"] == law]
    if sub.empty:
        raise ValueError(f"reliability table has no rows for law={law!r}")
    names = list(dict.fromkeys(table["predictor"]))  # every law: the same style per predictor
    style = styles(names)
    fig = new_figure(6.0, 7.2)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.2]})
    top.plot([0, 1], [0, 1], color="grey", lw=0.9, ls="--", label="perfect calibration")
    for name in names:
        r = sub[(sub["predictor"] == name) & (sub["count"] > 0)]
        if r.empty:
            continue
        s = style[name]
        top.plot(r["mean_prediction"], r["mean_label"], ms=5, lw=1.3,
                 label=f"{name} ({int(r['count'].sum()):,} candidates)", **s.kwargs())  # fmt: skip
        # the strip: one step per bin of EDGES, so each count sits under its bin
        counts = sub[sub["predictor"] == name]["count"].to_numpy()
        bottom.stairs(np.where(counts > 0, counts, np.nan), EDGES, color=s.color,
                      linestyle=s.linestyle, lw=1.4)  # fmt: skip
    _sqrt_axis(top, "x")
    _sqrt_axis(top, "y")
    top.set_ylabel("mean label in bin", fontsize=8)
    top.grid(alpha=0.25)
    top.legend(fontsize=7, loc="upper left", framealpha=0.85)
    top.set_title(title or f"{law}: out-of-fold reliability of first-level predictions",
                  fontsize=10)  # fmt: skip
    bottom.set_yscale("log")
    bottom.set_ylabel("candidates\nper bin", fontsize=8)
    bottom.set_xlabel("mean predicted first-factor probability (square-root scale)", fontsize=8)
    bottom.tick_params(axis="y", labelsize=7)
    bottom.grid(alpha=0.25)
    for edge in EDGES[1:-1]:
        bottom.axvline(edge, color="grey", lw=0.3, alpha=0.4)
    return fig

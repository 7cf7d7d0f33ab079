"""PNG figures logged with every run, written beside `summary.csv`.

    gain_vs_budget_<law>.png   gain over draft vs budget, one panel per rule family (`plots_gain`)
    comparisons.png            the paired comparisons as a forest plot, a panel per law
    reliability_<law>.png      out-of-fold reliability with bin counts (`plots_reliability`)

Every figure is drawn from a table the run also logs (`summary.csv`,
`comparisons.csv`, `reliability.csv`), so `notebooks/compare_runs.ipynb`
redraws the same figures from a run's artifacts with the functions below.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from rerank.report.plot_style import save
from rerank.report.plots_gain import comparison_forest, gain_figure
from rerank.report.plots_reliability import reliability_figure


def gain_vs_budget(summary: pd.DataFrame, out: Path, weighting: str = "round") -> list[Path]:
    """`gain_vs_budget_<law>.png` for every law of the summary."""
    paths = []
    for law in dict.fromkeys(summary["law"]):
        path = out / f"gain_vs_budget_{law}.png"
        save(gain_figure(summary, law, weighting), path)
        paths.append(path)
    return paths


def comparisons_plot(comparisons: pd.DataFrame, out: Path, weighting: str = "round") -> list[Path]:
    """`comparisons.png`, or nothing when the run compares no pairs."""
    if comparisons[comparisons["weighting"] == weighting].empty:
        return []
    path = out / "comparisons.png"
    save(comparison_forest(comparisons, weighting), path)
    return [path]


def reliability_plots(table: pd.DataFrame, out: Path) -> list[Path]:
    """`reliability_<law>.png` for every law of the reliability table."""
    paths = []
    for law in dict.fromkeys(table["law"]):
        path = out / f"reliability_{law}.png"
        save(reliability_figure(table, law), path)
        paths.append(path)
    return paths


def write_plots(
    out: Path, summary: pd.DataFrame, comparisons: pd.DataFrame, reliability: pd.DataFrame
) -> list[Path]:
    """Every figure of a run under `out`; returns their paths (all of them are logged)."""
    return [
        *gain_vs_budget(summary, out),
        *comparisons_plot(comparisons, out),
        *reliability_plots(reliability, out),
    ]

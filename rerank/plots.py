"""PNG figures logged with every run: gain vs budget, calibration reliability."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers or in CI
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd


def gain_vs_budget(summary: pd.DataFrame, out: Path, weighting: str = "round") -> list[Path]:
    """One figure per law: gain over draft selection vs budget, with 95% intervals."""
    paths = []
    sub = summary[(summary["weighting"] == weighting) & (summary["rule"] != "draft")]
    for law, part in sub.groupby("law"):
        fig, ax = plt.subplots(figsize=(8, 5))
        for rule, r in part.groupby("rule", sort=False):
            r = r.sort_values("budget")
            ax.plot(r["budget"], 100 * r["gain"], marker="o", label=rule)
            ax.fill_between(r["budget"], 100 * r["gain_lo"], 100 * r["gain_hi"], alpha=0.15)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("budget B (verified nodes)")
        ax.set_ylabel("gain in expected accepted tokens vs draft (%)")
        ax.set_title(
            f"{law}: gain over draft selection ({weighting}-weighted, 95% prompt bootstrap)"
        )
        ax.legend(fontsize=7, ncol=2)
        path = out / f"gain_vs_budget_{law}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def reliability(
    predictions: dict[str, np.ndarray], label: np.ndarray, title: str, path: Path, n_bins: int = 20
) -> Path:
    """Mean label vs mean prediction in equal-count bins, one line per predictor."""
    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    ax.plot([0, 1], [0, 1], color="black", lw=0.8, ls="--")
    for name, pred in predictions.items():
        order = np.argsort(pred, kind="stable")
        bins = np.array_split(order, n_bins)
        ax.plot(
            [pred[b].mean() for b in bins if b.size],
            [label[b].mean() for b in bins if b.size],
            marker=".",
            label=name,
        )
    ax.set_xlabel("mean predicted first-factor probability")
    ax.set_ylabel("mean label")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""Reliability of the acceptance estimators by task and by entropy half, and the forest plot
of the reference's advantage: the tables and figures of `rerank.report.acceptance`.

The reliability table holds, per law, candidate set, estimator and group, each of the
ECE's bins (`rerank.report.acceptance_metrics.ece_bin`, 15 equal-width bins): candidates,
mean prediction, mean event (X1 = c) and mean exact p(c). The groups: every candidate
(`all`), each task, and each half of the target's root-row entropy (`low`: at or below the
law's median over its rounds, `high`: above). The figures are drawn from the logged tables
(`acceptance_reliability.csv`, `acceptance.csv`), so the notebook redraws them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from rerank.report.acceptance import CANDIDATE_SETS, LawSet, law_label
from rerank.report.acceptance_metrics import ECE_BINS, METRICS, ece_bin
from rerank.report.plot_style import styles
from specrank.statistics.laws import law_columns

ACCEPTANCE_RELIABILITY_COLUMNS = [
    "law", "target_temperature", "candidates", "estimator", "by", "group", "bin_low",
    "bin_high", "count", "mean_prediction", "mean_event", "mean_exact",
]  # fmt: skip
RELIABILITY_TICKS = (0.0, 0.25, 0.5, 0.75, 1.0)
# drawn in the reliability figures when present (the reference reranker first)
SHOWN = ("draft_prob", "iso_q1", "vllm_logit_q", "vllm_online", "dspark_confidence")


def root_entropy_halves(frame: pd.DataFrame) -> np.ndarray:
    """`low` / `high` per candidate: its round's root-row entropy against the median over the
    law's rounds."""
    out = np.empty(len(frame), dtype=object)
    temps, entropy = frame["temperature"].to_numpy(), frame["root_entropy"].to_numpy()
    for t in np.unique(temps):
        at = np.flatnonzero(temps == t)
        per_round = pd.Series(entropy[at], index=frame["order"].to_numpy()[at])
        median = per_round.groupby(level=0).first().median()
        out[at] = np.where(entropy[at] <= median, "low", "high")
    return out


def text_values(column: pd.Series) -> np.ndarray:
    """A string or categorical column as an object array of str (a category's text once)."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        names = np.asarray(column.cat.categories.astype(str), dtype=object)
        return names[column.cat.codes.to_numpy()]
    return column.astype(str).to_numpy(dtype=object)


def _groups(tasks: np.ndarray, halves: np.ndarray) -> tuple[np.ndarray, list[tuple[str, str]]]:
    """[n, 3] group code of each candidate under each grouping (all, task, entropy half) and
    the (by, group) of each code."""
    names, task_code = np.unique(tasks, return_inverse=True)
    keys = [("all", "all"), *(("task", str(t)) for t in names),
            ("entropy_half", "low"), ("entropy_half", "high")]  # fmt: skip
    half = np.where(halves == "low", 1 + len(names), 2 + len(names))
    return np.stack([np.zeros(len(tasks), np.int64), 1 + task_code, half], axis=1), keys


def acceptance_reliability(frame: pd.DataFrame, sets: Sequence[LawSet]) -> pd.DataFrame:
    """Per law, set, estimator, group and bin (module doc): `ACCEPTANCE_RELIABILITY_COLUMNS`."""
    halves_all, tasks_all = root_entropy_halves(frame), text_values(frame["task"])
    edges = np.linspace(0.0, 1.0, ECE_BINS + 1)
    cols: dict[str, list] = {c: [] for c in ACCEPTANCE_RELIABILITY_COLUMNS}
    for ls in sets:
        part = frame.iloc[ls.rows]
        codes, keys = _groups(tasks_all[ls.rows], halves_all[ls.rows])
        size = len(keys) * ECE_BINS
        values = (part["event"].to_numpy(np.float64), law_label(part, ls.temperature))
        head = {**law_columns(ls.temperature), "candidates": ls.candidates,
                "by": np.repeat([k[0] for k in keys], ECE_BINS),
                "group": np.repeat([k[1] for k in keys], ECE_BINS),
                "bin_low": np.tile(edges[:-1], len(keys)),
                "bin_high": np.tile(edges[1:], len(keys))}  # fmt: skip
        for name, pred in ls.preds.items():
            s = np.clip(pred, 0.0, 1.0)
            at = (codes * ECE_BINS + ece_bin(s)[:, None]).ravel()  # each row in its 3 groups
            count = np.bincount(at, minlength=size)
            with np.errstate(invalid="ignore", divide="ignore"):
                means = [np.bincount(at, np.repeat(v, 3), minlength=size) / count
                         for v in (s, *values)]  # fmt: skip
            rec = head | {"estimator": name, "count": count, "mean_prediction": means[0],
                          "mean_event": means[1], "mean_exact": means[2]}  # fmt: skip
            for c, v in rec.items():
                cols[c].append(np.broadcast_to(np.asarray(v, dtype=object if isinstance(v, str)
                                                          else None), (size,)))  # fmt: skip
    return pd.DataFrame({c: np.concatenate(v) if v else [] for c, v in cols.items()})


def shown_estimators(table: pd.DataFrame, reference: str) -> list[str]:
    present = set(table["estimator"])
    return [e for e in (reference, *SHOWN) if e in present]


def _figure(width: float, height: float) -> Figure:
    """A figure outside pyplot with fixed margins: constrained layout and a tight bounding
    box took most of these figures' time (2.5 s of 3.5 at load 3.5 on 2 cores)."""
    return Figure(figsize=(width, height))


def save_figure(fig: Figure, path: object) -> None:
    """As drawn, margins included (no tight bounding box: the margins are fixed)."""
    fig.savefig(path, dpi=110)


def acceptance_reliability_figure(table: pd.DataFrame, reference: str, candidates: str = "top",
                                  title: str = "") -> Figure:  # fmt: skip
    """Mean exact P(X1 = c) against mean prediction per bin, for one candidate set: a row per
    law, a column per group (all, each task, each entropy half), a line per shown estimator."""
    sub = table[table["candidates"] == candidates]
    if sub.empty:
        raise ValueError(f"acceptance reliability table has no rows for candidates={candidates!r}")
    names, laws = shown_estimators(sub, reference), list(dict.fromkeys(sub["law"]))
    style = styles(names)
    groups = list(dict.fromkeys(zip(sub["by"], sub["group"], strict=True)))
    fig = _figure(2.2 * len(groups) + 1.6, 2.2 * len(laws) + 0.9)
    axes = fig.subplots(len(laws), len(groups), squeeze=False, sharex=True, sharey=True)
    fig.subplots_adjust(left=0.07, right=0.86, bottom=0.16, top=0.86, wspace=0.06, hspace=0.3)
    for i, law in enumerate(laws):
        for j, (by, group) in enumerate(groups):
            ax = axes[i][j]
            ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
            cell = sub[(sub["law"] == law) & (sub["by"] == by) & (sub["group"] == group)]
            for name in names:
                r = cell[(cell["estimator"] == name) & (cell["count"] > 0)]
                ax.plot(r["mean_prediction"], r["mean_exact"], ms=3, lw=1.0,
                        label=name if i == j == 0 else None, **style[name].kwargs())  # fmt: skip
            n = int(cell.loc[cell["estimator"] == names[0], "count"].sum()) if names else 0
            ax.set_title(f"{law}: {group} ({n:,})", fontsize=7)
    # shared, few ticks: the tick layout is most of a figure's drawing time
    axes[0][0].set_xticks(RELIABILITY_TICKS, [f"{t:g}" for t in RELIABILITY_TICKS], fontsize=6)
    axes[0][0].set_yticks(RELIABILITY_TICKS, [f"{t:g}" for t in RELIABILITY_TICKS], fontsize=6)
    axes[0][0].set_xlim(0, 1)
    axes[0][0].set_ylim(0, 1)
    fig.supxlabel(f"mean prediction ({ECE_BINS} equal-width bins)", fontsize=8)
    fig.supylabel("mean exact P(X1 = c)", fontsize=8)
    fig.legend(loc="center right", fontsize=7)
    fig.suptitle(title or f"acceptance reliability, {CANDIDATE_SETS[candidates]}: by task and "
                 f"by root-row entropy half", fontsize=9)  # fmt: skip
    return fig


def advantage_figure(table: pd.DataFrame, label: str = "event", title: str = "") -> Figure:
    """The reference's advantage over each estimator with its 95% paired interval, a panel
    per metric, the laws and candidate sets stacked (> 0: the reference is better)."""
    sub = table[(table["label"] == label) & (table["estimator"] != table["reference"])]
    cells = list(dict.fromkeys(zip(sub["law"], sub["candidates"], sub["estimator"], strict=True)))
    metrics = [m for m in METRICS if m in set(sub["metric"])]
    fig = _figure(2.6 * len(metrics) + 1.8, 0.16 * len(cells) + 1.2)
    axes = fig.subplots(1, len(metrics), squeeze=False, sharey=True)[0]
    fig.subplots_adjust(left=0.2, right=0.98, bottom=0.6 / (0.16 * len(cells) + 1.2),
                        top=1 - 0.55 / (0.16 * len(cells) + 1.2), wspace=0.08)  # fmt: skip
    y = np.arange(len(cells))
    index = pd.MultiIndex.from_tuples(cells)
    for ax, metric in zip(axes, metrics, strict=True):
        r = sub[sub["metric"] == metric].set_index(["law", "candidates", "estimator"])
        r = r.reindex(index)
        x = r["advantage"].to_numpy(float)
        err = np.clip([x - r["advantage_lo"].to_numpy(float),
                       r["advantage_hi"].to_numpy(float) - x], 0, None)  # fmt: skip
        ax.errorbar(x, y, xerr=np.nan_to_num(err), fmt="o", ms=2.5, lw=0.9, color="#0072B2")
        ax.axvline(0, color="black", lw=0.8)
        for k in range(1, len(cells)):
            if cells[k][:2] != cells[k - 1][:2]:
                ax.axhline(k - 0.5, color="grey", lw=0.5)
        ax.set_title(f"{metric} ({label})", fontsize=8)
        ax.tick_params(axis="x", labelsize=6)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, [f"{law}, {c}: {e}" for law, c, e in cells], fontsize=6)
    axes[0].set_ylim(len(cells) - 0.5, -0.5)
    ref = table["reference"].iloc[0] if len(table) else ""
    fig.suptitle(title or f"{ref}'s advantage over each estimator (> 0: {ref} better), "
                 f"95% paired prompt bootstrap", fontsize=9)  # fmt: skip
    return fig

"""Side-by-side tables of logged runs: pure reshaping of what `rerank.report.runs` read.

    tables = runs.load_runs(found, uri)                   # {"summary": ..., "breakdowns": ...}
    side_by_side(tables["summary"], "gain")              # rules x runs, "+12.3% [+8.1, +16.0]"

Nothing here touches MLflow or recomputes a result.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from rerank.config import DEFAULT_BUDGETS
from rerank.report.acceptance import acceptance_cell
from rerank.report.runs import ENV_BUDGETS, ENV_RULES, long_breakdowns


def rule_order(summary: pd.DataFrame) -> list[str]:
    """Rules in the order the job logged them (draft first), across runs."""
    return list(dict.fromkeys(summary["rule"]))


def select_rules(summary: pd.DataFrame, wanted: Sequence[str] = ()) -> list[str]:
    """Rules to plot: `wanted` (checked against the logged rules), else every rule but draft."""
    logged = rule_order(summary)
    unknown = [r for r in wanted if r not in logged]
    if unknown:
        raise ValueError(f"{ENV_RULES}: rules {unknown} were not logged; logged rules: {logged}")
    return list(wanted) if wanted else [r for r in logged if r != "draft"]


def headline_budgets(summary: pd.DataFrame, wanted: Sequence[int] = ()) -> list[int]:
    """Budgets of the side-by-side tables: `wanted` (checked), else the default
    budgets that were logged (B=8 and B=59), else every logged budget."""
    logged = sorted(int(b) for b in summary["budget"].unique())
    unknown = [b for b in wanted if b not in logged]
    if unknown:
        raise ValueError(f"{ENV_BUDGETS}: budgets {unknown} were not logged; logged: {logged}")
    if wanted:
        return sorted(set(wanted))
    return [b for b in logged if b in DEFAULT_BUDGETS] or logged


def law_order(summary: pd.DataFrame) -> list[str]:
    """Decoding laws in logged order (greedy before sampling)."""
    return list(dict.fromkeys(summary["law"]))


def format_interval(estimate: float, low: float, high: float, percent: bool = True) -> str:
    """`+12.3% [+8.1, +16.0]`; empty for an undefined value (e.g. a share with no advantage)."""
    if not np.isfinite(estimate):
        return ""
    s = 100.0 if percent else 1.0
    unit = "%" if percent else ""
    return f"{s * estimate:+.1f}{unit} [{s * low:+.1f}, {s * high:+.1f}]"


def side_by_side(
    summary: pd.DataFrame,
    value: str = "gain",
    weighting: str = "round",
    budgets: Sequence[int] | None = None,
) -> pd.DataFrame:
    """`value` with its 95% interval per rule, runs side by side: index (law, rule), columns (budget, run).

    `value` is a column with `_lo`/`_hi` partners in `tables/summary.csv`:
    gain, emitted_gain, share_root or share_oracle.
    """
    for col in (value, f"{value}_lo", f"{value}_hi"):
        if col not in summary.columns:
            raise KeyError(
                f"value={value!r}: summary has no column {col!r}; columns: {list(summary.columns)}"
            )
    sub = summary[summary["weighting"] == weighting]
    if sub.empty:
        raise ValueError(
            f"weighting={weighting!r}: no such rows; found {sorted(summary['weighting'].unique())}"
        )
    if budgets is not None:
        sub = sub[sub["budget"].isin(list(budgets))]
    text = [
        format_interval(v, lo, hi)
        for v, lo, hi in zip(sub[value], sub[f"{value}_lo"], sub[f"{value}_hi"], strict=True)
    ]
    sub = sub.assign(
        text=text,
        law=pd.Categorical(sub["law"], law_order(summary), ordered=True),
        rule=pd.Categorical(sub["rule"], rule_order(summary), ordered=True),
    )
    table = sub.pivot_table(
        index=["law", "rule"],
        columns=["budget", "run"],
        values="text",
        aggfunc="first",
        observed=True,
    )
    return table.fillna("")


def group_gains(breakdowns: pd.DataFrame) -> pd.DataFrame:
    """The logged breakdown means (long, or a wide table of a run logged before) with the
    gain over draft selection in each group.

    Columns: [run,] law, [target_temperature (runs logged since it is a column),] by, group,
    rounds, rule, budget, accepted, gain
    (gain = rule / draft - 1 within the group, as in the summary's point estimate).
    """
    keys = [c for c in ("run", "law", "target_temperature", "by", "group", "rounds")
            if c in breakdowns.columns]  # fmt: skip
    long = long_breakdowns(breakdowns).dropna(subset=["accepted"])
    draft = long[long["rule"] == "draft"].rename(columns={"accepted": "draft"})
    draft = draft.drop(columns=["rule", "rounds"])
    on = [c for c in (*keys, "budget") if c != "rounds"]
    if draft.empty:
        raise KeyError("breakdowns have no draft rows: gains are relative to draft selection")
    long = long.merge(draft, on=on, how="left", validate="many_to_one")
    long["gain"] = long["accepted"] / long["draft"] - 1.0
    return long.drop(columns="draft")


def unify_pair_rules(comparisons: pd.DataFrame, kinds: dict[str, str]) -> pd.DataFrame:
    """Name the learned rules of `comparisons.a` / `.b` `base` / `rows`, as the summary's are.

    `kinds` maps each run label to its model kind (`find_runs`' `run` and
    `rerank_model`), so `rows_hgb` of one run and `rows_lgbm` of another line up.
    """
    out = comparisons.copy()
    for col in ("a", "b"):
        out[col] = [
            rule.removesuffix(f"_{kinds[str(run)]}")
            if rule in {f"{s}_{kinds[str(run)]}" for s in ("base", "rows")}
            else rule
            for run, rule in zip(out["run"], out[col], strict=True)
        ]
    return out


def acceptance_side_by_side(table: pd.DataFrame, metric: str = "auroc",
                            label: str = "event") -> pd.DataFrame:  # fmt: skip
    """One acceptance figure (`tables/acceptance.csv`: `metric` against `label`) per estimator,
    runs side by side: index (law, candidates, estimator), a column per run; each cell as the
    run printed it, with its reference's paired advantage (`rerank.report.acceptance`)."""
    sub = table[(table["metric"] == metric) & (table["label"] == label)]
    if sub.empty:
        found = sorted(set(zip(table["metric"], table["label"], strict=True)))
        raise ValueError(f"no acceptance figures for metric={metric!r}, label={label!r}; "
                         f"found {found}")  # fmt: skip
    text = [acceptance_cell(r) for _, r in sub.iterrows()]
    sub = sub.assign(text=text, estimator=pd.Categorical(
        sub["estimator"], list(dict.fromkeys(sub["estimator"])), ordered=True))  # fmt: skip
    return sub.pivot_table(index=["law", "candidates", "estimator"], columns="run",
                           values="text", aggfunc="first", observed=True).fillna("")  # fmt: skip

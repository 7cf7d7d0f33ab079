"""Breakdowns of rule values (docs/method.md#reporting): by task, source category, entropy quintile, first-token match.

`breakdowns` gives the round-weighted mean values per group (a long table: one row per
law, grouping, group, rule and budget); `breakdown_gains` the gain of every rule over draft selection inside
each group with a 95% paired prompt-bootstrap interval (the prompts that have
rounds in the group are resampled, each with all of its rounds in the group).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from rerank.report.summary import budget_rows, value_columns
from selection.rules import budgets_of, parse_value_key
from specrank.statistics.bootstrap import (
    DEFAULT_RESAMPLES,
    PromptSums,
    resample_weights,
    weighted_means,
)
from specrank.statistics.laws import law_columns

GROUPINGS = ("task", "category", "entropy_quintile", "draft_top_is_argmax")


def _grouped(frame: pd.DataFrame, columns: list[str]):
    """(temperature, by, group, the group's rounds of `columns`) over every law and grouping.

    Each group's rounds are taken from the whole table by position, the grouping done on
    the law's keys alone, with no copy of each law's rows (all of the per-round table's
    columns) beside each group's: at 10x the breakdown gains peaked 0.8 GiB lower. The
    groups, their order and their rows' order are `groupby`'s, on the law's rows as before.
    Only `columns` are taken: at 10x the breakdown gains then peaked 11.06 GiB, not 11.45.
    """
    at = [frame.columns.get_loc(c) for c in columns]
    for temperature, law in sorted(frame.groupby("temperature").indices.items()):
        keys = frame[[g for g in GROUPINGS if g != "entropy_quintile"]].iloc[law]
        keys = keys.reset_index(drop=True)  # a group's index: positions among the law's rows
        keys["entropy_quintile"] = (
            pd.qcut(frame["root_entropy"].iloc[law].rank(method="first"), 5, labels=False) + 1
        ).to_numpy()
        for by in GROUPINGS:
            for group, members in keys.groupby(by):
                yield temperature, by, group, frame.iloc[law[members.index.to_numpy()], at]


def breakdowns(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean values per group: one row per law, grouping, group, rule and budget.

    Columns: law, target_temperature, by, group, rounds, rule, budget, accepted (the
    round-weighted mean of the rule's value in the group's rounds).
    """
    cols = value_columns(frame)
    keys = [parse_value_key(c) for c in cols]
    rows = []
    for temperature, by, group, sub in _grouped(frame, cols):
        head = {**law_columns(temperature), "by": by, "group": str(group), "rounds": len(sub)}
        means = sub.mean().to_numpy()
        rows += [head | {"rule": r, "budget": b, "accepted": float(m)}
                 for (r, b), m in zip(keys, means, strict=True)]  # fmt: skip
    return pd.DataFrame(rows, columns=BREAKDOWN_COLUMNS)


BREAKDOWN_COLUMNS = ["law", "target_temperature", "by", "group", "rounds", "rule", "budget",
                     "accepted"]  # fmt: skip


def breakdown_gains(
    frame: pd.DataFrame, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0
) -> pd.DataFrame:
    """Long table: law, by, group, rounds, prompts, rule, budget, accepted, gain [95% CI]."""
    cols = value_columns(frame)
    budgets = budgets_of(cols)
    rows = []
    for temperature, by, group, sub in _grouped(frame, ["prompt_id", "task", *cols]):
        stats = PromptSums.from_rounds(sub, cols)
        weights = resample_weights(len(stats.prompts), n_resamples, seed)
        point = weighted_means(stats, "round", None)[0]
        draws = weighted_means(stats, "round", weights)
        head = {**law_columns(temperature), "by": by, "group": str(group),
                "rounds": int(stats.rounds.sum()), "prompts": len(stats.prompts)}  # fmt: skip
        for b in budgets:
            # a small group can hold resamples where draft accepts nothing: gain undefined (NaN)
            with np.errstate(divide="ignore", invalid="ignore"):
                recs = budget_rows(point, draws, cols, b)
            for rec in recs:
                keep = ("rule", "accepted", "gain", "gain_lo", "gain_hi", "gain_nonfinite",
                        "gain_note")  # fmt: skip
                rows.append(head | {"budget": b} | {k: rec[k] for k in keep})
    out = pd.DataFrame(rows)
    return out[~np.isnan(out["accepted"])] if len(out) else out

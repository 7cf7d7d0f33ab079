"""Which budget's recording a table's features came from.

Offline values at every budget are computed on the rounds of one recording: its round
contexts, `prev_accepted` and `tokens_before`, and the retained rows (same-token row,
token-keyed cache writes, token-only rows) all come from the trees the recording verified,
at its `select.budget`. A decoder at another budget builds them from its own trees. So
every evaluation table names the recorded budget of its law beside its `budget` column
(`recorded_budget`; "8,59" for a store mixing recordings), and the printed table says it.
"""

from __future__ import annotations

import pandas as pd
import pyarrow.compute as pc
import pyarrow.dataset as ds

from rerank.evaluate.policy import with_scored_prefixes
from specrank.statistics.laws import law_name, pair_label

RECORDED = "recorded_budget"
PAIR = "pair"  # the paper's T_t|T_d of each row's law


def recorded_budgets(dataset: ds.Dataset) -> dict[str, str]:
    """Law name -> the budget(s) its rounds were recorded at, ascending, comma-joined."""
    table = dataset.to_table(columns=["temperature", "budget"])
    pairs = pc.unique(pc.binary_join_element_wise(
        pc.cast(table["temperature"], "string"), pc.cast(table["budget"], "string"), "|"
    ))  # fmt: skip
    out: dict[str, set[int]] = {}
    for pair in pairs.to_pylist():
        t, b = pair.split("|")
        out.setdefault(law_name(float(t)), set()).add(int(b))
    return {law: ",".join(str(b) for b in sorted(bs)) for law, bs in out.items()}


def with_recorded_budget(frame: pd.DataFrame, budgets: dict[str, str]) -> pd.DataFrame:
    """`frame` with the recorded budget of each row's law beside its law columns; a frame
    without a `law` column is returned as it is."""
    if "law" not in frame or RECORDED in frame:
        return frame
    at = list(frame.columns).index("target_temperature" if "target_temperature" in frame else "law")
    out = frame.copy()
    out.insert(at + 1, RECORDED, out["law"].map(budgets))
    return out


def with_pair(frame: pd.DataFrame, draft_temperature: float | None) -> pd.DataFrame:
    """`frame` with each row's temperature pair T_t|T_d beside its target temperature; a
    frame without that column is returned as it is."""
    if "target_temperature" not in frame or PAIR in frame:
        return frame
    out = frame.copy()
    out.insert(list(frame.columns).index("target_temperature") + 1, PAIR,
               [pair_label(t, draft_temperature) for t in out["target_temperature"]])  # fmt: skip
    return out


def store_draft_temperature(manifest: dict) -> float | None:
    """The drafter temperature a trace store was recorded at (absent: null, today's drafting)."""
    return manifest.get("config", {}).get("decode", {}).get("draft_temperature")


def labelled_table(table: pd.DataFrame, recorded: dict[str, str], per_round: pd.DataFrame,
                   draft_temperature: float | None = None) -> pd.DataFrame:  # fmt: skip
    """`table` naming the budget its rounds were recorded at (`with_recorded_budget`), its
    laws' temperature pairs (`with_pair`) and, per rule, the prefixes its pass scores under
    the policy (`with_scored_prefixes`)."""
    table = with_pair(with_recorded_budget(table, recorded), draft_temperature)
    return with_scored_prefixes(table, per_round)

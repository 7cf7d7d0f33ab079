"""Paired comparisons between two rules (docs/method.md#reporting): claims such as "Rows beats Base".

Two overlapping "vs draft" intervals say nothing about the difference between
two rules; the difference needs its own interval. For each pair `a:b`, law,
budget and weighting, the relative gain of a over b in expected accepted tokens
(`V_a / V_b - 1`) and in emitted tokens (`(V_a - V_b) / (V_b + 1)`), with a 95%
percentile interval over the same paired prompt resamples as every other figure
of the run (`rerank.summary.LawDraws`).
"""

from __future__ import annotations

import pandas as pd

from features.registry import FEATURE_SET_TREE
from rerank.fit.models import FEATURE_SETS
from rerank.report.summary import LawDraws
from selection.rules import RULES
from specrank.statistics.bootstrap import ci_text, emitted_gain, percentile_interval, relative_gain
from specrank.statistics.laws import law_columns

# The default comparisons (rule_a:rule_b), from the registries' `compare` entries: the
# paper's claims, what each richer feature set adds over its parent, and every learned rule
# and calibrator against the draft-rank control (what it adds beyond re-calibrating the
# draft order). A feature set names the run's reranker of that set.
DEFAULT_COMPARISONS = [f"{s.name}:{b}" for s in FEATURE_SET_TREE for b in s.compare] + [
    f"{r.name}:{b}" for r in RULES.values() for b in r.compare
]


def parse_comparisons(pairs: list[str], learned_kind: str) -> list[tuple[str, str]]:
    """`["rows:base", ...]` -> `[("rows_hgb", "base_hgb"), ...]`, each checked for its form.

    A learned feature set (`base`, `rows`) names the run's reranker of that set
    (`<set>_<model kind>`); every other name is a rule of the summary as it is.
    """
    out = []
    for pair in pairs:
        a, sep, b = str(pair).partition(":")
        if not sep or not a or not b or ":" in b:
            raise ValueError(
                f"The 'rerank.comparisons' entries must read 'rule_a:rule_b'. Got {pair!r} instead."
            )
        out.append(tuple(f"{r}_{learned_kind}" if r in FEATURE_SETS else r for r in (a, b)))
    return out


def check_comparisons(pairs: list[tuple[str, str]], rules: set[str]) -> None:
    """Refuse a comparison of a rule this run does not evaluate, listing the run's rules."""
    unknown = sorted({r for pair in pairs for r in pair} - rules)
    if unknown:
        raise ValueError(
            f"The 'rerank.comparisons' name rules this run does not evaluate: {unknown}; "
            f"its rules are {sorted(rules)}"
        )


def run_comparisons(configured: list[str] | None, learned_kind: str,
                    rules: set[str]) -> list[tuple[str, str]]:  # fmt: skip
    """A run's paired comparisons: the `configured` ones (each must name two of the run's
    `rules`), or, when None, the paper's (`DEFAULT_COMPARISONS`) among its `rules`."""
    if configured is None:
        pairs = parse_comparisons(DEFAULT_COMPARISONS, learned_kind)
        return [p for p in pairs if set(p) <= rules]
    pairs = parse_comparisons(configured, learned_kind)
    check_comparisons(pairs, rules)
    return pairs


def compare(draws: list[LawDraws], pairs: list[tuple[str, str]]) -> pd.DataFrame:
    """One row per (law, budget, weighting, a, b): gains of a over b with paired intervals."""
    rows = []
    for d in draws:
        for budget in d.budgets:
            for a, b in pairs:
                va, vb = d.column(a, budget), d.column(b, budget)
                if va is None or vb is None:
                    continue  # e.g. pearl_matched without curves: nothing to compare
                rec = {**law_columns(d.temperature), "budget": budget, "weighting": d.weighting,
                       "a": a, "b": b, "rounds": d.rounds, "prompts": d.prompts,
                       "accepted_a": va[0], "accepted_b": vb[0]}  # fmt: skip
                for key, fn in (("gain", relative_gain), ("emitted_gain", emitted_gain)):
                    rec |= percentile_interval(float(fn(va[0], vb[0])), fn(va[1], vb[1])).columns(
                        key
                    )
                rows.append(rec)
    columns = ["law", "target_temperature", "budget", "weighting", "a", "b", "rounds", "prompts",
               "accepted_a", "accepted_b"] + [f"{k}{x}" for k in ("gain", "emitted_gain")
                                for x in ("", "_lo", "_hi", "_nonfinite", "_note")]  # fmt: skip
    return pd.DataFrame(rows, columns=columns)


def comparisons_table(comparisons: pd.DataFrame, weighting: str = "round") -> str:
    """The paired comparisons, printed after the main results table."""
    sub = comparisons[comparisons["weighting"] == weighting]
    lines = []
    for law, part in sub.groupby("law", sort=False):
        budgets = sorted(part["budget"].unique())
        header = f"{'a vs b':<32}" + "".join(f"{'B=' + str(b) + ' gain of a over b [95% CI]':>36}"
                                             for b in budgets)  # fmt: skip
        lines += [f"\n== {law}: paired comparisons ({weighting}-weighted) ==", header,
                  "-" * len(header)]  # fmt: skip
        notes = []
        for (a, b), pair in part.groupby(["a", "b"], sort=False):
            line = f"{a + ' vs ' + b:<32}"
            for budget in budgets:
                r = pair[pair["budget"] == budget]
                if r.empty:
                    line += " " * 36
                    continue
                r = r.iloc[0]
                line += f"{ci_text(r['gain'], r['gain_lo'], r['gain_hi']):>36}"
                if isinstance(r.get("gain_note"), str) and r["gain_note"]:
                    notes.append(f"  {a} vs {b} at B={budget}: no interval, {r['gain_note']}")
            lines.append(line)
        lines += notes
    return "\n".join(lines)

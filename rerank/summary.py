"""From per-round rule values to the published numbers (SPEC §9).

Input: the per-round table of `rerank.evaluate` (plus a `fold` column). For
each decoding law (greedy and sampling are never pooled) and budget:
expected accepted tokens, emitted tokens (accepted + continuation), gains over
draft selection with paired prompt-bootstrap intervals (round-, prompt- and
task-weighted), and the shares of the root gain and the oracle advantage each
rule recovers. Geometric mixtures pick their weight on the *other* half of the
prompts, per budget, before anything is summarised.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from rerank.bootstrap import (
    WEIGHTINGS,
    PromptSums,
    bootstrap_means,
    emitted_gain,
    percentile_interval,
    relative_gain,
    share_recovered,
)

_MIX = re.compile(r"^mix_(?P<row>[a-z]+)_w(?P<w>[0-9.]+)@B(?P<b>\d+)$")


def law_of(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"T={temperature:g}"


def value_columns(frame: pd.DataFrame) -> list[str]:
    return [c for c in frame.columns if "@B" in c and not c.startswith("size/")]


def choose_mixture_weights(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Replace `mix_<row>_w<w>@B<b>` columns by `mix_<row>@B<b>` with w chosen on the other half.

    For rounds of fold f, w maximises the round-weighted mean value over the
    rounds of fold 1-f (same law and budget). Returns the new frame and the
    chosen weights (law, budget, row, fold, w).
    """
    if "fold" not in frame:
        raise KeyError(
            "the per-round table needs a 'fold' column (prompt half) to pick mixture weights"
        )
    groups: dict[tuple[str, int], dict[float, str]] = {}
    for col in frame.columns:
        m = _MIX.match(col)
        if m:
            groups.setdefault((m["row"], int(m["b"])), {})[float(m["w"])] = col
    out = frame.copy()
    chosen = []
    for (row, b), by_w in groups.items():
        name = f"mix_{row}@B{b}"
        out[name] = np.nan
        for temperature, part in frame.groupby("temperature"):
            for fold in (0, 1):
                other = part[part["fold"] == 1 - fold]
                if other.empty:
                    raise ValueError(
                        f"fold {1 - fold} has no rounds at T={temperature}: cannot pick w"
                    )
                best_w = max(by_w, key=lambda w: (other[by_w[w]].mean(), -w))
                target = part.index[part["fold"] == fold]
                out.loc[target, name] = frame.loc[target, by_w[best_w]]
                chosen.append(
                    {"law": law_of(temperature), "budget": b, "row": row, "fold": fold, "w": best_w}
                )
        out = out.drop(columns=list(by_w.values()))
    return out, pd.DataFrame(chosen)


def summarise(
    frame: pd.DataFrame,
    n_resamples: int = 2000,
    seed: int = 0,
    weightings: tuple[str, ...] = WEIGHTINGS,
) -> pd.DataFrame:
    """One row per (law, budget, weighting, rule) with values, gains, shares and 95% intervals."""
    rows = []
    for temperature, part in frame.groupby("temperature"):
        cols = value_columns(part)
        stats = PromptSums.from_rounds(part, cols)
        budgets = sorted({int(c.split("@B")[1]) for c in cols})
        for weighting in weightings:
            point, draws = bootstrap_means(stats, weighting, n_resamples, seed)
            index = {c: i for i, c in enumerate(cols)}
            for b in budgets:

                def col(rule: str, b: int = b) -> tuple[float, np.ndarray]:
                    i = index[f"{rule}@B{b}"]
                    return point[i], draws[:, i]

                base, base_d = col("draft")
                root, root_d = col("root") if f"root@B{b}" in index else (np.nan, None)
                orac, orac_d = col("oracle") if f"oracle@B{b}" in index else (np.nan, None)
                for c in cols:
                    rule, cb = c.split("@B")
                    if int(cb) != b:
                        continue
                    v, v_d = col(rule)
                    rec = {
                        "law": law_of(temperature),
                        "budget": b,
                        "weighting": weighting,
                        "rule": rule,
                        "rounds": int(stats.rounds.sum()),
                        "prompts": len(stats.prompts),
                        "accepted": v,
                        "emitted": v + 1.0,
                    }
                    for key, stat, draw in (
                        ("gain", relative_gain(v, base), relative_gain(v_d, base_d)),
                        ("emitted_gain", emitted_gain(v, base), emitted_gain(v_d, base_d)),
                    ):
                        iv = percentile_interval(stat, draw)
                        rec |= {key: iv.estimate, f"{key}_lo": iv.low, f"{key}_hi": iv.high}
                    for key, top, top_d in (
                        ("share_root", root, root_d),
                        ("share_oracle", orac, orac_d),
                    ):
                        if top_d is None:
                            continue
                        iv = percentile_interval(
                            float(share_recovered(np.array(v), np.array(base), np.array(top))),
                            share_recovered(v_d, base_d, top_d),
                        )
                        rec |= {key: iv.estimate, f"{key}_lo": iv.low, f"{key}_hi": iv.high}
                    rows.append(rec)
    return pd.DataFrame(rows)


def breakdowns(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean values by task, root-row entropy quintile and drafter/target first-token match."""
    cols = value_columns(frame)
    parts = []
    for temperature, part in frame.groupby("temperature"):
        part = part.copy()
        part["entropy_quintile"] = (
            pd.qcut(part["root_entropy"].rank(method="first"), 5, labels=False) + 1
        )
        for by in ("task", "entropy_quintile", "draft_top_is_argmax"):
            g = part.groupby(by)
            table = g[cols].mean()
            table.insert(0, "rounds", g.size())
            table = table.reset_index().rename(columns={by: "group"})
            table.insert(0, "by", by)
            table.insert(0, "law", law_of(temperature))
            table["group"] = table["group"].astype(str)
            parts.append(table)
    return pd.concat(parts, ignore_index=True)


def results_table(summary: pd.DataFrame, weighting: str = "round") -> str:
    """The at-a-glance table printed at the end of every run."""
    lines = []
    sub = summary[summary["weighting"] == weighting]
    for law, part in sub.groupby("law", sort=False):
        budgets = sorted(part["budget"].unique())
        header = f"{'rule':<16}" + "".join(
            f"{'B=' + str(b) + ' accepted':>16}{'gain vs draft [95% CI]':>30}{'root share':>12}"
            for b in budgets
        )
        lines += [f"\n== {law}: {part['rounds'].iloc[0]:,} rounds, {part['prompts'].iloc[0]} prompts "
                  f"({weighting}-weighted) ==", header, "-" * len(header)]  # fmt: skip
        for rule in part["rule"].unique():
            line = f"{rule:<16}"
            for b in budgets:
                r = part[(part["rule"] == rule) & (part["budget"] == b)]
                if r.empty:
                    line += " " * 58
                    continue
                r = r.iloc[0]
                ci = f"{100 * r['gain']:+6.1f}% [{100 * r['gain_lo']:+.1f}, {100 * r['gain_hi']:+.1f}]"
                share = r.get("share_root", np.nan)
                line += f"{r['accepted']:>16.3f}{ci:>30}{'' if np.isnan(share) else f'{100 * share:.0f}%':>12}"
            lines.append(line)
    return "\n".join(lines)

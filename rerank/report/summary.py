"""From per-round rule values to the published numbers (docs/method.md#reporting).

Input: the per-round table of `rerank.evaluate.values` (plus a `fold` column). For
each decoding law (greedy and sampling are never pooled) and budget:
expected accepted tokens, emitted tokens (accepted + continuation), gains over
draft selection with paired prompt-bootstrap intervals (round-, prompt- and
task-weighted), and the shares of the root gain and the oracle advantage each
rule recovers. Geometric mixtures pick their weight on the *other* half of the
prompts, per budget, before anything is summarised.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import pandas as pd

from rerank.evaluate.curves import PromptCurves
from rerank.evaluate.recorded import PAIR, RECORDED
from selection.rules import (
    BASELINE,
    PEARL,
    PEARL_MATCHED,
    ROOT_DRAW,
    SHARE_TOPS,
    budgets_of,
    mixture,
    parse_value_key,
    value_key,
)
from selection.rules import rule as rule_entry
from specrank.statistics.bootstrap import (
    DEFAULT_RESAMPLES,
    WEIGHTINGS,
    PromptSums,
    bootstrap_weights,
    ci_text,
    emitted_gain,
    fill_notes,
    percentile_interval,
    relative_gain,
    share_recovered,
    weighted_means,
)
from specrank.statistics.laws import law_columns


def value_columns(frame: pd.DataFrame) -> list[str]:
    """The per-round table's rule-value columns (`selection.rules.value_key`), without the
    per-rule auxiliaries (`size/`, `held/`, `scored/`, `<kind>/<rule>@B<b>`)."""
    return [c for c in frame.columns if (p := parse_value_key(c)) and "/" not in p[0]]


def _weighted_mixture(col: str) -> tuple[str, float, int] | None:
    """(row, weight, budget) of a per-weight mixture column `mix_<row>_w<w>@B<b>`, else None."""
    parsed = parse_value_key(col)
    if parsed is None or not parsed[0].startswith("mix_"):
        return None
    params = rule_entry(parsed[0]).params
    return (params["row"], float(params["weight"]), parsed[1]) if "weight" in params else None


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
        if (m := _weighted_mixture(col)) is not None:
            groups.setdefault((m[0], m[2]), {})[m[1]] = col
    new_cols: dict[str, np.ndarray] = {}
    chosen = []
    # each law and half as row positions: a column's values are taken where needed, with no
    # copy of the table's rows per law and half
    temps, halves = frame["temperature"].to_numpy(), frame["fold"].to_numpy()
    for (row, b), by_w in groups.items():
        values = np.full(len(frame), np.nan)
        for temperature in np.unique(temps):
            law = temps == temperature
            for fold in (0, 1):
                other = np.flatnonzero(law & (halves == 1 - fold))
                if not len(other):
                    raise ValueError(
                        f"fold {1 - fold} has no rounds at T={temperature}: cannot pick w"
                    )
                means = {w: pd.Series(frame[c].to_numpy()[other]).mean() for w, c in by_w.items()}
                best_w = max(by_w, key=lambda w: (means[w], -w))
                target = np.flatnonzero(law & (halves == fold))
                values[target] = frame[by_w[best_w]].to_numpy()[target]
                chosen.append(
                    {
                        **law_columns(temperature),
                        "budget": b,
                        "row": row,
                        "fold": fold,
                        "w": best_w,
                    }
                )
        new_cols[value_key(mixture(row).name, b)] = values
    dropped = [c for by_w in groups.values() for c in by_w.values()]
    # one concat instead of column-by-column inserts (pandas warns about fragmentation); with
    # copy-on-write neither the drop nor the concat copies the kept columns
    out = pd.concat(
        [frame.drop(columns=dropped), pd.DataFrame(new_cols, index=frame.index)], axis=1
    )
    return out, pd.DataFrame(chosen)


def _with_interval(rec: dict, key: str, point: float, draws: np.ndarray) -> None:
    rec |= percentile_interval(point, draws).columns(key)


def budget_rows(
    point: np.ndarray, draws: np.ndarray, cols: list[str], budget: int
) -> list[dict[str, float | str]]:
    """Values, gains and shares of every rule at one budget (one law, one weighting)."""
    index = {c: i for i, c in enumerate(cols)}

    def col(rule: str) -> tuple[np.ndarray, np.ndarray] | None:
        i = index.get(value_key(rule, budget))
        return None if i is None else (np.asarray(point[i]), draws[:, i])

    base = col(BASELINE)
    if base is None:
        raise KeyError(f"no draft values at B={budget}: gains are relative to draft selection")
    tops = {key: col(top) for key, top in SHARE_TOPS.items()}
    rows = []
    for c in cols:
        rule, b = parse_value_key(c)
        if b != budget:
            continue
        v, v_d = col(rule)
        rec: dict[str, float | str] = {
            "rule": rule,
            "accepted": float(v),
            "emitted": float(v) + 1.0,
        }
        _with_interval(rec, "gain", relative_gain(v, base[0]), relative_gain(v_d, base[1]))
        _with_interval(rec, "emitted_gain", emitted_gain(v, base[0]), emitted_gain(v_d, base[1]))
        for key, top in tops.items():
            if top is not None:
                share = share_recovered(v, base[0], top[0])
                _with_interval(rec, key, float(share), share_recovered(v_d, base[1], top[1]))
        rows.append(rec)
    return rows


def matched_pearl(
    value_curve: np.ndarray, size_curve: np.ndarray, target: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """PEARL at the pre-draw budget whose mean tree size equals `target`, per row.

    value/size curves [n, P]: PEARL's mean value and mean tree size at pre-draw
    budgets 1..P (one row per bootstrap resample, under any weighting); target [n].
    The budget mixes the two nearest whole budgets (paper App. D.2); the matching
    is repeated in every resample. Returns (value, fractional budget) per row; NaN
    where even the whole pool is smaller than the target.
    """
    size, value = size_curve, value_curve  # size is non-decreasing in the budget
    hi = np.array([np.searchsorted(row, t) for row, t in zip(size, target, strict=True)])
    reachable = hi < size.shape[1]
    hi = np.clip(hi, 1, size.shape[1] - 1)
    lo = hi - 1
    r = np.arange(len(target))
    span = size[r, hi] - size[r, lo]
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.where(span > 0, (size[r, hi] - target) / span, 1.0)  # weight of budget lo
    w = np.clip(w, 0.0, 1.0)
    out = w * value[r, lo] + (1 - w) * value[r, hi]
    budget = w * (lo + 1) + (1 - w) * (hi + 1)
    return np.where(reachable, out, np.nan), np.where(reachable, budget, np.nan)


def node_equivalent_budget(draft_curve: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Smallest budget at which draft selection's mean value reaches `value`, per row.

    draft_curve [n, P]: mean draft value at budgets 1..P (non-decreasing), e.g. one
    row per bootstrap resample; value [n]. NaN where even the whole pool under draft
    selection stays below `value` (docs/method.md#reporting).
    """
    # a rule equal to draft selection must map to its own budget despite summation order
    slack = 1e-9 * np.maximum(1.0, np.abs(value))
    first = (draft_curve < (value - slack)[:, None]).sum(axis=1)  # = searchsorted, left
    return np.where(first < draft_curve.shape[1], first + 1.0, np.nan)


def _mean_curves(
    curves: PromptCurves,
    name: str,
    *,
    temperature: float,
    stats: PromptSums,
    weighting: str,
    weights: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Point [1, P] and resampled [n_res, P] means of a per-budget curve, as for a value column."""
    sums = curves.array(name, temperature, stats.prompts)
    curve_stats = dataclasses.replace(
        stats, sums=sums, columns=[f"{name}@{j + 1}" for j in range(sums.shape[1])]
    )
    return (
        weighted_means(curve_stats, weighting, None),
        weighted_means(curve_stats, weighting, weights),
    )


@dataclass
class LawDraws:
    """One law under one weighting: point and resampled means of every `<rule>@B<b>`.

    Everything reported for the law and weighting (gains, shares, matched PEARL,
    node-equivalent budgets, paired comparisons) is computed from these, so all of
    it comes from the same resamples.
    """

    temperature: float
    weighting: str
    names: list[str]  # value keys (`selection.rules.value_key`)
    point: np.ndarray  # [n_names]
    draws: np.ndarray  # [n_resamples, n_names]
    rounds: int
    prompts: int
    extra: dict[str, dict[str, float]]  # per name: matched_budget, node budgets

    @property
    def budgets(self) -> list[int]:
        return budgets_of(self.names)

    def column(self, rule: str, budget: int) -> tuple[float, np.ndarray] | None:
        name = value_key(rule, budget)
        if name not in self.names:
            return None
        i = self.names.index(name)
        return float(self.point[i]), self.draws[:, i]


def _node_budgets(curve_p: np.ndarray, curve_d: np.ndarray, point: float,
                  draws: np.ndarray, key: str) -> dict[str, float]:  # fmt: skip
    """The budget at which a mean curve reaches a value, with interval (`Interval.columns`).

    NaN where the curve never reaches it: its note then says "beyond the pool".
    """
    point_budget = node_equivalent_budget(curve_p, np.asarray([point]))[0]
    iv = percentile_interval(point_budget, node_equivalent_budget(curve_d, draws),
                             undefined="beyond the pool")  # fmt: skip
    out = iv.columns(key)
    if not np.isfinite(point_budget):
        out[f"{key}_note"] = "beyond the pool" + (f"; {iv.reason}" if iv.reason else "")
    return out


def law_draws(
    frame: pd.DataFrame,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    weightings: tuple[str, ...] = WEIGHTINGS,
    curves: PromptCurves | None = None,
) -> list[LawDraws]:
    """Point and bootstrap means of every rule, per law and weighting (one weight matrix each).

    With `curves`: `pearl_matched@B<b>` (PEARL with its pre-draw budget raised until
    its mean tree size equals root-draw's), every rule's `node_budget` (the smallest
    budget at which draft selection reaches the rule's value) and, for each rule
    with a curve of its own (root, learned rules), `rule_budget` (the smallest budget
    at which that rule reaches draft selection's value at B; paper Table 13). All
    are found again in every resample, under each weighting.
    """
    # One piece: every derived figure of a weighting must use that weighting's resamples.
    out = []
    cols = value_columns(frame)
    budgets = budgets_of(cols)
    sizes = [value_key(f"size/{ROOT_DRAW}", b) for b in budgets]
    match = curves is not None and PEARL in curves.sums and all(c in frame for c in sizes)
    read = ["prompt_id", "task", *cols, *(sizes if match else [])]
    at = [frame.columns.get_loc(c) for c in read]
    for temperature, law in sorted(frame.groupby("temperature").indices.items()):
        # the law's rows of the columns read, as groupby's part in its row order: a part of
        # every column held the others too (the draws at 10x peaked 10.62 GiB, now 9.70)
        part = frame.iloc[law, at]
        stats = PromptSums.from_rounds(part, read[2:])
        del part
        for weighting in weightings:
            weights = bootstrap_weights(stats, weighting, n_resamples, seed)
            point = weighted_means(stats, weighting, None)[0]
            draws = weighted_means(stats, weighting, weights)
            names, extra = list(cols), {}
            mean_curve = functools.partial(
                _mean_curves, curves, temperature=temperature, stats=stats,
                weighting=weighting, weights=weights,
            )  # fmt: skip
            if match:
                (value_p, value_d), (size_p, size_d) = (
                    mean_curve(PEARL),
                    mean_curve(f"size/{PEARL}"),
                )
                extra_p, extra_d = [], []
                for b in budgets:
                    i = stats.columns.index(value_key(f"size/{ROOT_DRAW}", b))
                    vp, bp = matched_pearl(value_p, size_p, point[i : i + 1])
                    vd, _ = matched_pearl(value_d, size_d, draws[:, i])
                    extra_p.append(vp[0])
                    extra_d.append(vd)
                    names.append(value_key(PEARL_MATCHED, b))
                    extra[value_key(PEARL_MATCHED, b)] = {"matched_budget": float(bp[0])}
                point = np.concatenate([point[: len(cols)], extra_p])
                draws = np.concatenate([draws[:, : len(cols)], np.stack(extra_d, axis=1)], axis=1)
            if curves is not None and BASELINE in curves.sums:
                draft_p, draft_d = mean_curve(BASELINE)
                for i, name in enumerate(names):
                    extra.setdefault(name, {}).update(
                        _node_budgets(draft_p, draft_d, point[i], draws[:, i], "node_budget")
                    )
                own = (r for r in curves.sums if r not in (BASELINE, PEARL, f"size/{PEARL}"))
                for curve_rule in own:
                    rule_p, rule_d = mean_curve(curve_rule)
                    for b in budgets:
                        i = names.index(value_key(BASELINE, b))
                        extra.setdefault(value_key(curve_rule, b), {}).update(
                            _node_budgets(rule_p, rule_d, point[i], draws[:, i], "rule_budget")
                        )
            out.append(LawDraws(float(temperature), weighting, names, point, draws,
                                int(stats.rounds.sum()), len(stats.prompts), extra))  # fmt: skip
    return out


def summarise_draws(draws: list[LawDraws]) -> pd.DataFrame:
    """One row per (law, budget, weighting, rule): values, gains, shares, 95% intervals."""
    out = []
    for d in draws:
        for b in d.budgets:
            for rec in budget_rows(d.point, d.draws, d.names, b):
                rec |= d.extra.get(value_key(rec["rule"], b), {})
                head = {**law_columns(d.temperature), "budget": b, "weighting": d.weighting,
                        "rounds": d.rounds, "prompts": d.prompts}  # fmt: skip
                out.append(head | rec)
    return fill_notes(pd.DataFrame(out))  # a rule without a curve has no rule_budget note


def results_table(summary: pd.DataFrame, weighting: str = "round") -> str:
    """The at-a-glance table printed at the end of every run."""
    lines = []
    sub = summary[summary["weighting"] == weighting]
    # node-equivalent budget: the draft budget that reaches the rule's value ("beyond": the pool)
    node = "node_budget" in sub and bool(sub["node_budget"].notna().any())
    for law, part in sub.groupby("law", sort=False):
        budgets = sorted(part["budget"].unique())
        header = f"{'rule':<16}" + "".join(
            f"{'B=' + str(b) + ' accepted':>16}{'gain vs draft [95% CI]':>30}{'root share':>12}"
            + (f"{'draft B':>9}" if node else "")
            for b in budgets
        )
        source = ""
        if RECORDED in part:  # rerank.evaluate.recorded: what the features came from
            source = f", features from rounds recorded at B={part[RECORDED].iloc[0]}"
        pair = f" (T_t|T_d {part[PAIR].iloc[0]})" if PAIR in part else ""  # the paper's pair
        lines += [f"\n== {law}{pair}: {part['rounds'].iloc[0]:,} rounds, {part['prompts'].iloc[0]} prompts "
                  f"({weighting}-weighted{source}) ==", header, "-" * len(header)]  # fmt: skip
        notes = []
        for rule in part["rule"].unique():
            line = f"{rule:<16}"
            for b in budgets:
                r = part[(part["rule"] == rule) & (part["budget"] == b)]
                if r.empty:
                    line += " " * (67 if node else 58)
                    continue
                r = r.iloc[0]
                ci = ci_text(r["gain"], r["gain_lo"], r["gain_hi"])
                if isinstance(r.get("gain_note"), str) and r["gain_note"]:
                    notes.append(f"  {rule} at B={b}: no gain interval, {r['gain_note']}")
                share = r.get("share_root", np.nan)
                line += f"{r['accepted']:>16.3f}{ci:>30}{'' if np.isnan(share) else f'{100 * share:.0f}%':>12}"
                if node:
                    nb = r.get("node_budget", np.nan)
                    line += f"{'beyond' if np.isnan(nb) else f'{nb:.0f}':>9}"
            lines.append(line)
        if node:
            notes.append("  draft B 'beyond': draft selection does not reach the value in the pool")
        lines += notes
    return "\n".join(lines)

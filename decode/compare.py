"""Several rules in one online run (`run.rules`): who decodes, and the paired comparison.

    python -m decode.run 'run.rules=[draft,reranker:<folder>,root_draw]'

Each entry of `run.rules` is an online rule (`selection.rules.online_rules`) or
`reranker:<folder or MLflow URI>` (bare `reranker` reads `run.reranker`). Every prompt
is decoded by every rule at select.budget and at each of `run.budgets` (rules x
budgets decodes a prompt), the rules in an order rotating with the prompt's position
(`decode.session.arm_order`) and the budgets reversed on odd positions, after `run.warmup_prompts` untimed decodes
of every rule; the target-only baseline once per prompt. So two rules' speeds meet the
machine's load alike. `run.seen_prompts` applies to every reranker of the list: a
prompt any of them was trained on is refused, or skipped for all rules (the rules
stay paired). On Ray a shard's prompts, every rule of each, run on one worker.

Per rule and budget: tokens per pass (tau), tokens/s and stage times (the per-rule
groups tables), and against the first rule the paired prompt-bootstrap intervals of
the ratios of tau and of tokens/s (`paired_ratios`). With run.score=record|pool each
rule's realized value stands beside its offline expected value at the same rounds.
With `run.offline` (the per-round values of a `rerank.train` or `rerank.transfer` run
on a separate recording of the same prompts) each rule's realized tau stands beside the
offline prediction for the same prompts, with realized minus predicted and its paired
interval (`decode.predicted`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from decode.metrics import PromptTiming, prompt_table
from decode.session import RunReport
from selection.rules import online_rules
from selection.rules import rule as rule_entry
from specrank.settings.errors import Refusal
from specrank.statistics.bootstrap import percentile_interval, resample_weights


@dataclass(frozen=True)
class RuleSpec:
    """One rule of the run: its `run.rule` name and, for `reranker`, the model's source."""

    rule: str
    reranker: str | None = None
    # `<rule>@+N` / `<rule>@-N`: decoded at each of the run's budgets + N (or - N), scoring
    # its tree only; at run.score=top_m with +N = run.score_top_m it scores as many prefixes a pass
    # as the others (draft at B + M: the practical baseline of the paper's App. D.10,
    # Theorem 2); `draft@-4` beside draft at B=8 is draft at B=4 in the same run
    extra_budget: int = 0


def _extra_budget(i: int, entry: str, name: str, extra: str) -> int:
    """N of `run.rules[i]` = `<rule>@+N` or `<rule>@-N`, checked: a signed nonzero integer,
    a rule that reads no reranker, not the first rule (the ratios' reference and the
    traces' rule)."""
    ok = extra[:1] in ("+", "-") and extra[1:].isdigit() and int(extra[1:]) > 0
    if not ok or i == 0 or name not in online_rules() or rule_entry(name).predictor:
        raise Refusal(
            f"The 'run.rules[{i}]' with '@' must be <rule>@+N or <rule>@-N (N > 0 nodes more "
            f"or fewer, a rule without a reranker, not the first rule). Got {entry!r} instead."
        )
    return int(extra)


def rule_specs(rules: list[str], rule: str, reranker: str | None) -> list[RuleSpec]:
    """`run.rules` parsed (or `run.rule` alone when empty), every entry checked by name; a
    reranker entry without a model source is refused."""
    if not rules:
        if rule_entry(rule).predictor and not reranker:
            raise Refusal(f"run.rule={rule} needs run.reranker=<folder or MLflow URI>; got none")
        return [RuleSpec(rule, reranker if rule_entry(rule).predictor else None)]
    out = []
    for i, entry in enumerate(rules):
        name, sep, source = str(entry).partition(":")
        name, at, extra = name.partition("@")
        extra_budget = _extra_budget(i, str(entry), name, extra) if at else 0
        predictor = name in online_rules() and rule_entry(name).predictor
        if name not in online_rules() or (sep and not predictor) or (sep and not source):
            raise Refusal(
                f"The 'run.rules[{i}]' must be one of {list(online_rules())} or "
                f"reranker:<folder or MLflow URI>. Got {entry!r} instead."
            )
        if predictor and not source:
            if not reranker:
                raise Refusal(f"run.rules[{i}]=reranker names no model and run.reranker is "
                                 f"unset; write reranker:<folder or MLflow URI>")  # fmt: skip
            source = reranker
        out.append(RuleSpec(name, source or None, extra_budget))
    if len(set(out)) < len(out):
        raise Refusal(f"The 'run.rules' must not repeat a rule. Got {list(rules)!r} instead.")
    return out


def unique_labels(labels: list[str]) -> list[str]:
    """Labels made unique in order (`reranker_rows_lgbm`, `reranker_rows_lgbm_2`, ...)."""
    out: list[str] = []
    for label in labels:
        k, name = 1, label
        while name in out:
            k += 1
            name = f"{label}_{k}"
        out.append(name)
    return out


def paired_ratios(timings: dict[str, dict[int, list[PromptTiming]]], eos_ids: frozenset[int],
                  n_resamples: int, seed: int) -> pd.DataFrame:  # fmt: skip
    """Per rule and budget: tau, tokens/s and their ratios to the first rule's, paired, and the
    mean prefixes a pass scored beside the root (`ratios_of_tables` on this run's tables)."""
    prompts, rounds = {}, {}
    for r, by_budget in timings.items():
        for budget, ts in by_budget.items():
            prompts[r, budget] = prompt_table(ts, eos_ids)
            every = [x for p in ts for x in p.run.rounds]
            rounds[r, budget] = pd.DataFrame(
                {"scored": [x.scored for x in every], "matched_row": [x.matched_row for x in every]}
            )
    return ratios_of_tables(prompts, rounds, n_resamples, seed)


def ratios_of_tables(prompts: dict[tuple[str, int], pd.DataFrame],
                     rounds: dict[tuple[str, int], pd.DataFrame], n_resamples: int,
                     seed: int) -> pd.DataFrame:  # fmt: skip
    """The paired comparison from per-(rule, budget) prompt tables (`prompt_table`'s columns)
    and round tables (`scored`, `matched_row`); the first key's rule is the reference.

    tau = emitted tokens / rounds and tokens/s = tokens / time, each summed over the
    prompts; every resample draws prompts (the same draws for every rule and budget),
    and a ratio is the rule's statistic over the first rule's in the same draw.
    """
    labels = list(dict.fromkeys(r for r, _ in prompts))
    first = labels[0]
    rows = []
    for budget in dict.fromkeys(b for r, b in prompts if r == first):
        ids = prompts[first, budget]["prompt_id"].tolist()
        for r in labels:
            if prompts[r, budget]["prompt_id"].tolist() != ids:
                raise ValueError(f"rules {first} and {r} decoded other prompts: not paired")
        w = resample_weights(len(ids), n_resamples, seed)
        stats = {r: _stats(prompts[r, budget], w) for r in labels}
        for r in labels:
            rs = rounds[r, budget]
            # what a pass of the rule costs: prefixes scored beside the root (run.score)
            row = {"rule": r, "budget": budget, "prompts": len(ids),
                   "scored_prefixes": float(rs["scored"].mean()) if len(rs) else float("nan"),
                   "matched_row_share": float(rs["matched_row"].mean())
                   if len(rs) else float("nan")}  # fmt: skip
            for name in ("tau", "tokens_per_s"):
                point, draws = stats[r][name]
                base_point, base_draws = stats[first][name]
                row[name] = point
                iv = percentile_interval(point / base_point, draws / base_draws)
                row[f"{name}_ratio"] = iv.estimate
                row[f"{name}_ratio_lo"], row[f"{name}_ratio_hi"] = iv.low, iv.high
            rows.append(row)
    return pd.DataFrame(rows)


def _stats(t: pd.DataFrame, w: np.ndarray) -> dict[str, tuple[float, np.ndarray]]:
    """(point, per-resample draws) of tau and tokens/s of one rule's prompt table."""
    out = {}
    for name, num, den, scale in (("tau", "emitted", "rounds", 1.0),
                                  ("tokens_per_s", "tokens", "ms", 1000.0)):  # fmt: skip
        a, b = t[num].to_numpy(np.float64), t[den].to_numpy(np.float64)
        out[name] = (scale * a.sum() / b.sum(), scale * (w @ a) / (w @ b))
    return out


def combine_reports(reports: dict[str, RunReport], ratios: pd.DataFrame) -> RunReport:
    """One report of several rules: their tables stacked with a `rule` column, each rule's
    metrics under `online/<label>/...` (its offline and realized values keep their
    rule-named keys), the ratios to the first rule under `compare/B<b>/<label>/...`."""

    def stacked(name: str) -> pd.DataFrame:
        parts = [getattr(r, name).assign(rule=label) for label, r in reports.items()]
        return pd.concat([p for p in parts if not p.empty] or [pd.DataFrame()], ignore_index=True)

    metrics: dict[str, float] = {}
    for label, r in reports.items():
        for k, v in r.metrics.items():
            metrics["online/" + label + k[len("online") :] if k.startswith("online/") else k] = v
    for row in ratios.to_dict("records"):
        for k, v in row.items():
            if k.startswith(("tau", "tokens_per_s")) and np.isfinite(v):
                metrics[f"compare/B{row['budget']}/{row['rule']}/{k}"] = float(v)
    first = next(iter(reports.values()))
    return RunReport(stacked("rounds"), stacked("prompts"), stacked("groups"), {}, metrics, None,
                     stacked("elasticity"), first.entropy, compare=ratios)  # fmt: skip


def ratios_text(table: pd.DataFrame) -> str:
    """The paired comparison as printed: ratio [95% CI] of tau and tokens/s to the first rule."""
    first = table["rule"].iloc[0]
    lines = [f"rules in one interleaved run, against {first} (paired prompt bootstrap; the "
             f"intervals hold the prompts' draws and the fitted models fixed):"]  # fmt: skip
    for r in table.itertuples():
        lines.append(
            f"  B={r.budget:<3d} {r.rule:<28s} scored {r.scored_prefixes:5.1f}  "
            f"matched row {100 * r.matched_row_share:3.0f}%  "
            f"tau {r.tau:6.3f}  x{r.tau_ratio:.3f} "
            f"[{r.tau_ratio_lo:.3f}, {r.tau_ratio_hi:.3f}]   tokens/s {r.tokens_per_s:7.2f}  "
            f"x{r.tokens_per_s_ratio:.3f} [{r.tokens_per_s_ratio_lo:.3f}, "
            f"{r.tokens_per_s_ratio_hi:.3f}]"
        )
    return "\n".join(lines)


def plot_ratios(table: pd.DataFrame, path: Path) -> Path:
    """The ratios of tau and tokens/s to the first rule, with their intervals, per budget."""
    from rerank.report.plot_style import new_figure, save

    fig = new_figure(9.0, 3.2)
    axes = fig.subplots(1, 2)
    budgets = sorted(table["budget"].unique())
    rules = list(dict.fromkeys(table["rule"]))
    for ax, name in zip(axes, ("tau", "tokens_per_s"), strict=True):
        for j, rule in enumerate(rules):
            part = table[table["rule"] == rule].set_index("budget").loc[budgets]
            x = np.arange(len(budgets)) + 0.8 * (j - (len(rules) - 1) / 2) / max(len(rules), 1)
            y = part[f"{name}_ratio"].to_numpy()
            err = [y - part[f"{name}_ratio_lo"].to_numpy(), part[f"{name}_ratio_hi"].to_numpy() - y]
            ax.errorbar(x, y, yerr=err, fmt="o", capsize=3, label=rule)
        ax.axhline(1.0, color="0.5", lw=0.8)
        ax.set_xticks(np.arange(len(budgets)), [f"B={b}" for b in budgets])
        ax.set_title(f"{'tau' if name == 'tau' else 'tokens/s'} / {rules[0]}", fontsize=9)
    axes[0].legend(fontsize=7)
    save(fig, path)
    return path

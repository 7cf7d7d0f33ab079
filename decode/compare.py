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
interval (`realized_vs_offline`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from decode.metrics import PromptTiming, prompt_table
from decode.session import RunReport
from rerank.evaluate.policy import DRAFT_SCORED
from rerank.serving import local_path
from selection.rules import BASELINE, online_rules, value_key
from selection.rules import rule as rule_entry
from specrank.bootstrap import Interval, percentile_interval, resample_weights
from specrank.laws import law_name


@dataclass(frozen=True)
class RuleSpec:
    """One rule of the run: its `run.rule` name and, for `reranker`, the model's source."""

    rule: str
    reranker: str | None = None
    # `<rule>@+N`: decoded at each of the run's budgets + N, scoring its tree only; at
    # run.score=top_m with N = run.top_m it scores as many prefixes a pass as the others
    # (issue 28's draft at B + M, the practical baseline of App. D.10's Theorem 2)
    extra_budget: int = 0


def _extra_budget(i: int, entry: str, name: str, extra: str) -> int:
    """N of `run.rules[i]` = `<rule>@+N`, checked: a positive integer, a rule that reads no
    reranker, not the first rule (the ratios' reference and the traces' rule)."""
    ok = extra.startswith("+") and extra[1:].isdigit() and int(extra[1:]) > 0
    if not ok or i == 0 or name not in online_rules() or rule_entry(name).predictor:
        raise ValueError(
            f"The 'run.rules[{i}]' with '@' must be <rule>@+N (N > 0 extra nodes, a rule "
            f"without a reranker, not the first rule). Got {entry!r} instead."
        )
    return int(extra[1:])


def rule_specs(rules: list[str], rule: str, reranker: str | None) -> list[RuleSpec]:
    """`run.rules` parsed (or `run.rule` alone when empty), every entry checked by name; a
    reranker entry without a model source is refused."""
    if not rules:
        if rule_entry(rule).predictor and not reranker:
            raise ValueError(f"run.rule={rule} needs run.reranker=<folder or MLflow URI>; got none")
        return [RuleSpec(rule, reranker if rule_entry(rule).predictor else None)]
    out = []
    for i, entry in enumerate(rules):
        name, sep, source = str(entry).partition(":")
        name, at, extra = name.partition("@")
        extra_budget = _extra_budget(i, str(entry), name, extra) if at else 0
        predictor = name in online_rules() and rule_entry(name).predictor
        if name not in online_rules() or (sep and not predictor) or (sep and not source):
            raise ValueError(
                f"The 'run.rules[{i}]' must be one of {list(online_rules())} or "
                f"reranker:<folder or MLflow URI>. Got {entry!r} instead."
            )
        if predictor and not source:
            if not reranker:
                raise ValueError(f"run.rules[{i}]=reranker names no model and run.reranker is "
                                 f"unset; write reranker:<folder or MLflow URI>")  # fmt: skip
            source = reranker
        out.append(RuleSpec(name, source or None, extra_budget))
    if len(set(out)) < len(out):
        raise ValueError(f"The 'run.rules' must not repeat a rule. Got {list(rules)!r} instead.")
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
    mean prefixes a pass scored beside the root.

    tau = emitted tokens / rounds and tokens/s = tokens / time, each summed over the
    prompts; every resample draws prompts (the same draws for every rule and budget),
    and a ratio is the rule's statistic over the first rule's in the same draw.
    """
    labels = list(timings)
    first = labels[0]
    rows = []
    for budget in timings[first]:
        tables = {r: prompt_table(timings[r][budget], eos_ids) for r in labels}
        ids = tables[first]["prompt_id"].tolist()
        for r in labels:
            if tables[r]["prompt_id"].tolist() != ids:
                raise ValueError(f"rules {first} and {r} decoded other prompts: not paired")
        w = resample_weights(len(ids), n_resamples, seed)
        stats = {r: _stats(t, w) for r, t in tables.items()}
        for r in labels:
            rounds = [x for p in timings[r][budget] for x in p.run.rounds]
            # what a pass of the rule costs: prefixes scored beside the root (run.score)
            scored = float(np.mean([x.scored for x in rounds])) if rounds else float("nan")
            row = {"rule": r, "budget": budget, "prompts": len(ids), "scored_prefixes": scored,
                   "matched_row_share": float(np.mean([x.matched_row for x in rounds]))
                   if rounds else float("nan")}  # fmt: skip
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


def offline_metrics(table: pd.DataFrame) -> dict[str, float]:
    """`offline/B<b>/<label>/...`: the offline prediction beside the realized tau."""
    out = {}
    for row in table.to_dict("records"):
        for k in ("realized_tau", "offline_tau", "realized_minus_offline",
                  "realized_minus_offline_lo", "realized_minus_offline_hi", "minus_first",
                  "minus_first_lo", "minus_first_hi"):  # fmt: skip
            if k in row and np.isfinite(row[k]):
                out[f"offline/B{row['budget']}/{row['rule']}/{k}"] = float(row[k])
    return out


def offline_text(table: pd.DataFrame, source: str) -> str:
    """Realized tau beside the offline prediction for the same prompts, as printed."""
    lines = [f"realized tau beside the offline prediction of {source} (same prompts; paired "
             f"prompt bootstrap of realized - offline, and of that minus the first rule's):"]  # fmt: skip
    for r in table.itertuples():
        own = "" if r.rule == getattr(r, "against_first", r.rule) else (
            f"; minus {r.against_first}'s {r.minus_first:+.3f} "
            f"[{r.minus_first_lo:+.3f}, {r.minus_first_hi:+.3f}]")  # fmt: skip
        lines.append(
            f"  B={r.budget:<3d} {r.rule:<28s} realized {r.realized_tau:6.3f}  offline "
            f"{r.offline_tau:6.3f}  diff {r.realized_minus_offline:+.3f} "
            f"[{r.realized_minus_offline_lo:+.3f}, {r.realized_minus_offline_hi:+.3f}] = "
            f"[{100 * r.realized_minus_offline_lo / r.realized_tau:+.1f}%, "
            f"{100 * r.realized_minus_offline_hi / r.realized_tau:+.1f}%] of realized tau{own}"
        )
    return "\n".join(lines)


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


# -- the offline prediction beside the realized tau ------------------------------------------------


def offline_values(source: str, tracking_uri: str) -> pd.DataFrame:
    """The per-round values of `run.offline`: a run folder of rerank.train / rerank.transfer
    (its `per_round_values.parquet`), that file, or an MLflow URI of either."""
    path = local_path(source, tracking_uri)
    if path.is_dir():
        path = path / "per_round_values.parquet"
    if not path.is_file():
        raise FileNotFoundError(
            f"run.offline: no such file '{path}' (expected the folder of a rerank.train or "
            f"rerank.transfer run, or its per_round_values.parquet)"
        )
    return pd.read_parquet(path)


def _law_rows(values: pd.DataFrame, temperature: float, source: str) -> pd.DataFrame:
    """The offline rounds of the run's law; refuses a table without any."""
    part = values[np.isclose(values["temperature"].to_numpy(np.float64), temperature)]
    if part.empty:
        raise ValueError(f"run.offline={source}: no rounds of the {law_name(temperature)} law "
                         f"(T={temperature})")  # fmt: skip
    return part


def offline_prompt_sums(values: pd.DataFrame, rule: str, budget: int, temperature: float,
                        prompt_ids: list[str], source: str) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Per prompt (in `prompt_ids`' order): summed offline tau (value + 1) and rounds of
    `rule` at `budget` under the run's law. Refuses a table that lacks the column, the law
    or any of the prompts, naming them."""
    col = value_key(rule, budget)
    if col not in values:
        have = sorted(c for c in values.columns if "@B" in c)
        raise ValueError(f"run.offline={source}: no offline value {col!r} (rule {rule} at "
                         f"B={budget}); it holds {have[:12]}{' ...' if len(have) > 12 else ''}")  # fmt: skip
    part = _law_rows(values, temperature, source)
    grouped = part.groupby("prompt_id")[col].agg(["sum", "size"])
    missing = [p for p in prompt_ids if p not in grouped.index]
    if missing:
        raise ValueError(f"run.offline={source}: {len(missing)} of the run's {len(prompt_ids)} "
                         f"prompts have no recorded rounds there (e.g. {missing[:3]}); record "
                         f"those prompts and evaluate them (rerank.transfer)")  # fmt: skip
    g = grouped.loc[prompt_ids]
    return (g["sum"] + g["size"]).to_numpy(np.float64), g["size"].to_numpy(np.float64)


def offline_rule(spec: RuleSpec, name: str | None, score: str, top_m: int) -> str | None:
    """A rule's name in the offline values (``name``: its own, for a rule at the run's
    budgets). `draft@+M` under `run.score=top_m` with M = run.top_m is App. D.10's draft at
    B + M scored prefixes, whose offline value is `draft_scored` (draft's tree of B + M nodes
    at the recorded rounds); another `<rule>@+N` has none (the recording is at the run's
    budgets)."""
    if not spec.extra_budget:
        return name
    if spec.rule == BASELINE and score == "top_m" and spec.extra_budget == top_m:
        return DRAFT_SCORED
    return None


def check_draft_scored(values: pd.DataFrame, budget: int, top_m: int, temperature: float,
                       source: str) -> None:  # fmt: skip
    """`draft_scored@B` predicts draft@+M only where the offline run scored B + M prefixes a
    pass (its `rerank.score=top_m` with `rerank.score_top_m` = run.top_m): its draft's
    largest count must be B + M (fewer only where a pool holds fewer candidates)."""
    col = value_key(f"scored/{BASELINE}", budget)
    part = _law_rows(values, temperature, source)
    found = part[col].max() if col in part else None
    if found != budget + top_m:
        raise ValueError(
            f"run.offline={source}: draft@+{top_m} is predicted by {value_key(DRAFT_SCORED, budget)}, "
            f"draft's tree of B + M = {budget + top_m} nodes, but the offline run's draft scored "
            f"at most {found} prefixes a pass ({col}); expected a rerank.train / rerank.transfer "
            f"run with rerank.score=top_m and rerank.score_top_m={top_m}"
        )


def realized_vs_offline(timings: dict[str, dict[int, list[PromptTiming]]],
                        offline_names: dict[str, str | None], values: pd.DataFrame,
                        temperature: float, eos_ids: frozenset[int], n_resamples: int, seed: int,
                        source: str) -> pd.DataFrame:  # fmt: skip
    """Per rule and budget: realized tau, the offline prediction for the same prompts, and
    realized minus predicted with a prompt-bootstrap interval (each resample draws the same
    prompts for both; each is a ratio of sums over the drawn prompts' rounds); and that
    difference minus the first rule's (`minus_first`, `against_first`).
    `offline_names`: label -> the rule's offline name (None: the rule has none, skipped)."""
    rows, sums = [], {}
    for label, by_budget in timings.items():
        name = offline_names.get(label)
        if name is None:
            continue
        for budget, ts in by_budget.items():
            t = prompt_table(ts, eos_ids)
            ids = t["prompt_id"].tolist()
            off, off_rounds = offline_prompt_sums(values, name, budget, temperature, ids, source)
            real, real_rounds = t["emitted"].to_numpy(np.float64), t["rounds"].to_numpy(np.float64)
            sums[label, budget] = pd.DataFrame(
                {"real": real, "real_rounds": real_rounds, "off": off, "off_rounds": off_rounds},
                index=pd.Index(ids, name="prompt_id"),
            )
            w = resample_weights(len(ids), n_resamples, seed)
            point = real.sum() / real_rounds.sum() - off.sum() / off_rounds.sum()
            draws = (w @ real) / (w @ real_rounds) - (w @ off) / (w @ off_rounds)
            iv = percentile_interval(point, draws)
            rows.append({"rule": label, "offline_rule": name, "budget": budget,
                         "prompts": len(ids), "realized_tau": real.sum() / real_rounds.sum(),
                         "offline_tau": off.sum() / off_rounds.sum(), **iv.columns(
                             "realized_minus_offline")})  # fmt: skip
    for row in rows:
        first = next(label for label, b in sums if b == row["budget"])
        row["against_first"] = first
        row.update(minus_first(sums[row["rule"], row["budget"]], sums[first, row["budget"]],
                               n_resamples, seed).columns("minus_first"))  # fmt: skip
    return pd.DataFrame(rows)


def minus_first(rule: pd.DataFrame, first: pd.DataFrame, n_resamples: int, seed: int) -> Interval:
    """A rule's realized minus offline tau, minus the first rule's, over the prompts both
    decoded: a paired prompt bootstrap (each resample draws the same prompts for both rules
    and both figures). Per prompt (index) each frame holds summed emitted tokens and rounds,
    realized (`real`, `real_rounds`) and offline (`off`, `off_rounds`).

    Where the offline contexts are a recording of the first rule (draft), the first rule's
    gap is zero in expectation; the difference then isolates what is the rule's own: its
    prediction evaluated at contexts another rule visited. The rules decode their own
    sampled trajectories, so at T>0 their gaps' noise adds rather than cancels.
    """
    both = rule.merge(first, left_index=True, right_index=True, suffixes=("", "_first"))
    if both.empty:
        raise ValueError("no prompt was decoded by both the rule and the first rule")

    def gap(w: np.ndarray, suffix: str) -> np.ndarray:
        c = {k: both[f"{k}{suffix}"].to_numpy(np.float64)
             for k in ("real", "real_rounds", "off", "off_rounds")}  # fmt: skip
        return (w @ c["real"]) / (w @ c["real_rounds"]) - (w @ c["off"]) / (w @ c["off_rounds"])

    ones = np.ones((1, len(both)))
    point = float((gap(ones, "") - gap(ones, "_first"))[0])
    w = resample_weights(len(both), n_resamples, seed)
    return percentile_interval(point, gap(w, "") - gap(w, "_first"))

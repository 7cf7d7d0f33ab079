"""The offline prediction beside the realized tau (`run.offline`).

`run.offline` names the per-round values of a `rerank.train` or `rerank.transfer` run on a
separate recording of the run's prompts. A rule's predicted tau over the run's prompts is

    tau_hat = sum_p L_p / sum_p (L_p / v_p)

with v_p the rule's offline mean of tokens per round (value + 1) over prompt p's recorded
rounds and L_p the tokens the recording emitted on p (its own tree's value + 1 summed over
its rounds: at T=0 the tokens it emitted, at T>0 their expectation). Realized tau is the
rule's tokens over its own rounds, summed over the prompts, so a prompt weighs by the
rule's rounds there; the plain mean over the recorded rounds (printed beside it as
`offline_round_mean`) weighs it by the recording rule's instead. L_p / v_p is the rounds the
rule takes on p if its rounds there emit v_p on average (renewal-reward, prompt by prompt).
What it leaves out: inside a prompt the rule starts its rounds at other positions than the
recording did (the README measures that part with draft at B + M, which no feature reads).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from decode.compare import RuleSpec
from decode.metrics import PromptTiming, prompt_table
from rerank.evaluate.policy import DRAFT_SCORED
from rerank.serving import local_path
from selection.rules import BASELINE, value_key
from specrank.settings.errors import Refusal
from specrank.statistics.bootstrap import Interval, percentile_interval, resample_weights
from specrank.statistics.laws import law_name

_SUMS = ("real", "real_rounds", "pred", "pred_rounds")


def offline_metrics(table: pd.DataFrame) -> dict[str, float]:
    """`offline/B<b>/<label>/...`: the offline prediction beside the realized tau."""
    out = {}
    for row in table.to_dict("records"):
        for k in ("realized_tau", "offline_tau", "offline_round_mean", "realized_minus_offline",
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
        own = "" if r.rule == r.against_first else (
            f"; minus {r.against_first}'s {r.minus_first:+.3f} "
            f"[{r.minus_first_lo:+.3f}, {r.minus_first_hi:+.3f}]")  # fmt: skip
        lines.append(
            f"  B={r.budget:<3d} {r.rule:<28s} realized {r.realized_tau:6.3f}  offline "
            f"{r.offline_tau:6.3f} (round mean {r.offline_round_mean:.3f})  "
            f"diff {r.realized_minus_offline:+.3f} "
            f"[{r.realized_minus_offline_lo:+.3f}, {r.realized_minus_offline_hi:+.3f}] = "
            f"[{100 * r.realized_minus_offline_lo / r.realized_tau:+.1f}%, "
            f"{100 * r.realized_minus_offline_hi / r.realized_tau:+.1f}%] of realized tau{own}"
        )
    return "\n".join(lines)


def offline_values(source: str, tracking_uri: str) -> pd.DataFrame:
    """The per-round values of `run.offline`: a run folder of rerank.train / rerank.transfer
    (its `per_round_values.parquet`), that file, or an MLflow URI of either."""
    path = local_path(source, tracking_uri)
    if path.is_dir():
        path = path / "per_round_values.parquet"
    if not path.is_file():
        raise Refusal(
            f"run.offline: no such file '{path}' (expected the folder of a rerank.train or "
            f"rerank.transfer run, or its per_round_values.parquet)"
        )
    return pd.read_parquet(path)


def _law_rows(values: pd.DataFrame, temperature: float, source: str) -> pd.DataFrame:
    """The offline rounds of the run's law; refuses a table without any."""
    part = values[np.isclose(values["temperature"].to_numpy(np.float64), temperature)]
    if part.empty:
        raise Refusal(f"run.offline={source}: no rounds of the {law_name(temperature)} law "
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
        raise Refusal(f"run.offline={source}: no offline value {col!r} (rule {rule} at "
                         f"B={budget}); it holds {have[:12]}{' ...' if len(have) > 12 else ''}")  # fmt: skip
    part = _law_rows(values, temperature, source)
    g = _of_prompts(part.groupby("prompt_id")[col].agg(["sum", "size"]), prompt_ids, source)
    return (g["sum"] + g["size"]).to_numpy(np.float64), g["size"].to_numpy(np.float64)


def offline_rule(spec: RuleSpec, name: str | None, score: str, top_m: int) -> str | None:
    """A rule's name in the offline values (``name``: its own, for a rule at the run's
    budgets). `draft@+M` under `run.score=top_m` with M = run.score_top_m is App. D.10's draft at
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
    pass (its `rerank.score=top_m` with `rerank.score_top_m` = run.score_top_m): its draft's
    largest count must be B + M (fewer only where a pool holds fewer candidates)."""
    col = value_key(f"scored/{BASELINE}", budget)
    part = _law_rows(values, temperature, source)
    found = part[col].max() if col in part else None
    if found != budget + top_m:
        raise Refusal(
            f"run.offline={source}: draft@+{top_m} is predicted by {value_key(DRAFT_SCORED, budget)}, "
            f"draft's tree of B + M = {budget + top_m} nodes, but the offline run's draft scored "
            f"at most {found} prefixes a pass ({col}); expected a rerank.train / rerank.transfer "
            f"run with rerank.score=top_m and rerank.score_top_m={top_m}"
        )


def recorded_tokens(values: pd.DataFrame, temperature: float, prompt_ids: list[str],
                    source: str) -> np.ndarray:  # fmt: skip
    """Per prompt (in `prompt_ids`' order): L_p, the tokens the recording emitted there, as
    its own tree's offline value + 1 summed over its rounds (each row's `rule` and `budget`
    name the recording's). Refuses a table without them, naming what is missing."""
    part = _law_rows(values, temperature, source)
    if not {"rule", "budget"} <= set(part.columns):
        raise Refusal(f"run.offline={source}: no 'rule' and 'budget' columns naming the "
                         f"recording's rule and budget (expected the per-round values of "
                         f"rerank.train or rerank.transfer)")  # fmt: skip
    tokens = np.empty(len(part))
    for (rule, budget), at in part.groupby(["rule", "budget"]).indices.items():
        col = value_key(rule, int(budget))
        if col not in part:
            raise Refusal(f"run.offline={source}: no offline value {col!r} of the recording's "
                             f"own tree ({rule} at B={budget}), which gives each prompt's "
                             f"recorded tokens; evaluate the recording's budget too")  # fmt: skip
        tokens[at] = part[col].to_numpy(np.float64)[at] + 1.0
    per = pd.Series(tokens).groupby(part["prompt_id"].to_numpy()).sum()
    return _of_prompts(per, prompt_ids, source).to_numpy(np.float64)


def _of_prompts(per: pd.DataFrame | pd.Series, prompt_ids: list[str],
                source: str) -> pd.DataFrame | pd.Series:  # fmt: skip
    """`per` (indexed by prompt id) at `prompt_ids`, in their order; refuses a missing one."""
    missing = [q for q in prompt_ids if q not in per.index]
    if missing:
        raise Refusal(f"run.offline={source}: {len(missing)} of the run's {len(prompt_ids)} "
                         f"prompts have no recorded rounds there (e.g. {missing[:3]}); record "
                         f"those prompts and evaluate them (rerank.transfer)")  # fmt: skip
    return per.loc[prompt_ids]


def predicted_rounds(tokens: np.ndarray, sums: np.ndarray, rounds: np.ndarray) -> np.ndarray:
    """Per prompt: the rounds a rule takes for the recording's tokens (`recorded_tokens`) at
    its offline mean tokens per round there (`offline_prompt_sums`: sums / rounds)."""
    return tokens * rounds / sums


def check_offline(values: pd.DataFrame, names: list[str | None], budgets: list[int],
                  temperature: float, prompt_ids: list[str], top_m: int, source: str) -> None:  # fmt: skip
    """Before any model: every rule with an offline name has its value at every budget for
    every prompt, the recording's tokens are there, and `draft_scored` scored B + M."""
    recorded_tokens(values, temperature, prompt_ids, source)
    for name in names:
        for b in budgets if name else ():
            offline_prompt_sums(values, name, b, temperature, prompt_ids, source)
            if name == DRAFT_SCORED:
                check_draft_scored(values, b, top_m, temperature, source)


def realized_vs_offline(timings: dict[str, dict[int, list[PromptTiming]]],
                        offline_names: dict[str, str | None], values: pd.DataFrame,
                        temperature: float, eos_ids: frozenset[int], n_resamples: int, seed: int,
                        source: str) -> pd.DataFrame:  # fmt: skip
    """`offline_comparison` of the run's decodes: each rule's and budget's prompt table."""
    tables = {(label, budget): prompt_table(ts, eos_ids)
              for label, by_budget in timings.items() for budget, ts in by_budget.items()}  # fmt: skip
    return offline_comparison(tables, offline_names, values, temperature, n_resamples, seed,
                              source)  # fmt: skip


def offline_comparison(tables: dict[tuple[str, int], pd.DataFrame],
                       offline_names: dict[str, str | None], values: pd.DataFrame,
                       temperature: float, n_resamples: int, seed: int,
                       source: str) -> pd.DataFrame:  # fmt: skip
    """Per rule and budget: realized tau, the offline prediction for the same prompts (the
    module's tau_hat; the plain round mean beside it), and realized minus predicted with a
    prompt-bootstrap interval (each resample draws the same prompts for both, each a ratio
    of sums over the drawn prompts); and that difference minus the first rule's
    (`minus_first`, `against_first`). `tables`: (label, budget) -> the prompt table
    (`prompt_id`, `emitted`, `rounds`), in the run's order, first rule first;
    `offline_names`: label -> the rule's offline name (None: the rule has none, skipped)."""
    # the recording's tokens per prompt are every rule's and budget's: read once
    every = list(dict.fromkeys(q for t in tables.values() for q in t["prompt_id"]))
    tokens_of = pd.Series(recorded_tokens(values, temperature, every, source), index=every)
    rows, sums = [], {}
    for (label, budget), t in tables.items():
        name = offline_names.get(label)
        if name is None:
            continue
        ids = t["prompt_id"].tolist()
        off, off_rounds = offline_prompt_sums(values, name, budget, temperature, ids, source)
        tokens = tokens_of.loc[ids].to_numpy(np.float64)
        c = sums[label, budget] = pd.DataFrame(
            {"real": t["emitted"].to_numpy(np.float64),
             "real_rounds": t["rounds"].to_numpy(np.float64), "pred": tokens,
             "pred_rounds": predicted_rounds(tokens, off, off_rounds)},
            index=pd.Index(ids, name="prompt_id"),
        )  # fmt: skip
        w = resample_weights(len(ids), n_resamples, seed)
        iv = percentile_interval(float(_gap(c, np.ones((1, len(c))))[0]), _gap(c, w))
        rows.append({"rule": label, "offline_rule": name, "budget": budget, "prompts": len(ids),
                     "realized_tau": c.real.sum() / c.real_rounds.sum(),
                     "offline_tau": c.pred.sum() / c.pred_rounds.sum(),
                     "offline_round_mean": off.sum() / off_rounds.sum(),
                     **iv.columns("realized_minus_offline")})  # fmt: skip
    for row in rows:
        first = next(label for label, b in sums if b == row["budget"])
        row["against_first"] = first
        row.update(minus_first(sums[row["rule"], row["budget"]], sums[first, row["budget"]],
                               n_resamples, seed).columns("minus_first"))  # fmt: skip
    return pd.DataFrame(rows)


def _gap(c: pd.DataFrame, w: np.ndarray, suffix: str = "") -> np.ndarray:
    """Realized minus predicted tau per row of prompt weights `w`, from the per-prompt sums
    `c` (columns `_SUMS`, each with `suffix`)."""
    x = {k: c[f"{k}{suffix}"].to_numpy(np.float64) for k in _SUMS}
    return (w @ x["real"]) / (w @ x["real_rounds"]) - (w @ x["pred"]) / (w @ x["pred_rounds"])


def minus_first(rule: pd.DataFrame, first: pd.DataFrame, n_resamples: int, seed: int) -> Interval:
    """A rule's realized minus offline tau, minus the first rule's, over the prompts both
    decoded: a paired prompt bootstrap (each resample draws the same prompts for both rules
    and both figures). Per prompt (index) each frame holds summed emitted tokens and rounds,
    realized (`real`, `real_rounds`) and predicted (`pred`, `pred_rounds`).

    Where the offline contexts are a recording of the first rule (draft), the first rule's
    gap is zero in expectation; the difference then isolates what is the rule's own: its
    prediction evaluated at contexts another rule visited. The rules decode their own
    sampled trajectories, so at T>0 their gaps' noise adds rather than cancels.
    """
    both = rule.merge(first, left_index=True, right_index=True, suffixes=("", "_first"))
    if both.empty:
        raise ValueError("no prompt was decoded by both the rule and the first rule")
    ones = np.ones((1, len(both)))
    point = float((_gap(both, ones) - _gap(both, ones, "_first"))[0])
    w = resample_weights(len(both), n_resamples, seed)
    return percentile_interval(point, _gap(both, w) - _gap(both, w, "_first"))

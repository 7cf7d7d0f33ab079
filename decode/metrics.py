"""Metrics of an online run (seed 003's protocol) and the offline expectation of its own rounds.

Per round: tau = accepted + 1 = tokens committed by the round (a draw rule's X1
counts as accepted), per-stage milliseconds. Per prompt: tokens up to the first
EOS and the time from the start of the target prefill to the last commit, for
the speculative decoder and for target-only decoding of the same prompt in the
same run. A group's speed divides summed tokens by summed time; speedup =
speculative speed / target-only speed, with a paired prompt-bootstrap interval.
Per-stage ms per round are reported as means and as medians (`ms_per_round_median/`).
Groups: all prompts, each task, and the low/high-entropy halves of the tasks. The
split is one per target and run: tasks ordered by the mean entropy of the target's
row at each token of the target-only baseline decode (token-weighted, up to the
first EOS; `decode.baseline.row_entropies`), the lower half, rounded down,
"low"; every decoder and budget of the run shares it. Without a baseline the
split falls back to the mean root-row entropy of the run's own rounds.

Realized vs expected: on the run's own recorded rounds, `selection.values.
evaluate_pools` gives each round's expected value of the rule that chose its
tree (reranker: the round's own log phat as the first factor); the realized
value is the round's accepted count (draw rules: 1 + accepted descendants).
Under greedy decoding the two are equal round by round; under sampling the
mean difference gets a paired prompt-bootstrap interval.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from transformers import PreTrainedModel

from decode.baseline import autoregressive_decode
from decode.loop import PromptRun
from decode.round import STAGES
from decode.stream import prompt_seed
from selection.pool_batch import pool_batch_from_table
from selection.ranking import replace_first_factor
from selection.rules import POOL_RULES
from selection.rules import rule as rule_entry
from selection.values import evaluate_pools
from specrank.statistics.bootstrap import (
    PromptSums,
    percentile_interval,
    resample_weights,
    weighted_means,
)
from specrank.store.trace_schema import TRACE_SCHEMA


@dataclass
class PromptTiming:
    """One prompt's two decodes."""

    prompt_id: str
    task: str
    run: PromptRun
    baseline_tokens: int  # target-only tokens up to the first EOS (0 without a baseline)
    baseline_ms: float
    greedy_match: bool | None = None  # T=0: both outputs agree on their common length
    baseline_entropy: np.ndarray | None = None  # nats per baseline token up to the first EOS


def tokens_to_eos(output: Sequence[int], eos_ids: frozenset[int]) -> int:
    """Tokens emitted up to and including the first EOS (all of them without one)."""
    for i, t in enumerate(output):
        if t in eos_ids:
            return i + 1
    return len(output)


def round_table(timings: list[PromptTiming]) -> pd.DataFrame:
    """One row per round: prompt, task, tau, accepted, tree size, passes, entropy, stages."""
    rows = []
    for p in timings:
        for i, r in enumerate(p.run.rounds):
            row = {
                "prompt_id": p.prompt_id,
                "task": p.task,
                "round_index": i,
                "tau": len(r.emitted),
                "accepted": r.n_accepted,
                "tree_size": r.tree_size,
                "scored": r.scored,
                "passes": r.passes,
                "covered": r.covered,
                "matched_row": r.matched_row,
                "root_entropy": r.root_entropy,
            }
            row |= {f"ms_{s}": ms for s, ms in zip(STAGES, r.stage_ms, strict=True)}
            rows.append(row)
    return pd.DataFrame(rows)


def prompt_table(timings: list[PromptTiming], eos_ids: frozenset[int]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "prompt_id": p.prompt_id,
                "task": p.task,
                "tokens": tokens_to_eos(p.run.output, eos_ids),
                "ms": p.run.total_ms,
                "prefill_ms": p.run.prefill_ms,
                "rounds": len(p.run.rounds),
                "emitted": sum(len(r.emitted) for r in p.run.rounds),
                "passes": sum(r.passes for r in p.run.rounds),
                "baseline_tokens": p.baseline_tokens,
                "baseline_ms": p.baseline_ms,
                "baseline_entropy_sum": _sum_or_zero(p.baseline_entropy),
                "baseline_entropy_tokens": _len_or_zero(p.baseline_entropy),
            }
            for p in timings
        ]
    )


def _sum_or_zero(x: np.ndarray | None) -> float:
    return 0.0 if x is None else float(np.sum(x))


def _len_or_zero(x: np.ndarray | None) -> int:
    return 0 if x is None else len(x)


def task_entropy(rounds: pd.DataFrame, prompts: pd.DataFrame) -> tuple[pd.Series, str]:
    """Mean target entropy per task and its source: "baseline" (token-weighted over the
    target-only decode's tokens) when the run has one, else "rounds" (root rows)."""
    if "baseline_entropy_tokens" in prompts and prompts["baseline_entropy_tokens"].sum() > 0:
        by_task = prompts.groupby("task")[["baseline_entropy_sum", "baseline_entropy_tokens"]].sum()
        return by_task["baseline_entropy_sum"] / by_task["baseline_entropy_tokens"], "baseline"
    return rounds.groupby("task")["root_entropy"].mean(), "rounds"


def entropy_halves(task_means: pd.Series) -> dict[str, str]:
    """task -> "low" | "high": tasks ordered by mean entropy, the lower half (rounded down) low."""
    means = task_means.sort_values(kind="stable")
    n_low = len(means) // 2
    return {t: ("low" if i < n_low else "high") for i, t in enumerate(means.index)}


def _speedup_draws(prompts: pd.DataFrame, weights: np.ndarray) -> np.ndarray:
    """Speedup in each resample (summed tokens over summed time, both decoders). [n]."""
    spec = (weights @ prompts["tokens"].to_numpy()) / (weights @ prompts["ms"].to_numpy())
    base = (weights @ prompts["baseline_tokens"].to_numpy()) / (
        weights @ prompts["baseline_ms"].to_numpy()
    )
    return spec / base


def group_metrics(rounds: pd.DataFrame, prompts: pd.DataFrame, n_resamples: int, seed: int) -> dict:
    """tau, speeds, speedup (+ interval) and per-stage ms per round of one group of prompts."""
    out = {
        "prompts": float(len(prompts)),
        "rounds": float(len(rounds)),
        "tau": float(rounds["tau"].mean()),
        "accepted": float(rounds["accepted"].mean()),
        "tree_size": float(rounds["tree_size"].mean()),
        # prefixes a round's tree pass scores beside the root: what run.score costs
        "scored_prefixes": float(rounds["scored"].mean()),
        "tokens_per_pass": float(prompts["tokens"].sum() / max(prompts["passes"].sum(), 1)),
        "root_entropy": float(rounds["root_entropy"].mean()),
        "tokens_per_s": 1000.0 * prompts["tokens"].sum() / prompts["ms"].sum(),
    }
    for s in STAGES:
        out[f"ms_per_round/{s}"] = float(rounds[f"ms_{s}"].mean())
        out[f"ms_per_round_median/{s}"] = float(rounds[f"ms_{s}"].median())
    round_ms = sum(out[f"ms_per_round/{s}"] for s in STAGES)
    out["ms_per_round/total"] = round_ms
    out["ms_per_round_median/total"] = float(
        rounds[[f"ms_{s}" for s in STAGES]].sum(axis=1).median()
    )
    out["features_share_of_round"] = out["ms_per_round/features"] / round_ms
    out["features_over_draft"] = out["ms_per_round/features"] / out["ms_per_round/draft"]
    if prompts["baseline_ms"].sum() > 0:
        out["baseline_tokens_per_s"] = (
            1000.0 * prompts["baseline_tokens"].sum() / prompts["baseline_ms"].sum()
        )
        out["speedup"] = out["tokens_per_s"] / out["baseline_tokens_per_s"]
        draws = _speedup_draws(prompts, resample_weights(len(prompts), n_resamples, seed))
        out |= percentile_interval(out["speedup"], draws).columns("speedup")
        # the tokens a round must yield for its mean cost to equal target-only's time for
        # them: above it speculation pays (prefill aside, which both decoders pay alike)
        out["break_even_tau"] = round_ms * out["baseline_tokens_per_s"] / 1000.0
    return out


def run_groups(
    rounds: pd.DataFrame, prompts: pd.DataFrame, n_resamples: int, seed: int,
    halves: dict[str, str] | None = None,
) -> pd.DataFrame:  # fmt: skip
    """Metrics of all prompts, of each task and of the low/high-entropy task halves.

    halves: the run's entropy split (task -> low/high), shared by all its decoders;
    by default `entropy_halves(task_entropy(rounds, prompts)[0])`.
    """
    if halves is None:
        halves = entropy_halves(task_entropy(rounds, prompts)[0])
    groups = [("all", np.ones(len(prompts), bool))]
    groups += [(f"task/{t}", (prompts["task"] == t).to_numpy()) for t in sorted(halves)]
    groups += [
        (f"entropy/{h}", prompts["task"].map(halves).eq(h).to_numpy()) for h in ("low", "high")
    ]
    rows = []
    for name, mask in groups:
        if not mask.any():
            continue
        ids = set(prompts.loc[mask, "prompt_id"])
        part = rounds[rounds["prompt_id"].isin(ids)]
        rows.append({"group": name, **group_metrics(part, prompts[mask], n_resamples, seed)})
    return pd.DataFrame(rows)


def timed_baseline(
    target: PreTrainedModel, prompt: list[int], max_new_tokens: int, eos_ids: frozenset[int],
    temperature: float, seed: int, prompt_id: str,
) -> tuple[list[int], float]:  # fmt: skip
    """Target-only decoding of one prompt (the speedup baseline) and its wall time in ms.

    Timed like `decode_prompt`: from the start of the prefill to the last token.
    Sampling draws from its own per-prompt generator (seeded apart from the decoder's).
    """
    dev = target.device
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=dev).manual_seed(prompt_seed(seed, f"baseline/{prompt_id}"))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    out = autoregressive_decode(target, prompt, max_new_tokens, eos_ids, temperature, gen)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return out, 1000.0 * (time.perf_counter() - t0)


# -- realized vs offline expected ------------------------------------------------------------------


def expected_values(
    trace_rows: list[dict], rule: str, budget: int, first_logprob: list[np.ndarray] | None = None
) -> np.ndarray:
    """Offline expected value of `rule` at `budget` on each recorded round. [R] float64."""
    table = pa.Table.from_pylist(trace_rows, schema=TRACE_SCHEMA)
    pool = pool_batch_from_table(table)
    entry = rule_entry(rule)
    if entry.predictor:
        if first_logprob is None:
            raise ValueError("expected_values: rule=reranker needs each round's log phat")
        first = torch.zeros_like(pool.draft_logprob)  # [R, P]; only depth-1 entries are read
        for r, lp in enumerate(first_logprob):
            first[r, : lp.shape[0]] = torch.from_numpy(lp)
        scores = replace_first_factor(pool.draft_logprob, pool.depth, first, pool.parent)
        out = evaluate_pools(pool, [budget], rules=["draft"], extra_scores={"reranker": scores})
        return out["reranker"][:, 0].double().numpy()
    if rule not in POOL_RULES:
        raise ValueError(f"no offline value for run.rule={rule!r} (selection.rules: {entry})")
    out = evaluate_pools(pool, [budget], rules=[rule])
    return out[rule][:, 0].double().numpy()


def realized_vs_expected(
    rounds: pd.DataFrame, n_resamples: int, seed: int, level: float = 0.95
) -> dict[str, float]:
    """Round-weighted realized and expected values; their difference with a prompt-bootstrap interval."""
    frame = rounds.assign(diff=rounds["accepted"] - rounds["expected"])
    stats = PromptSums.from_rounds(frame, ["accepted", "expected", "diff"])
    point = weighted_means(stats, "round", None)[0]
    draws = weighted_means(stats, "round", resample_weights(len(stats.prompts), n_resamples, seed))
    iv = percentile_interval(point[2], draws[:, 2], level)
    return {
        "realized": float(point[0]),
        "expected": float(point[1]),
        **iv.columns("realized_minus_expected"),
        "rounds_equal": float(np.mean(np.isclose(frame["accepted"], frame["expected"]))),
    }

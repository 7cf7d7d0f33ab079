"""Benchmark: rule values on paper-scale synthetic traces (365,922 rounds x 710 candidates).

    python -m bench.select_values                 # paper scale (generates the cache once)
    python -m bench.select_values --rounds 20000  # quicker

Prints generation time (once), read + densify time, evaluation time for draft,
root, depth-two, oracle, root-draw and PEARL-style values at B=8 and B=59,
rounds per second, peak memory, and two ratios measured in the same run: the
compiled CPU kernels against the selector's torch route (the CUDA route) on one
chunk, and the batched evaluator against a per-round reference loop. Then the
profile per rule: each rule's time on one greedy and one sampling chunk, its context
(the batch's shared quantities and draft order) built once beforehand, and a
first-factor rule (a reranker's place in the pass: random first-level factors) as the
job evaluates it, with and without its every-budget curve, and 14 such rules in a call
each against all in one call (one pass over the rounds).
"""

from __future__ import annotations

import argparse
import resource
import time
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from bench.bench_extract import paper_traces
from selection.context import pool_context
from selection.pool_batch import POOL_COLUMNS, pool_batch_from_table
from selection.ranking import (
    draft_scores,
    first_level_ancestor,
    path_product,
    rank_order,
    torch_route,
)
from selection.values import evaluate_pools
from specrank.runtime.memory import retain_freed_heap
from specrank.store.trace_schema import trace_store

PAPER_ROUNDS = 365_922  # = 1402 prompts x 261 rounds
PAPER_ROUNDS_PER_PROMPT = 261
RULES = ["draft", "root", "depth_two", "oracle", "root_draw", "pearl"]
BUDGETS = [8, 59]


def ensure_traces(rounds: int) -> Path:
    """Synthetic traces of at least `rounds` rounds (the paper-scale cache is shared)."""
    return paper_traces(
        prompts=-(-rounds // PAPER_ROUNDS_PER_PROMPT), rounds=PAPER_ROUNDS_PER_PROMPT
    )


def reference_loop_values(pool, budgets) -> dict[str, np.ndarray]:
    """Baseline: draft/oracle/root values one round at a time (what a naive loop costs)."""
    law = pool.law_edge_prob()
    out = {r: np.zeros((pool.shape[0], len(budgets))) for r in ("draft", "root", "oracle")}
    for r in range(pool.shape[0]):
        sl = slice(r, r + 1)
        prob = path_product(law[sl], pool.parent[sl])
        draft = draft_scores(pool.draft_logprob[sl], pool.parent[sl])
        anc = first_level_ancestor(pool.parent[sl])
        root = (
            draft
            - torch.gather(pool.draft_logprob[sl], -1, anc)
            + torch.log(torch.gather(law[sl], -1, anc))
        )
        for name, score in (("draft", draft), ("root", root), ("oracle", torch.log(prob))):
            order = rank_order(score)
            mass = torch.cumsum(prob[0, order[0]], 0)
            out[name][r] = [mass[b - 1].item() for b in budgets]
    return out


MANY_FIRSTS = 14


def _timed(fn) -> float:
    """Best of two runs (the first also pays one-off kernel loading)."""
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _law_chunk(dataset, greedy: bool, chunk_rounds: int):
    """The first chunk whose rounds are all of one law (None if there is none)."""
    for batch in dataset.to_batches(columns=POOL_COLUMNS, batch_size=chunk_rounds):
        t = batch.column("temperature").to_numpy()
        if ((t == 0) if greedy else (t > 0)).all():
            return pool_batch_from_table(pa.Table.from_batches([batch]))
    return None


def _rule_times(pool) -> dict[str, float]:
    """Seconds of each rule alone on the pool, its context and draft order built before."""
    ctx = pool_context(pool)
    order = rank_order(ctx.draft, ctx.restrict)
    n1 = int((pool.depth[0] == 1).sum())
    lead = torch.log(torch.rand(pool.shape[0], n1, generator=torch.Generator().manual_seed(0)))
    cases = {r: {"rules": [r]} for r in RULES}
    cases["first factor"] = {"rules": ["draft"], "first_factors": {"ff": lead}}
    cases["first factor, curve"] = {"rules": ["draft"], "first_factors": {"ff": lead},
                                    "curves": True, "curve_rules": ["ff"]}  # fmt: skip
    # the job's 14 first-factor rules without curves (substitutions, mixtures, calibrators)
    # share one pass over the rounds: against a call (and so a pass) for each
    many = {f"ff{j}": lead - 0.1 * j for j in range(MANY_FIRSTS)}
    cases[f"{MANY_FIRSTS} first factors, a call each"] = [
        {"rules": [], "first_factors": {name: f}} for name, f in many.items()
    ]
    cases[f"{MANY_FIRSTS} first factors, one pass"] = [{"rules": [], "first_factors": many}]

    def run(kw: dict | list[dict]) -> None:
        for one in kw if isinstance(kw, list) else [kw]:
            evaluate_pools(pool, BUDGETS, ctx=ctx, draft_order=order, **one)

    return {name: _timed(partial(run, kw)) for name, kw in cases.items()}


def per_rule_profile(dataset, chunk_rounds: int) -> None:
    """Milliseconds per 1,000 rounds of each rule, alone on a prebuilt context, by law."""
    print(f"\nper rule, ms per 1,000 rounds (one chunk of each law, <= {chunk_rounds:,} rounds):")
    for law in ("greedy", "sampling"):
        pool = _law_chunk(dataset, law == "greedy", chunk_rounds)
        if pool is None:
            print(f"  {law}: no chunk of that law alone")
            continue
        times = _rule_times(pool)
        per_k = {k: 1e6 * v / pool.shape[0] for k, v in times.items()}
        print(f"  {law} ({pool.shape[0]:,} rounds): "
              + ", ".join(f"{k} {v:.1f}" for k, v in per_k.items()))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=PAPER_ROUNDS)
    parser.add_argument("--chunk", type=int, default=16384, help="rounds per evaluation batch")
    args = parser.parse_args()
    torch.set_num_threads(2)
    heap = retain_freed_heap()

    dataset = trace_store(ensure_traces(args.rounds)).dataset()
    n_read = n_eval = 0
    t_read = t_eval = 0.0
    sums = {r: np.zeros(len(BUDGETS)) for r in RULES}
    t = time.perf_counter()
    for batch in dataset.to_batches(columns=POOL_COLUMNS, batch_size=args.chunk):
        table = pa.Table.from_batches([batch]).slice(0, max(0, args.rounds - n_read))
        if table.num_rows == 0:
            break
        pool = pool_batch_from_table(table)
        n_read += table.num_rows
        t_read += time.perf_counter() - t
        t = time.perf_counter()
        values = evaluate_pools(pool, BUDGETS, rules=RULES)
        for r in RULES:
            sums[r] += values[r].double().sum(0).numpy()
        n_eval += table.num_rows
        t_eval += time.perf_counter() - t
        t = time.perf_counter()
    if n_read == 0:
        raise SystemExit("no rounds read")

    # Same-run baseline on one chunk: compiled kernels vs the torch route.
    chunk = pool_batch_from_table(dataset.head(min(args.chunk, n_eval), columns=POOL_COLUMNS))
    t_kernels = _timed(lambda: evaluate_pools(chunk, BUDGETS, rules=RULES))
    with torch_route():
        t_torch = _timed(lambda: evaluate_pools(chunk, BUDGETS, rules=RULES))

    # Same-run baseline on a small slice: per-round loop vs the batched evaluator.
    sample = pool_batch_from_table(dataset.head(500, columns=POOL_COLUMNS))
    reference_loop_values(pool_batch_from_table(dataset.head(5, columns=POOL_COLUMNS)), BUDGETS)
    t0 = time.perf_counter()
    ref = reference_loop_values(sample, BUDGETS)
    t_loop = time.perf_counter() - t0
    t0 = time.perf_counter()
    fast = evaluate_pools(sample, BUDGETS, rules=["draft", "root", "oracle"])
    t_fast = time.perf_counter() - t0
    for name in ref:
        np.testing.assert_allclose(fast[name].numpy(), ref[name], atol=1e-4)

    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"\nrounds: {n_eval:,} x {pool.shape[1]} candidates, torch threads {torch.get_num_threads()}, freed heap retained: {heap}"
    )
    print(f"read + densify : {t_read:7.1f} s  ({n_read / t_read:,.0f} rounds/s)")
    print(
        f"evaluate       : {t_eval:7.1f} s  ({n_eval / t_eval:,.0f} rounds/s)  rules {RULES} at B={BUDGETS}"
    )
    print(f"total          : {t_read + t_eval:7.1f} s")
    print(f"peak memory    : {peak_gb:.2f} GiB (max RSS)")
    print(
        f"compiled kernels vs torch route ({chunk.shape[0]:,} rounds): "
        f"{t_kernels:.2f} s vs {t_torch:.2f} s, {t_torch / t_kernels:.1f}x faster"
    )
    print(
        f"batched vs per-round loop (draft, root, oracle; 500 rounds): {t_loop / t_fast:.0f}x faster"
    )
    per_rule_profile(dataset, args.chunk)
    print("\nmean expected accepted tokens per round:")
    for r in RULES:
        print(
            f"  {r:10s} "
            + "  ".join(f"B={b}: {s / n_eval:.3f}" for b, s in zip(BUDGETS, sums[r], strict=True))
        )


if __name__ == "__main__":
    main()

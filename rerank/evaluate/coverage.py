"""Coverage of scored sets on the recorded pools, and the decoder without a root pass.

Coverage (docs/method.md#verification, paper Eq. 5): with the verified tree T = the draft top-B and
a scored set Q ⊇ T, exhaustive traversal is covered exactly when it exits on
the scored frontier F = {u in Q \\ T : parent(u) in T or u a first-level node},
so the coverage probability is the sum of the target path probabilities P(u)
over F (greedy: 0/1, the greedy path's exit). Computed exactly per round from
the recorded edge probabilities, for these scored sets (paper Table 21, App. D.10):

  tree          Q = T (coverage 0 by Theorem 1: a check)
  top<M>        Q = the M highest draft-ranked candidates (∪ T)
  recorded      Q = the recording pass's scored set (`cand_scored`) ∪ T
  pool          Q = the whole pool (every scored subset of the pool covers at most this)
  frontier<K>   Q = T ∪ the K best draft-ranked frontier candidates
  frontier      Q = T ∪ the complete frontier (= `pool`'s coverage, fewer prefixes)

The decoder without a separate root pass, covered as its own trees are under the
run's policy, is `rerank.evaluate.policy`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import torch

from rerank.evaluate.joined import joined_columns, law_ordered_frame, law_spans
from rerank.evaluate.pool_chunks import PoolChunk, iter_pool_chunks
from selection.rules import parse_value_key, value_key
from specrank.runtime.jit import njit
from specrank.statistics.bootstrap import PromptSums, bootstrap_means, percentile_interval
from specrank.statistics.laws import law_columns

COVERAGE_COLUMNS = ["task", "cand_scored"]


@njit(nogil=True)
def _prefix_sets(order, rank, valid, parent, path_prob, scored, budget, tops, ks):  # fmt: skip
    """round_coverage's sets in one scan of each round's draft order. Per round and prefix set
    (tree, each top M, pool, each frontier K, frontier): coverage, extra scored prefixes and
    scored frontier size ([R, S] float64 each); for the recorded set (`scored` ∪ T) its
    extra prefixes and frontier size ([R, 2] float64) and the path mass of its frontier
    ([R, P] float32, 0 elsewhere: summed by torch, in torch's order, as before).

    The frontier mass is cumulated as a float32 curve in float64 (torch's float32 cumsum:
    each entry rounded), so every coverage is an entry of that curve, as before.
    """
    n_rounds, width = order.shape
    n_sets = 3 + tops.shape[0] + ks.shape[0]
    cov, extra, front = np.zeros((n_rounds, n_sets)), np.zeros((n_rounds, n_sets)), np.zeros((n_rounds, n_sets))  # fmt: skip
    frontier = np.zeros(width, dtype=np.bool_)
    recorded = np.zeros((n_rounds, 2))
    recorded_mass = np.zeros((n_rounds, width), dtype=np.float32)
    cum_mass = np.zeros(width, dtype=np.float32)
    cum_front = np.zeros(width, dtype=np.int64)
    for r in range(n_rounds):
        n_valid = 0
        for u in range(width):
            n_valid += valid[r, u]
            in_tree = valid[r, u] and rank[r, u] < budget
            p = parent[r, u]
            parent_in = p < 0 or (valid[r, p] and rank[r, p] < budget)
            frontier[u] = valid[r, u] and not in_tree and parent_in
            if scored[r, u] and valid[r, u] and not in_tree:
                recorded[r, 0] += 1
                if frontier[u]:
                    recorded[r, 1] += 1
                    recorded_mass[r, u] = path_prob[r, u]
        acc, n_front = 0.0, 0
        for j in range(width):
            u = order[r, j]
            if frontier[u]:
                acc += np.float64(path_prob[r, u])
                n_front += 1
            cum_mass[j], cum_front[j] = np.float32(acc), n_front
        n_tree = min(n_valid, budget)
        # tree (its frontier mass inside its own positions: 0 by construction, Theorem 1),
        # then each top M: the first n ranked
        for s in range(1 + tops.shape[0]):
            n = n_tree if s == 0 else min(n_valid, max(tops[s - 1], budget))
            cov[r, s] = cum_mass[min(n - 1, width - 1)] if n > 0 else 0.0
            front[r, s] = cum_front[min(n - 1, width - 1)] if n > 0 else 0
            extra[r, s] = n - n_tree
        s = 1 + tops.shape[0]
        cov[r, s], extra[r, s], front[r, s] = cum_mass[width - 1], n_valid - n_tree, n_front
        s += 1  # pool
        for k in ks:  # ranked entries up to the k-th frontier node (all of them if fewer)
            upto = 0
            while upto < width and cum_front[upto] < k:
                upto += 1
            cov[r, s] = cum_mass[min(upto, width - 1)]
            extra[r, s] = front[r, s] = min(n_front, k)
            s += 1
        cov[r, s], extra[r, s], front[r, s] = cum_mass[width - 1], n_front, n_front  # frontier
    return cov, extra, front, recorded, recorded_mass


def round_coverage(
    chunk: PoolChunk, budget: int, top_ms: Sequence[int], frontier_ks: Sequence[int]
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per round, for each scored set: (coverage, extra scored prefixes, scored frontier size). [R] each.

    Works in draft order, where the tree is the first B positions and every
    top-M or first-K-frontier set is a prefix, so one cumulative sum of the
    frontier mass answers all of them, in one compiled scan per round (`_prefix_sets`;
    the [R, P] torch passes it replaced took 6-9% of the pool pass).
    """
    pool = chunk.pool
    cov, extra, front, counts, mass = _prefix_sets(
        chunk.order.contiguous().numpy(), chunk.rank.contiguous().numpy(),
        pool.valid.contiguous().numpy(), pool.parent.contiguous().numpy(),
        chunk.ctx.path_prob.contiguous().numpy(), chunk.scored.contiguous().numpy(), budget,
        np.asarray(top_ms, dtype=np.int64), np.asarray(frontier_ks, dtype=np.int64),
    )  # fmt: skip
    names = ["tree", *(f"top{m}" for m in top_ms), "pool", *(f"frontier{k}" for k in frontier_ks),
             "frontier"]  # fmt: skip
    out = {name: (cov[:, i], extra[:, i], front[:, i]) for i, name in enumerate(names)}
    # the recorded set's coverage: a float32 sum of its frontier's mass, as torch orders it
    recorded = (torch.from_numpy(mass).sum(-1).double().numpy(), counts[:, 0], counts[:, 1])
    order = [*names[: 1 + len(top_ms)], "recorded", *names[1 + len(top_ms) :]]
    return {name: recorded if name == "recorded" else out[name] for name in order}


@dataclass
class CoverageRounds:
    """Collects per-round coverage of every scored set at every budget, chunk by chunk."""

    budgets: Sequence[int]
    top_ms: Sequence[int] = (100,)
    frontier_ks: Sequence[int] = (40,)
    # per chunk: (its rounds' prompt, task and temperature, their coverage columns)
    parts: list[tuple[pd.DataFrame, dict[str, np.ndarray]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("budgets", "top_ms", "frontier_ks"):
            values = list(getattr(self, name))
            if any(v < 1 for v in values) or (name == "budgets" and not values):
                raise ValueError(f"The '{name}' must be ints >= 1. Got {values} instead.")

    def add(self, chunk: PoolChunk) -> None:
        self.merge(self.part(chunk))

    def merge(self, part: tuple[pd.DataFrame, dict[str, np.ndarray]]) -> None:
        self.parts.append(part)

    def part(self, chunk: PoolChunk) -> tuple[pd.DataFrame, dict[str, np.ndarray]]:
        """A chunk's per-round coverage (computed anywhere; `merge` in chunk order)."""
        cols: dict[str, np.ndarray] = {}
        # the counts (at most the pool's width) held as int16 until the table joins them
        # as float64, exactly: a quarter of the bytes (24 columns x 6 bytes saved a round:
        # 0.5 GB at 10x, by count)
        count = np.int16 if chunk.pool.shape[1] < 2**15 else np.int32
        for b in self.budgets:
            for name, (cov, n_extra, n_front) in round_coverage(
                chunk, b, self.top_ms, self.frontier_ks
            ).items():
                cols[value_key(f"cov/{name}", b)] = cov
                cols[value_key(f"extra/{name}", b)] = n_extra.astype(count)
                cols[value_key(f"frontier/{name}", b)] = n_front.astype(count)
        return chunk.keys[["prompt_id", "task", "temperature"]].reset_index(drop=True), cols

    def table(self, n_resamples: int = 0, seed: int = 0) -> pd.DataFrame:
        """One row per (law, budget, scored set); `coverage_lo/hi`: 95% prompt-bootstrap interval.

        Columns: `coverage` (expected share of rounds whose emitted address is scored),
        `extra_scored` (mean scored prefixes outside the tree), `frontier_scored` (mean
        of those on the frontier), `rounds`, `prompts`. Round-weighted; no intervals
        when `n_resamples` is 0. Takes the rounds added (the accumulator is empty after).
        """
        if not self.parts:
            raise ValueError("the trace store holds no rounds")
        frame = self._law_ordered()
        cov_cols = [c for c in frame.columns if c.startswith("cov/")]
        rows = []
        for temperature, span in law_spans(frame["temperature"].to_numpy()):
            part = frame.iloc[span]  # a view (rows law by law), as groupby's part would copy
            means = part.mean(numeric_only=True)
            n_prompts = part["prompt_id"].nunique()  # once a law, not once a scored set
            draws = None
            if n_resamples > 0:
                stats = PromptSums.from_rounds(part, cov_cols)
                _, draws = bootstrap_means(stats, "round", n_resamples, seed)
            for j, col in enumerate(cov_cols):
                name, b = parse_value_key(col.removeprefix("cov/"))
                iv = percentile_interval(
                    means[col], draws[:, j] if draws is not None else np.empty(0)
                )
                rows.append(
                    {
                        **law_columns(float(temperature)),
                        "budget": int(b),
                        "scored_set": name,
                        **iv.columns("coverage"),
                        "extra_scored": means[value_key(f"extra/{name}", b)],
                        "frontier_scored": means[value_key(f"frontier/{name}", b)],
                        "rounds": len(part),
                        "prompts": n_prompts,
                    }
                )
        return pd.DataFrame(rows)

    def _law_ordered(self) -> pd.DataFrame:
        """Every round added, law by law (`rerank.evaluate.joined`), the parts freed."""
        heads, values = [h for h, _ in self.parts], [cols for _, cols in self.parts]
        self.parts = []
        head, order = law_ordered_frame(heads)
        return pd.concat([head, joined_columns(values, order)], axis=1)


def coverage_table(
    dataset: ds.Dataset,
    budgets: Sequence[int],
    top_ms: Sequence[int] = (100,),
    frontier_ks: Sequence[int] = (40,),
    n_resamples: int = 0,
    seed: int = 0,
    chunk_rounds: int = 8192,
) -> pd.DataFrame:
    """Coverage of every scored set per law and budget (see `CoverageRounds.table`)."""
    acc = CoverageRounds(list(budgets), list(top_ms), list(frontier_ks))
    for chunk in iter_pool_chunks(dataset, chunk_rounds, COVERAGE_COLUMNS):
        acc.add(chunk)
    return acc.table(n_resamples, seed)

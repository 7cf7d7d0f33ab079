"""Coverage of scored sets on the recorded pools, and the decoder without a root pass (issue 14.7).

Coverage (SPEC §3, paper Eq. 5): with the verified tree T = the draft top-B and
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
from torch import Tensor

from rerank.evaluate.joined import joined_columns, law_ordered_frame, law_spans
from rerank.evaluate.pool_chunks import PoolChunk, iter_pool_chunks
from selection.rules import parse_value_key, value_key
from specrank.bootstrap import PromptSums, bootstrap_means, percentile_interval
from specrank.laws import law_columns

COVERAGE_COLUMNS = ["task", "cand_scored"]


def _at(curve: Tensor, count: Tensor) -> Tensor:
    """curve[:, count - 1] per row: a cumulative curve after `count` entries (0 -> 0). [R]."""
    idx = (count - 1).clamp(0, curve.shape[-1] - 1)
    return torch.where(count > 0, torch.gather(curve, -1, idx[:, None])[:, 0], 0.0)


def round_coverage(
    chunk: PoolChunk, budget: int, top_ms: Sequence[int], frontier_ks: Sequence[int]
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per round, for each scored set: (coverage, extra scored prefixes, scored frontier size). [R] each.

    Works in draft order, where the tree is the first B positions and every
    top-M or first-K-frontier set is a prefix, so one cumulative sum of the
    frontier mass answers all of them (no [R, P] pass per scored set).
    """
    pool, order, rank = chunk.pool, chunk.order, chunk.rank
    valid = pool.valid
    in_tree = (rank < budget) & valid
    parent_in = torch.gather(in_tree, -1, pool.parent.clamp(min=0))
    frontier = valid & ~in_tree & ((pool.parent < 0) | parent_in)
    front_o = torch.gather(frontier, -1, order)
    mass_o = torch.where(front_o, chunk.path_prob_ordered, 0.0)
    cum_mass = torch.cumsum(mass_o, -1)  # frontier mass within the first j+1 ranked
    cum_front = torch.cumsum(front_o, -1, dtype=torch.int32)  # frontier nodes among them
    n_valid = valid.sum(-1)
    n_tree = n_valid.clamp(max=budget)
    n_front = cum_front[:, -1].long()
    # Q = T: the frontier mass inside the tree's own positions (0 by construction, Theorem 1)
    out = {"tree": (_at(cum_mass, n_tree), n_tree - n_tree, _at(cum_front, n_tree))}
    for m in top_ms:
        n_top = n_valid.clamp(max=max(m, budget))
        out[f"top{m}"] = (_at(cum_mass, n_top), n_top - n_tree, _at(cum_front, n_top))
    scored_front = frontier & chunk.scored
    out["recorded"] = (
        torch.where(scored_front, chunk.ctx.path_prob, 0.0).sum(-1),
        (chunk.scored & valid & ~in_tree).sum(-1),
        scored_front.sum(-1),
    )
    out["pool"] = (cum_mass[:, -1], n_valid - n_tree, n_front)
    for k in frontier_ks:
        # ranked entries up to the k-th frontier node: searchsorted on the frontier count
        upto = torch.searchsorted(cum_front, torch.full((len(n_valid), 1), k, dtype=torch.int32))
        n_k = n_front.clamp(max=k)
        out[f"frontier{k}"] = (_at(cum_mass, upto[:, 0] + 1), n_k, n_k)
    out["frontier"] = (cum_mass[:, -1], n_front, n_front)
    return {
        name: tuple(v.double().numpy() for v in values)  # type: ignore[misc]
        for name, values in out.items()
    }


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

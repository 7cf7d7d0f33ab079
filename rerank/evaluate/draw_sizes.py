"""Tree sizes of the draw rules (paper Table 12, App. D.2).

Root-draw and PEARL-style selection draw X1 from the root row first; their
verified trees then depend on the draw. Everything here is an exact
expectation over that draw under the recorded root row (greedy: the argmax),
summed over rounds, never a sample:

  top-draw share        E[p(g* | c)], g* the drafter's top first-level token
  size after top/other  E[size · 1{X1 = g*}] / E[1{X1 = g*}], and likewise over
                        the other first-level tokens (draws outside the first
                        level keep the drawn token alone: size 1, in neither)
  matched PEARL         PEARL with its pre-draw budget raised until its mean
                        tree size equals root-draw's; the budget mixes the two
                        nearest whole budgets (`selection.draws.matched_budget`,
                        point estimate; `rerank.report.summary` repeats the matching in
                        every bootstrap resample for the *values*)
  exceeds B             E[1{matched PEARL's pruned tree holds more than B nodes}]

With g a first-level candidate, d_g its pool descendants and T_b the draft
top-b tree: root-draw keeps 1 + min(B-1, |d_g|) nodes after drawing g, PEARL
at pre-draw budget b keeps 1 + |d_g ∩ T_b|. The latter exceeds B from the
budget b at which g's B-th descendant in draft order enters T_b, so the
expected exceed share at every b is one scatter and one cumulative sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import torch
from torch import Tensor

from rerank.evaluate.pool_chunks import PoolChunk, iter_pool_chunks
from selection.draws import matched_budget
from selection.rules import parse_value_key
from specrank.runtime.jit import njit
from specrank.statistics.bootstrap import PromptSums, bootstrap_means, percentile_interval
from specrank.statistics.laws import law_columns


@njit(nogil=True)
def _curve_sums(order, anc, below, law, size, law_of, n_laws, budgets):  # fmt: skip
    """Per-law sums over rounds of the size curves at every pre-draw budget 1..P, in float64,
    [n_laws, 2 + n_b, P]: PEARL's size, its size times 1{X1 = g*}, then for each B the share
    whose matched PEARL tree exceeds B; and each candidate's count of such descendants
    (float32 [R, P]).

    One scan of each round's draft order counts every first-level candidate's descendants
    as they enter the draft tree (`below`: valid, depth >= 2): g's B-th one adds p(g|c) to
    the exceed curve from there on. Each round's curve is the float32 one the torch route
    built (a float32 cumulative sum accumulates in float64, rounding each entry): only the
    order of the float64 sum over rounds differs from it (`test_fast_paths`). Fused because
    the [R, P] curves, cumulated and masked by law, took 6% of the pool pass.
    """
    n_rounds, width = order.shape
    n_b = budgets.shape[0]
    out = np.zeros((n_laws, 2 + n_b, width))
    n_desc = np.empty((n_rounds, width), dtype=np.float32)
    count = np.zeros(width, dtype=np.int64)
    running = np.zeros(n_b)
    for r in range(n_rounds):
        k, top = law_of[r], order[r, 0]  # draft rank 0 is a first-level candidate
        p_top = law[r, top]
        count[:] = 0
        running[:] = 0.0
        n_top = 0
        for j in range(width):
            u = order[r, j]
            if below[r, u]:
                g = anc[r, u]
                count[g] += 1
                if g == top:
                    n_top += 1
                for i in range(n_b):
                    if count[g] == budgets[i]:
                        running[i] += law[r, g]
            out[k, 0, j] += size[r, j]
            out[k, 1, j] += p_top * np.float32(1 + n_top)
            for i in range(n_b):
                out[k, 2 + i, j] += np.float32(running[i])
        n_desc[r] = count
    return out, n_desc


def _pad_edge(a: np.ndarray, width: int) -> np.ndarray:
    """Extend a cumulative curve to `width` with its last value (the tree holds the whole pool)."""
    return a if a.shape[-1] >= width else np.pad(a, (0, width - a.shape[-1]), mode="edge")


@dataclass
class DrawSizeSums:
    """Per-temperature sums over rounds of the draw rules' size terms (see module doc)."""

    budgets: Sequence[int]
    scalars: dict[float, dict[str, float]] = field(default_factory=dict)
    curves: dict[float, dict[str, np.ndarray]] = field(default_factory=dict)

    def add(self, chunk: PoolChunk) -> None:
        self.merge(self.part(chunk))

    def part(self, chunk: PoolChunk) -> dict[float, tuple[dict[str, float], dict[str, np.ndarray]]]:
        """A chunk's sums per temperature (computed anywhere; `merge` them in chunk order)."""
        pool, ctx, order = chunk.pool, chunk.ctx, chunk.order
        law, anc = ctx.law, ctx.first_ancestor
        first = (pool.depth == 1) & pool.valid
        below = (pool.depth >= 2) & pool.valid
        # pool order puts the first level in the leading columns: first-level sums need only those
        n1 = max(int(first.sum(-1).max()), 1)
        top = order[:, :1]  # draft rank 0 is a first-level candidate (ancestor closure)
        p_top = torch.gather(law, -1, top)[:, 0]
        law1 = torch.where(first[:, :n1], law[:, :n1], 0.0)
        _, size = chunk.pearl  # [R, P]: 1 + E|d_X1 ∩ T_b| at b = 1..P
        temperature = chunk.temperature
        laws, law_of = np.unique(temperature, return_inverse=True)
        sums, n_desc = _curve_sums(
            order.contiguous().numpy(), anc.contiguous().numpy(), below.contiguous().numpy(),
            law.contiguous().numpy(), size.contiguous().numpy(), law_of.astype(np.int64),
            len(laws), np.asarray(self.budgets, dtype=np.int64),
        )  # fmt: skip
        n_desc = torch.from_numpy(n_desc)[:, :n1]
        n_desc_top = torch.gather(n_desc, -1, top)[:, 0]
        terms: dict[str, Tensor] = {
            "rounds": torch.ones_like(p_top),
            "p_top": p_top,
            "first_mass": law1.sum(-1),
        }
        for b in self.budgets:
            kept = n_desc.clamp(max=max(b - 1, 0))  # descendants root-draw keeps below each g
            terms[f"rd_size@{b}"] = 1 + (law1 * kept).sum(-1)
            terms[f"rd_top@{b}"] = p_top * (1 + n_desc_top.clamp(max=max(b - 1, 0)))
        names = ["pearl_size", "pearl_top", *(f"exceed@{b}" for b in self.budgets)]
        out = {}
        for i, t in enumerate(laws):
            rows = torch.from_numpy(temperature == t)
            out[float(t)] = (
                {k: float(v[rows].sum(dtype=torch.float64)) for k, v in terms.items()},
                dict(zip(names, sums[i], strict=True)),
            )
        return out

    def merge(self, part: dict[float, tuple[dict[str, float], dict[str, np.ndarray]]]) -> None:
        """Add a chunk's sums (chunk after chunk: the float sums' order is fixed)."""
        for t, (scalars, curves) in part.items():
            acc = self.scalars.setdefault(t, {})
            for k, v in scalars.items():
                acc[k] = acc.get(k, 0.0) + v
            store = self.curves.setdefault(t, {})
            for k, new in curves.items():
                old = store.get(k, np.zeros(1))
                w = max(len(new), len(old))
                store[k] = _pad_edge(old, w) + _pad_edge(new, w)

    def table(self) -> pd.DataFrame:
        """One row per (law, budget); columns in the module doc (`size_*`, `*_share`, `matched_budget`)."""
        if not self.scalars:
            raise ValueError("the trace store holds no rounds")
        rows = []
        for t, s in sorted(self.scalars.items()):
            c = self.curves[t]
            n, p_top, first_mass = s["rounds"], s["p_top"], s["first_mass"]
            p_other, outside = first_mass - p_top, n - first_mass
            for b in self.budgets:
                rd, rd_top = s[f"rd_size@{b}"], s[f"rd_top@{b}"]
                i = min(b, len(c["pearl_size"])) - 1

                def at(name: str, j: int = i, c: dict = c) -> float:
                    return float(c[name][j])

                rec = {
                    **law_columns(t),
                    "budget": b,
                    "rounds": round(n),
                    "top_draw_share": p_top / n,
                    "other_first_share": p_other / n,
                    "size_root_draw": rd / n,
                    "size_root_draw_top": _ratio(rd_top, p_top),
                    "size_root_draw_other": _ratio(rd - rd_top - outside, p_other),
                    "size_pearl": at("pearl_size") / n,
                    "size_pearl_top": _ratio(at("pearl_top"), p_top),
                    "size_pearl_other": _ratio(
                        at("pearl_size") - at("pearl_top") - outside, p_other
                    ),
                }
                rec |= _matched(c, b, rd / n, n, p_top, p_other, outside)
                rows.append(rec)
        return pd.DataFrame(rows)


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else float("nan")


def _matched(
    c: dict[str, np.ndarray], b: int, target: float, n: float, p_top, p_other, outside
) -> dict[str, float]:
    """Matched-size PEARL's budget, sizes and exceed share (NaN where the pool is too small)."""
    keys = ("matched_budget", "size_pearl_matched", "size_pearl_matched_top",
            "size_pearl_matched_other", "exceed_share_pearl_matched")  # fmt: skip
    curve = torch.from_numpy(c["pearl_size"] / n)
    if target > curve[-1]:  # even the whole pool's PEARL trees are smaller on average
        return dict.fromkeys(keys, float("nan"))
    lo, hi, w = matched_budget(curve, target)

    def mix(name: str) -> float:
        return float(w * c[name][lo - 1] + (1 - w) * c[name][hi - 1])

    size, top = mix("pearl_size"), mix("pearl_top")
    values = (w * lo + (1 - w) * hi, size / n, _ratio(top, p_top),
              _ratio(size - top - outside, p_other), mix(f"exceed@{b}") / n)  # fmt: skip
    return dict(zip(keys, values, strict=True))


def draw_size_table(
    dataset: ds.Dataset, budgets: Sequence[int], chunk_rounds: int = 8192
) -> pd.DataFrame:
    """Draw-rule tree sizes per law and budget, read from the traces (`DrawSizeSums.table`)."""
    acc = DrawSizeSums(list(budgets))
    for chunk in iter_pool_chunks(dataset, chunk_rounds):
        acc.add(chunk)
    return acc.table()


def size_means(per_round: pd.DataFrame, n_resamples: int = 0, seed: int = 0) -> pd.DataFrame:
    """Mean expected tree size of every `size/<rule>@B<b>` column of the per-round table.

    One row per (law, budget, rule) with a round-weighted 95% prompt-bootstrap
    interval (`size_lo/hi`; NaN when `n_resamples` is 0).
    """
    cols = [c for c in per_round.columns if c.startswith("size/") and parse_value_key(c)]
    if not cols:
        raise KeyError("the per-round table has no 'size/<rule>@B<b>' columns (no draw rules)")
    rows = []
    # the columns read, selected first (no copy): each law's part then copies only those
    by_law = per_round[["temperature", "prompt_id", "task", *cols]].groupby("temperature")
    for temperature, part in by_law:
        stats = PromptSums.from_rounds(part, cols)
        point = stats.sums.sum(0) / stats.rounds.sum()
        draws = bootstrap_means(stats, "round", n_resamples, seed)[1] if n_resamples else None
        for j, col in enumerate(cols):
            rule, b = parse_value_key(col.removeprefix("size/"))
            iv = percentile_interval(point[j], draws[:, j] if draws is not None else np.empty(0))
            rows.append({**law_columns(float(temperature)), "budget": int(b), "rule": rule,
                         **iv.columns("size"),
                         "rounds": int(stats.rounds.sum()), "prompts": len(stats.prompts)})  # fmt: skip
    return pd.DataFrame(rows)

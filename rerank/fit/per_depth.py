"""The per-depth calibration control (docs/method.md#cross-fitting): isotonic maps of every
draft factor, one per depth, fitted out of fold on pool edges of the traces (streamed, kept
edges only) and applied to every edge of a pool in the evaluation's pass."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import torch

from calibrate.isotonic import DEFAULT_BINS, PerDepthIsotonic
from rerank.evaluate.pool_chunks import iter_trace_chunks
from rerank.fit.halves import prompt_folds
from selection.pool_batch import PoolBatch
from selection.ranking import pool_levels
from specrank.runtime.memory import release_freed_heap
from specrank.settings.errors import Refusal

# What the per-depth maps read of the traces (fit_per_depth_maps reads nothing else).
EDGE_COLUMNS = ["prompt_id", "temperature", "root_argmax", "cand_parent", "cand_depth",
                "cand_token", "cand_draft_logprob", "cand_target_prob", "cand_target_argmax"]  # fmt: skip


class _FlatEdges:
    """A trace table's pool edges as flat arrays in row-major pool order (no dense pools).

    The same values `selection.pool_batch.pool_batch_from_table` would put in the
    valid entries of its dense tensors, in the order a row-major mask reads them;
    columns stay Arrow's own buffers until the kept edges are gathered.
    """

    def __init__(self, table: pa.Table) -> None:
        parent = table["cand_parent"].combine_chunks()
        self.lengths = pc.list_value_length(parent).fill_null(0).to_numpy().astype(np.int64)
        self.starts = np.cumsum(self.lengths) - self.lengths
        self.width = int(self.lengths.max(initial=0))
        fills = {"cand_parent": -1, "cand_depth": 0, "cand_token": -1,
                 "cand_draft_logprob": -np.inf, "cand_target_prob": 0.0, "cand_target_argmax": -1}  # fmt: skip
        self.flat = {}
        for name, fill in fills.items():
            values = table[name].combine_chunks().flatten()
            values = values.fill_null(fill) if values.null_count else values
            self.flat[name] = values.to_numpy(zero_copy_only=False)
        self.root_argmax = table["root_argmax"].to_numpy().astype(np.int64)
        self.greedy = table["temperature"].to_numpy().astype(np.float32) == 0

    def positions(self, rows: np.ndarray, pick: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(flat position, row) of edges `pick` of the edge list of `rows` (row by row, pool order)."""
        ends = np.cumsum(self.lengths[rows])
        at = np.searchsorted(ends, pick, side="right")  # which of `rows` holds each edge
        row = rows[at]
        within = pick - (ends[at] - self.lengths[row])
        return self.starts[row] + within, row

    def arrays(self, pos: np.ndarray, row: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per-edge (draft prob, depth, law target prob) at flat positions `pos` of rows `row`."""
        f = self.flat
        parent = f["cand_parent"][pos].astype(np.int64)
        # the target's argmax at the edge's parent prefix (the root row at depth 1)
        parent_argmax = np.where(
            parent >= 0,
            f["cand_target_argmax"][self.starts[row] + np.maximum(parent, 0)].astype(np.int64),
            self.root_argmax[row],
        )
        greedy_edge = (f["cand_token"][pos].astype(np.int64) == parent_argmax).astype(np.float32)
        law = np.where(self.greedy[row], greedy_edge, f["cand_target_prob"][pos].astype(np.float32))
        return (
            np.exp(f["cand_draft_logprob"][pos].astype(np.float32).astype(np.float64)),
            f["cand_depth"][pos].astype(np.int64),
            law.astype(np.float64),
        )


def fit_per_depth_maps(dataset: ds.Dataset, folds: dict[str, int], max_edges: int, seed: int,
                       chunk_rounds: int) -> dict[tuple[float, int], PerDepthIsotonic]:  # fmt: skip
    """Per-depth isotonic maps of every draft factor, one per (temperature, predicted fold).

    The map for fold f is fitted on pool edges of fold 1-f prompts: at most
    `max_edges` per (temperature, half), thinned uniformly while streaming so
    paper-scale traces never sit in memory. Only the kept edges are gathered
    (`_FlatEdges`); the thinning draws one uniform number per edge.
    """
    rng = np.random.default_rng(seed)
    n_rounds = dataset.count_rows()
    buckets: dict[tuple[float, int], list[tuple[np.ndarray, ...]]] = {}
    rate = None
    for table in iter_trace_chunks(dataset, chunk_rounds, EDGE_COLUMNS):
        prompt_fold = prompt_folds(pc.dictionary_encode(table["prompt_id"]).to_pandas(), folds)
        edges = _FlatEdges(table)
        if rate is None:  # ~4 (temperature, half) groups share the rounds: oversample 4x
            rate = min(1.0, 4 * max_edges / max(1, n_rounds * edges.width))
        temps = table["temperature"].to_numpy()
        for t in np.unique(temps):
            for half in (0, 1):
                rows = np.flatnonzero((temps == t) & (prompt_fold == half))
                if rows.size:
                    # one uniform number per edge of these rows, in pool order
                    keep = np.flatnonzero(rng.random(int(edges.lengths[rows].sum())) < rate)
                    buckets.setdefault((float(t), half), []).append(
                        edges.arrays(*edges.positions(rows, keep))
                    )
    return maps_of_buckets(buckets, max_edges, rng)


def maps_of_buckets(buckets: dict[tuple[float, int], list[tuple[np.ndarray, ...]]],
                    max_edges: int, rng: np.random.Generator,
                    ) -> dict[tuple[float, int], PerDepthIsotonic]:  # fmt: skip
    """The per-depth map of each (temperature, half)'s kept edges (x, depth, y), at most
    `max_edges` of them drawn without replacement, keyed by the half it predicts."""
    maps = {}
    for (t, half), chunks in buckets.items():
        x, d, y = (np.concatenate(c) for c in zip(*chunks, strict=True))
        if x.size > max_edges:
            pick = rng.choice(x.size, max_edges, replace=False)
            x, d, y = x[pick], d[pick], y[pick]
        maps[(t, 1 - half)] = PerDepthIsotonic(n_bins=DEFAULT_BINS).fit(x, y, d)
    return maps


def per_depth_factors(
    pool: PoolBatch,
    prompt_ids: np.ndarray,
    folds: dict[str, int],
    maps: dict[tuple[float, int], PerDepthIsotonic],
) -> torch.Tensor:
    """Every edge's log factor through its depth's out-of-fold map, -inf off the pool. [R, P]
    (the per-depth rule's scores are their path sums)."""
    fold = np.array([folds[p] for p in prompt_ids])
    temps = pool.temperature.numpy()
    logf = torch.full(pool.shape, -torch.inf)
    depth = pool.depth.numpy()
    levels = pool_levels(pool.parent, pool.depth)
    for t in np.unique(temps):
        for f in np.unique(fold[temps == t]):
            if (float(t), int(f)) not in maps:
                raise Refusal(f"no per-depth map for T={t:g} fold {f}: the other half has no "
                              f"rounds at T={t:g} (expected a trace store, rerank.traces, with "
                              f"rounds at each temperature in both rerank.halves halves)")  # fmt: skip
    for (t, f), iso in maps.items():
        rows = np.flatnonzero((temps == np.float32(t)) & (fold == f))
        if rows.size == 0:
            continue
        q = np.exp(pool.draft_logprob.numpy()[rows], dtype=np.float64)  # no float64 copy
        if levels:  # each depth's columns at once: the same values PerDepthIsotonic maps
            cal = np.empty_like(q)
            for d, (lo, hi) in enumerate(levels, start=1):
                if d not in iso.maps_:  # as PerDepthIsotonic.predict refuses it
                    raise Refusal(f"no map for depth(s) [{d}]: the training half had edges "
                                  f"at depths {sorted(iso.maps_)} only (expected a trace store, "
                                  f"rerank.traces, with edges at every pool depth in both "
                                  f"halves: record more prompts)")  # fmt: skip
                cal[:, lo:hi] = iso.maps_[d].predict(q[:, lo:hi].ravel()).reshape(rows.size, -1)
        else:
            cal = iso.predict(q.reshape(-1), depth[rows].reshape(-1)).reshape(rows.size, -1)
        logf[rows] = torch.from_numpy(np.log(cal).astype(np.float32))  # the maps clip already
    return torch.where(pool.valid, logf, -torch.inf)


def per_depth_extra(dataset: ds.Dataset, folds: dict[str, int], max_edges: int, seed: int,
                    chunk_rounds: int) -> Callable[[PoolBatch, pa.Table], dict[str, torch.Tensor]]:  # fmt: skip
    """The evaluation pass's `extra_factor` of the per-depth control: every edge's log factor
    through the maps fitted here out of fold (`fit_per_depth_maps`)."""
    maps = fit_per_depth_maps(dataset, folds, max_edges, seed, chunk_rounds)
    release_freed_heap()

    def extra(pool: PoolBatch, table: pa.Table) -> dict[str, torch.Tensor]:
        ids = table["prompt_id"].to_numpy(zero_copy_only=False)
        return {"per_depth": per_depth_factors(pool, ids, folds, maps)}

    return extra

"""Out-of-fold first-factor predictions of every learned rule (docs/method.md#features-8).

For each decoding law separately (greedy rows are never mixed with sampled rows), cross-fitted
rerankers (one per feature set: Base, Rows and those beyond the paper), the isotonic control of
the first draft factor and the draft-rank control give phat for every first-level candidate;
per-depth isotonic maps of every draft factor are fitted on pool edges of the training half.
Every prediction of a prompt comes from a model fitted on the other half (`rerank.fit.folds`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import torch

from calibrate.isotonic import DEFAULT_BINS, PerDepthIsotonic
from rerank.evaluate.matched import SimulatedPredictions
from rerank.evaluate.pool_chunks import ROUND_KEYS, iter_trace_chunks
from rerank.fit.binned import BinnedRuns
from rerank.fit.boosting import PAPER_CAPACITY, Capacity
from rerank.fit.design import same_values
from rerank.fit.folds import crossfit_calibrate, crossfit_rank_control, prompt_halves
from rerank.fit.law_memo import LawMemo
from rerank.fit.models import LABEL_OF_LAW, FittedReranker
from rerank.fit.out_of_fold import CrossfitResult, FitStore, LawFits, frame_folds, prompt_folds
from selection.pool_batch import PoolBatch
from selection.ranking import pool_levels
from selection.rules import learned
from specrank.errors import Refusal
from specrank.laws import law_kind
from specrank.memory import release_freed_heap

log = logging.getLogger(__name__)
# Cross-fits every (temperature, feature set) job elsewhere: (settings, jobs, folds) -> results
Prefit = Callable[
    [LawFits, list[tuple[float, str]], dict[str, int]], Mapping[tuple[float, str], CrossfitResult]
]


def fold_map(prompt_ids: np.ndarray, scheme: str, seed: int,
             tasks: np.ndarray | None = None) -> dict[str, int]:  # fmt: skip
    """prompt id -> fold (0/1), computed once over ALL prompts so chunks agree.

    ``tasks`` (aligned with ``prompt_ids``) balances the halves within each task
    (`rerank.fit.folds.prompt_halves`); without it all prompts count as one task.
    """
    if tasks is None:
        unique = np.unique(prompt_ids)
        return dict(zip(unique.tolist(), prompt_halves(unique, scheme, seed).tolist(), strict=True))
    # One row per (prompt, task) pair: the split works on prompts, not on millions of rows;
    # a prompt with two tasks survives as two rows and is refused by prompt_halves.
    pairs = pd.DataFrame({"prompt_id": prompt_ids, "task": tasks}).drop_duplicates()
    pids = pairs["prompt_id"].to_numpy().astype(str)
    folds = prompt_halves(pids, scheme, seed, tasks=pairs["task"].to_numpy().astype(str))
    return dict(zip(pids.tolist(), folds.tolist(), strict=True))


def halves_table(frame: pd.DataFrame, folds: dict[str, int]) -> pd.DataFrame:
    """Prompts and rounds per task and half (plus an `all` row), to print and log the split.

    ``frame`` has `prompt_id`, `task` and the round keys (candidate or round rows,
    any multiplicity); columns `prompts_0`, `prompts_1`, `rounds_0`, `rounds_1`
    count prompts and distinct rounds (all laws together) in halves 0 and 1.
    """
    keys = [k for k in ROUND_KEYS if k in frame.columns]
    rounds = frame[["task", *keys]].drop_duplicates()
    rounds = rounds.assign(half=rounds["prompt_id"].map(folds))
    if rounds["half"].isna().any():
        raise ValueError("rows with prompts outside the fold map")
    grouped = rounds.groupby(["task", "half"])
    table = pd.concat(
        {"prompts": grouped["prompt_id"].nunique(), "rounds": grouped.size()}, axis=1
    ).unstack("half", fill_value=0)
    table = table.reindex(columns=pd.MultiIndex.from_product([["prompts", "rounds"], [0, 1]]),
                          fill_value=0)  # fmt: skip
    table.columns = [f"{what}_{int(half)}" for what, half in table.columns]
    table.loc["all"] = table.sum()
    table.index.name = "task"
    return table.astype(np.int64)


@dataclass
class FirstFactorPredictions:
    """ROUND_KEYS + cand_index + fold + one phat column per learned rule, and fitted models."""

    frame: pd.DataFrame
    rules: list[str]
    models: dict[str, tuple[FittedReranker, FittedReranker]] = field(default_factory=dict)
    fit_seconds: dict[str, tuple[float, float]] = field(default_factory=dict)
    # The candidate-table row (position) of each row of `frame`, when made from that table.
    rows: np.ndarray | None = None

    def law_columns(self, candidates: pd.DataFrame, columns: list[str]
                    ) -> Iterator[tuple[float, dict[str, np.ndarray]]]:  # fmt: skip
        """Per temperature (ascending), `columns` of its predictions' rows (of the prediction
        frame or of each one's candidate), as the rows of `joined` give them, without its
        copy of the whole prediction frame."""
        if self.rows is None:  # a frame not made from the candidate table: joined by keys
            merged = self.joined(candidates, [c for c in columns if c not in self.frame])
            for t, part in merged.groupby("temperature"):
                yield float(t), {c: part[c].to_numpy() for c in columns}
            return
        temps = self.frame["temperature"].to_numpy()
        for t in np.unique(temps):
            at = np.flatnonzero(temps == t)
            yield float(t), {c: self.frame[c].to_numpy()[at] if c in self.frame
                             else candidates[c].to_numpy()[self.rows[at]] for c in columns}  # fmt: skip

    def joined(self, candidates: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
        """`columns` of each prediction's candidate beside the prediction frame.

        What `candidates.merge(frame, on=ROUND_KEYS + cand_index)` gives, in the same
        order within each temperature, without a join of the whole candidate table.
        """
        keys = [*ROUND_KEYS, "cand_index"]
        if self.rows is None:
            return candidates[list(dict.fromkeys([*keys, *columns]))].merge(self.frame, on=keys)
        extra = [c for c in columns if c not in self.frame.columns]
        part = candidates[extra].take(self.rows).reset_index(drop=True)
        return pd.concat([self.frame.reset_index(drop=True), part], axis=1)


def predict_first_factors(
    candidates: pd.DataFrame,
    folds: dict[str, int],
    kind: str,
    feature_sets: list[str],
    calibrators: list[str],
    seed: int = 0,
    n_threads: int | None = None,
    rank_q_bins: int = 1,
    capacity: Capacity = PAPER_CAPACITY,
    law_frame: Callable[[float], pd.DataFrame] | None = None,
    prior_split: str = "prompt",
    fits: FitStore | None = None,
    train_share: float = 1.0,
    prefit: Prefit | None = None,
    simulated: SimulatedPredictions | None = None,
) -> FirstFactorPredictions:
    """Cross-fitted phat of every learned first-factor rule, per law (rerankers of ``capacity``).

    ``rank_q_bins``: draft-probability bins within each draft rank of the rank control.
    ``prior_split``: how the token prior alternates the training rows (`rerank.fit.token_prior`).
    ``law_frame(temperature)``, when given, returns every column of that temperature's
    rows, in the order they have in ``candidates``, which then needs only the keys,
    `task` and `temperature` (the job reads one law's features at a time that way); by
    default each law's rows are taken from ``candidates``. ``fits``: where finished fits are
    kept and taken from (`rerank.fit.resume`). ``train_share``: the share of each training
    half's prompts a model is fitted on (`rerank.fit.folds.prompt_subsample`).
    ``prefit(settings, jobs, folds)``, when given, cross-fits every (temperature, feature
    set) of ``jobs`` elsewhere first (Ray workers: `rerank.on_ray`), each as
    ``settings.crossfit`` would here. ``simulated``: its sets' held-out phat with and without
    the matched row too (`with/<rule>`, `without/<rule>`: `rerank.evaluate.matched`).
    """
    parts, rules = [], []
    models: dict[str, tuple[FittedReranker, FittedReranker]] = {}
    seconds: dict[str, tuple[float, float]] = {}
    temperatures = candidates["temperature"].to_numpy()
    settings = LawFits(kind, seed, n_threads, tuple(sorted(candidates["task"].unique())),
                       capacity, prior_split, fits, train_share)  # fmt: skip
    jobs = [(float(t), fs) for t in np.unique(temperatures) for fs in feature_sets]
    done, positions = (prefit(settings, jobs, folds) if prefit is not None else {}), []
    for temperature in np.unique(temperatures):  # a half's rows at a time, not a sorted copy
        law = law_kind(float(temperature))
        rows = np.flatnonzero(temperatures == temperature)
        positions.append(rows)
        frame = _law_rows(candidates, rows, float(temperature), law_frame)
        fold = frame_folds(frame, folds)
        # the keys in the candidate table's own dtypes (categories of the job's strings:
        # 3 bytes a row where two strings take 33), the rows checked equal to the frame's
        out = candidates[[*ROUND_KEYS, "cand_index"]].take(rows).reset_index(drop=True)
        out["fold"] = fold
        runs, memo = BinnedRuns(), LawMemo()  # what the law's feature sets' fits share
        for feature_set in feature_sets:
            name, key = learned(feature_set, kind).name, (float(temperature), feature_set)
            runs.keep = feature_set != feature_sets[-1]  # the last set takes the kept runs
            res = done[key] if key in done else settings.crossfit(frame, *key, folds, runs, memo)
            out[name] = res.phat
            if simulated is not None:
                simulated.add_to(out, name, feature_set, res.models, fold, key[0])
            release_freed_heap()  # the fits' transient matrices
            models[f"{name}/T{temperature:g}"] = res.models
            seconds[f"{name}/T{temperature:g}"] = res.fit_seconds
            if name not in rules:
                rules.append(name)
            log.info("%s at T=%g: fitted in %.1f s + %.1f s, %d + %d iterations", name,
                     temperature, *res.fit_seconds, *(m.n_iter for m in res.models))  # fmt: skip
        for name in _add_controls(out, frame, law, fold, calibrators, rank_q_bins):
            if name not in rules:
                rules.append(name)
        parts.append(out)
        del frame, runs, memo  # the next law's rows take their place
        release_freed_heap()
    return FirstFactorPredictions(
        pd.concat(parts, ignore_index=True), rules, models, seconds, np.concatenate(positions)
    )


def _law_rows(
    candidates: pd.DataFrame,
    rows: np.ndarray,
    temperature: float,
    law_frame: Callable[[float], pd.DataFrame] | None,
) -> pd.DataFrame:
    """One law's candidate rows `rows`: from ``law_frame`` (checked) or from ``candidates``."""
    if law_frame is None:
        return candidates.take(rows).reset_index(drop=True)
    frame = law_frame(temperature)
    _check_same_rows(frame, candidates, rows, temperature)
    return frame


def _add_controls(
    out: pd.DataFrame,
    frame: pd.DataFrame,
    law: str,
    fold: np.ndarray,
    calibrators: list[str],
    rank_q_bins: int,
) -> list[str]:
    """Add the cross-fitted controls among ``calibrators`` to ``out``; their names, in order."""
    added = []
    if "rank_control" in calibrators:
        # the draft-rank control: the other half's mean label at the candidate's draft rank
        y = frame[LABEL_OF_LAW[law]].to_numpy()
        out["rank_control"], _ = crossfit_rank_control(
            frame["draft_rank"].to_numpy(), frame["draft_prob"].to_numpy(), y, fold,
            rank_q_bins,
        )  # fmt: skip
        added.append("rank_control")
    if "iso_q1" in calibrators:
        # isotonic map of the first draft factor over 200 equal-count bins (docs/method.md#cross-fitting)
        x, y = frame["draft_prob"].to_numpy(), frame[LABEL_OF_LAW[law]].to_numpy()
        out["iso_q1"] = crossfit_calibrate(x, y, fold).prob
        added.append("iso_q1")
    return added


def _check_same_rows(
    frame: pd.DataFrame, candidates: pd.DataFrame, rows: np.ndarray, temperature: float
) -> None:
    """A law's rows as `law_frame` gave them must be `candidates`' rows `rows`, in order."""
    keys = [*ROUND_KEYS, "cand_index"]
    if len(frame) != rows.size:
        raise ValueError(
            f"law_frame({temperature:g}) gave {len(frame)} rows; the candidate table has "
            f"{rows.size} at T={temperature:g}"
        )
    for key in keys:  # Series compared as Series: no Python string per row
        got = frame[key].reset_index(drop=True)
        want = candidates[key].iloc[rows].reset_index(drop=True)
        bad = np.flatnonzero(~same_values(got, want))
        if bad.size:
            raise ValueError(
                f"law_frame({temperature:g}) gave its rows in another order than the candidate "
                f"table: row {bad[0]} has {key}={got[bad[0]]!r}, the table {want[bad[0]]!r}"
            )


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
        edges = _FlatEdges(table)
        if rate is None:  # ~4 (temperature, half) groups share the rounds: oversample 4x
            rate = min(1.0, 4 * max_edges / max(1, n_rounds * edges.width))
        prompt_fold = prompt_folds(pc.dictionary_encode(table["prompt_id"]).to_pandas(), folds)
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
    maps = {}
    for (t, half), chunks in buckets.items():
        x, d, y = (np.concatenate(c) for c in zip(*chunks, strict=True))
        if x.size > max_edges:
            pick = rng.choice(x.size, max_edges, replace=False)
            x, d, y = x[pick], d[pick], y[pick]
        maps[(t, 1 - half)] = PerDepthIsotonic(n_bins=DEFAULT_BINS).fit(
            x, y, d
        )  # predicts the other half
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

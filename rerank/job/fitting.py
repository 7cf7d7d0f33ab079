"""The job's fitting stage: the cross-fitted first-level predictions of every learned rule
on the candidate table, one law's features at a time, here or on Ray (`rerank.on_ray`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from features.schema import candidate_store
from rerank.config import RerankConfig
from rerank.evaluate.matched import (
    NextRootRows,
    SimulatedPredictions,
    next_root_rows,
)
from rerank.evaluate.policy import for_policy
from rerank.evaluate.pool_chunks import ROUND_KEYS
from rerank.fit.boosting import Capacity
from rerank.fit.design import TOKEN_PRIOR
from rerank.fit.halves import fold_map, halves_table
from rerank.fit.models import LABEL_OF_LAW, feature_list
from rerank.fit.predict import FirstFactorPredictions, predict_first_factors
from rerank.fit.quality import prediction_quality
from rerank.fit.resume import FitFolder
from rerank.settings import CheckedSettings, derived_settings
from specrank.runtime import faults
from specrank.runtime.memory import release_freed_heap
from specrank.runtime.parallel import ParallelConfig
from specrank.store.frames import scanned_frame
from specrank.store.trace_schema import trace_store

log = logging.getLogger(__name__)

# The candidate table's columns the job keeps for every row once the rerankers are fitted:
# keys, the halves' tasks, and what the prediction quality and reliability tables join.
FITTED_COLUMNS = [*ROUND_KEYS, "cand_index", "task", "draft_prob", *LABEL_OF_LAW.values()]
# What the fitting process reads of each law when Ray's workers do the cross-fits: the keys and
# the controls' inputs (`rerank.fit.folds.add_controls`), none of which a policy masks.
CONTROL_COLUMNS = list(dict.fromkeys([*FITTED_COLUMNS, "temperature", "draft_rank"]))


@dataclass(frozen=True)
class FitInputs:
    """What the fitting stage reads, from settings checked once (`rerank.settings`)."""

    features: Path  # the candidate table
    traces: Path  # its traces (the matched row of a simulated set)
    fits: Path | None  # the folder of saved fits to resume from
    kind: str  # lgbm | hgb
    n_threads: int | None
    fit_nodes: int
    capacity: Capacity
    feature_sets: list[str]
    simulated: list[str]  # of feature_sets, those simulated on their own trees
    calibrators: list[str]
    rank_q_bins: int
    prior_split: str
    train_share: float
    halves: str
    score: str
    score_top_m: int
    first_budget: int  # rerank.budgets[0]: the simulated sets' matched row is fitted there


@dataclass
class Fitted:
    """Cross-fitted first-level predictions and their held-out quality.

    `candidates` holds FITTED_COLUMNS of every row of the candidate table.
    """

    candidates: pd.DataFrame
    folds: dict[str, int]  # prompt id -> half
    preds: FirstFactorPredictions
    quality: pd.DataFrame
    seconds: float
    # `halves_table(candidates, folds)`, when the fitting made it: the evaluation reports it
    # rather than finding every distinct round again (0.5 GiB at 3x the paper)
    halves: pd.DataFrame | None = None


def fit_columns(feature_sets: list[str]) -> list[str]:
    """What a law's cross-fits read of the candidate table: the controls' inputs, the token
    and the features of `feature_sets` (by default 10 of the table's 64 columns are left)."""
    features = [f for fs in feature_sets for f in feature_list(fs) if f != TOKEN_PRIOR]
    return list(dict.fromkeys([*CONTROL_COLUMNS, "token", *features]))


def law_frame(features: Path, score: str, temperature: float,
              columns: list[str] | None = None, prompts: tuple[str, ...] | None = None,
              next_root: NextRootRows | None = None, variant: str = "fit") -> pd.DataFrame:  # fmt: skip
    """One law's candidate rows (`columns` of them; None: every column; `prompts`: only
    theirs, in the same order), as a decoder under policy `score` holds them (`for_policy`,
    with `next_root` and `variant` under a SIMULATED policy); read by the fitting process, or
    by a Ray worker (hence a module function)."""
    dataset = candidate_store(features).dataset()
    law = pc.field("temperature") == pa.scalar(temperature, pa.float32())
    if prompts is not None:
        law = law & pc.field("prompt_id").isin(list(prompts))
    # filled a record batch at a time, strings (prompt, rule, task) as categories as the
    # candidates' keys are: no whole Arrow table beside the frame (at 10x the paper a law's
    # rows peaked at 8.6 GiB read whole; strings took 0.8 GiB of its 4.4)
    frame = scanned_frame(dataset.scanner(columns=columns, filter=law))
    frame = for_policy(frame, score, next_root, variant)
    release_freed_heap()  # the batches' buffers, now copied
    return frame


def sorted_categories(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with each categorical column's categories sorted (Arrow gives them in order of
    appearance): grouped by one, tables come out in the order its strings would give."""
    cats = [c for c in frame.columns if isinstance(frame[c].dtype, pd.CategoricalDtype)]
    return frame.assign(**{c: frame[c].cat.set_categories(sorted(frame[c].cat.categories))
                           for c in cats})  # fmt: skip


def fit_inputs(rerank: RerankConfig, checked: CheckedSettings) -> FitInputs:
    """The fitting stage's share of the settings and of what checking them decided."""
    booster = rerank.booster
    return FitInputs(
        checked.features, checked.traces, checked.fits, booster.kind, booster.n_threads,
        booster.fit_nodes, checked.capacity, list(rerank.feature_sets), checked.simulated,
        list(rerank.calibrators), rerank.rank_q_bins, rerank.prior_split, rerank.train_share,
        rerank.halves, rerank.score, rerank.score_top_m, rerank.budgets[0],
    )  # fmt: skip


def fit(rerank: RerankConfig, seed: int, parallel: ParallelConfig | None = None) -> Fitted:
    """`fit_rerankers` on the settings `rerank` alone (the benches' entry: the job checks
    its settings once, `rerank.settings.check_train`, and calls `fit_rerankers`)."""
    return fit_rerankers(fit_inputs(rerank, derived_settings(rerank)), seed, parallel)


def fit_rerankers(inputs: FitInputs, seed: int, parallel: ParallelConfig | None = None) -> Fitted:
    """Cross-fit the rerankers and the q1 calibration on the candidate table (docs/method.md#cross-fitting);
    `parallel.backend=ray`: the (law, feature set) cross-fits as Ray workers' tasks."""
    faults.phase("fitting")
    t0 = time.perf_counter()
    features = inputs.features
    # Every row's keys and what the evaluation joins; the features of one law at a time.
    # Its strings (prompt, rule, task) as categories: 6 bytes a row where they took 48
    # (36.6 M rows at 10x the paper); the predictions' keys take the same dtypes.
    candidates = sorted_categories(
        candidate_store(features)
        .dataset()
        .to_table(columns=FITTED_COLUMNS)
        .to_pandas(strings_to_categorical=True, split_blocks=True, self_destruct=True)
    )
    columns = fit_columns(inputs.feature_sets)  # what a law's cross-fits read of the table
    # a row per prompt first, from the categories' codes: every row's strings hashed took
    # 1.1 GiB at 3x the paper
    pairs = candidates[["prompt_id", "task"]].drop_duplicates()
    folds = fold_map(pairs["prompt_id"].to_numpy(), inputs.halves, seed, pairs["task"].to_numpy())
    halves = halves_table(candidates, folds)
    log.info("halves=%s:\n%s", inputs.halves, halves.to_string())
    frame_of = partial(law_frame, features, inputs.score, columns=columns)
    simulated = None
    if sets := inputs.simulated:
        # the matched row on draft's trees at the first budget, from the traces (module doc of
        # rerank.evaluate.matched); the evaluation ranks by the phat with and without it
        next_root = next_root_rows(trace_store(inputs.traces).dataset(), inputs.score,
                                   inputs.score_top_m, inputs.first_budget, seed)  # fmt: skip
        frame_of = partial(frame_of, next_root=next_root)
        # its own binding: frame_of is rebound below for a Ray run's driver (keys only)
        simulated_frame = frame_of
        simulated = SimulatedPredictions(sets, lambda t, v: simulated_frame(t, variant=v))
        log.info("rerank.score=%s: the matched row of %s follows each rule's own trees; fitted "
                 "on draft's at B=%d", inputs.score, sets, inputs.first_budget)  # fmt: skip
    prefit = None
    if parallel is not None and parallel.backend == "ray":
        from rerank.on_ray import RayFits  # Ray is imported only by a run that uses it

        # the workers read every feature; this process only the keys and the controls' inputs
        prefit = RayFits(parallel, frame_of)
        if inputs.fit_nodes > 1:
            from rerank.on_nodes import NodeFits  # Ray is imported only by a run that uses it

            # each fit on fit_nodes Ray Train workers: this process reads each law's keys and
            # labels, the workers their prompts' rows (`columns`)
            prefit = NodeFits(parallel, inputs.fit_nodes, partial(law_frame, features, inputs.score),
                              columns, candidate_store(features).fingerprint(), inputs.fits)  # fmt: skip
        frame_of = partial(law_frame, features, inputs.score, columns=CONTROL_COLUMNS)
    preds = predict_first_factors(
        candidates,
        folds,
        inputs.kind,
        inputs.feature_sets,
        inputs.calibrators,
        seed,
        inputs.n_threads,
        inputs.rank_q_bins,
        capacity=inputs.capacity,
        law_frame=frame_of,
        prior_split=inputs.prior_split,
        fits=None if inputs.fits is None else FitFolder(inputs.fits),
        train_share=inputs.train_share,
        prefit=prefit,
        simulated=simulated,
    )
    quality = prediction_quality(candidates, preds)
    # the laws' prediction parts, joined into one table, and the fits' transients: without a
    # trim they stay resident into the pass (at 10x the fitting ended at 7.2 GiB resident,
    # 3.9 with it)
    release_freed_heap()
    seconds = time.perf_counter() - t0
    return Fitted(candidates, folds, preds, quality, seconds, halves)

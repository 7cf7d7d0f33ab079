"""The settings of `python -m rerank.train`, checked before anything is read or fitted.

`check_settings` validates every `rerank` setting (messages from `specrank.settings.checks`
name the setting, what was expected and what was found) and returns what the settings
alone decide (`CheckedSettings`): which rules the job reports (`run_rules`), which paired
comparisons it computes (`comparison_pairs`), the boosting capacity of `rerank.booster`
(`model_capacity`), the stores' paths. The job's stages read this record; none of them
checks or derives a setting again. `check_stores` reads the stores' manifests once: the
candidate table must come from the traces, whose pools say which budgets the job evaluates.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from features.schema import candidate_store
from rerank.config import (
    CALIBRATORS,
    SWEEP_BUDGETS,
    BoosterConfig,
    RerankConfig,
)
from rerank.evaluate.matched import simulated_sets
from rerank.evaluate.values import RETAINED_ROWS
from rerank.fit.boosting import Capacity
from rerank.fit.halves import SCHEMES
from rerank.fit.models import FEATURE_SETS
from rerank.fit.token_prior import PRIOR_SPLITS
from rerank.report.comparisons import run_comparisons
from selection.policies import SCORE_MODES
from selection.rules import MODEL_KINDS, RULES, learned, mixture, substitution
from specrank.runtime.parallel import ParallelConfig, check_parallel
from specrank.settings.checks import check_choice, check_int, check_ints, check_real, check_subset
from specrank.settings.errors import Refusal
from specrank.settings.paths import project_path
from specrank.store.tables import SchemaError
from specrank.store.trace_schema import trace_store
from tree.config import PoolConfig
from tree.pool import pool_size

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckedSettings:
    """What the `rerank` settings alone decide, once they are checked (`check_settings`)."""

    rules: set[str]  # every rule the job reports (`run_rules`)
    comparisons: list[tuple[str, str]]  # its paired comparisons (`comparison_pairs`)
    capacity: Capacity  # the boosting capacity of rerank.booster
    rerankers: list[str]  # the learned rule of each of rerank.feature_sets, in order
    learned: dict[str, str]  # every feature set -> its learned rule under rerank.booster.kind
    simulated: list[str]  # the feature sets simulated on their own trees (rerank.evaluate.matched)
    features: Path  # rerank.features, resolved (`project_path`)
    traces: Path  # rerank.traces, resolved
    fits: Path | None  # rerank.fits, resolved


def model_capacity(model: BoosterConfig) -> Capacity:
    """The boosting capacity of the `rerank.booster` settings."""
    return Capacity(
        n_iter=model.n_iter, learning_rate=model.learning_rate, max_leaves=model.max_leaves,
        early_stopping=model.early_stopping, patience=model.patience,
        validation_share=model.validation_share, refit=model.refit,
    )  # fmt: skip


def check_train_parallel(p: ParallelConfig, model: BoosterConfig | None = None) -> None:
    """The `parallel` settings of a training run: local, or Ray (`rerank.on_ray`); with
    `model`, its fits' spread over nodes (`rerank.booster.fit_nodes`) too."""
    check_parallel(p, "cpu")
    nodes = 1 if model is None else model.fit_nodes
    if nodes > 1 and (p.backend != "ray" or model.kind != "lgbm"):
        raise Refusal(
            f"rerank.booster.fit_nodes={nodes} trains each LightGBM fit on Ray Train workers: it "
            f"needs launcher=ray (parallel.backend is {p.backend!r}) and rerank.booster.kind=lgbm "
            f"(it is {model.kind!r})"
        )
    if p.parts != 1:
        raise Refusal(
            f"parallel.parts={p.parts}: rerank.train is one job, not split into ranges of "
            f"shards; spread it with launcher=ray parallel.workers=N"
        )


def check_settings(rerank: RerankConfig) -> CheckedSettings:
    """Every `rerank` setting, before anything is read or fitted (specrank.settings.checks messages);
    returns what the settings decide, for the stages to read."""
    check_choice("rerank.booster.kind", rerank.booster.kind, MODEL_KINDS)
    if rerank.booster.n_threads is not None:
        check_int("rerank.booster.n_threads", rerank.booster.n_threads, 1)
    check_int("rerank.booster.n_iter", rerank.booster.n_iter, 1)
    check_real("rerank.booster.learning_rate", rerank.booster.learning_rate, 0.0, low_open=True)
    check_int("rerank.booster.max_leaves", rerank.booster.max_leaves, 2)
    check_int("rerank.booster.patience", rerank.booster.patience, 1)
    check_int("rerank.booster.fit_nodes", rerank.booster.fit_nodes, 1)
    share = rerank.booster.validation_share
    check_real("rerank.booster.validation_share", share, 0.0, 1.0, low_open=True)
    if share == 1.0:  # every training prompt held out: nothing left to fit
        raise Refusal(
            f"The 'rerank.booster.validation_share' must be in (0, 1). Got {share!r} instead."
        )
    check_subset("rerank.feature_sets", rerank.feature_sets, list(FEATURE_SETS))
    check_subset("rerank.calibrators", rerank.calibrators, CALIBRATORS)
    check_int("rerank.rank_q_bins", rerank.rank_q_bins, 1)
    check_subset("rerank.substitutions", rerank.substitutions, list(RETAINED_ROWS))
    if rerank.substitutions and not rerank.mixture_weights:
        raise Refusal(
            "The 'rerank.mixture_weights' must be a non-empty list when rerank.substitutions "
            f"is not empty. Got {list(rerank.mixture_weights)!r} instead."
        )
    for w in rerank.mixture_weights:
        check_real("rerank.mixture_weights", w, 0.0, 1.0, low_open=True)
    check_choice("rerank.halves", rerank.halves, SCHEMES)
    check_choice("rerank.prior_split", rerank.prior_split, PRIOR_SPLITS)
    check_real("rerank.train_share", rerank.train_share, 0.0, 1.0, low_open=True)
    check_ints("rerank.budgets", rerank.budgets, 1)
    check_int("rerank.draft_top_m", rerank.draft_top_m, 0)
    check_choice("rerank.score", rerank.score, SCORE_MODES)
    check_int("rerank.score_top_m", rerank.score_top_m, 1)
    if rerank.draft_top_m and rerank.score != "tree":
        raise Refusal(
            f"rerank.score={rerank.score} prices a decoder's own trees over the whole pool, but "
            f"rerank.draft_top_m={rerank.draft_top_m} restricts every rule to the draft top {rerank.draft_top_m}: "
            f"set one of them (rerank.score=tree or rerank.draft_top_m=0)"
        )
    check_int("rerank.n_resamples", rerank.n_resamples, 1)
    check_int("rerank.calibration_edges", rerank.calibration_edges, 1)
    check_int("rerank.chunk_rounds", rerank.chunk_rounds, 1)
    if rerank.eval_threads is not None:
        check_int("rerank.eval_threads", rerank.eval_threads, 1)
    return derived_settings(rerank)


def derived_settings(rerank: RerankConfig) -> CheckedSettings:
    """What the settings `rerank` decide, derived without checking them (`check_settings`
    checks them first; `rerank.transfer` and the benches derive from settings they checked)."""
    capacity, rules, kind = model_capacity(rerank.booster), run_rules(rerank), rerank.booster.kind
    rerankers = [learned(fs, kind).name for fs in rerank.feature_sets]
    learned_rules = {fs: learned(fs, kind).name for fs in FEATURE_SETS}
    comparisons = run_comparisons(rerank.comparisons, kind, rules)
    simulated = simulated_sets(rerank.feature_sets, rerank.score)
    features, traces = project_path(rerank.features), project_path(rerank.traces)
    fits = None if rerank.fits is None else project_path(rerank.fits)
    return CheckedSettings(rules, comparisons, capacity, rerankers, learned_rules, simulated,
                           features, traces, fits)  # fmt: skip


def check_train(rerank: RerankConfig, parallel: ParallelConfig) -> CheckedSettings:
    """The settings of `rerank.train`, checked once before anything is read or fitted: every
    `rerank` setting and `parallel`. Returns what they decide, for the stages to read."""
    checked = check_settings(rerank)
    check_train_parallel(parallel, rerank.booster)
    return checked


def store_pool_size(manifest: Mapping[str, Any], store: object) -> int:
    """Candidates per pool of a trace store, from the `pool` section its manifest recorded."""
    pool = manifest.get("config", {}).get("pool")
    if not isinstance(pool, Mapping):
        raise SchemaError(
            f"{store}: the trace manifest records no 'pool' section (expected the pool "
            f"settings the traces were recorded with); record the store again"
        )
    try:
        return pool_size(PoolConfig(**pool))
    except TypeError as err:  # a key PoolConfig does not know
        raise SchemaError(f"{store}: the manifest's pool section {dict(pool)} is not a pool "
                          f"config ({err})") from err  # fmt: skip


def evaluated_budgets(
    rerank: RerankConfig, manifest: Mapping[str, Any], store: object
) -> list[int]:
    """The budgets the job evaluates on a store whose `manifest` says its pools' size.

    `rerank.budgets` past the pool (or past `rerank.draft_top_m` when set: every rule then keeps
    at most M candidates) are refused, naming both: every rule would equal draft there.
    Sweep budgets past them are left out, and the log says which.
    """
    n_pool = store_pool_size(manifest, store)
    limit, why = n_pool, f"the pool size {n_pool} of {store} (its manifest's pool section)"
    if 0 < rerank.draft_top_m < n_pool:
        limit, why = (
            rerank.draft_top_m,
            f"rerank.draft_top_m={rerank.draft_top_m} (the pool holds {n_pool})",
        )
    beyond = [b for b in rerank.budgets if b > limit]
    if beyond:
        raise Refusal(
            f"The 'rerank.budgets' must be at most {limit}, {why}. Got {list(rerank.budgets)!r} "
            f"instead ({beyond} beyond it: every rule would keep the same tree as draft)."
        )
    budgets = set(rerank.budgets)
    if rerank.sweep:
        budgets |= {b for b in SWEEP_BUDGETS if b <= limit}
        left_out = [b for b in SWEEP_BUDGETS if b > limit]
        if left_out:
            log.warning("rerank.sweep: budgets %s left out, beyond %s", left_out, why)
    return sorted(budgets)


@dataclass(frozen=True)
class StoreFacts:
    """What the stores' manifests say, read before any shard (`check_stores`)."""

    fingerprint: str  # the traces' content fingerprint, the one the candidate table came from
    budgets: list[int]  # the budgets evaluated on the traces' pools (`evaluated_budgets`)


def check_stores(rerank: RerankConfig, features: Path, traces: Path) -> StoreFacts:
    """The stores the settings name, checked once before anything is read or fitted: the
    candidate table `features` must come from exactly the traces `traces`, whose pools
    decide the budgets evaluated (`evaluated_budgets`). Manifests are read, no shard."""
    store = trace_store(traces)
    traces_fp = store.fingerprint()
    found = candidate_store(features).manifest().get("config", {}).get("source_fingerprint")
    if found != traces_fp:
        raise SchemaError(
            f"the candidate table in {features} was extracted from traces with fingerprint "
            f"{str(found)[:12]}, but {traces} has fingerprint {traces_fp[:12]}: "
            f"re-run `python -m features.extract` on these traces"
        )
    return StoreFacts(traces_fp, evaluated_budgets(rerank, store.manifest(), store.root))


def store_budgets(rerank: RerankConfig) -> list[int]:
    """`evaluated_budgets` on the trace store `rerank.traces` (its manifest read, no shard)."""
    store = trace_store(project_path(rerank.traces))
    return evaluated_budgets(rerank, store.manifest(), store.root)


def comparison_pairs(rerank: RerankConfig, rules: set[str] | None = None) -> list[tuple[str, str]]:
    """The run's paired comparisons: the configured ones, or the paper's among its rules
    (`rules`: `run_rules(rerank)`, when known)."""
    rules = run_rules(rerank) if rules is None else rules
    return run_comparisons(rerank.comparisons, rerank.booster.kind, rules)


def run_rules(rerank: RerankConfig) -> set[str]:
    """Every rule the job reports, known from the settings before anything is fitted."""
    rules = {n for n, r in RULES.items() if r.offline is not None and n not in CALIBRATORS}
    rules |= {learned(fs, rerank.booster.kind).name for fs in rerank.feature_sets}
    rules |= {substitution(row).name for row in rerank.substitutions}
    if rerank.mixture_weights:  # rerank.transfer evaluates none (the weight is chosen by fold)
        rules |= {mixture(row).name for row in rerank.substitutions}
    return rules | set(rerank.calibrators)

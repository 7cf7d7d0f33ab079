"""`python -m rerank.transfer`: saved rerankers judged on a trace store, without refitting.

    python -m rerank.transfer                                   # newest rerank.train run, fold 0
    python -m rerank.transfer transfer.rerankers=<run folder>/rerankers paths.traces=<store> paths.features=<table>
    python -m rerank.transfer transfer.rerankers=runs:/<run id>/rerankers transfer.fold=1

The models of one cross-fitting half (`transfer.fold`; fold k was fitted on half 1 - k)
predict every first-level candidate of the store (`rerank.traces`, its candidate table
`rerank.features`) exactly as they predict held-out rows in `rerank.train`: the same
design matrix, the token prior of their own training half, the same forest route. Every
rule is then evaluated as `rerank.train` evaluates it, with the same tables, plots and
MLflow metrics (`accepted/<law>/B<b>/<rule>`, `gain/...`, `compare/...`), tagged
`job=transfer`. Nothing is fitted: the calibration controls (iso_q1, per_depth,
rank_control) need labels of the store, and a mixture's weight is chosen on the other
half, so both are left out; the rules that need no fit (draft, root, the retained-row
substitutions, ...) are evaluated beside the rerankers.

A prompt a loaded model was trained on is skipped (`transfer.seen_prompts=skip`, the
default: on the training store itself, fold k evaluates exactly half k, out of fold) or
refused (`refuse`). A task the models never saw is warned, naming it and its prompts:
its `task` feature is missing (NaN), as online (`rerank.serving.unknown_task_counts`),
and the counts go to `transfer_tasks.csv`.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import hydra
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from features.schema import candidate_store
from rerank.config import RerankConfig, TransferConfig
from rerank.evaluate.matched import NextRootRows, next_root_rows, simulated_sets
from rerank.evaluate.policy import for_policy
from rerank.evaluate.pool_chunks import ROUND_KEYS
from rerank.fit.design import design_matrix
from rerank.fit.models import BATCH_ROUTE, FEATURE_SETS, FittedReranker, feature_list
from rerank.fit.persist import SIDECAR, RerankerLoadError, load_reranker, read_sidecar
from rerank.fit.predict import FirstFactorPredictions
from rerank.fit.quality import prediction_quality
from rerank.job.acceptance import acceptance_report
from rerank.job.evaluation import Evaluation, evaluate
from rerank.job.fitting import FITTED_COLUMNS, Fitted, fit_columns
from rerank.job.tracked import evaluation_metrics
from rerank.serving import reranker_folder, unknown_task_counts
from rerank.settings import check_settings, check_stores, comparison_pairs
from rerank.train import write_tables
from selection.rules import learned
from specrank.settings import config as _schema  # noqa: F401  (registers the Hydra schema)
from specrank.settings.checks import check_choice, check_int
from specrank.settings.cli import exits_on_refusal, run_entry_point
from specrank.settings.config import MlflowConfig
from specrank.settings.errors import Refusal
from specrank.settings.paths import CONF_DIR, project_path
from specrank.statistics.laws import law_kind
from specrank.store.files import atomic_write
from specrank.store.trace_schema import trace_store
from specrank.tracking.run_record import RunRecord, TrackingError, log_or_explain, write_record

log = logging.getLogger(__name__)
SEEN = ("skip", "refuse")  # transfer.seen_prompts
# rerank.train's folder names: <set>_<kind>_T<temperature>_fold<k> (rerank.train.write_tables)
_FOLDER = re.compile(r"^(?P<name>.+)_T(?P<t>[0-9.]+)_fold(?P<fold>[01])$")


@dataclass
class Loaded:
    """One fold's saved rerankers: temperature -> feature set -> model, and where from."""

    folder: Path
    models: dict[float, dict[str, FittedReranker]]
    kind: str

    @property
    def feature_sets(self) -> list[str]:
        """The feature sets every temperature holds, in `rerank.fit.models.FEATURE_SETS` order."""
        held = [set(m) for m in self.models.values()]
        return [fs for fs in FEATURE_SETS if all(fs in h for h in held)]

    @property
    def trained_on(self) -> set[str]:
        return {p for by_set in self.models.values() for m in by_set.values()
                for p in m.train_prompts}  # fmt: skip


def latest_rerankers(outputs: Path) -> Path:
    """The `rerankers/` folder of the newest run under `outputs` that saved any."""
    sidecars = list(outputs.glob(f"**/rerankers/*/{SIDECAR}"))
    if not sidecars:
        raise Refusal(
            f"transfer.rerankers=latest: no run folder under {outputs} holds saved rerankers "
            f"(expected rerankers/<set>_<kind>_T<t>_fold<k>/{SIDECAR}); run `python -m "
            f"rerank.train` first, or set transfer.rerankers=<folder or runs:/<id>/rerankers>"
        )
    return max(sidecars, key=lambda p: p.stat().st_mtime).parent.parent


def load_rerankers(source: str, fold: int, tracking_uri: str) -> Loaded:
    """Every saved reranker of `fold` under `source`, each loaded with its checks."""
    if source == "latest":
        folder = latest_rerankers(project_path("outputs"))
    else:
        folder = reranker_folder(source, tracking_uri, "transfer.rerankers")
    models: dict[float, dict[str, FittedReranker]] = {}
    names = sorted(d.name for d in folder.iterdir() if d.is_dir())
    for name in names:
        m = _FOLDER.match(name)
        if m is None or int(m["fold"]) != fold:
            continue
        path = folder / name
        feature_set = read_sidecar(path).get("feature_set")
        if feature_set not in FEATURE_SETS:
            raise RerankerLoadError(
                path, [f"feature_set: expected one of {list(FEATURE_SETS)}, found {feature_set!r}"]
            )
        model = load_reranker(path, expected_features=feature_list(feature_set))
        temperature = float(m["t"])
        if model.law != law_kind(temperature):
            raise RerankerLoadError(path, [f"law: the folder names T={m['t']} ("
                                           f"{law_kind(temperature)}), the model is {model.law}"])  # fmt: skip
        models.setdefault(temperature, {})[feature_set] = model
    if not models:
        raise Refusal(
            f"transfer.rerankers: {folder} holds no reranker of fold {fold} (expected folders "
            f"<set>_<kind>_T<t>_fold{fold}; found {names[:8]})"
        )
    kinds = {m.kind for by_set in models.values() for m in by_set.values()}
    if len(kinds) > 1:
        raise Refusal(f"transfer.rerankers: {folder} mixes model kinds {sorted(kinds)}; "
                         f"a rerank.train run saves one")  # fmt: skip
    return Loaded(folder, models, kinds.pop())


def kept_prompts(prompt_ids: list[str], trained_on: set[str], seen: str) -> list[str]:
    """The store's prompts to evaluate under `transfer.seen_prompts` (never a trained one)."""
    if not trained_on:
        raise Refusal(
            "transfer.rerankers: the models list no training prompts, so nothing shows they "
            "never saw this store's prompts; refit them from a table with prompt ids"
        )
    seen_ids = [p for p in prompt_ids if p in trained_on]
    if seen_ids and seen == "refuse":
        raise Refusal(
            f"transfer.seen_prompts=refuse: the models were trained on {len(seen_ids)} of the "
            f"store's {len(prompt_ids)} prompts (e.g. {seen_ids[:3]}); set "
            f"transfer.seen_prompts=skip to evaluate the others"
        )
    kept = [p for p in prompt_ids if p not in trained_on]
    if not kept:
        raise Refusal(f"transfer.seen_prompts=skip: the models were trained on all "
                         f"{len(prompt_ids)} prompts of the store; nothing is left")  # fmt: skip
    if seen_ids:
        log.info("transfer.seen_prompts=skip: %d of %d prompts left out (trained on)",
                 len(seen_ids), len(prompt_ids))  # fmt: skip
    return kept


def predict_store(rerank: RerankConfig, loaded: Loaded, fold: int, seen: str,
                  n_threads: int | None = None, next_root: NextRootRows | None = None,
                  ) -> tuple[Fitted, pd.DataFrame]:  # fmt: skip
    """The loaded models' phat of every kept candidate (as `Fitted`), and the tasks table.
    Under a SIMULATED policy (`next_root` given) a set reading the matched row gets its phat
    with and without it too (`with/<rule>`, `without/<rule>`: rerank.evaluate.matched)."""
    t0 = time.perf_counter()
    dataset = candidate_store(project_path(rerank.features)).dataset()
    ids = pc.unique(dataset.to_table(columns=["prompt_id"])["prompt_id"]).to_pylist()
    kept = pc.field("prompt_id").isin(kept_prompts(sorted(ids), loaded.trained_on, seen))
    candidates = dataset.to_table(columns=FITTED_COLUMNS, filter=kept).to_pandas()
    store_ts = sorted(float(t) for t in candidates["temperature"].unique())
    missing = [t for t in store_ts if t not in loaded.models]
    if missing:
        raise Refusal(
            f"transfer.rerankers: {loaded.folder} holds models for T={sorted(loaded.models)}, "
            f"but the store {rerank.features} also has rounds at T={missing}"
        )
    tasks = _task_table(candidates, loaded)
    rules = [learned(fs, loaded.kind).name for fs in loaded.feature_sets]
    simulated = simulated_sets(loaded.feature_sets, rerank.score) if next_root else []
    columns = fit_columns(loaded.feature_sets)  # what the models read, not every feature
    parts = []
    for temperature in store_ts:
        at = kept & (pc.field("temperature") == pa.scalar(temperature, pa.float32()))
        raw = dataset.to_table(columns=columns, filter=at).to_pandas()
        frame = for_policy(raw, rerank.score, next_root)
        out = frame[[*ROUND_KEYS, "cand_index"]].copy()
        out["fold"] = np.int8(fold)
        for fs, rule in zip(loaded.feature_sets, rules, strict=True):
            model = loaded.models[temperature][fs]
            out[rule] = _phat(model, frame, n_threads)
            for variant in ("with", "without") if fs in simulated else ():
                variant_frame = for_policy(raw, rerank.score, next_root, variant)
                out[f"{variant}/{rule}"] = _phat(model, variant_frame, n_threads)
        parts.append(out)
        del frame, raw
    preds = FirstFactorPredictions(pd.concat(parts, ignore_index=True), rules)
    folds = dict.fromkeys(candidates["prompt_id"].unique().tolist(), fold)
    quality = prediction_quality(candidates, preds)
    quality = quality[quality["fold"].isin(["all", fold])]  # the other half holds no row
    return Fitted(candidates, folds, preds, quality, time.perf_counter() - t0), tasks


def _phat(model: FittedReranker, frame: pd.DataFrame, n_threads: int | None) -> np.ndarray:
    """The model's phat of `frame`'s rows, as rerank.fit.out_of_fold.crossfit_predict predicts a
    held-out row (the training half's token prior, the batch route)."""
    prior = model.token_prior.transform(frame["token"].to_numpy())
    X = design_matrix(frame, model.features, model.categories, prior)
    return model.predict_matrix(X, n_threads, route=BATCH_ROUTE[model.kind])


def _task_table(candidates: pd.DataFrame, loaded: Loaded) -> pd.DataFrame:
    """Prompts per task of the store and whether the models know the task (warned if not)."""
    prompts = candidates.groupby("task")["prompt_id"].nunique()
    model = next(iter(next(iter(loaded.models.values())).values()))  # one categories list
    unknown = unknown_task_counts(model, prompts.to_dict(), "transfer.rerankers")
    return pd.DataFrame({"task": prompts.index, "prompts": prompts.to_numpy(),
                         "known": [t not in unknown for t in prompts.index]})  # fmt: skip


@dataclass
class TransferResult:
    evaluation: Evaluation
    tasks: pd.DataFrame
    run_id: str
    text: str


def transfer(rerank: RerankConfig, settings: TransferConfig, tracking: MlflowConfig,
             resolved_config: dict, seed: int, out_dir: Path) -> TransferResult:  # fmt: skip
    """Load, predict, evaluate, write tables, log the run: `rerank.train` without its fits."""
    check_settings(replace(rerank, feature_sets=[]))  # the sets are the saved models' (below)
    check_int("transfer.fold", settings.fold, 0, 1)
    check_choice("transfer.seen_prompts", settings.seen_prompts, SEEN)
    stores = check_stores(rerank, project_path(rerank.features), project_path(rerank.traces))
    fingerprint, budgets = stores.fingerprint, stores.budgets
    t0 = time.perf_counter()
    loaded = load_rerankers(settings.rerankers, settings.fold, tracking.tracking_uri)
    next_root = None
    if simulated_sets(loaded.feature_sets, rerank.score):  # the matched row on own trees
        next_root = next_root_rows(trace_store(project_path(rerank.traces)).dataset(),
                                   rerank.score, rerank.score_top_m, rerank.budgets[0], seed)  # fmt: skip
    # the run's rules are the loaded models' and those that need no fit: no calibration
    # control, and no mixture (its weight is chosen on the other half, which has no rows)
    rerank = replace(rerank, feature_sets=loaded.feature_sets, calibrators=[],
                     mixture_weights=[], booster=replace(rerank.booster, kind=loaded.kind))  # fmt: skip
    comparison_pairs(rerank)  # configured comparisons must name rules this run has
    fitted, tasks = predict_store(rerank, loaded, settings.fold, settings.seen_prompts,
                                  rerank.booster.n_threads, next_root)  # fmt: skip
    store = trace_store(project_path(rerank.traces)).dataset()
    kept = store.filter(pc.field("prompt_id").isin(list(fitted.folds)))
    ev = evaluate(rerank, fitted, seed, budgets, dataset=kept)
    # vLLM's training-half fits need a training half: the store holds the evaluated one only
    acceptance = (acceptance_report(rerank, fitted, seed, kept, crossfit=False)
                  if rerank.acceptance else None)  # fmt: skip
    total = time.perf_counter() - t0
    tables, plots = write_tables(out_dir, fitted, ev, acceptance)
    atomic_write(out_dir / "transfer_tasks.csv", lambda tmp: tasks.to_csv(tmp, index=False))
    head = (f"transfer: fold {settings.fold}'s rerankers (fitted on half {1 - settings.fold}) "
            f"from {loaded.folder}, on {len(fitted.folds)} prompts of {rerank.traces}; tasks "
            f"the models never saw: {list(tasks.loc[~tasks['known'], 'task']) or 'none'}")  # fmt: skip
    metrics = evaluation_metrics(ev, fitted.quality) | {
        "time/total_s": total, "transfer/prompts": float(len(fitted.folds)),
        "transfer/unknown_task_prompts": float(tasks.loc[~tasks["known"], "prompts"].sum()),
    } | (acceptance.metrics() if acceptance is not None else {})  # fmt: skip
    tags = {"job": "transfer", "trace_fingerprint": fingerprint, "rerank_model": loaded.kind,
            "rerankers": str(loaded.folder), "fold": str(settings.fold)}  # fmt: skip
    artifacts = [*((t, "tables") for t in [*tables, "transfer_tasks.csv"]),
                 *((p.name, "plots") for p in plots)]  # fmt: skip
    write_record(out_dir, RunRecord(tracking.tracking_uri, tracking.experiment, tracking.run_name,
                                    resolved_config, tags, metrics, artifacts))  # fmt: skip
    run_id = log_or_explain(out_dir, tracking.tracking_uri)
    text = f"{head}\n{ev.table}" + (acceptance.text if acceptance is not None else "")
    return TransferResult(ev, tasks, run_id, text)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="transfer")
@exits_on_refusal
def main(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        result = transfer(OmegaConf.to_object(cfg.rerank), OmegaConf.to_object(cfg.transfer),
                          OmegaConf.to_object(cfg.mlflow), OmegaConf.to_container(cfg, resolve=True),
                          cfg.seed, out_dir)  # fmt: skip
    except TrackingError as err:  # the outputs are complete: say how to log them later
        sys.exit(f"error: {err}")
    print(result.text)
    print(f"\nMLflow run {result.run_id}; tables and plots in {out_dir}")


if __name__ == "__main__":
    run_entry_point(main, stage="rerank.transfer")

"""A fitted reranker for the online decoder: loading with every check, and fast phat.

    features (features.decoding) -> design matrix X [n1, F] float32 (= rerank.design.design_matrix)
    X -> phat -> log phat [n1] float32 on the decoding device

on the fastest exact route for the model and device (`run.predictor`; see
`OnlinePredictor`): on a CPU the project's forest walked by compiled code
(`rerank.forest.jit`, a quarter of LightGBM's own predictor's time per call).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from calibrate.isotonic import PROB_FLOOR
from features.first_level import FEATURE_DTYPES, DesignLayout, FirstLevelFeatures
from features.registry import BY_NAME, FEATURE_SET_TREE, first_in
from pairs.prompts import Prompt
from rerank.fit.design import TOKEN_PRIOR
from rerank.fit.models import FEATURE_SETS, FittedReranker, feature_list
from rerank.fit.persist import RerankerLoadError, load_reranker, read_sidecar
from rerank.forest.jit import JitForest, jit_forest, log_phat
from rerank.forest.table import ForestError, forest_of
from rerank.forest.walk import CompiledForest, TorchForest, compile_forest, link, prepare
from selection.policies import NO_TOKEN_ONLY, SCORE_MODES
from specrank.runtime.jit import njit
from specrank.settings.errors import Refusal
from specrank.settings.paths import project_path
from specrank.statistics.laws import law_kind

log = logging.getLogger(__name__)
PREDICTORS = ("auto", "library", "forest", "compiled")  # run.predictor (OnlinePredictor)
SEEN_PROMPTS = ("refuse", "skip", "allow")  # run.seen_prompts
MLFLOW_SCHEMES = ("runs:/", "models:/", "mlflow-artifacts:/")
# Inputs the online decoder can compute: every first-level feature, the task, the prior.
ONLINE_FEATURES = frozenset(FEATURE_DTYPES) | {"task", TOKEN_PRIOR}
# the features of every set beyond the first (base): each reads a retained target row
ROW_READING = frozenset(
    n for s in FEATURE_SET_TREE if s.parent is not None for n in first_in(s.name)
)


def local_path(source: str, tracking_uri: str) -> Path:
    """`source` on this machine: an MLflow artifact URI downloaded, else the path itself
    (relative to the project root)."""
    if source.startswith(MLFLOW_SCHEMES):
        import mlflow  # only runs that name an MLflow URI pay for the import

        from specrank.tracking.train_runs import resolve_tracking_uri

        uri = resolve_tracking_uri(tracking_uri)
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=source, tracking_uri=uri))
    return project_path(source)


def reranker_folder(source: str, tracking_uri: str, setting: str = "run.reranker") -> Path:
    """A local folder for `setting`: the path itself, or an MLflow artifact downloaded."""
    path = local_path(source, tracking_uri)
    if not source.startswith(MLFLOW_SCHEMES) and not path.is_dir():
        raise Refusal(
            f"{setting}: no such folder '{source}' (expected a folder written by "
            f"rerank.persist.save_reranker, or an MLflow URI like runs:/<id>/rerankers/<name>)"
        )
    return path


def load_online_reranker(
    source: str | None, temperature: float, tracking_uri: str
) -> FittedReranker:
    """Load `run.reranker` with every check: integrity, feature list, law, computable inputs."""
    if not source:
        raise Refusal("run.rule=reranker needs run.reranker=<folder or MLflow URI>; got none")
    path = reranker_folder(source, tracking_uri)
    meta = read_sidecar(path)
    feature_set = meta.get("feature_set")
    if feature_set not in FEATURE_SETS:
        raise RerankerLoadError(
            path, [f"feature_set: expected one of {list(FEATURE_SETS)}, found {feature_set!r}"]
        )
    # The saved list must be today's definition of its feature set (order included).
    model = load_reranker(path, expected_features=feature_list(feature_set))
    missing = [f for f in model.features if f not in ONLINE_FEATURES]
    if missing:
        raise RerankerLoadError(path, [f"features the online decoder cannot compute: {missing}"])
    law = law_kind(temperature)
    if model.law != law:
        kind = {"greedy": "classifier saved for T=0", "sampling": "regressor saved for T>0"}
        raise Refusal(
            f"run.reranker: {source} holds a {model.law} model, but decode.temperature="
            f"{temperature} decodes under the {law} law; use the {kind[law]}"
        )
    return model


def unseen_prompts(model: FittedReranker, prompts: list[Prompt], seen: str) -> list[Prompt]:
    """The prompts to decode with `model`, given `run.seen_prompts` (docs/method.md#cross-fitting: no leakage).

    Online gains on the reranker's training prompts are in-sample; the saved
    model lists them, so the check is exact. refuse: fail if any is among the
    run's prompts; skip: drop them; allow: decode everything.
    """
    if seen not in SEEN_PROMPTS:
        raise Refusal(
            f"The 'run.seen_prompts' must be one of {list(SEEN_PROMPTS)}. Got {seen!r} instead."
        )
    if seen == "allow":
        return prompts
    if not model.train_prompts:
        raise Refusal(
            "run.reranker: the model lists no training prompts, so nothing shows it never saw "
            "the prompts this run decodes; refit it from a table with prompt ids, or set "
            "run.seen_prompts=allow"
        )
    trained = set(model.train_prompts)
    kept = [p for p in prompts if p.id not in trained]
    n_seen = len(prompts) - len(kept)
    if n_seen and seen == "refuse":
        example = [p.id for p in prompts if p.id in trained][:3]
        raise Refusal(
            f"run.reranker: the model was trained on {n_seen} of the {len(prompts)} prompts "
            f"this run decodes (e.g. {example}); its gains there would be in-sample. Set "
            f"run.seen_prompts=skip to decode only the others, or run.seen_prompts=allow"
        )
    if not kept:
        raise Refusal(
            f"run.seen_prompts=skip: the model was trained on all {len(prompts)} prompts of "
            f"this run; nothing is left to decode"
        )
    if n_seen:
        log.info("run.seen_prompts=skip: %d of %d prompts left out", n_seen, len(prompts))
    return kept


def unknown_tasks(model: FittedReranker, prompts: list[Prompt]) -> dict[str, int]:
    """Tasks of `prompts` the model never saw, with their prompt counts, warned once."""
    counts: dict[str, int] = {}
    for p in prompts:
        counts[p.task] = counts.get(p.task, 0) + 1
    return unknown_task_counts(model, counts, "run.reranker")


def unknown_task_counts(model: FittedReranker, prompts_per_task: Mapping[str, int],
                        what: str) -> dict[str, int]:  # fmt: skip
    """Of `prompts_per_task` (task -> prompts), the tasks the model never saw, warned once.

    The design matrix holds a task as its index among the model's training tasks; an
    unknown one is NaN there, so every split on `task` sends it the way missing values
    go: the model still predicts, but without the task it was fitted to condition on.
    Empty when the model does not read `task`.
    """
    known = set(model.categories)
    unknown = {t: n for t, n in sorted(prompts_per_task.items()) if t not in known}
    if not unknown or "task" not in model.features:
        return {}
    log.warning(
        "%s: the model never saw the task(s) %s (prompts: %s); it knows %s. "
        "Their `task` feature is missing (NaN), so the trees send them the missing way",
        what, list(unknown), list(unknown.values()), sorted(known),
    )  # fmt: skip
    return unknown


# Feature groups a decoder's scored set never gives it (`run.score`): under `tree` the
# emitted address (the accepted path and the continuation) is never a verified prefix, so a
# round never holds the matched row (0% of online rounds when measured); under every
# policy but `record` the decoder keeps no token-only row (selection.policies.NO_TOKEN_ONLY,
# as offline).
NEVER_UNDER_SCORE = {"tree": ("matched", "token_only"),
                     **{p: ("token_only",) for p in NO_TOKEN_ONLY if p != "tree"}}  # fmt: skip


def split_features(model: FittedReranker) -> set[str]:
    """The features some split of the model's trees tests. A feature missing in every
    training row (a row the fitting policy never gave) is never split on, so the model's phat
    does not depend on it."""
    forest = forest_of(model.estimator, model.kind)
    internal = forest.left != np.arange(len(forest.left))  # leaves point to themselves
    return {model.features[j] for j in np.unique(forest.feature[internal])}


def check_feature_availability(model: FittedReranker, score: str, allow: bool) -> list[str]:
    """Refuse a reranker whose trees split on a feature the run's scored set never gives it.

    Returns those features, always missing (NaN) under `score`; raises a Refusal listing
    them and the policy unless `allow` (run.allow_missing_features), which logs a warning
    instead: the model would be decoded on inputs it was not fitted on. A feature the trees
    never test (a model fitted under the same policy) is not one.
    """
    groups = NEVER_UNDER_SCORE.get(score, ())
    read = split_features(model)
    never = [f for f in model.features
             if f in BY_NAME and BY_NAME[f].group in groups and f in read]  # fmt: skip
    if not never:
        return []
    what = (
        f"run.reranker: {len(never)} of the features its trees split on are always missing "
        f"under run.score={score} (its {' and '.join(groups)} rows; see "
        f"rerank.serving.NEVER_UNDER_SCORE): {never}"
    )
    if not allow:
        raise Refusal(
            f"{what}. Decode it under a run.score that gives them ({_giving(groups)}), use a "
            f"model fitted under run.score={score} (rerank.score), or set "
            f"run.allow_missing_features=true to decode it anyway"
        )
    log.warning("%s; decoded anyway (run.allow_missing_features=true)", what)
    return never


def _giving(groups: tuple[str, ...]) -> str:
    """The policies under which none of `groups` is always missing."""
    return ", ".join(p for p in SCORE_MODES if not set(NEVER_UNDER_SCORE.get(p, ())) & set(groups))


def uses_rows(model: FittedReranker) -> bool:
    """Whether the model reads retained-row features (then the decoder keeps the rows)."""
    return any(f in ROW_READING for f in model.features)


class OnlinePredictor:
    """Design matrix and phat for one round's first-level candidates, on the fastest exact route.

    run.predictor:
      auto     = compiled, on every device (on a GPU one round's predict is several
                 times faster this way than as torch ops on the device: docs/benchmarks.md);
                 the library's predictor, with a warning, when the forest cannot
                 represent the model exactly (`rerank.forest.table.ForestError`)
      library  = the model's own predict (CPU), log phat copied to the device
      forest   = the project's forest: the compiled walk on a CPU device, torch ops on the
                 device otherwise (`rerank.forest.walk.TorchForest`)
      compiled = the compiled walk on the host whatever the device, then one copy of the
                 n1 log phats to it (`bench/gpu_check.sh` times it against forest on CUDA)
    Every route predicts the library's phat to 1e-12 (`tests/test_online_speed.py`).
    """

    def __init__(
        self, model: FittedReranker, device: torch.device, predictor: str = "auto"
    ) -> None:
        if predictor not in PREDICTORS:
            raise Refusal(
                f"The 'run.predictor' must be one of {list(PREDICTORS)}. Got {predictor!r} instead."
            )
        self.model, self.device = model, device
        self.uses_rows = uses_rows(model)
        self.compiled: CompiledForest | None = None
        self.jit: JitForest | None = None
        self.torch_forest: TorchForest | None = None
        self.route = "library"  # then "compiled" (host walk) or "forest" (device torch ops)
        self._prior = _PriorTable(model) if TOKEN_PRIOR in model.features else None
        names = list(model.features)
        self._prior_column = names.index(TOKEN_PRIOR) if TOKEN_PRIOR in names else None
        self._task_column = names.index("task") if "task" in names else None
        self._feature_columns = [j for j, n in enumerate(names) if n not in (TOKEN_PRIOR, "task")]
        # `_design_rows`' fixed arguments: block rows -> design columns, the prior's table
        p = self._prior
        self._block_args = (
            *(a for pair in DesignLayout.of(names).rows for a in pair),
            np.zeros(1, np.float32) if p is None else p.table, 0 if p is None else p.top,
            -1 if self._prior_column is None else self._prior_column,
            -1 if self._task_column is None else self._task_column, len(names),
        )  # fmt: skip
        if predictor == "library":
            return
        try:
            self.compiled = compile_forest(forest_of(model.estimator, model.kind))
            on_device = device.type != "cpu" and predictor == "forest"
            if on_device:
                self.torch_forest = TorchForest(self.compiled, device)
            else:
                self.jit = jit_forest(self.compiled)
        except ForestError as err:
            if predictor != "auto":
                raise
            log.warning("run.predictor=auto: the library's predictor is used (%s)", err)
            self.compiled = None
            return
        # what runs each round: torch ops on the device, or the compiled walk on the host
        self.route = "forest" if self.torch_forest is not None else "compiled"

    def design(self, features: Mapping, tokens: np.ndarray, task: str) -> np.ndarray:
        """X [n1, F] float32, column for column what `rerank.design.design_matrix` builds.

        Filled into [F, n1] and returned transposed (a view; the compiled walk reads the
        [F, n1] rows, the libraries copy it into their own layout). From
        `FirstLevelFeatures` (the decoder's) in one compiled call (`_design_rows`), from
        any other mapping name by name; the same float32 values either way.
        """
        m = self.model
        task_code = np.float32(m.categories.index(task) if task in m.categories else np.nan)
        if isinstance(features, FirstLevelFeatures):  # the decoder's: one compiled call
            return _design_rows(*features.blocks, tokens, task_code, *self._block_args).T
        XT = np.empty((len(m.features), tokens.shape[0]), dtype=np.float32)
        for j in self._feature_columns:
            XT[j] = features[m.features[j]]
        if self._prior_column is not None:
            XT[self._prior_column] = self._prior(tokens)
        if self._task_column is not None:  # index in the model's categories; NaN if unknown
            XT[self._task_column] = task_code
        return XT.T

    def first_logprob(self, X: np.ndarray) -> Tensor:
        """log phat (phat clipped to [PROB_FLOOR, 1] like predict_matrix) [n1] float32 on the device."""
        if self.torch_forest is not None:
            Xv = torch.from_numpy(prepare(self.compiled, X)).to(self.device, non_blocking=True)
            phat = link(self.compiled, self.torch_forest.raw(Xv))
            return torch.log(phat.clamp(PROB_FLOOR, 1.0)).float()
        if self.jit is not None:
            out = torch.from_numpy(log_phat(self.jit, X))
        else:
            phat = self.model.predict_matrix(X, n_threads=1)
            out = torch.from_numpy(np.log(phat).astype(np.float32))
        return out if self.device.type == "cpu" else out.to(self.device)


class _PriorTable:
    """The model's token prior (`token_prior.transform`) looked up in a table of its values.

    transform's values for every token id up to the largest seen in training, and one
    slot past it for every larger (unseen) id: the prior's mean, as transform gives it.
    The same float32 values, in two array ops per round instead of transform's checks.
    Token ids are >= 0 (vocabulary indices).
    """

    def __init__(self, model: FittedReranker) -> None:
        prior = model.token_prior
        top = int(np.asarray(prior.tokens_, dtype=np.int64).max(initial=-1)) + 1
        self.table = prior.transform(np.arange(top + 1, dtype=np.int64))  # [top + 1] float32
        self.top = top

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        return self.table[np.minimum(tokens, self.top)]


@njit(nogil=True)
def _design_rows(o32, oi32, ob, tokens, task_code, d32, r32, di, ri, db, rb, prior_table,
                 prior_top, prior_column, task_column, n_features):  # fmt: skip
    """X^T [F, n1] float32 from the feature blocks: block rows to their design columns (cast
    as numpy's assignment casts), the token prior looked up (`_PriorTable`), the task code.

    One call per round: each array call from Python costs microseconds once the models'
    passes have evicted the interpreter's caches (`bench/bench_online.py`, per round).
    """
    n = tokens.shape[0]
    XT = np.empty((n_features, n), dtype=np.float32)
    for a in range(d32.size):
        for i in range(n):
            XT[d32[a], i] = o32[r32[a], i]
    for a in range(di.size):
        for i in range(n):
            XT[di[a], i] = np.float32(oi32[ri[a], i])
    for a in range(db.size):
        for i in range(n):
            XT[db[a], i] = np.float32(1.0) if ob[rb[a], i] else np.float32(0.0)
    if prior_column >= 0:
        for i in range(n):
            XT[prior_column, i] = prior_table[min(tokens[i], prior_top)]
    if task_column >= 0:
        for i in range(n):
            XT[task_column, i] = task_code
    return XT

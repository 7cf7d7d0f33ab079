"""A fitted reranker for the online decoder: loading with every check, and fast phat.

    features (features.online) -> design matrix X [n1, F] float32 (= rerank.models.design_matrix)
    X -> phat -> log phat [n1] float32 on the decoding device

on the fastest exact route for the model and device (`run.predictor`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from calibrate.isotonic import PROB_FLOOR
from decode.prompts import Prompt
from features.first_level import FEATURE_DTYPES
from features.schema import ROW_FEATURES
from rerank.forest import ForestError, forest_from_hgb, forest_from_lightgbm
from rerank.forest_eval import (
    CompiledForest,
    TorchForest,
    compile_forest,
    link,
    prepare,
    walk_numpy,
)
from rerank.models import FEATURE_SETS, TOKEN_PRIOR, FittedReranker, feature_list
from rerank.persist import RerankerLoadError, load_reranker, read_sidecar
from specrank.laws import law_kind
from specrank.paths import project_path

log = logging.getLogger(__name__)
PREDICTORS = ("auto", "library", "forest")  # run.predictor (see decode.online.config)
SEEN_PROMPTS = ("refuse", "skip", "allow")  # run.seen_prompts
MLFLOW_SCHEMES = ("runs:/", "models:/", "mlflow-artifacts:/")
# Inputs the online decoder can compute: every first-level feature, the task, the prior.
ONLINE_FEATURES = frozenset(FEATURE_DTYPES) | {"task", TOKEN_PRIOR}


def reranker_folder(source: str, tracking_uri: str) -> Path:
    """A local folder for `run.reranker`: the path itself, or an MLflow artifact downloaded."""
    if source.startswith(MLFLOW_SCHEMES):
        import mlflow  # only runs that name an MLflow URI pay for the import

        from specrank.tracking import resolve_tracking_uri

        uri = resolve_tracking_uri(tracking_uri)
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=source, tracking_uri=uri))
    path = project_path(source)
    if not path.is_dir():
        raise FileNotFoundError(
            f"run.reranker: no such folder '{source}' (expected a folder written by "
            f"rerank.persist.save_reranker, or an MLflow URI like runs:/<id>/rerankers/<name>)"
        )
    return path


def load_online_reranker(
    source: str | None, temperature: float, tracking_uri: str
) -> FittedReranker:
    """Load `run.reranker` with every check: integrity, feature list, law, computable inputs."""
    if not source:
        raise ValueError("run.rule=reranker needs run.reranker=<folder or MLflow URI>; got none")
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
        raise ValueError(
            f"run.reranker: {source} holds a {model.law} model, but decode.temperature="
            f"{temperature} decodes under the {law} law; use the {kind[law]}"
        )
    return model


def unseen_prompts(model: FittedReranker, prompts: list[Prompt], seen: str) -> list[Prompt]:
    """The prompts to decode with `model`, given `run.seen_prompts` (SPEC §8: no leakage).

    Online gains on the reranker's training prompts are in-sample; the saved
    model lists them, so the check is exact. refuse: fail if any is among the
    run's prompts; skip: drop them; allow: decode everything.
    """
    if seen not in SEEN_PROMPTS:
        raise ValueError(
            f"The 'run.seen_prompts' must be one of {list(SEEN_PROMPTS)}. Got {seen!r} instead."
        )
    if seen == "allow":
        return prompts
    if not model.train_prompts:
        raise ValueError(
            "run.reranker: the model lists no training prompts, so nothing shows it never saw "
            "the prompts this run decodes; refit it from a table with prompt ids, or set "
            "run.seen_prompts=allow"
        )
    trained = set(model.train_prompts)
    kept = [p for p in prompts if p.id not in trained]
    n_seen = len(prompts) - len(kept)
    if n_seen and seen == "refuse":
        example = [p.id for p in prompts if p.id in trained][:3]
        raise ValueError(
            f"run.reranker: the model was trained on {n_seen} of the {len(prompts)} prompts "
            f"this run decodes (e.g. {example}); its gains there would be in-sample. Set "
            f"run.seen_prompts=skip to decode only the others, or run.seen_prompts=allow"
        )
    if not kept:
        raise ValueError(
            f"run.seen_prompts=skip: the model was trained on all {len(prompts)} prompts of "
            f"this run; nothing is left to decode"
        )
    if n_seen:
        log.info("run.seen_prompts=skip: %d of %d prompts left out", n_seen, len(prompts))
    return kept


def forest_of(model: FittedReranker):
    """The model's trees as a `rerank.forest.Forest` (raises ForestError if not exact)."""
    if model.kind == "lgbm":
        return forest_from_lightgbm(model.estimator)
    return forest_from_hgb(model.estimator)


def uses_rows(model: FittedReranker) -> bool:
    """Whether the model reads retained-row features (then the decoder keeps the rows)."""
    return any(f in ROW_FEATURES for f in model.features)


class OnlinePredictor:
    """Design matrix and phat for one round's first-level candidates, on the fastest exact route."""

    def __init__(
        self, model: FittedReranker, device: torch.device, predictor: str = "auto"
    ) -> None:
        if predictor not in PREDICTORS:
            raise ValueError(
                f"The 'run.predictor' must be one of {list(PREDICTORS)}. Got {predictor!r} instead."
            )
        self.model, self.device = model, device
        self.uses_rows = uses_rows(model)
        self.compiled: CompiledForest | None = None
        self.torch_forest: TorchForest | None = None
        self.route = "library"
        if predictor == "auto" and device.type == "cpu" and model.kind == "lgbm":
            return  # LightGBM's own C predictor: ~0.2 ms for 10 rows x 400 trees on a CPU
        if predictor == "library":
            return
        try:
            self.compiled = compile_forest(forest_of(model))
        except ForestError as err:
            if predictor == "forest":
                raise
            log.warning("run.predictor=auto: the library's predictor is used (%s)", err)
            return
        self.route = "forest"
        if device.type != "cpu":
            self.torch_forest = TorchForest(self.compiled, device)

    def design(self, features: dict[str, np.ndarray], tokens: np.ndarray, task: str) -> np.ndarray:
        """X [n1, F] float32, column for column what `rerank.models.design_matrix` builds."""
        m = self.model
        n = tokens.shape[0]
        X = np.empty((n, len(m.features)), dtype=np.float32)
        for j, name in enumerate(m.features):
            if name == TOKEN_PRIOR:
                X[:, j] = m.token_prior.transform(tokens)
            elif name == "task":  # index in the model's categories; NaN for an unknown task
                X[:, j] = m.categories.index(task) if task in m.categories else np.nan
            else:
                X[:, j] = features[name]
        return X

    def first_logprob(self, X: np.ndarray) -> Tensor:
        """log phat (phat clipped to [PROB_FLOOR, 1] like predict_matrix) [n1] float32 on the device."""
        if self.torch_forest is not None:
            Xv = torch.from_numpy(prepare(self.compiled, X)).to(self.device, non_blocking=True)
            phat = link(self.compiled, self.torch_forest.raw(Xv))
            return torch.log(phat.clamp(PROB_FLOOR, 1.0)).float()
        if self.compiled is not None:  # numpy walk (CPU)
            raw = walk_numpy(self.compiled, prepare(self.compiled, X))
            phat = np.clip(link(self.compiled, raw), PROB_FLOOR, 1.0)
        else:
            phat = self.model.predict_matrix(X, n_threads=1)
        return torch.from_numpy(np.log(phat).astype(np.float32)).to(self.device)

"""First-level rerankers (docs/method.md#features-8): a feature set (`FEATURE_SETS`), HGB / LightGBM, cross-fitted.

The model predicts, before verification, the first target factor of each
first-level candidate: under greedy decoding whether it is the target's argmax
(classifier on ``label_is_argmax``), under sampling its target probability
(regressor on ``label_target_prob``). The selector then ranks by
``log phat(x1) + log q(x2) + ...``.

Capacity and the libraries' settings live in `rerank.fit.boosting`: the paper's
fixed 400 x 0.05 x 63 leaves, or early stopping on a prompt-grouped inner split
of the training half.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd
from threadpoolctl import threadpool_limits

from calibrate.isotonic import PROB_FLOOR
from features.registry import FEATURE_SET_TREE, set_features
from rerank.fit.boosting import (
    PAPER_CAPACITY,
    Capacity,
    estimator_iterations,
    fit_estimator,
)
from rerank.fit.design import TOKEN_PRIOR, design_matrix, task_categories
from rerank.fit.fingerprints import frame_fingerprint
from rerank.fit.folds import train_prompts
from rerank.fit.token_prior import (
    DEFAULT_PSEUDO_COUNT,
    PriorColumn,
    TokenPrior,
    prior_groups,
    token_prior_features,
)
from rerank.forest.jit import JitForest, batch_phat, jit_forest
from rerank.forest.table import ForestError, forest_of
from rerank.forest.walk import compile_forest
from selection.rules import MODEL_KINDS
from specrank.statistics.laws import law_kind

log = logging.getLogger(__name__)
PREDICT_ROUTES = ("library", "forest")
# The faster exact route for many rows, per library (both give the same phat bit for bit):
# the batch walk on the compiled walk's layout (rerank.forest.jit.batch_phat) is 2.1-2.4x
# faster than HGB's predictor and 1.9-2.0x faster than LightGBM's (bench.bench_forest:
# 0.4M rows of 200 trees, 2 threads, load 0.9).
BATCH_ROUTE = {"hgb": "forest", "lgbm": "forest"}
LAWS = ("greedy", "sampling")
# the rerankers' inputs: each set's features (features.registry), then the fold's token prior
FEATURE_SETS: dict[str, list[str]] = {
    s.name: [*set_features(s.name), TOKEN_PRIOR] for s in FEATURE_SET_TREE
}
LABEL_OF_LAW = {"greedy": "label_is_argmax", "sampling": "label_target_prob"}


def feature_list(feature_set: str) -> list[str]:
    """Model inputs of ``feature_set`` ("base" or "rows"), in matrix column order."""
    if feature_set not in FEATURE_SETS:
        raise ValueError(f"feature_set must be one of {list(FEATURE_SETS)}; got {feature_set!r}")
    return list(FEATURE_SETS[feature_set])


def law_of(frame: pd.DataFrame) -> str:
    """The decoding law of ``frame``; refuses a frame mixing temperatures.

    Greedy (T = 0) and sampling rows have different labels and models. Two
    different positive temperatures are refused too: temperature is not a
    model input, so pooling them would blur two target laws into one model.
    """
    temps = np.unique(np.asarray(frame["temperature"], dtype=np.float64))
    if temps.size != 1:
        raise ValueError(
            f"a reranker is fitted on one temperature at a time; the frame mixes temperatures "
            f"{temps.tolist()} (greedy = 0). Pass one temperature's rows per call."
        )
    return law_kind(float(temps[0]))


@dataclass(kw_only=True)  # eleven fields: built by name, never by position
class FittedReranker:
    """A fitted first-level model with everything needed to apply it to new rows."""

    kind: str
    law: str
    feature_set: str
    features: list[str]
    categories: list[str]
    estimator: Any  # HistGradientBoosting{Classifier,Regressor} or lightgbm.Booster
    token_prior: TokenPrior
    train_fingerprint: str
    seed: int = 0
    capacity: Capacity = PAPER_CAPACITY
    # Distinct prompts of the training half: lets anyone audit that a prediction
    # never came from a model that saw its prompt.
    train_prompts: tuple[str, ...] = ()

    @property
    def n_iter(self) -> int:
        """Boosting iterations the model holds (with early stopping: the count chosen)."""
        return estimator_iterations(self.estimator, self.kind)

    def predict_matrix(
        self, X: np.ndarray, n_threads: int | None = None, route: str = "library"
    ) -> np.ndarray:
        """phat (float64, clipped to [PROB_FLOOR, 1]) for a design matrix.

        ``route``: "library", the library's own predictor; "forest", the same trees
        walked row by row on the compiled walk's layout (`rerank.forest.jit.batch_phat`:
        the libraries' raw scores bit for bit, faster than HGB's tree-by-tree predictor
        on many rows). A model the forest cannot represent exactly (`ForestError`)
        is predicted by the library, with a warning.
        """
        if X.shape[1] != len(self.features):
            raise ValueError(f"matrix has {X.shape[1]} columns; the model expects {self.features}")
        if route not in PREDICT_ROUTES:
            raise ValueError(f"route must be one of {PREDICT_ROUTES}; got {route!r}")
        if route == "forest" and (forest := self._batch_forest) is not None:
            return np.clip(batch_phat(forest, X, n_threads), PROB_FLOOR, 1.0)
        if self.kind == "lgbm":
            raw = self.estimator.predict(X, num_threads=n_threads or 0)
        else:
            with threadpool_limits(limits=n_threads, user_api="openmp"):
                if self.law == "greedy":
                    raw = self.estimator.predict_proba(X)[:, 1]
                else:
                    raw = self.estimator.predict(X)
        return np.clip(np.asarray(raw, dtype=np.float64), PROB_FLOOR, 1.0)

    @cached_property
    def _batch_forest(self) -> JitForest | None:
        """The estimator's trees in the batch walk's layout, built once per model, not once
        per block of its held-out half (`rerank.fit.out_of_fold.predict_blocks`: two blocks a model
        at paper scale, about twenty at 10x; building them per block was a visible share of
        `experiment=paper`'s fitting, docs/benchmarks.md). None where the
        walk cannot represent them exactly (the library predicts)."""
        try:
            return jit_forest(compile_forest(forest_of(self.estimator, self.kind)))
        except ForestError as err:
            log.warning("%s %s: the library predicts (%s)", self.feature_set, self.kind, err)
            return None

    def __getstate__(self) -> dict:
        # a pickled model (a Ray fit task's result) travels without its compiled forest,
        # a few MB for 400 trees; the receiver builds it again if it predicts by the walk
        return {k: v for k, v in self.__dict__.items() if k != "_batch_forest"}

    def predict_phat(self, frame: pd.DataFrame, n_threads: int | None = None) -> np.ndarray:
        """phat for new rows: features from ``frame``, prior from the whole training half."""
        prior = self.token_prior.transform(frame["token"].to_numpy())
        X = design_matrix(frame, self.features, self.categories, prior)
        return self.predict_matrix(X, n_threads)


def law_labels(frame: pd.DataFrame, law: str) -> np.ndarray:
    """The label column of `law` (`LABEL_OF_LAW`) as float64; refused when the frame lacks it."""
    col = LABEL_OF_LAW[law]
    if col not in frame.columns:
        raise ValueError(f"law={law!r} needs label column {col!r}; the frame lacks it")
    return frame[col].to_numpy(dtype=np.float64)


def check_law_frame(frame: pd.DataFrame, kind: str, law: str) -> None:
    """Refuse an unknown model kind or law, or a frame whose temperature is another law's."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"kind must be one of {MODEL_KINDS}; got {kind!r}")
    if law not in LAWS:
        raise ValueError(f"law must be one of {LAWS}; got {law!r}")
    found = law_of(frame)
    if found != law:
        raise ValueError(f"law={law!r} but the frame's temperature makes it {found!r}")


def fit_reranker(
    frame: pd.DataFrame,
    feature_set: str,
    kind: str,
    law: str,
    categories: Sequence[str] | None = None,
    seed: int = 0,
    n_threads: int | None = None,
    capacity: Capacity = PAPER_CAPACITY,
    pseudo_count: float = DEFAULT_PSEUDO_COUNT,
    prior_split: str = "prompt",
) -> FittedReranker:
    """Fit one reranker on all rows of ``frame`` (they form the training half).

    Training rows get alternation token priors (`rerank.fit.token_prior`); the
    returned model applies the whole-half prior to new rows.
    """
    check_law_frame(frame, kind, law)
    features = feature_list(feature_set)
    cats = task_categories(frame, categories)
    y = law_labels(frame, law)
    tokens = frame["token"].to_numpy()
    groups = frame["prompt_id"].to_numpy() if "prompt_id" in frame.columns else None
    by_prompt = prior_groups(prior_split, groups)
    prior, full = token_prior_features(tokens, y, np.ones(len(frame), bool), pseudo_count,
                                       by_prompt)  # fmt: skip
    X = design_matrix(frame, features, cats, prior)
    column = PriorColumn(features.index(TOKEN_PRIOR), tokens, pseudo_count, by_prompt is not None)
    est = fit_estimator(X, y, features, kind, law, capacity, seed, n_threads, groups=groups,
                        tasks=frame["task"].to_numpy(), prior=column)  # fmt: skip
    fp = frame_fingerprint(frame, fingerprint_columns(frame, features, law))
    prompts = () if groups is None else train_prompts(groups)
    return FittedReranker(
        kind=kind, law=law, feature_set=feature_set, features=features, categories=cats,
        estimator=est, token_prior=full, train_fingerprint=fp, seed=seed, capacity=capacity,
        train_prompts=prompts,
    )  # fmt: skip


def fingerprint_columns(frame: pd.DataFrame, features: list[str], law: str) -> list[str]:
    """The columns a fit's training rows are fingerprinted by: keys, features, the label."""
    keys = [c for c in ("prompt_id", "round_index", "cand_index", "token") if c in frame.columns]
    feats = [f for f in features if f != TOKEN_PRIOR and f not in keys]
    return [*keys, *feats, LABEL_OF_LAW[law]]

"""Design matrices that exercise every input rule of the forest paths, and the libraries' own
predictions to hold them against (`tests/test_online_forest.py`, `tests/test_online_speed.py`)."""

from __future__ import annotations

import numpy as np

from rerank.fit.design import design_matrix
from tests.candidate_frames import make_candidate_frame


def forest_inputs(model, temperature: float) -> np.ndarray:
    """A design matrix from a fresh frame, perturbed where the libraries' rules differ:
    NaN, category codes in and out of range, zeros, and values LightGBM reads as zero."""
    frame = make_candidate_frame(n_prompts=12, rounds=6, temperature=temperature, seed=9)
    prior = model.token_prior.transform(frame["token"].to_numpy())
    X = design_matrix(frame, model.features, model.categories, prior)
    rng = np.random.default_rng(1)
    X[rng.random(X.shape) < 0.1] = np.nan
    task = model.features.index("task")
    X[:60, task] = rng.choice([-1, -0.5, 0, 0.5, 1, 2, 3, 5, 70, np.nan], 60)
    X[60:80] = 0.0
    X[80:100] = np.float32(1e-38)  # subnormal: LightGBM reads |x| <= 1e-35 as 0
    X[100:110] = -np.float32(1e-38)
    return X


def library_predict(model, X: np.ndarray) -> np.ndarray:
    """The library's own prediction (unclipped)."""
    if model.kind == "lgbm":
        return model.estimator.predict(X, num_threads=1)
    if model.law == "greedy":
        return model.estimator.predict_proba(X)[:, 1]
    return model.estimator.predict(X)

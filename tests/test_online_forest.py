"""The forest fast path predicts what the libraries predict (LightGBM, scikit-learn HGB).

Tolerance: |ours - library| <= 1e-12 on phat (absolute). Decisions are exact (float32
thresholds are rounded so `x <= t32` equals the libraries' float64 test for every
float32 input), so only the float64 summation order of the leaf values differs:
measured ~2e-15 on 400-tree models. Inputs include NaN, unknown / negative /
fractional / out-of-range task codes, zeros and subnormal values.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import rerank.serving as online_rerank
from rerank.fit.models import fit_reranker
from rerank.forest.table import ForestError, _mask, forest_from_hgb, forest_from_lightgbm
from rerank.forest.walk import TorchForest, compile_forest, link, prepare, walk_numpy
from rerank.serving import OnlinePredictor
from tests.candidate_frames import FAST, TASKS, make_candidate_frame
from tests.forest_inputs import forest_inputs, library_predict
from tests.tiny_models import one_thread

TOL = 1e-12


@pytest.fixture(scope="module", params=[("lgbm", 0.0), ("lgbm", 1.0), ("hgb", 0.0), ("hgb", 1.0)])
def model(request):
    kind, temperature = request.param
    frame = make_candidate_frame(n_prompts=40, rounds=8, temperature=temperature, seed=3)
    frame = frame[frame["task"] != TASKS[1]]  # a declared task never seen in training
    law = "greedy" if temperature == 0 else "sampling"
    with one_thread():
        return fit_reranker(
            frame, "rows", kind, law, categories=TASKS, n_threads=1, capacity=FAST
        ), temperature


def test_forest_walks_match_the_library(model):
    m, temperature = model
    forest = forest_from_lightgbm(m.estimator) if m.kind == "lgbm" else forest_from_hgb(m.estimator)
    c = compile_forest(forest)
    assert forest.n_trees == FAST.n_iter and forest.depth >= 4
    assert forest.categorical.any()  # the task splits are exercised
    X = forest_inputs(m, temperature)
    ref = library_predict(m, X)
    ours_numpy = link(c, walk_numpy(c, prepare(c, X)))
    with one_thread():
        ours_torch = link(c, TorchForest(c, "cpu").raw(torch.from_numpy(prepare(c, X)))).numpy()
    assert np.abs(ours_numpy - ref).max() <= TOL
    assert np.abs(ours_torch - ref).max() <= TOL


@pytest.mark.parametrize("predictor", ["auto", "library", "forest", "compiled"])
def test_online_predictor_routes_agree(model, predictor):
    m, temperature = model
    X = forest_inputs(m, temperature)
    p = OnlinePredictor(m, torch.device("cpu"), predictor)
    # on a CPU, auto, forest and compiled all walk the forest with the compiled walk
    assert p.route == ("library" if predictor == "library" else "compiled")
    assert (p.jit is not None) == (predictor != "library")
    got = p.first_logprob(X).numpy()
    want = np.log(m.predict_matrix(X, n_threads=1)).astype(
        np.float32
    )  # clipped like predict_matrix
    assert np.abs(got - want).max() <= 1e-6  # float32 logs of phat equal to 1e-12


def test_unrepresentable_models_fall_back_to_the_library(model, monkeypatch, caplog):
    m, _ = model
    with pytest.raises(ForestError, match=r"category codes \[63\] exceed the fast path's range"):
        _mask([63], "split")

    def refuse(_estimator, _kind):
        raise ForestError("too many categories")

    monkeypatch.setattr(online_rerank, "forest_of", refuse)
    with caplog.at_level(logging.WARNING, logger="rerank.serving"):
        assert OnlinePredictor(m, torch.device("cpu"), "auto").route == "library"
    assert m.kind == "lgbm" or "too many categories" in caplog.text
    with pytest.raises(ForestError, match="too many categories"):
        OnlinePredictor(m, torch.device("cpu"), "forest")
    with pytest.raises(ValueError, match=r"'run.predictor' must be one of \['auto'"):
        OnlinePredictor(m, torch.device("cpu"), "onnx")


@pytest.mark.gpu
@pytest.mark.parametrize("predictor", ["forest", "auto"])
def test_forest_on_cuda_matches_the_library(model, predictor):
    """forest: torch ops on the device; auto: the compiled walk on the host, then one copy."""
    m, temperature = model
    X = forest_inputs(m, temperature)
    p = OnlinePredictor(m, torch.device("cuda"), predictor)
    assert p.route == {"forest": "forest", "auto": "compiled"}[predictor]
    assert (p.torch_forest is not None) == (predictor == "forest")
    assert (p.jit is not None) == (predictor == "auto")
    got = p.first_logprob(X).cpu().numpy()
    want = np.log(m.predict_matrix(X, n_threads=1)).astype(np.float32)
    assert np.abs(got - want).max() <= 1e-6

"""`rerank.booster.fit_nodes` (rerank.fit.data_parallel): the nodes' code on one node is the
single-process cross-fit, bit for bit; the count early stopping keeps is LightGBM's own; the
prompts are spread over nodes whole and none is left empty; bad settings are refused."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import lightgbm as lgb
import numpy as np
import pytest

from rerank.config import BoosterConfig
from rerank.fit.boosting import Capacity
from rerank.fit.data_parallel import (
    InProcess,
    crossfit_on_nodes,
    early_stopping_count,
    key_columns,
    node_prompts,
)
from rerank.fit.design import task_categories
from rerank.fit.halves import fold_map
from rerank.fit.out_of_fold import LawFits
from rerank.job.fitting import fit_columns, law_frame
from rerank.settings import check_train_parallel
from specrank.runtime.parallel import ParallelConfig
from specrank.statistics.laws import law_kind
from tests.small_jobs import small_stores

SET = "rows"


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> Path:
    return small_stores(tmp_path_factory.mktemp("nodes"), 32, 20, 4)[1]


def _settings(frame, capacity: Capacity) -> LawFits:
    return LawFits(kind="lgbm", seed=3, n_threads=1, categories=tuple(task_categories(frame)),
                   capacity=capacity, prior_split="prompt", fits=None, train_share=1.0)  # fmt: skip


def _rows(features: Path, temperature: float, prompts: tuple[str, ...]):
    return law_frame(features, "tree", temperature, fit_columns([SET]), prompts)


@pytest.mark.parametrize(
    ("temperature", "capacity"),
    [
        (0.0, Capacity(n_iter=80, learning_rate=0.1, early_stopping=True, patience=4)),
        (1.0, Capacity(n_iter=80, learning_rate=0.1, early_stopping=True, patience=4)),
        (1.0, Capacity(n_iter=30, learning_rate=0.1, early_stopping=True, patience=4, refit=True)),
        (0.0, Capacity(n_iter=25, learning_rate=0.1)),
    ],
)
def test_one_node_is_the_single_process_cross_fit(features, temperature, capacity):
    frame = law_frame(features, "tree", temperature, fit_columns([SET]))
    folds = fold_map(frame["prompt_id"].to_numpy(), "seeded", 0, frame["task"].to_numpy())
    settings = _settings(frame, capacity)
    one = settings.crossfit(frame, temperature, SET, folds)
    keys = law_frame(features, "tree", temperature, key_columns(law_kind(temperature)))
    runner = InProcess(partial(_rows, features, temperature))
    nodes = crossfit_on_nodes(keys, settings, temperature, SET, folds, 1, runner, "store")
    assert np.array_equal(one.folds, nodes.folds)
    assert np.array_equal(one.phat, nodes.phat)  # bit for bit
    for a, b in zip(one.models, nodes.models, strict=True):
        assert a.n_iter == b.n_iter
        if capacity.early_stopping:
            assert a.n_iter < capacity.n_iter or capacity.refit  # the stopping chose a count
        assert a.train_prompts == b.train_prompts
        assert a.token_prior.to_dict() == b.token_prior.to_dict()


def test_the_count_kept_is_lightgbm_s_early_stopping_choice():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(3000, 6))
    y = X[:, 0] + rng.normal(scale=2.0, size=3000)
    params = {"objective": "regression", "learning_rate": 0.3, "num_leaves": 31, "verbosity": -1,
              "seed": 0, "num_threads": 1}  # fmt: skip
    train, held = lgb.Dataset(X[:2000], y[:2000]), lgb.Dataset(X[2000:], y[2000:])
    for patience in (2, 5, 20):
        record: dict = {}
        stopped = lgb.train(params, train, 200, valid_sets=[held], valid_names=["held"],
                            callbacks=[lgb.early_stopping(patience, verbose=False)])  # fmt: skip
        lgb.train(params, train, 200, valid_sets=[held], valid_names=["held"],
                  callbacks=[lgb.record_evaluation(record)])  # fmt: skip
        curve = np.asarray(record["held"]["l2"])
        assert stopped.best_iteration < 200  # it did stop
        assert early_stopping_count(curve, patience) == stopped.best_iteration


def test_prompts_are_dealt_to_nodes_whole_in_turn():
    codes = np.repeat([7, 3, 9, 1, 4], 3)  # prompts in order of first appearance: 7 3 9 1 4
    mask = codes != 9
    groups = node_prompts(codes, mask, 2)
    assert [g.tolist() for g in groups] == [[7, 1], [3, 4]]
    with pytest.raises(ValueError, match="2 prompt"):
        node_prompts(np.repeat([0, 1], 3), np.ones(6, bool), 3)


@pytest.mark.parametrize(
    ("backend", "kind", "found"),
    [
        ("local", "lgbm", "parallel.backend is 'local'"),
        ("ray", "hgb", r"kind=lgbm \(it is 'hgb'\)"),
    ],
)
def test_fit_nodes_needs_ray_and_lightgbm(backend, kind, found):
    model = BoosterConfig(kind=kind, fit_nodes=2)
    with pytest.raises(ValueError, match=rf"rerank.booster.fit_nodes=2 .*{found}"):
        check_train_parallel(ParallelConfig(backend=backend), model)

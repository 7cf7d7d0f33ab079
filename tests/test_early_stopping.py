"""Early stopping chooses capacity on the training half alone, on a prompt-grouped inner split."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hydra import compose
from omegaconf import OmegaConf

from rerank.fit.boosting import Capacity, fit_estimator
from rerank.fit.design import design_matrix
from rerank.fit.folds import check_grouped, inner_validation
from rerank.fit.halves import prompt_halves
from rerank.fit.law_memo import LawMemo
from rerank.fit.models import LABEL_OF_LAW, feature_list
from rerank.fit.out_of_fold import crossfit_predict
from rerank.fit.token_prior import token_prior_features
from rerank.settings import model_capacity
from tests.candidate_frames import make_candidate_frame

# Fast enough for tests, large enough that the held-out loss turns before n_iter.
STOP = Capacity(n_iter=300, learning_rate=0.2, max_leaves=15, early_stopping=True, patience=8)


# -- the inner split ------------------------------------------------------------------------


def test_inner_split_is_prompt_grouped_stratified_and_seeded() -> None:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 40, 2000)
    ids = np.array([f"p{i}" for i in prompt])
    tasks = np.array(["code", "math", "chat", "qa"])[prompt % 4]
    held = inner_validation(ids, 0.25, seed=1, tasks=tasks)
    # grouped: a prompt's rows are all held out or all kept (check_grouped on 0/1 ids)
    check_grouped(ids, held.astype(np.int8))
    n_held = {t: len(set(ids[held & (tasks == t)])) for t in set(tasks)}
    n_all = {t: len(set(ids[tasks == t])) for t in set(tasks)}
    assert sum(n_held.values()) == round(0.25 * len(set(ids)))
    for t in n_all:  # stratified: every task gives about its share
        assert abs(n_held[t] - 0.25 * n_all[t]) <= 1, (t, n_held, n_all)
    # the split depends on the set of prompts and the seed, not on row order
    perm = rng.permutation(ids.size)
    np.testing.assert_array_equal(inner_validation(ids[perm], 0.25, 1, tasks[perm]), held[perm])
    assert set(ids[inner_validation(ids, 0.25, 2, tasks)]) != set(ids[held])


def test_inner_split_refuses_what_it_cannot_split() -> None:
    with pytest.raises(ValueError, match="validation_share"):
        inner_validation(np.array(["a", "b"]), 1.0)
    with pytest.raises(ValueError, match=r">= 2 training prompts.*early_stopping=false"):
        inner_validation(np.array(["a", "a"]), 0.2)
    # a tiny half still holds one prompt out and keeps one
    held = inner_validation(np.array(["a", "b", "a"]), 0.01)
    assert held.sum() in (1, 2) and len(set(np.array(["a", "b", "a"])[held])) == 1


# -- early stopping never reads the predicted half ------------------------------------------


@pytest.fixture(scope="module")
def greedy_frame():
    return make_candidate_frame(n_prompts=30, rounds=6, temperature=0.0, seed=21)


def _changed_half(frame, rows: np.ndarray, seed: int):
    """`frame` with new labels and features for `rows` (every input a model could read)."""
    out = frame.copy()
    rng = np.random.default_rng(seed)
    n = int(rows.sum())
    out.loc[rows, "label_is_argmax"] = rng.random(n) < 0.5
    out.loc[rows, "label_target_prob"] = rng.random(n).astype(np.float32)
    for col in ("draft_prob", "draft_logprob", "cache_logprob", "same_logprob", "subtree_size"):
        out.loc[rows, col] = out.loc[rows, col].to_numpy()[rng.permutation(n)]
    return out


@pytest.mark.parametrize("kind", ["lgbm", "hgb"])
def test_early_stopping_never_reads_the_predicted_half(greedy_frame, kind) -> None:
    frame = greedy_frame
    folds = prompt_halves(frame["prompt_id"].to_numpy())
    res = crossfit_predict(frame, "rows", kind, "greedy", folds, n_threads=1, capacity=STOP)
    chosen = [m.n_iter for m in res.models]
    assert all(1 <= c < STOP.n_iter for c in chosen)  # it did stop early
    # Everything about fold 0 (labels, features) changes: the model that predicts
    # fold 0 (fitted on fold 1, its capacity chosen inside fold 1) is unchanged ...
    zero = folds == 0
    changed = _changed_half(frame, zero, seed=4)
    res2 = crossfit_predict(changed, "rows", kind, "greedy", folds, n_threads=1, capacity=STOP)
    assert res2.models[0].n_iter == chosen[0]
    original = frame[zero]
    np.testing.assert_array_equal(
        res2.models[0].predict_phat(original, 1), res.models[0].predict_phat(original, 1)
    )
    # ... while the model fitted on fold 0 moves (the change is one a model would see).
    other = frame[~zero]
    assert not np.array_equal(
        res2.models[1].predict_phat(other, 1), res.models[1].predict_phat(other, 1)
    )


def _design(frame, law: str = "greedy"):
    features = feature_list("rows")
    y = frame[LABEL_OF_LAW[law]].to_numpy(np.float64)
    prior, _ = token_prior_features(frame["token"].to_numpy(), y, np.ones(len(frame), bool))
    X = design_matrix(frame, features, sorted(frame["task"].unique()), prior)
    return X, y, features, frame["prompt_id"].to_numpy(), frame["task"].to_numpy()


@pytest.mark.parametrize("kind", ["lgbm", "hgb"])
def test_the_held_out_prompts_choose_the_capacity(greedy_frame, kind) -> None:
    # Guards the test above: the inner validation labels are what stops the fit.
    X, y, features, groups, tasks = _design(greedy_frame)
    held = inner_validation(groups, STOP.validation_share, 0, tasks)
    est = fit_estimator(X, y, features, kind, "greedy", STOP, 0, 1, groups=groups, tasks=tasks)
    flipped = y.copy()
    flipped[held] = 1 - flipped[held]  # every tree now moves away from the held-out labels
    est2 = fit_estimator(X, flipped, features, kind, "greedy", STOP, 0, 1, groups=groups,
                         tasks=tasks)  # fmt: skip
    n = [e.num_trees() if kind == "lgbm" else e.n_iter_ for e in (est, est2)]
    assert n[1] <= 2 < n[0]


@pytest.mark.parametrize("kind", ["lgbm", "hgb"])
def test_sample_weight_weighs_training_and_held_out_loss(greedy_frame, kind) -> None:
    X, y, features, groups, tasks = _design(greedy_frame)
    held = inner_validation(groups, STOP.validation_share, 0, tasks)
    kw = dict(groups=groups, tasks=tasks)

    def predict(est):
        return est.predict(X) if kind == "lgbm" else est.predict_proba(X)[:, 1]

    base = fit_estimator(X, y, features, kind, "greedy", STOP, 0, 1, **kw)
    # held-out rows of weight 0 do not count: flipping their labels changes nothing
    w = np.ones(len(y))
    mute = held & (groups == groups[held][0])
    w[mute] = 0.0
    muted = fit_estimator(X, y, features, kind, "greedy", STOP, 0, 1, sample_weight=w, **kw)
    flipped = y.copy()
    flipped[mute] = 1 - flipped[mute]
    muted2 = fit_estimator(X, flipped, features, kind, "greedy", STOP, 0, 1, sample_weight=w, **kw)
    np.testing.assert_array_equal(predict(muted2), predict(muted))
    # training rows' weights reach the library's loss
    w = np.where(np.isin(groups, np.unique(groups)[::3]), 4.0, 1.0)
    heavy = fit_estimator(X, y, features, kind, "greedy", STOP, 0, 1, sample_weight=w, **kw)
    assert not np.array_equal(predict(heavy), predict(base))
    with pytest.raises(ValueError, match="sample_weight"):
        fit_estimator(X, y, features, kind, "greedy", STOP, 0, 1, sample_weight=-w, **kw)


@pytest.mark.parametrize("kind", ["lgbm", "hgb"])
@pytest.mark.parametrize("refit", [False, True])
def test_early_stopped_model_is_a_fixed_fit_of_the_chosen_count(greedy_frame, kind, refit):
    X, y, features, groups, tasks = _design(greedy_frame)
    cap = replace(STOP, refit=refit)
    est = fit_estimator(X, y, features, kind, "greedy", cap, 0, 1, groups=groups, tasks=tasks)
    n = est.num_trees() if kind == "lgbm" else est.n_iter_
    rows = (
        np.ones(len(y), bool)
        if refit
        else ~inner_validation(groups, cap.validation_share, 0, tasks)
    )
    fixed = replace(cap, n_iter=n, early_stopping=False)
    ref = fit_estimator(X[rows], y[rows], features, kind, "greedy", fixed, 0, 1)

    def predict(e):
        return e.predict(X) if kind == "lgbm" else e.predict_proba(X)[:, 1]

    np.testing.assert_array_equal(predict(est), predict(ref))


@pytest.mark.parametrize("kind", ["lgbm", "hgb"])
@pytest.mark.parametrize("early", [True, False])
def test_fitting_rows_of_a_matrix_equals_fitting_a_copy_of_them(greedy_frame, kind, early):
    # `rows=` (what cross-fitting passes: no copy of the training half) fits the model a
    # copy of those rows and their per-row arguments fits, whatever the library's dtype.
    X, y, features, groups, tasks = _design(greedy_frame)
    rows = np.flatnonzero(np.isin(groups, np.unique(groups)[::2]))  # every other prompt
    w = np.random.default_rng(3).uniform(0.5, 2.0, len(y))
    cap = STOP if early else replace(STOP, n_iter=40, early_stopping=False)
    est = fit_estimator(X, y, features, kind, "greedy", cap, 0, 1, sample_weight=w,
                        groups=groups, tasks=tasks, rows=rows)  # fmt: skip
    ref = fit_estimator(X[rows], y[rows], features, kind, "greedy", cap, 0, 1,
                        sample_weight=w[rows], groups=groups[rows], tasks=tasks[rows])  # fmt: skip
    other = fit_estimator(X, y, features, kind, "greedy", cap, 0, 1, sample_weight=w,
                          groups=groups, tasks=tasks)  # fmt: skip

    def predict(e):
        return e.predict(X) if kind == "lgbm" else e.predict_proba(X)[:, 1]

    np.testing.assert_array_equal(predict(est), predict(ref))
    assert not np.array_equal(predict(other), predict(ref))  # the rows are what it fitted
    with pytest.raises(ValueError, match=r"sample_weight has shape \(3,\)"):
        fit_estimator(X, y, features, kind, "greedy", cap, 0, 1, sample_weight=w[:3],
                      groups=groups, tasks=tasks, rows=rows)  # fmt: skip


def test_early_stopping_needs_the_prompts(greedy_frame) -> None:
    X, y, features, _, _ = _design(greedy_frame)
    with pytest.raises(ValueError, match="groups="):
        fit_estimator(X, y, features, "lgbm", "greedy", STOP, 0, 1)


# -- both capacities are reachable by config ------------------------------------------------


def test_default_is_early_stopped_and_paper_is_fixed_400(hydra_conf) -> None:
    default = OmegaConf.to_object(compose("train").rerank)
    paper = OmegaConf.to_object(compose("train", overrides=["experiment=paper"]).rerank)
    # early stopping at learning rate 0.1 (half the paper's trees for the same rule values)
    assert model_capacity(default.booster) == Capacity(learning_rate=0.1, early_stopping=True)
    assert model_capacity(paper.booster) == Capacity()  # 400 x 0.05 x 63, no early stopping
    assert Capacity() == Capacity(n_iter=400, learning_rate=0.05, max_leaves=63)
    fixed = compose("train", overrides=["rerank.booster.early_stopping=false"])
    assert not OmegaConf.to_object(fixed.rerank).booster.early_stopping


# -- what a law's feature sets share -----------------------------------------------------------


def test_feature_sets_sharing_a_law_memo_fit_what_each_fits_alone(greedy_frame) -> None:
    """One `LawMemo` across a law's feature sets (as `predict_first_factors` shares it) gives
    each set the predictions and models of a cross-fit of its own; its parts (the split, the
    token priors, the inner splits) come from the first set, and a setting they depend on
    (the seed, the training share) keys parts of its own."""
    frame = greedy_frame
    folds = prompt_halves(frame["prompt_id"].to_numpy())
    memo = LawMemo()
    runs = [("base", 0, 1.0), ("rows", 0, 1.0), ("rows", 1, 1.0), ("base", 0, 0.5)]
    sizes = []
    for feature_set, seed, share in runs:
        kw = dict(n_threads=1, capacity=STOP, seed=seed, train_share=share)
        shared = crossfit_predict(frame, feature_set, "lgbm", "greedy", folds, memo=memo, **kw)
        alone = crossfit_predict(frame, feature_set, "lgbm", "greedy", folds, **kw)
        np.testing.assert_array_equal(shared.phat, alone.phat)
        for a, b in zip(shared.models, alone.models, strict=True):
            assert a.n_iter == b.n_iter and a.train_prompts == b.train_prompts
        sizes.append(len(memo))
    # the split and the 2 inner splits; the second set adds nothing
    assert sizes[0] == 3 and sizes[1] == 3
    assert sizes[2] > sizes[1] and sizes[3] > sizes[2]

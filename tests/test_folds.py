"""Cross-fitting by prompt and the token prior: nothing a prediction uses saw its own label."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rerank.fit.folds import check_grouped, fold_masks, prompt_subsample
from rerank.fit.halves import prompt_halves
from rerank.fit.models import fit_reranker
from rerank.fit.out_of_fold import crossfit_predict
from rerank.fit.token_prior import (
    PriorColumn,
    TokenPrior,
    alternation_parts,
    split_priors,
    token_prior_features,
)
from tests.candidate_frames import FAST, make_candidate_frame

# -- prompt halves -------------------------------------------------------------------------


def test_even_odd_uses_the_trailing_integer() -> None:
    ids = np.array(["spec_bench-81", "HumanEval/3", "synth-000012", "HumanEval/3", "mt-10"])
    np.testing.assert_array_equal(prompt_halves(ids), [1, 1, 0, 1, 0])
    assert prompt_halves(ids).dtype == np.int8


def test_even_odd_refuses_ids_without_a_number() -> None:
    with pytest.raises(ValueError, match=r"even_odd.*'intro'.*seeded"):
        prompt_halves(np.array(["q-1", "intro", "q-2"]))


def test_a_split_with_an_empty_half_is_refused() -> None:
    # one prompt: balanced within the tolerance (|1 - 0| <= 1), yet one half is empty
    with pytest.raises(ValueError, match="both halves"):
        prompt_halves(np.array(["a-2", "a-2"]))


def test_seeded_split_is_grouped_balanced_and_independent_of_row_order() -> None:
    rng = np.random.default_rng(0)
    ids = np.array([f"p{i}" for i in rng.integers(0, 31, 500)])  # names without parity meaning
    folds = prompt_halves(ids, "seeded", seed=3)
    check_grouped(ids, folds)
    per_prompt = dict(zip(ids, folds, strict=True))
    assert sorted(np.bincount(list(per_prompt.values()))) == [15, 16]
    perm = rng.permutation(ids.size)
    assert dict(zip(ids[perm], prompt_halves(ids[perm], "seeded", seed=3), strict=True)) == (
        per_prompt
    )
    other = prompt_halves(ids, "seeded", seed=4)
    assert not np.array_equal(folds, other)  # the seed matters


def test_check_grouped_refuses_a_prompt_in_both_folds() -> None:
    ids = np.array(["a-1", "a-1", "b-2"])
    check_grouped(ids, np.array([1, 1, 0]))
    with pytest.raises(ValueError, match=r"both folds.*a-1"):
        check_grouped(ids, np.array([1, 0, 0]))
    with pytest.raises(ValueError, match="0 or 1"):
        check_grouped(ids, np.array([1, 1, 2]))


def test_fold_masks_train_on_the_other_half() -> None:
    folds = np.array([0, 1, 1, 0], dtype=np.int8)
    got = [(f, t.tolist(), p.tolist()) for f, t, p in fold_masks(folds)]
    assert got == [
        (0, [False, True, True, False], [True, False, False, True]),
        (1, [True, False, False, True], [False, True, True, False]),
    ]


# -- token prior ------------------------------------------------------------------------------


def _reference_prior(tokens, labels, a=20.0):
    """Slow dictionary reference: token -> (sum + a * mean) / (count + a)."""
    m = float(np.mean(labels))
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for t, y in zip(tokens, labels, strict=True):
        sums[int(t)] = sums.get(int(t), 0.0) + float(y)
        counts[int(t)] = counts.get(int(t), 0) + 1
    return lambda t: (sums.get(int(t), 0.0) + a * m) / (counts.get(int(t), 0) + a)


def test_token_prior_matches_the_shrinkage_formula() -> None:
    tokens = np.array([5, 5, 7, 9, 5])
    labels = np.array([1.0, 0.0, 1.0, 0.0, 1.0])
    prior = TokenPrior(pseudo_count=20).fit(tokens, labels)
    m = 0.6
    np.testing.assert_allclose(
        prior.transform(np.array([5, 7, 9, 123])),
        [(2 + 20 * m) / 23, (1 + 20 * m) / 21, (0 + 20 * m) / 21, m],  # 123: never seen -> mean
        rtol=1e-6,
    )
    assert prior.transform(np.array([5])).dtype == np.float32


def test_alternation_and_predicted_half_priors_by_hand() -> None:
    tokens = np.array([3, 3, 4, 3, 4, 3, 3])
    labels = np.array([1.0, 0.0, 1.0, 1.0, 0.0, np.nan, np.nan])  # predicted labels unread
    train = np.array([True] * 5 + [False] * 2)
    got, full = token_prior_features(tokens, labels, train)
    np.testing.assert_array_equal(alternation_parts(5), [0, 1, 0, 1, 0])
    part0, part1 = np.array([0, 2, 4]), np.array([1, 3])
    ref0 = _reference_prior(tokens[part1], labels[part1])  # part 0 reads part 1
    ref1 = _reference_prior(tokens[part0], labels[part0])
    reff = _reference_prior(tokens[:5], labels[:5])
    want = [ref0(3), ref1(3), ref0(4), ref1(3), ref0(4), reff(3), reff(3)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(full.transform(tokens[5:]), want[5:], rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(4, 60),
    vocab=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    which=st.integers(0, 10_000),
)
def test_a_training_rows_prior_never_contains_its_own_label(n, vocab, seed, which) -> None:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, n)
    labels = rng.random(n)
    train = rng.random(n) < 0.6
    train[:2] = True  # the alternation needs two training rows
    before, _ = token_prior_features(tokens, labels, train)
    i = np.flatnonzero(train)[which % train.sum()]
    flipped = labels.copy()
    flipped[i] = 1.0 - labels[i] + 5.0  # a large change, so any dependence would show
    after, _ = token_prior_features(tokens, flipped, train)
    assert after[i] == before[i]
    # The predicted half's priors change (they read the whole training half) ...
    assert np.all(after[~train] != before[~train])
    # ... and predicted-half labels are never read.
    scrambled = labels.copy()
    scrambled[~train] = np.nan
    np.testing.assert_array_equal(token_prior_features(tokens, scrambled, train)[0], before)


def test_prompt_alternation_by_hand() -> None:
    prompts = np.array(["b", "b", "a", "c", "a", "c", "b"])  # parts by first appearance
    np.testing.assert_array_equal(alternation_parts(7, prompts), [0, 0, 1, 0, 1, 0, 0])
    tokens = np.array([3, 3, 3, 4, 3, 4, 4])
    labels = np.array([1.0, 0.5, 0.0, 1.0, 0.25, 0.0, 1.0])
    got, _ = token_prior_features(tokens, labels, np.ones(7, bool), groups=prompts)
    part0, part1 = np.array([0, 1, 3, 5, 6]), np.array([2, 4])
    ref0, ref1 = (_reference_prior(tokens[p], labels[p]) for p in (part1, part0))
    want = [ref0(t) if i in part0 else ref1(t) for i, t in enumerate(tokens)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(ValueError, match="one prompt; the prompt alternation"):
        token_prior_features(tokens, labels, np.ones(7, bool), groups=np.array(["x"] * 7))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(4, 60), n_prompts=st.integers(2, 8), seed=st.integers(0, 2**16))
def test_by_prompt_no_training_prior_reads_a_label_of_its_own_prompt(n, n_prompts, seed) -> None:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 3, n)
    labels = rng.random(n)
    prompts = np.array([f"p{i}" for i in rng.integers(0, n_prompts, n)])
    prompts[:2] = ["p0", "p1"]  # two prompts at least
    before, _ = token_prior_features(tokens, labels, np.ones(n, bool), groups=prompts)
    mine = prompts == prompts[-1]
    moved = labels.copy()
    moved[mine] += 5.0  # every label of one prompt: its own rows' priors must not move
    after, _ = token_prior_features(tokens, moved, np.ones(n, bool), groups=prompts)
    np.testing.assert_array_equal(after[mine], before[mine])
    assert (after[~mine] != before[~mine]).any()  # the other part's priors read them


def test_flipping_a_label_moves_the_prior_of_the_other_part() -> None:
    # Guards the test above against passing trivially (e.g. a prior that ignores labels).
    tokens = np.array([1, 1, 1, 1])
    labels = np.array([0.0, 0.0, 0.0, 0.0])
    before, _ = token_prior_features(tokens, labels, np.ones(4, bool))
    labels[0] = 1.0
    after, _ = token_prior_features(tokens, labels, np.ones(4, bool))
    assert after[0] == before[0] and after[2] == before[2]  # part 0: rows 0, 2
    assert after[1] > before[1] and after[3] > before[3]  # part 1 reads row 0


# -- out-of-fold predictions ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampling_frame() -> pd.DataFrame:
    return make_candidate_frame(n_prompts=24, rounds=5, temperature=1.0, seed=11)


@pytest.mark.parametrize("kind", ["lgbm", "hgb"])
def test_no_prediction_comes_from_a_model_that_saw_its_prompt(sampling_frame, kind) -> None:
    frame = sampling_frame
    ids = frame["prompt_id"].to_numpy()
    folds = prompt_halves(ids)
    res = crossfit_predict(frame, "rows", kind, "sampling", folds, n_threads=1, capacity=FAST)
    # 1. The persisted fold ids: grouped, and each row's model never trained on its prompt.
    check_grouped(ids, res.folds)
    np.testing.assert_array_equal(res.folds, folds)
    for f in (0, 1):
        assert set(res.models[f].train_prompts) == set(ids[res.folds == 1 - f])
        assert not set(res.models[f].train_prompts) & set(ids[res.folds == f])
    assert np.isfinite(res.phat).all()
    # 2. Refitting: new labels for fold-0 prompts leave fold-0 predictions unchanged
    #    (only fold 1's model reads them) but do change fold-1 predictions.
    changed = frame.copy()
    rng = np.random.default_rng(5)
    zero = res.folds == 0
    changed.loc[zero, "label_target_prob"] = rng.random(int(zero.sum())).astype(np.float32)
    res2 = crossfit_predict(changed, "rows", kind, "sampling", folds, n_threads=1, capacity=FAST)
    np.testing.assert_array_equal(res2.phat[zero], res.phat[zero])
    assert not np.array_equal(res2.phat[~zero], res.phat[~zero])


def test_crossfit_model_equals_a_model_fitted_on_the_training_half_alone(sampling_frame) -> None:
    # The cross-fit path and the standalone path build the same priors and model.
    frame = sampling_frame
    folds = prompt_halves(frame["prompt_id"].to_numpy())
    res = crossfit_predict(frame, "base", "lgbm", "sampling", folds, n_threads=1, capacity=FAST)
    cats = sorted(frame["task"].unique())
    alone = fit_reranker(
        frame[folds == 1], "base", "lgbm", "sampling", cats, n_threads=1, capacity=FAST
    )
    np.testing.assert_array_equal(alone.predict_phat(frame[folds == 0], 1), res.phat[folds == 0])
    assert alone.train_fingerprint == res.models[0].train_fingerprint
    prompts = tuple(sorted(set(frame["prompt_id"][folds == 1].astype(str))))
    assert res.models[0].train_prompts == alone.train_prompts == prompts


def test_distinct_values_are_numpys_unique_of_the_strings():
    from rerank.fit.folds import distinct_strings

    rng = np.random.default_rng(5)
    words = np.array(["b-10", "b-9", "a", "é", "B", "b-1"], dtype=object)
    for values in (words[rng.integers(0, 6, 200)], words[rng.integers(0, 6, 50)].astype(str)):
        names, inverse = distinct_strings(values)
        want_names, want_inverse = np.unique(values.astype(str), return_inverse=True)
        np.testing.assert_array_equal(names, want_names)
        np.testing.assert_array_equal(inverse, want_inverse)
    names, inverse = distinct_strings(np.array([10, 2, 10, 1]))  # as strings, as before
    assert names.tolist() == ["1", "10", "2"] and inverse.tolist() == [1, 2, 1, 0]


@pytest.mark.parametrize("by_prompt", [True, False])
def test_the_inner_split_priors_never_read_a_held_out_label(by_prompt) -> None:
    rng = np.random.default_rng(5)
    n = 40
    tokens, labels = rng.integers(0, 4, n), rng.random(n)
    prompts = np.array([f"p{i // 4}" for i in range(n)])  # 10 prompts of 4 rows
    rows = np.arange(0, n)  # the training half: every row of X here
    held = np.isin(prompts, ["p2", "p7"])  # the validation prompts
    column = PriorColumn(0, tokens, by_prompt=by_prompt)
    inner, out = split_priors(column, labels, rows, held, prompts)
    moved = labels.copy()
    moved[held] += 5.0
    inner2, out2 = split_priors(column, moved, rows, held, prompts)
    np.testing.assert_array_equal(inner, inner2)
    np.testing.assert_array_equal(out, out2)
    # the held-out rows get the inner rows' whole prior, as a predicted half does
    full = TokenPrior().fit(tokens[~held], labels[~held])
    np.testing.assert_array_equal(out, full.transform(tokens[held]))


def test_an_inner_split_of_one_prompt_alternates_by_row_and_says_so(caplog) -> None:
    tokens, labels = np.array([1, 1, 2, 2, 1, 2]), np.array([1.0, 0.0, 1.0, 0.5, 0.2, 0.1])
    prompts = np.array(["a", "a", "a", "a", "b", "b"])
    held = prompts == "b"
    column = PriorColumn(0, tokens, by_prompt=True)
    with caplog.at_level("WARNING", logger="rerank.fit.token_prior"):
        inner, _ = split_priors(column, labels, np.arange(6), held, prompts)
    assert "trains on one prompt" in caplog.text
    by_row, _ = token_prior_features(tokens[:4], labels[:4], np.ones(4, bool))
    np.testing.assert_array_equal(inner, by_row)


def test_a_training_subsample_takes_a_share_of_each_tasks_prompts() -> None:
    ids = np.array([f"p{i % 40}" for i in range(400)])
    tasks = np.array(["a" if i % 40 < 24 else "b" for i in range(400)])
    keep = prompt_subsample(ids, 0.25, seed=3, tasks=tasks)
    kept = set(ids[keep])
    assert len({p for p in kept if int(p[1:]) < 24}) == 6  # a quarter of task a's 24
    assert len({p for p in kept if int(p[1:]) >= 24}) == 4  # ... and of task b's 16
    assert all(keep[ids == p].all() for p in kept)  # whole prompts
    order = np.random.default_rng(0).permutation(400)  # the set, not the row order, decides
    np.testing.assert_array_equal(prompt_subsample(ids[order], 0.25, 3, tasks[order]), keep[order])
    assert prompt_subsample(ids, 1.0).all()
    with pytest.raises(ValueError, match=r"'rerank.train_share' must be in \(0, 1\]"):
        prompt_subsample(ids, 0.0)


def test_a_subsampled_fit_trains_on_a_share_of_its_half_and_predicts_the_other(sampling_frame):
    frame = sampling_frame
    ids = frame["prompt_id"].to_numpy()
    folds = prompt_halves(ids)
    res = crossfit_predict(frame, "base", "lgbm", "sampling", folds, n_threads=1, capacity=FAST,
                           train_share=0.5)  # fmt: skip
    for f in (0, 1):
        half = set(ids[folds == 1 - f])
        assert set(res.models[f].train_prompts) < half
        assert len(res.models[f].train_prompts) == round(len(half) / 2)
    assert np.isfinite(res.phat).all()  # every held-out row predicted
    full = crossfit_predict(frame, "base", "lgbm", "sampling", folds, n_threads=1, capacity=FAST)
    assert not np.array_equal(full.phat, res.phat)


# -- fits read in row blocks ---------------------------------------------------------------------


def test_row_hashes_and_held_out_predictions_do_not_depend_on_the_block(
    monkeypatch, sampling_frame
) -> None:
    from rerank.fit import fingerprints as fingerprints_module
    from rerank.fit import out_of_fold as halves_module
    from rerank.fit.fingerprints import hash_rows

    frame = sampling_frame
    folds = prompt_halves(frame["prompt_id"].to_numpy())
    columns = ["prompt_id", "task", "token", "draft_prob", "label_target_prob"]
    whole = hash_rows(frame, columns)
    res = crossfit_predict(frame, "rows", "lgbm", "sampling", folds, n_threads=1, capacity=FAST)
    monkeypatch.setattr(fingerprints_module, "_HASH_BLOCK", 13)
    monkeypatch.setattr(halves_module, "_PREDICT_BLOCK", 11)
    np.testing.assert_array_equal(hash_rows(frame, columns), whole)
    assert len(np.unique(whole)) > len(frame) // 2  # rows hash apart
    again = crossfit_predict(frame, "rows", "lgbm", "sampling", folds, n_threads=1, capacity=FAST)
    np.testing.assert_array_equal(again.phat, res.phat)
    assert [m.train_fingerprint for m in again.models] == [m.train_fingerprint for m in res.models]

"""The online decoder's fast paths give the reference paths' values (issue 19).

- the compiled forest walk (`rerank.forest.jit`) predicts the libraries' phat to 1e-12;
- the compiled feature kernels (`features.first_level`, `features.subtree`): a round's
  features are bitwise the same from the online entry point (`RoundBlocks.one_round`,
  the pool's int64 arrays), from `RoundArrays.one_round` and from a batch of rounds with
  other pool shapes (a round's sums never run over another round's padding), and the
  order-sensitive sums are numpy's (`features.kernels.pairwise_sum` against np.sum, bit for bit);
- the design matrix from the feature blocks equals the name-by-name one, bitwise, and
  the token-prior table equals `TokenPrior.transform`.
Timings are `bench/bench_online.py`'s, never asserted here.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pyarrow as pa
import pytest
import torch

import rerank.forest.jit as forest_jit
from calibrate.isotonic import PROB_FLOOR
from features.first_level import (
    FEATURE_DTYPES,
    FirstLevelFeatures,
    features_of_blocks,
    first_level_features,
)
from features.from_trace import candidate_table, round_arrays
from features.kernels import pairwise_sum
from features.rounds import FL_ROWS, ROW_ARGMAX, ROW_SCALARS, RoundArrays, RoundBlocks
from rerank.fit.boosting import Capacity
from rerank.fit.models import fit_reranker
from rerank.forest.table import forest_of
from rerank.forest.walk import compile_forest, link, prepare, walk_numpy
from rerank.serving import OnlinePredictor
from specrank.store.trace_schema import TRACE_SCHEMA
from tests.candidate_frames import TASKS, make_candidate_frame
from tests.fake_traces import random_trace
from tests.forest_inputs import forest_inputs, library_predict
from tests.tiny_models import one_thread

TOL = 1e-12
# 45 trees: five groups of eight and a tail of five (both loops of the walk)
CAPACITY = Capacity(n_iter=45, learning_rate=0.1, max_leaves=31)


@pytest.fixture(
    scope="module",
    params=[
        ("lgbm", 0.0, "rows"),
        ("lgbm", 1.0, "rows_matched"),
        ("hgb", 0.0, "rows"),
        ("hgb", 1.0, "rows_matched"),
    ],
    ids=lambda p: "-".join(map(str, p)),
)
def model(request):
    kind, temperature, feature_set = request.param
    frame = make_candidate_frame(n_prompts=40, rounds=8, temperature=temperature, seed=3)
    frame = frame[frame["task"] != TASKS[1]]  # a declared task never seen in training
    law = "greedy" if temperature == 0 else "sampling"
    with one_thread():
        m = fit_reranker(
            frame, feature_set, kind, law, categories=TASKS, n_threads=1, capacity=CAPACITY
        )
    return m, temperature


# -- the compiled forest walk ---------------------------------------------------------------


def test_compiled_walk_predicts_the_library(model):
    m, temperature = model
    c = compile_forest(forest_of(m.estimator, m.kind))
    assert c.forest.n_trees % 8 != 0  # the tail loop runs too
    j = forest_jit.jit_forest(c)
    X = forest_inputs(m, temperature)
    ref = library_predict(m, X)
    ours = forest_jit.phat(j, X)
    assert np.abs(ours - ref).max() <= TOL
    assert np.abs(ours - link(c, walk_numpy(c, prepare(c, X)))).max() <= TOL
    for rows in (1, 3, 10):  # a round's handful of rows, as the decoder calls it
        assert np.abs(forest_jit.phat(j, X[:rows]) - ref[:rows]).max() <= TOL
    # the design matrix arrives transposed from OnlinePredictor.design
    assert np.abs(forest_jit.phat(j, np.asfortranarray(X[:10])) - ref[:10]).max() <= TOL


def test_log_phat_is_prepare_then_the_walk_then_the_log(model):
    """log_phat (prepare, the walk and the log in one compiled call) equals the log of the
    reference walk of `prepare`'s Xv bit for bit, on every input rule (NaN, codes, tiny),
    whatever the layout of X: the decoder's transposed block or a C-ordered matrix."""
    m, temperature = model
    j = forest_jit.jit_forest(compile_forest(forest_of(m.estimator, m.kind)))
    X = forest_inputs(m, temperature)
    p = forest_jit.phat(j, X)
    want = np.array([math.log(min(max(v, PROB_FLOOR), 1.0)) for v in p], dtype=np.float32)
    rows = np.ascontiguousarray(X.T)  # [F, N]: what OnlinePredictor.design fills
    for layout in (X, rows.T):
        np.testing.assert_array_equal(forest_jit.log_phat(j, layout), want)
    for n in (1, 10):
        np.testing.assert_array_equal(
            forest_jit.log_phat(j, np.ascontiguousarray(X[:n].T).T), want[:n]
        )
    ref = np.log(np.clip(library_predict(m, X), PROB_FLOOR, 1.0))
    assert np.abs(forest_jit.log_phat(j, rows.T) - ref).max() <= 1e-6  # float32 log phat
    with pytest.raises(ValueError, match="forest input"):
        forest_jit.log_phat(j, X[:, 1:])


def test_compiled_layout_is_preorder_with_every_leaf_once(model):
    m, _ = model
    c = compile_forest(forest_of(m.estimator, m.kind))
    j = forest_jit.jit_forest(c)
    word = j.node[:, 1]
    leaf = word == 0
    assert leaf.sum() == c.is_leaf.sum() == j.value.size
    assert np.array_equal(np.sort(j.node[leaf, 0]), np.arange(j.value.size))
    assert ((word[~leaf] >> 16) & 1 == 1).all()  # an internal node's left child is the next
    assert np.array_equal(np.sort(j.value), np.sort(c.forest.value[c.is_leaf]))


def test_route_falls_back_when_the_layout_cannot_hold_a_tree(model, monkeypatch, caplog):
    m, temperature = model
    monkeypatch.setattr(forest_jit, "MAX_OFFSET", 1)  # no tree has its right child next
    with pytest.raises(forest_jit.ForestError, match="more than 1 nodes"):
        forest_jit.jit_forest(compile_forest(forest_of(m.estimator, m.kind)))
    with caplog.at_level(logging.WARNING, logger="rerank.serving"):
        p = OnlinePredictor(m, torch.device("cpu"), "auto")
    assert p.route == "library" and "more than 1 nodes" in caplog.text
    with pytest.raises(forest_jit.ForestError):
        OnlinePredictor(m, torch.device("cpu"), "compiled")
    X = forest_inputs(m, temperature)[:10]
    want = np.log(m.predict_matrix(X, n_threads=1)).astype(np.float32)
    np.testing.assert_array_equal(p.first_logprob(X).numpy(), want)


def test_compiled_route_hands_log_phat_to_another_device(model):
    """The host walk then one copy (run.predictor=compiled on a GPU); `meta` stands in here."""
    m, temperature = model
    p = OnlinePredictor(m, torch.device("meta"), "compiled")
    assert p.jit is not None and p.torch_forest is None
    out = p.first_logprob(forest_inputs(m, temperature)[:10])
    assert out.device.type == "meta" and out.shape == (10,) and out.dtype == torch.float32


# -- the design matrix ----------------------------------------------------------------------


def test_design_from_blocks_equals_design_by_name(model):
    m, _ = model
    p = OnlinePredictor(m, torch.device("cpu"))
    rounds = round_arrays(random_trace(3, n_prompts=2, n_rounds=4, level_sizes=[10, 20, 8]))
    feats = first_level_features(rounds)
    assert isinstance(feats, FirstLevelFeatures)
    tokens = rounds.cand_token[:, :10].ravel().astype(np.int64)
    for task in ("coding", "math", "unknown task"):
        fast = p.design(feats, tokens, task)
        slow = p.design({name: np.array(feats[name]) for name in feats}, tokens, task)
        np.testing.assert_array_equal(fast, slow, strict=True)
        assert fast.dtype == np.float32 and fast.shape == (tokens.size, len(m.features))


def test_prior_table_equals_the_prior(model):
    m, _ = model
    p = OnlinePredictor(m, torch.device("cpu"))
    seen = np.asarray(m.token_prior.tokens_, dtype=np.int64)
    tokens = np.concatenate([seen, seen + 1, [0, seen.max() + 1, seen.max() + 10**6]])
    np.testing.assert_array_equal(p._prior(tokens), m.token_prior.transform(tokens), strict=True)


# -- the feature kernels --------------------------------------------------------------------


def _online_call(rounds: RoundArrays, r: int, pool_dtype=np.int64) -> dict:
    """Round r as the online decoder passes it: unpadded pool arrays, the rows as host values."""
    P = int((rounds.cand_depth[r] > 0).sum())
    k = int(rounds.n_first_level()[r])
    only = rounds.token_only_argmax[r]

    def scalar(x: float) -> float | None:
        return None if np.isnan(x) else float(x)

    return dict(
        cand_token=rounds.cand_token[r, :P].astype(pool_dtype),
        cand_parent=rounds.cand_parent[r, :P].astype(pool_dtype),
        cand_depth=rounds.cand_depth[r, :P].astype(pool_dtype),
        cand_draft_logprob=rounds.cand_draft_logprob[r, :P],
        cand_expanded=rounds.cand_expanded[r, :P],
        root_token=int(rounds.root_token[r]),
        prompt_length=int(rounds.prompt_length[r]),
        round_index=int(rounds.round_index[r]),
        tokens_before=int(rounds.tokens_before[r]),
        prev_accepted=scalar(rounds.prev_accepted[r]),
        rows={
            **{name: getattr(rounds, name)[r, :k] for name in FL_ROWS},
            **{name: scalar(getattr(rounds, name)[r]) for name in ROW_SCALARS},
            **{
                name: None if getattr(rounds, name)[r] < 0 else int(getattr(rounds, name)[r])
                for name in ROW_ARGMAX
            },
            "token_only_argmax": only[only >= 0],
        },
    )


def _assert_same(a, b, start: int, k: int) -> None:
    for name in FEATURE_DTYPES:
        np.testing.assert_array_equal(
            a[name], b[name][start : start + k], err_msg=name, strict=True
        )


@pytest.mark.parametrize(
    "seed, sizes",
    [(11, [10, 30, 40, 5]), (11, [9, 0]), (11, [4, 6, 3]), (11, [16, 20]), (11, [130, 12]),
     *((seed, None) for seed in range(4))],  # None: pool shapes vary between rounds
)  # fmt: skip
def test_online_entry_point_equals_both_others_bitwise(seed: int, sizes: list[int] | None) -> None:
    """RoundBlocks.one_round (int64 pools) = RoundArrays.one_round = the batch, bit for bit."""
    rounds = round_arrays(random_trace(seed, n_prompts=2, n_rounds=4, level_sizes=sizes))
    batch = first_level_features(rounds)
    n1 = rounds.n_first_level()
    start = 0
    for r in range(rounds.n_rounds):
        call = _online_call(rounds, r)
        online = features_of_blocks(RoundBlocks.one_round(**call))
        assert list(online) == list(FEATURE_DTYPES)
        _assert_same(online, batch, start, int(n1[r]))
        _assert_same(first_level_features(RoundArrays.one_round(**call)), batch, start, int(n1[r]))
        start += int(n1[r])


def test_a_round_never_depends_on_its_batch() -> None:
    """Rounds with n1 >= 8 (pairwise sums) batched with narrower ones: the same values."""
    wide = random_trace(5, n_prompts=2, n_rounds=3, level_sizes=[12, 30, 9])
    narrow = random_trace(6, n_prompts=20, n_rounds=4, level_sizes=[7, 9])
    other = pa.array([f"other-{p}" for p in narrow["prompt_id"].to_pylist()])
    narrow = narrow.set_column(0, TRACE_SCHEMA.field("prompt_id"), other)
    alone_wide, alone_narrow = candidate_table(wide), candidate_table(narrow)
    mixed = candidate_table(pa.concat_tables([narrow, wide]))
    assert mixed.slice(0, alone_narrow.num_rows).to_pylist() == alone_narrow.to_pylist()
    assert mixed.slice(alone_narrow.num_rows).to_pylist() == alone_wide.to_pylist()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 10, 16, 17, 127, 128, 129, 130, 300, 1000, 4099])
def test_pairwise_sum_is_numpys(n: int) -> None:
    x = np.exp(np.random.default_rng(n).normal(0.0, 3.0, n))
    assert pairwise_sum(x, 0, n) == np.sum(x)
    if n > 3:
        assert pairwise_sum(x, 3, n - 3) == np.sum(x[3:])


def test_round_blocks_refuse_a_row_of_the_wrong_length() -> None:
    rounds = round_arrays(random_trace(2, n_prompts=1, n_rounds=2, level_sizes=[4, 6]))
    call = _online_call(rounds, 0)
    call["rows"]["fl_cache_logprob"] = np.zeros(5, dtype=np.float32)
    with pytest.raises(ValueError, match=r"fl_cache_logprob: expected shape \(1, 4\)"):
        RoundBlocks.one_round(**call)

"""The main job's fast paths give exactly what their reference paths give (issue 19).

Each fast path is checked against the slower implementation it replaced, kept
here as the reference: the compiled forest against the libraries' predictors,
the flat edge sampler of the per-depth maps and their per-level application
against the dense pools, the draw-size scan against a sort, pandas' grouped
sums against the compiled ones, integer round codes against MultiIndex
lookups, and the threaded evaluation against one chunk at a time. The fused
first-factor kernel is checked in tests/test_select_kernels.py.
"""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch

from calibrate.isotonic import PROB_FLOOR
from rerank.evaluate.curves import PromptCurves
from rerank.evaluate.policy import PolicyRounds
from rerank.evaluate.pool_chunks import ROUND_KEYS, RoundCodes, chunk_of, iter_trace_chunks
from rerank.evaluate.reports import ReportAccumulators
from rerank.evaluate.values import EvalPlan, evaluate_traces
from rerank.fit.boosting import Capacity
from rerank.fit.design import design_matrix
from rerank.fit.halves import fold_map
from rerank.fit.models import fit_reranker
from rerank.fit.out_of_fold import crossfit_predict
from rerank.fit.per_depth import (
    EDGE_COLUMNS,
    fit_per_depth_maps,
    maps_of_buckets,
    per_depth_factors,
)
from rerank.fit.predict import predict_first_factors
from rerank.fit.quality import round_firsts
from selection.draws import subtree_ranks
from selection.kernels import greedy_edges
from selection.pool_batch import POOL_COLUMNS, PoolBatch, pool_batch_from_table
from selection.ranking import path_sum, pool_levels
from tests.candidate_frames import FAST, TASKS, make_candidate_frame

TOL = 1e-12  # the tolerance on predictions; the forest meets it with equality


# -- predictions: the compiled forest is the library, bit for bit -----------------------------


@pytest.mark.parametrize("kind", ["lgbm", "hgb"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forest_route_predicts_what_the_library_predicts(kind, temperature):
    law = "greedy" if temperature == 0 else "sampling"
    frame = make_candidate_frame(n_prompts=30, rounds=6, temperature=temperature, seed=3)
    frame = frame[frame["task"] != TASKS[1]]  # a declared task never seen in training
    model = fit_reranker(frame, "rows", kind, law, categories=TASKS, n_threads=1, capacity=FAST)
    new = make_candidate_frame(n_prompts=20, rounds=6, temperature=temperature, seed=9)
    X = design_matrix(new, model.features, model.categories,
                      model.token_prior.transform(new["token"].to_numpy()))  # fmt: skip
    rng = np.random.default_rng(1)
    X[rng.random(X.shape) < 0.1] = np.nan
    X[:40, model.features.index("task")] = rng.choice([-1, 0, 0.5, 1, 2, 70, np.nan], 40)
    library = model.predict_matrix(X, 1, route="library")
    forest = model.predict_matrix(X, 1, route="forest")
    assert np.abs(forest - library).max() <= TOL
    np.testing.assert_array_equal(forest, library)  # the same sums in the same order


@pytest.mark.parametrize("n_rows", [1, 7, 263, 600])
def test_the_batch_walk_predicts_any_number_of_rows_bit_for_bit(n_rows):
    # 256 rows a task of the batch walk, two threads: one short task, and tasks in parallel
    frame = make_candidate_frame(n_prompts=30, rounds=6, temperature=1.0, seed=3)
    model = fit_reranker(frame, "rows", "hgb", "sampling", categories=TASKS, n_threads=1,
                         capacity=FAST)  # fmt: skip
    new = make_candidate_frame(n_prompts=60, rounds=6, temperature=1.0, seed=9)
    X = design_matrix(new, model.features, model.categories,
                      model.token_prior.transform(new["token"].to_numpy()))[:n_rows]  # fmt: skip
    assert len(X) == n_rows
    library = model.predict_matrix(X, 1, route="library")
    np.testing.assert_array_equal(model.predict_matrix(X, 2, route="forest"), library)


@pytest.mark.parametrize("kind", ["hgb", "lgbm"])
def test_crossfit_predictions_do_not_depend_on_the_route(kind):
    frame = make_candidate_frame(n_prompts=24, rounds=5, temperature=1.0, seed=11)
    folds = np.asarray(frame["prompt_id"].str[-1].astype(int) % 2, dtype=np.int8)
    kw = dict(n_threads=1, capacity=Capacity(n_iter=40, learning_rate=0.1, max_leaves=15))
    # the library's predictor against the compiled forest (the default, BATCH_ROUTE, is one)
    library = crossfit_predict(frame, "rows", kind, "sampling", folds, route="library", **kw)
    forest = crossfit_predict(frame, "rows", kind, "sampling", folds, route="forest", **kw)
    np.testing.assert_array_equal(library.phat, forest.phat)


def test_a_model_builds_its_forest_once_for_all_its_blocks(monkeypatch):
    from rerank.fit import models as models_module
    from rerank.fit import out_of_fold as halves_module

    frame = make_candidate_frame(n_prompts=24, rounds=5, temperature=1.0, seed=11)
    folds = np.asarray(frame["prompt_id"].str[-1].astype(int) % 2, dtype=np.int8)
    kw = dict(n_threads=1, capacity=Capacity(n_iter=40, learning_rate=0.1, max_leaves=15))
    library = crossfit_predict(frame, "rows", "hgb", "sampling", folds, route="library", **kw)
    built, forest_of = [], models_module.forest_of
    monkeypatch.setattr(models_module, "forest_of", lambda *a: built.append(a) or forest_of(*a))
    monkeypatch.setattr(halves_module, "_PREDICT_BLOCK", 16)  # dozens of blocks a half
    blocks = crossfit_predict(frame, "rows", "hgb", "sampling", folds, route="forest", **kw)
    assert min(np.bincount(folds)) > 2 * 16
    assert len(built) == 2  # one per half's model, not one per block
    np.testing.assert_array_equal(blocks.phat, library.phat)
    model = blocks.models[0]
    # copied as pickle copies it (its __getstate__), as a Ray task's result is shipped
    shipped = copy.copy(model)
    assert "_batch_forest" in vars(model) and "_batch_forest" not in vars(shipped)
    X = np.nan_to_num(np.random.default_rng(2).normal(size=(40, len(model.features))))
    np.testing.assert_array_equal(shipped.predict_matrix(X, 1, route="forest"),
                                  model.predict_matrix(X, 1, route="library"))  # fmt: skip


# -- per-depth maps: flat sampling and per-level application ------------------------------------


def _dense_edges(pool: PoolBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    v = pool.valid.numpy()
    return (np.exp(pool.draft_logprob.numpy()[v].astype(np.float64)), pool.depth.numpy()[v],
            pool.law_edge_prob().numpy()[v].astype(np.float64))  # fmt: skip


def _reference_maps(dataset, folds, max_edges, seed, chunk_rounds):
    """fit_per_depth_maps as it was: dense pools, sliced per (temperature, half)."""
    rng = np.random.default_rng(seed)
    n_rounds, buckets, rate = dataset.count_rows(), {}, None
    for table in iter_trace_chunks(dataset, chunk_rounds, EDGE_COLUMNS):
        pool = pool_batch_from_table(table)
        if rate is None:
            rate = min(1.0, 4 * max_edges / max(1, n_rounds * pool.shape[1]))
        prompt_fold = table["prompt_id"].to_pandas().map(folds).to_numpy()
        temps = table["temperature"].to_numpy()
        for t in np.unique(temps):
            for half in (0, 1):
                rows = torch.from_numpy(np.flatnonzero((temps == t) & (prompt_fold == half)))
                if len(rows):
                    part = PoolBatch(
                        **{k: getattr(pool, k)[rows] for k in pool.__dataclass_fields__}
                    )
                    x, d, y = _dense_edges(part)
                    keep = rng.random(x.size) < rate
                    buckets.setdefault((float(t), half), []).append((x[keep], d[keep], y[keep]))
    return maps_of_buckets(buckets, max_edges, rng)


def test_per_depth_maps_and_scores_equal_the_dense_reference(fast_traces):
    ids = fast_traces.to_table(columns=["prompt_id"])["prompt_id"].to_numpy(zero_copy_only=False)
    folds = fold_map(ids, "seeded", 0)
    for max_edges in (500, 10**7):  # thinned, and every edge
        got = fit_per_depth_maps(fast_traces, folds, max_edges, 5, chunk_rounds=40)
        want = _reference_maps(fast_traces, folds, max_edges, 5, chunk_rounds=40)
        assert got.keys() == want.keys()
        for key in want:
            for d, m in want[key].maps_.items():
                np.testing.assert_array_equal(got[key].maps_[d].bin_x_, m.bin_x_)
                np.testing.assert_array_equal(got[key].maps_[d].bin_y_, m.bin_y_)
    table = next(iter_trace_chunks(fast_traces, 10**6, sorted({*EDGE_COLUMNS, *ROUND_KEYS})))
    pool = pool_batch_from_table(table)
    assert pool_levels(pool.parent, pool.depth) is not None  # the per-level route is taken
    ids = table["prompt_id"].to_numpy(zero_copy_only=False)
    fold = np.array([folds[p] for p in ids])
    ref = torch.full(pool.shape, -torch.inf)
    q = np.exp(pool.draft_logprob.numpy().astype(np.float64))
    for (t, f), iso in got.items():
        rows = np.flatnonzero((pool.temperature.numpy() == np.float32(t)) & (fold == f))
        if rows.size == 0:
            continue
        cal = iso.predict(q[rows].ravel(), pool.depth.numpy()[rows].ravel()).reshape(len(rows), -1)
        ref[rows] = torch.from_numpy(np.log(np.clip(cal, PROB_FLOOR, 1.0)).astype(np.float32))
    ref = path_sum(torch.where(pool.valid, ref, -torch.inf), pool.parent)
    assert torch.equal(path_sum(per_depth_factors(pool, ids, folds, got), pool.parent), ref)


# -- reports, curves and round lookups -------------------------------------------------------


def test_draw_size_scan_equals_the_sort_and_parts_merge_in_order(fast_traces):
    columns = sorted({*ReportAccumulators([1]).columns, *POOL_COLUMNS, *ROUND_KEYS})
    tables = list(iter_trace_chunks(fast_traces, 50, columns))
    chunk = chunk_of(tables[0])
    acc = ReportAccumulators([2, 5])
    sizes = acc.sizes.part(chunk)
    # the reference: each first-level candidate's b-th descendant by one sort of the pool
    perm, group, rank_below = subtree_ranks(chunk.ctx)
    entry_pos = torch.gather(chunk.rank, -1, perm)
    mass = torch.gather(chunk.ctx.law, -1, group.clamp(max=chunk.pool.shape[1] - 1))
    for b in (2, 5):
        hit = (group < chunk.pool.shape[1]) & (rank_below == b - 1)
        bins = torch.zeros_like(chunk.ctx.law).scatter_add_(
            -1, entry_pos, torch.where(hit, mass, 0)
        )
        want = torch.cumsum(bins, -1)
        for t, (_, curves) in sizes.items():
            rows = torch.from_numpy(chunk.temperature == t)
            # the same float32 curves; only the float64 sum over rounds runs in another order
            np.testing.assert_allclose(
                curves[f"exceed@{b}"], want[rows].sum(0, dtype=torch.float64).numpy(), rtol=1e-12
            )
    # PEARL's size curves (1 + E|d_X1 ∩ T_b|) and their share under the drafter's top token
    order, anc, law = chunk.order, chunk.ctx.first_ancestor, chunk.ctx.law
    below = (chunk.pool.depth >= 2) & chunk.pool.valid
    p_top = torch.gather(law, -1, order[:, :1])
    below_top = torch.gather(below & (anc == order[:, :1]), -1, order)
    pearl_top = p_top * (1 + torch.cumsum(below_top, -1, dtype=torch.float32))
    for t, (_, curves) in sizes.items():
        rows = torch.from_numpy(chunk.temperature == t)
        for name, want in (("pearl_size", chunk.pearl[1]), ("pearl_top", pearl_top)):
            np.testing.assert_allclose(
                curves[name], want[rows].sum(0, dtype=torch.float64).numpy(), rtol=1e-12
            )
    # parts computed out of order, merged in order == added one chunk at a time
    one, merged = ReportAccumulators([2, 5]), ReportAccumulators([2, 5])
    chunks = [chunk_of(t) for t in tables]
    parts = [merged.part(c) for c in reversed(chunks)][::-1]
    for c, p in zip(chunks, parts, strict=True):
        one.add(c)
        merged.merge(p)
    a, b = one.tables(None, 20, 0), merged.tables(None, 20, 0)
    for name in a:
        pd.testing.assert_frame_equal(a[name], b[name])


def test_prompt_curve_sums_are_pandas_grouped_sums():
    rng = np.random.default_rng(0)
    curves = PromptCurves()
    ref: dict = {}
    for _ in range(3):
        n = 300
        t = rng.choice([0.0, 1.0], n).astype(np.float32)
        p = rng.choice([f"p{i}" for i in range(12)], n).astype(object)
        v = (rng.standard_normal((n, 17)) * 10.0 ** rng.integers(-6, 6, (n, 17))).astype(np.float32)
        curves.add(t, p, {"c": torch.from_numpy(v)})
        keys = pd.MultiIndex.from_arrays([t.astype(np.float64), p])
        sums = pd.DataFrame(v.astype(np.float64)).groupby(keys).sum()
        for key, row in zip(sums.index, sums.to_numpy(), strict=True):
            ref[key] = ref.get(key, 0.0) + row
    assert curves.sums["c"].keys() == ref.keys()
    for key, row in ref.items():
        np.testing.assert_array_equal(curves.sums["c"][key], row)


@pytest.mark.parametrize("strings", ["object", "str", "category"])
def test_round_codes_find_what_a_multiindex_finds(strings):
    # the query's keys as the traces give them (Arrow strings, float32 temperatures) or
    # as numpy objects / categories: codes are found by value, whatever the dtypes
    rng = np.random.default_rng(2)
    keys = pd.DataFrame({
        "prompt_id": rng.choice(["a", "b", "c"], 200), "temperature": rng.choice([0.0, 1.0], 200),
        "rule": "draft", "budget": rng.choice([8, 59], 200), "round_index": rng.integers(0, 9, 200),
    }).drop_duplicates(ignore_index=True)  # fmt: skip
    query = pd.concat([keys.sample(80, random_state=1), keys.assign(prompt_id="z").head(5),
                       keys.assign(round_index=keys["round_index"] + 30).head(5)])  # fmt: skip
    query = query.astype({"prompt_id": strings, "rule": strings, "temperature": np.float32})
    codes = RoundCodes(keys)
    got = pd.Index(codes.encode(keys)).get_indexer(codes.encode(query))
    want = pd.MultiIndex.from_frame(keys).get_indexer(pd.MultiIndex.from_frame(query[ROUND_KEYS]))
    np.testing.assert_array_equal(got, want)
    prev = query.assign(round_index=query["round_index"] - 1)
    want = pd.MultiIndex.from_frame(keys).get_indexer(pd.MultiIndex.from_frame(prev[ROUND_KEYS]))
    np.testing.assert_array_equal(pd.Index(codes.encode(keys)).get_indexer(
        codes.encode(query, shift=-1)), want)  # fmt: skip


def test_threaded_evaluation_equals_one_chunk_at_a_time(fast_traces):
    plan = EvalPlan([2, 8], substitutions=["cache", "prev"], mixture_weights=[0.5],
                    curve_rules=["root"])  # fmt: skip
    out = {}
    for workers in (1, 2):
        curves, acc = PromptCurves(), ReportAccumulators([2, 8])
        policy = PolicyRounds([2, 8], "top_m", 100)
        per_round = evaluate_traces(fast_traces, plan, chunk_rounds=30, curves=curves,
                                    consumers=[policy, acc], workers=workers)  # fmt: skip
        out[workers] = policy.apply(per_round), curves, acc.tables(per_round, 20, 0)
    pd.testing.assert_frame_equal(out[1][0], out[2][0])
    for name, store in out[1][1].sums.items():
        for key, row in store.items():
            np.testing.assert_array_equal(out[2][1].sums[name][key], row)
    for name, table in out[1][2].items():
        pd.testing.assert_frame_equal(table, out[2][2][name])
    # the decoder without a root pass: root where it holds the row, draft elsewhere
    per_round = out[1][0]
    assert (per_round["root_if_covered@B8"] != per_round["draft@B8"]).any()


def test_predictions_join_their_candidates_by_position_as_a_merge_would():
    frame = pd.concat([make_candidate_frame(n_prompts=12, rounds=4, temperature=t, seed=s)
                       for t, s in ((1.0, 1), (0.0, 2))], ignore_index=True)  # fmt: skip
    frame = frame.sample(frac=1.0, random_state=0).reset_index(drop=True)  # laws interleaved
    folds = fold_map(frame["prompt_id"].to_numpy(), "seeded", 0)
    preds = predict_first_factors(frame, folds, "lgbm", ["base"], ["iso_q1"], n_threads=1,
                                  capacity=Capacity(n_iter=20, learning_rate=0.2, max_leaves=7))  # fmt: skip
    columns = ["label_is_argmax", "label_target_prob", "draft_prob"]
    fast = preds.joined(frame, columns)
    slow = frame.merge(preds.frame, on=[*ROUND_KEYS, "cand_index"])
    for t in (0.0, 1.0):
        a = fast[fast["temperature"] == t].reset_index(drop=True)
        b = slow[slow["temperature"] == t].reset_index(drop=True)
        pd.testing.assert_frame_equal(a[b.columns.intersection(a.columns)],
                                      b[b.columns.intersection(a.columns)])  # fmt: skip


def test_law_frames_read_apart_give_the_predictions_of_the_whole_table():
    # The job reads one law's feature columns at a time (rerank.job.fitting.fit): the same
    # predictions as from the whole table, and rows in another order are refused.
    frame = pd.concat([make_candidate_frame(n_prompts=12, rounds=4, temperature=t, seed=s)
                       for t, s in ((1.0, 1), (0.0, 2))], ignore_index=True)  # fmt: skip
    frame = frame.sample(frac=1.0, random_state=0).reset_index(drop=True)  # laws interleaved
    folds = fold_map(frame["prompt_id"].to_numpy(), "seeded", 0)
    kw = dict(n_threads=1, capacity=Capacity(n_iter=20, learning_rate=0.2, max_leaves=7))
    whole = predict_first_factors(frame, folds, "lgbm", ["base"], ["iso_q1"], **kw)
    keys = frame[[*ROUND_KEYS, "cand_index", "task"]]
    asked = []

    def law_frame(t: float) -> pd.DataFrame:
        asked.append(t)
        return frame[frame["temperature"] == t].reset_index(drop=True)

    apart = predict_first_factors(keys, folds, "lgbm", ["base"], ["iso_q1"], law_frame=law_frame,
                                  **kw)  # fmt: skip
    assert asked == [0.0, 1.0]
    pd.testing.assert_frame_equal(apart.frame, whole.frame)
    np.testing.assert_array_equal(apart.rows, whole.rows)

    def shuffled(t: float) -> pd.DataFrame:
        return law_frame(t).iloc[::-1].reset_index(drop=True)

    with pytest.raises(ValueError, match=r"law_frame\(0\) gave its rows in another order"):
        predict_first_factors(keys, folds, "lgbm", ["base"], [], law_frame=shuffled, **kw)
    with pytest.raises(ValueError, match=r"law_frame\(0\) gave 3 rows; the candidate table has"):
        predict_first_factors(keys, folds, "lgbm", ["base"], [],
                              law_frame=lambda t: law_frame(t).head(3), **kw)  # fmt: skip


def test_greedy_edges_equal_the_flat_take_they_replaced():
    # ragged pools: padded columns (parent -1, token -1) are never greedy edges
    rng = np.random.default_rng(5)
    n, width = 40, 12
    lengths = rng.integers(0, width + 1, n)
    parent = np.where(np.arange(width) < 3, -1, rng.integers(-1, 3, (n, width)))
    parent[np.arange(width)[None, :] >= lengths[:, None]] = -1
    token, argmax = (
        rng.integers(-1, 4, (n, width)),
        rng.integers(-1, 4, (n, width)).astype(np.int32),
    )
    root = rng.integers(0, 4, n)
    at_parent = np.take_along_axis(argmax, np.maximum(parent, 0), axis=1)
    valid = np.arange(width)[None, :] < lengths[:, None]
    want = (token == np.where(parent >= 0, at_parent, root[:, None])) & valid
    got = greedy_edges(token, parent, argmax, root, lengths)
    assert want.any() and (~want & valid).any()  # both outcomes occur
    np.testing.assert_array_equal(got, want)
    parent[0, 0], lengths[0] = width, width  # a parent past the pool is refused, not read
    with pytest.raises(ValueError, match="cand_parent: a parent index past the pool's width"):
        greedy_edges(token, parent, argmax, root, lengths)


def test_round_firsts_equal_the_stable_sort_they_replaced():
    """Each round's first row by descending key, as the lexsort gave it (the reference,
    kept here): ties to the first row, NaN below every number, a round of NaNs its first
    row, round numbers without a row skipped."""
    rng = np.random.default_rng(3)
    n = 5_000
    round_id = rng.integers(0, 900, n) * 2  # odd numbers unused
    key = rng.integers(0, 4, n).astype(np.float64)  # many ties
    key[rng.random(n) < 0.2] = np.nan
    key[round_id == 0] = np.nan  # a round of NaNs
    key[(round_id == 2) & (key == 0)] = -0.0  # -0.0 ties 0.0
    order = np.lexsort((-key, round_id))
    expected = order[np.r_[True, round_id[order][1:] != round_id[order][:-1]]]
    got = round_firsts(key, round_id)
    assert np.array_equal(got, expected)
    assert np.isnan(key[got[0]]) and got[0] == np.flatnonzero(round_id == 0)[0]

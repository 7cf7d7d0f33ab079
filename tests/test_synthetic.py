"""Synthetic traces: pool shape (SPEC §2), schema contract, traversal law, determinism, resume."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.job import synth_chunk, write_synthetic_traces
from recipes.synth.rounds import pool_layout, synth_rounds
from selection.pool_batch import pool_batch_from_table
from selection.ranking import draft_scores, path_product, top_b
from specrank.store.shard_store import ShardStore
from specrank.store.trace_schema import TRACE_SCHEMA, trace_store
from tree.config import PoolConfig, SelectConfig
from tree.stopping import expected_outcome

JOB = SynthJobConfig(
    toy_prompts=6, rounds_per_prompt=12, prompts_per_shard=2, temperatures=[0.0, 1.0]
)
POOL, SELECT, SYNTH = PoolConfig(), SelectConfig(), SynthConfig()


@pytest.fixture(scope="module")
def greedy_table() -> pa.Table:
    return synth_chunk(0, JOB, POOL, SELECT, SYNTH, seed=0)  # shard 0: T = 0


@pytest.fixture(scope="module")
def sampled_table() -> pa.Table:
    return synth_chunk(1, JOB, POOL, SELECT, SYNTH, seed=0)  # shard 1: T = 1


def _col(table: pa.Table, name: str) -> np.ndarray:
    """A fixed-length list column as a dense [R, P] array."""
    arr = table[name].combine_chunks()
    return arr.flatten().to_numpy(zero_copy_only=False).reshape(len(arr), -1).copy()


def _lists(table: pa.Table, name: str) -> list:
    return table[name].to_pylist()


def test_layout_counts_default_and_chain():
    lay = pool_layout(PoolConfig())
    assert lay.n_cand == (10,) + (100,) * 7
    assert lay.n_pool == 710 and lay.n_expanded == 70 and lay.max_depth == 8
    assert lay.n_expand == (10,) * 7 + (0,)
    chain = pool_layout(PoolConfig(top_k=1, expand_steps=6, expand=1))
    assert chain.n_cand == (1,) * 7 and chain.n_expanded == 6
    with pytest.raises(
        ValueError, match=r"The 'pool.top_k' parameter must be an int >= 1. Got 0 instead."
    ):
        pool_layout(PoolConfig(top_k=0))


def test_layout_matches_the_decoders_pool_growth():
    # the real decoder's level sizes, for other shapes too (imports transformers: ~3 s once)
    from tree.pool import level_sizes

    for cfg in (PoolConfig(), PoolConfig(top_k=10, expand_steps=3, expand=4), PoolConfig(4, 5, 6)):
        lay = pool_layout(cfg)
        assert list(zip(lay.n_cand, lay.n_expand, strict=True)) == level_sizes(cfg)


@pytest.mark.parametrize("fixture", ["greedy_table", "sampled_table"])
def test_pool_counts_and_order(fixture, request):
    table = request.getfixturevalue(fixture)
    depth, parent = _col(table, "cand_depth"), _col(table, "cand_parent").astype(np.int64)
    expanded, token = _col(table, "cand_expanded"), _col(table, "cand_token")
    assert depth.shape[1] == 710
    assert [(depth[0] == d).sum() for d in range(1, 9)] == [10] + [100] * 7
    assert (expanded.sum(1) == 70).all()
    for d in range(1, 8):
        assert ((expanded & (depth == d)).sum(1) == 10).all()
    assert not (expanded & (depth == 8)).any()
    assert (np.diff(depth, axis=1) >= 0).all()  # depths non-decreasing
    idx = np.arange(710)
    assert ((parent == -1) == (depth == 1)).all()
    assert (parent < idx).all()  # parents precede children
    rows = np.arange(len(parent))[:, None]
    par = np.maximum(parent, 0)
    has_parent = parent >= 0
    assert (depth[rows, par][has_parent] == depth[has_parent] - 1).all()
    # every candidate's parent is the root or an expanded node, which is scored
    scored = _col(table, "cand_scored")
    assert expanded[rows, par][has_parent].all() and scored[rows, par][has_parent].all()
    # siblings carry distinct tokens (top-k of one drafter row)
    key = np.where(has_parent, parent, -1) * 1000 + token
    assert all(len(np.unique(k)) == 710 for k in key)


def test_expansions_are_best_cumulative_draft_per_depth(greedy_table):
    pool = pool_batch_from_table(greedy_table)
    score = draft_scores(pool.draft_logprob, pool.parent)
    expanded = torch.from_numpy(_col(greedy_table, "cand_expanded"))
    for d in range(1, 8):
        block = torch.nonzero(pool.depth[0] == d).squeeze(1)
        # best 10 of the depth: score desc, pool index asc (stable sort)
        order = torch.sort(score[:, block], dim=1, descending=True, stable=True).indices[:, :10]
        want = (
            torch.zeros(len(block), dtype=torch.bool).repeat(len(score), 1).scatter_(1, order, True)
        )
        assert torch.equal(expanded[:, block], want)


@pytest.mark.parametrize("fixture", ["greedy_table", "sampled_table"])
def test_tree_is_draft_top_b_and_scored_set(fixture, request):
    table = request.getfixturevalue(fixture)
    pool = pool_batch_from_table(table)
    in_tree = torch.from_numpy(_col(table, "cand_in_tree"))
    scored = torch.from_numpy(_col(table, "cand_scored"))
    score = draft_scores(
        pool.draft_logprob, pool.parent
    )  # recomputed from the stored float32 edges
    assert torch.equal(in_tree, top_b(score, SELECT.budget))
    assert (in_tree.sum(1) == SELECT.budget).all()
    closed = torch.where(pool.parent >= 0, torch.gather(in_tree, 1, pool.parent.clamp(min=0)), True)
    assert (closed | ~in_tree).all()  # ancestor-closed
    expanded = torch.from_numpy(_col(table, "cand_expanded"))
    assert torch.equal(scored, in_tree | expanded | top_b(score, SELECT.record_top_m))
    argmax = torch.from_numpy(_col(table, "cand_target_argmax"))
    assert torch.equal(argmax >= 0, scored)  # -1 exactly where unscored


@pytest.mark.parametrize(
    "cfg", [PoolConfig(top_k=10, expand_steps=3, expand=4), PoolConfig(4, 5, 3)]
)
def test_other_pool_shapes(cfg):
    select = SelectConfig(budget=12, record_top_m=20)
    rounds = synth_rounds(np.random.default_rng(2), 40, 1.0, cfg, select, SYNTH)
    lay, g = pool_layout(cfg), rounds.pool
    for d, (n, n_exp) in enumerate(zip(lay.n_cand, lay.n_expand, strict=True), start=1):
        at = rounds.depth == d
        assert at.sum() == n and (g.expanded[:, at].sum(1) == n_exp).all()
    has_parent = g.parent >= 0
    assert np.take_along_axis(g.expanded, np.maximum(g.parent, 0), 1)[has_parent].all()
    score = draft_scores(torch.from_numpy(g.draft_logprob), torch.from_numpy(g.parent))
    assert torch.equal(torch.from_numpy(rounds.in_tree), top_b(score, 12))
    assert (rounds.outcome.path_len <= lay.max_depth).all()


def test_target_edge_probs_are_the_generating_rows():
    rng = np.random.default_rng(0)
    rounds = synth_rounds(rng, 64, 1.0, POOL, SELECT, SYNTH)
    root_p = np.exp(rounds.root_logp)  # the generating root row
    first = rounds.target_prob[:, :10]
    np.testing.assert_array_equal(
        first, np.take_along_axis(root_p, rounds.pool.token[:, :10], axis=1)
    )
    assert (first.sum(1) <= 1 + 1e-6).all()
    assert (rounds.root_argmax == root_p.argmax(1)).all()
    # every expanded node's children: a top-k slice of one row, mass <= 1
    parent = rounds.pool.parent
    sums = np.zeros((64, 711))
    np.add.at(sums, (np.arange(64)[:, None].repeat(710, 1), parent + 1), rounds.target_prob)
    assert (sums <= 1 + 1e-5).all()


def test_temperature_convention():
    # T = 0 stores the unit-temperature softmax; same seed, same pool as T = 1.
    r0 = synth_rounds(np.random.default_rng(3), 32, 0.0, POOL, SELECT, SYNTH)
    r1 = synth_rounds(np.random.default_rng(3), 32, 1.0, POOL, SELECT, SYNTH)
    np.testing.assert_array_equal(r0.target_prob, r1.target_prob)
    np.testing.assert_array_equal(r0.pool.token, r1.pool.token)
    # T = 0.5 squares the unit-temperature odds: p_T(a) / p_T(b) = (p(a) / p(b))^2
    rh = synth_rounds(np.random.default_rng(3), 32, 0.5, POOL, SELECT, SYNTH)
    odds_1 = np.log(r1.target_prob[:, 0] / r1.target_prob[:, 1])
    odds_h = np.log(rh.target_prob[:, 0] / rh.target_prob[:, 1])
    np.testing.assert_allclose(odds_h, 2 * odds_1, rtol=1e-3, atol=1e-3)


def test_greedy_path_follows_argmaxes(greedy_table):
    tok, par = _col(greedy_table, "cand_token"), _col(greedy_table, "cand_parent")
    argmax, in_tree = _col(greedy_table, "cand_target_argmax"), _col(greedy_table, "cand_in_tree")
    scored = _col(greedy_table, "cand_scored")
    for r, (path, cont, covered, root_am) in enumerate(
        zip(
            _lists(greedy_table, "accepted_path"),
            _lists(greedy_table, "continuation_token"),
            _lists(greedy_table, "covered"),
            _lists(greedy_table, "root_argmax"),
            strict=True,
        )
    ):
        want = root_am  # the argmax at the reached prefix
        last = -1
        for node in path:
            assert par[r, node] == last and in_tree[r, node] and tok[r, node] == want
            last, want = node, argmax[r, node]
        assert cont == want  # the continuation is the argmax at the last accepted node
        kids = np.flatnonzero(par[r] == last)
        assert not (in_tree[r, kids] & (tok[r, kids] == cont)).any()
        assert covered == bool((scored[r, kids] & (tok[r, kids] == cont)).any())


def test_greedy_outcome_equals_exact_stopping(greedy_table):
    # Under the greedy law the traversal is deterministic: the trace's accepted
    # length and coverage equal the exact exhaustive expectation round by round.
    pool = pool_batch_from_table(greedy_table)
    in_tree = torch.from_numpy(_col(greedy_table, "cand_in_tree"))
    scored = torch.from_numpy(_col(greedy_table, "cand_scored"))
    acc, cov = expected_outcome(pool.law_edge_prob().double(), pool.parent, in_tree, scored)
    lengths = pc.list_value_length(greedy_table["accepted_path"]).to_numpy()
    np.testing.assert_array_equal(acc.numpy(), lengths)
    np.testing.assert_array_equal(cov.numpy().astype(bool), greedy_table["covered"].to_numpy())


def test_sampled_outcome_has_the_exhaustive_law():
    # Mean accepted length and coverage of T = 1 traversals match the exact
    # expectations (V(T) and exit mass on scored children). Tolerance 5 standard
    # errors of the mean over 2000 independent rounds (~0.13 tokens, ~0.05
    # coverage; mean acceptance ~1.8): a correct generator fails for ~6e-7 of
    # seeds, and any bias above ~7% of the mean acceptance is caught.
    rounds = synth_rounds(np.random.default_rng(11), 2000, 1.0, POOL, SELECT, SYNTH)
    parent = torch.from_numpy(rounds.pool.parent)
    edge = torch.from_numpy(rounds.target_prob).double()
    in_tree, scored = torch.from_numpy(rounds.in_tree), torch.from_numpy(rounds.scored)
    acc, cov = expected_outcome(edge, parent, in_tree, scored)
    torch.testing.assert_close(acc, (path_product(edge, parent) * in_tree).sum(1))
    length, covered = rounds.outcome.path_len, rounds.outcome.covered
    n = len(length)
    assert abs(length.mean() - acc.mean().item()) < 5 * length.std() / np.sqrt(n)
    assert abs(covered.mean() - cov.mean().item()) < 5 * covered.std() / np.sqrt(n)


@pytest.mark.parametrize("fixture", ["greedy_table", "sampled_table"])
def test_rounds_of_a_prompt_chain(fixture, request):
    table = request.getfixturevalue(fixture).to_pandas()
    for _, g in table.groupby("prompt_id"):
        assert list(g["round_index"]) == list(range(JOB.rounds_per_prompt))
        assert g["task"].nunique() == 1 and g["prompt_length"].nunique() == 1
        assert (g["root_token"].to_numpy()[1:] == g["continuation_token"].to_numpy()[:-1]).all()
        emitted = g["accepted_path"].map(len).to_numpy() + 1
        assert (
            g["tokens_before"].to_numpy() == np.concatenate([[0], np.cumsum(emitted)[:-1]])
        ).all()
        first = g.iloc[0]
        assert (
            first["prev_tree_root_count"] != first["prev_tree_root_count"]
        )  # NaN: no previous tree
        assert first["matched_tv"] != first["matched_tv"] and len(first["token_only_tv"]) == 0


@pytest.mark.parametrize("fixture", ["greedy_table", "sampled_table"])
def test_retained_rows_are_consistent(fixture, request):
    table = request.getfixturevalue(fixture)
    tok, in_tree, scored = (
        _col(table, "cand_token"),
        _col(table, "cand_in_tree"),
        _col(table, "cand_scored"),
    )
    root = table["root_token"].to_numpy()
    rnd = table["round_index"].to_numpy()
    covered = table["covered"].to_numpy()
    fl_prev, fl_cache, fl_same = (
        table[c].to_pylist() for c in ("fl_prev_logprob", "fl_cache_logprob", "fl_same_logprob")
    )
    for r in range(table.num_rows):
        first = tok[r, :10]
        # preceding row: always present, null exactly at the root (continuation) token
        assert [v is None for v in fl_prev[r]] == list(first == root[r])
        for name, fl in (("cache", fl_cache), ("same", fl_same)):
            present = table[f"{name}_tv"][r].is_valid
            assert all((v is not None) == present for v in fl[r])
            assert table[f"{name}_argmax_agree"][r].is_valid == present
        n_tok = len(table["token_only_tv"][r])
        assert n_tok == len(table["token_only_argmax_agree"][r]) <= 25
        if rnd[r] == 0:
            continue
        prev_count = int((in_tree[r - 1] & (tok[r - 1] == root[r])).sum())
        assert table["prev_tree_root_count"][r].as_py() == prev_count
        same = root[r - 1] == root[r] or prev_count > 0
        assert table["same_tv"][r].is_valid == same
        if same:
            assert table["cache_age"][r].as_py() == 1  # stored after the previous round
        assert table["matched_tv"][r].is_valid == covered[r - 1]
        others = int((scored[r - 1] & (tok[r - 1] == root[r])).sum()) - int(covered[r - 1])
        assert n_tok == min(24, others) + int(root[r - 1] == root[r])
    for name in ("cache", "same", "prev", "matched"):
        tv = table[f"{name}_tv"].drop_null().to_numpy()
        assert ((tv >= 0) & (tv <= 1)).all()
    assert pc.max(table["matched_tv"]).as_py() < 0.05  # matched rows ~ the root row
    assert table["prev_tv"].null_count == 0


def test_store_round_trip_and_determinism(tmp_path, greedy_table):
    again = synth_chunk(0, JOB, POOL, SELECT, SYNTH, seed=0)
    assert again.equals(greedy_table)
    assert not synth_chunk(0, JOB, POOL, SELECT, SYNTH, seed=1).equals(greedy_table)
    store = trace_store(tmp_path / "t")
    store.open_for_writing({"x": 1})
    store.write_shard("0", greedy_table)
    back = store.read()
    assert back.schema.equals(TRACE_SCHEMA) and back.equals(greedy_table.cast(back.schema))


def test_resume_after_interruption(tmp_path, monkeypatch):
    ref = write_synthetic_traces(tmp_path / "ref", JOB, POOL, SELECT, SYNTH, seed=0)
    assert ref.shards_written == 3 and ref.rounds_written == 6 * 12

    real_write = ShardStore.write_shard
    calls = {"n": 0}

    def crashing_write(self, shard_id, table, claim=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("simulated kill during shard 2")
        return real_write(self, shard_id, table, claim)

    monkeypatch.setattr(ShardStore, "write_shard", crashing_write)
    with pytest.raises(KeyboardInterrupt):
        write_synthetic_traces(tmp_path / "run", JOB, POOL, SELECT, SYNTH, seed=0)
    monkeypatch.setattr(ShardStore, "write_shard", real_write)
    assert trace_store(tmp_path / "run").done_shards() == ["00000"]
    resumed = write_synthetic_traces(tmp_path / "run", JOB, POOL, SELECT, SYNTH, seed=0)
    assert (resumed.shards_skipped, resumed.shards_written) == (1, 2)
    assert resumed.fingerprint == ref.fingerprint
    keys = trace_store(tmp_path / "run").read(["prompt_id", "round_index"]).to_pandas()
    assert len(keys) == 6 * 12 and not keys.duplicated().any()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"select": SelectConfig(rule="root")},
            r"'select.rule' must be 'draft'. Got 'root' instead.",
        ),
        ({"synth": SynthConfig(vocab=4)}, r"'synth.vocab' parameter must be >= pool.top_k \(10\)"),
        (
            {"job": SynthJobConfig(toy_prompts=0)},
            r"'synth_job.toy_prompts' parameter must be an int >= 1. Got 0",
        ),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    args = {"job": JOB, "pool": POOL, "select": SELECT, "synth": SYNTH, "seed": 0} | kwargs
    with pytest.raises(ValueError, match=message):
        synth_chunk(0, **args)


def test_growth_scores_equal_select_draft_scores_bitwise():
    # synth_rounds ranks with synth_pool's cumulative sums; they must be select's scores exactly
    rounds = synth_rounds(np.random.default_rng(5), 16, 1.0, POOL, SELECT, SYNTH)
    g = rounds.pool
    want = draft_scores(torch.from_numpy(g.draft_logprob), torch.from_numpy(g.parent)).numpy()
    np.testing.assert_array_equal(g.draft_score, want)


def test_entry_point_composes_and_writes(tmp_path):
    from hydra import compose, initialize_config_dir

    from recipes.synth.job import main
    from specrank.settings.paths import PROJECT_ROOT

    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose("synth", overrides=["debug=default", f"paths.synthetic={tmp_path / 's'}"])
    main.__wrapped__(cfg)  # the function under @hydra.main
    table = trace_store(tmp_path / "s").read()
    assert table.num_rows == cfg.synth_job.toy_prompts * cfg.synth_job.rounds_per_prompt
    assert set(table["temperature"].to_pylist()) == set(cfg.synth_job.temperatures)

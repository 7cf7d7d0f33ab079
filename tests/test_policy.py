"""Scored-set policies offline (rerank.evaluate.policy): coverage of a rule's own tree against
hand-computed values and against the recorder's own coverage flag, App. D.10's recursion,
root_if_covered and draft_scored through the evaluation pass."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import torch

from decode.loop import decode_prompt
from decode.recording import record_traces
from features.registry import FEATURES
from features.schema import candidate_store
from pairs.prompts import encode_prompt
from rerank.config import RerankConfig
from rerank.evaluate.policy import (
    PolicyRounds,
    _held,
    for_policy,
    own_tree_coverage,
    simulable_rounds,
)
from rerank.evaluate.pool_chunks import chunk_of
from rerank.evaluate.tree_coverage import compiled_coverage
from rerank.evaluate.values import EvalPlan, evaluate_traces
from rerank.serving import OnlinePredictor, load_online_reranker
from rerank.settings import check_settings
from selection.ranking import rank_order, ranks_of_order, torch_route
from selection.values import rule_scores
from specrank.store.trace_schema import TRACE_SCHEMA, trace_store
from tests.fake_traces import random_trace
from tests.online_fixtures import PROMPTS, fitted_reranker, settings
from tests.test_reports import IDX, NAMES, trace_row
from tests.tiny_models import one_thread, tiny_pair


def _cov(row: dict, budget: int, policy: str, top_m: int = 100) -> tuple[float, int, int]:
    chunk = chunk_of(pa.Table.from_pylist([row], schema=TRACE_SCHEMA))
    cov, n_tree, extra = own_tree_coverage(chunk.ctx, chunk.order, budget, policy, top_m,
                                           chunk.scored)  # fmt: skip
    return float(cov[0]), int(n_tree[0]), int(extra[0])


def test_spec_trie_coverage_under_each_policy():
    """SPEC §10 trie, IID uniform binary target, T = the draft top-7 {a, b, aa, ab, ba, aaa,
    aab}; the draft order continues baa, bab, aba, abb, bb, bba, bbb. The frontier of T is
    baa, bab, aba, abb (1/8 each) and bb (1/4): 3/4 (exits below aaa, aab leave the pool)."""
    scored = [n in ("a", "b", "aa", "ab", "ba", "aaa", "aab", "bb", "bba") for n in NAMES]
    row = trace_row(cand_scored=scored)
    assert _cov(row, 7, "tree") == (0.0, 7, 0)  # Theorem 1
    assert _cov(row, 7, "top_m", 1) == pytest.approx((1 / 8, 7, 1))  # baa
    assert _cov(row, 7, "top_m", 3) == pytest.approx((3 / 8, 7, 3))  # + bab, aba
    assert _cov(row, 7, "top_m", 5) == pytest.approx((3 / 4, 7, 5))  # + abb, bb
    assert _cov(row, 7, "top_m", 100) == pytest.approx((3 / 4, 7, 7))  # bba, bbb: not frontier
    assert _cov(row, 7, "frontier") == pytest.approx((3 / 4, 7, 5))
    assert _cov(row, 7, "pool") == pytest.approx((3 / 4, 7, 7))
    assert _cov(row, 7, "record") == pytest.approx((1 / 4, 7, 2))  # bb; bba's parent is outside
    # B=3: T = {a, b, aa}; frontier aaa, aab (1/8), ab, ba, bb (1/4): every exit in the pool
    assert _cov(row, 3, "pool")[0] == pytest.approx(1.0)
    assert _cov(row, 3, "top_m", 2)[0] == pytest.approx(1 / 8 + 1 / 4)  # aaa, ab


def test_greedy_coverage_is_the_greedy_exit_in_the_scored_set():
    """Greedy path b -> ba -> bab leaves T (B=7) at bab, the second outside it."""
    argmax = [0] * len(NAMES)
    argmax[IDX["b"]], argmax[IDX["ba"]] = 0, 1
    row = trace_row(temperature=0.0, root_argmax=1, cand_target_argmax=argmax)
    assert _cov(row, 7, "top_m", 1)[0] == 0.0
    assert _cov(row, 7, "top_m", 2)[0] == 1.0
    assert _cov(row, 7, "frontier")[0] == 1.0


def test_recorded_coverage_is_the_recorders_flag(tmp_path):
    """The paper's check (App. D.10): under `record`, draft's own tree at the recorded budget is
    covered exactly in the greedy rounds the recorder flagged covered."""
    pair = tiny_pair(tmp_path / "models", "llama")
    with one_thread():
        record_traces(tmp_path / "t", pair, PROMPTS, settings().base, 4, {}, progress=False)
    table = trace_store(tmp_path / "t").dataset().to_table()
    chunk = chunk_of(table)
    budget = int(table["budget"][0].as_py())
    cov, _, _ = own_tree_coverage(chunk.ctx, chunk.order, budget, "record", 0, chunk.scored)
    flags = np.array(table["covered"].to_pylist())
    assert flags.any() and (~flags).any()
    np.testing.assert_array_equal(cov.numpy() == 1.0, flags)
    assert set(np.unique(cov.numpy())) <= {0.0, 1.0}


def test_held_probability_recursion_by_hand():
    """h_0 = 0; h_t+1 = h_t cov_root + (1 - h_t) cov_draft; 0 again where a series restarts."""
    follows = np.array([False, True, True, False, True])
    cov_d = np.array([0.5, 0.2, 1.0, 0.3, 0.0])
    cov_r = np.array([0.9, 0.4, 0.0, 0.6, 0.1])
    np.testing.assert_allclose(_held(follows, cov_d, cov_r), [0.0, 0.5, 0.3, 0.0, 0.3])


def _evaluate(table: pa.Table, policy: str, top_m: int = 3) -> pd.DataFrame:
    acc = PolicyRounds([2, 5], policy, top_m)
    plan = EvalPlan([2, 5], rules=["draft", "root"], substitutions=[])
    per_round = evaluate_traces(ds.dataset(table), plan, chunk_rounds=5, consumers=[acc])
    return acc.apply(per_round)


def test_root_if_covered_uses_its_own_trees_across_chunks():
    """Greedy rounds: the row is held after a round whose own tree (draft's, or root's when
    that round held the row) was covered; the value is root's there and draft's elsewhere."""
    table = random_trace(3, n_prompts=4, n_rounds=6, level_sizes=[4, 6, 5])
    table = table.set_column(table.schema.get_field_index("temperature"), "temperature",
                             pa.array(np.zeros(len(table)), pa.float32()))  # fmt: skip
    out = _evaluate(table, "top_m")
    chunk = chunk_of(table)
    orders = {"draft": chunk.order, "root": rank_order(rule_scores(chunk.ctx, "root"))}
    for b in (2, 5):
        cov = {n: own_tree_coverage(chunk.ctx, o, b, "top_m", 3)[0].numpy()
               for n, o in orders.items()}  # fmt: skip
        held = out[f"held/root_if_covered@B{b}"].to_numpy()
        assert set(np.unique(held)) <= {0.0, 1.0}  # greedy: the row is held or it is not
        assert held.any() or b == 5
        keys = list(zip(table["prompt_id"].to_pylist(), table["round_index"].to_pylist(),
                        strict=True))  # fmt: skip
        at = {k: i for i, k in enumerate(keys)}  # the rows are shuffled
        for i, (p, r) in enumerate(keys):
            j = at.get((p, r - 1))
            want = 0.0 if j is None else cov["root" if held[j] else "draft"][j]
            assert held[i] == want, (p, r)
        want = np.where(held == 1, out[f"root@B{b}"], out[f"draft@B{b}"])
        np.testing.assert_array_equal(out[f"root_if_covered@B{b}"], want)
        assert out[f"scored/draft@B{b}"].eq(min(b + 3, 15)).all()  # B + M, within 15 nodes


def test_tree_policy_is_never_covered_and_draft_scored_is_a_larger_draft_tree():
    table = random_trace(4, n_prompts=3, n_rounds=5, level_sizes=[4, 6, 5])
    tree = _evaluate(table, "tree")
    for b in (2, 5):
        assert (tree[f"held/root_if_covered@B{b}"] == 0).all()
        np.testing.assert_array_equal(tree[f"root_if_covered@B{b}"], tree[f"draft@B{b}"])
        np.testing.assert_allclose(tree[f"draft_scored@B{b}"], tree[f"draft@B{b}"])
    top = _evaluate(table, "top_m", 3)
    wide = evaluate_traces(ds.dataset(table), EvalPlan([5, 8], rules=["draft"], substitutions=[]))
    np.testing.assert_allclose(top["draft_scored@B2"], wide["draft@B5"])  # B + M = 5
    np.testing.assert_allclose(top["draft_scored@B5"], wide["draft@B8"])


def test_policy_settings_are_checked():
    with pytest.raises(ValueError, match=r"rerank.score' must be one of .*'everything'"):
        check_settings(RerankConfig(score="everything"))
    with pytest.raises(ValueError, match=r"rerank.score_top_m"):
        check_settings(RerankConfig(score="top_m", score_top_m=0))
    with pytest.raises(ValueError, match=r"rerank.draft_top_m=50 restricts"):
        check_settings(RerankConfig(score="pool", draft_top_m=50, feature_sets=["base", "rows"]))


def test_under_tree_the_matched_and_token_only_rows_are_absent_online_and_offline(tmp_path):
    """A tree-only decoder never holds the matched row (Theorem 1) and keeps no token-only
    row (NO_TOKEN_ONLY): online their features are absent in every round (count 0, the rest
    missing); offline `for_policy(tree)` gives the recorded rows exactly those values, and
    changes nothing else."""
    pair = tiny_pair(tmp_path / "models", "llama")
    absent = [f.name for f in FEATURES if f.group in ("matched", "token_only")]
    with one_thread():
        path = fitted_reranker(tmp_path / "rr", pair, 0.0, feature_set="rows_matched")
        predictor = OnlinePredictor(load_online_reranker(str(path), 0.0, "unused"), pair.device)
        s = settings("reranker", 0.0, score="tree", max_new_tokens=32)
        rounds = [x for p in PROMPTS[:4] for x in decode_prompt(
            pair.target, pair.drafter, encode_prompt(pair.tokenizer, p.text), s, frozenset(),
            p.id, p.task, predictor, keep_features=True).rounds]  # fmt: skip
    assert len(rounds) > 10
    for name in absent:
        values = np.concatenate([np.asarray(x.features[name], dtype=float) for x in rounds])
        if name == "token_only_count":
            assert (values == 0).all()
        else:
            assert np.isnan(values).all(), name
    frame = candidate_store(tmp_path / "rr" / "features").read().to_pandas()
    assert np.isfinite(frame["matched_logprob"].to_numpy(float)).any()  # recorded: some rounds
    assert (frame["token_only_count"] > 0).any()
    masked = for_policy(frame, "tree")
    assert (masked["token_only_count"] == 0).all()
    assert masked[[c for c in absent if c != "token_only_count"]].isna().all().all()
    pd.testing.assert_frame_equal(masked.drop(columns=absent), frame.drop(columns=absent))
    assert masked["token_only_count"].dtype == frame["token_only_count"].dtype
    assert for_policy(frame, "record") is frame
    # beyond tree and record the matched row follows each rule's own trees, simulated
    # (tests/test_matched_simulated.py)
    check_settings(RerankConfig(score="pool", feature_sets=["rows", "rows_matched"]))
    with pytest.raises(ValueError, match=r"rerank.score=top_m: the matched row follows"):
        for_policy(frame, "top_m")


@pytest.mark.parametrize("score", ["record", "pool"])
def test_the_matched_row_follows_exactly_the_covered_rounds_online(tmp_path, score):
    """Under a policy that scores beyond the tree (recorded, so the rows say which rounds were
    covered), the matched row is there in round t exactly when round t-1's emitted address
    was scored. Token-only rows are kept under `record` alone (NO_TOKEN_ONLY)."""
    pair = tiny_pair(tmp_path / "models", "llama")
    with one_thread():
        path = fitted_reranker(tmp_path / "rr", pair, 0.0, feature_set="rows_matched")
        predictor = OnlinePredictor(load_online_reranker(str(path), 0.0, "unused"), pair.device)
        s = settings("reranker", 0.0, score=score, record=True, max_new_tokens=32)
        runs = [decode_prompt(pair.target, pair.drafter, encode_prompt(pair.tokenizer, p.text), s,
                              frozenset(), p.id, p.task, predictor, keep_features=True)
                for p in PROMPTS[:4]]  # fmt: skip
    held, covered = [], []
    for run in runs:
        for prev, x in zip(run.rounds, run.rounds[1:], strict=False):
            held.append(bool(np.isfinite(np.asarray(x.features["matched_logprob"], float)).any()))
            covered.append(bool(prev.fields["covered"]))
    assert any(covered) and (not all(covered) or score == "pool")
    assert held == covered
    # the round's own flag (online tables' `matched_row`) says the same
    assert [x.matched_row for r in runs for x in r.rounds[1:]] == held
    assert not any(r.rounds[0].matched_row for r in runs)
    count = np.concatenate([x.features["token_only_count"] for r in runs for x in r.rounds])
    assert (count > 0).any() if score == "record" else (count == 0).all()


def test_a_store_whose_parents_were_not_all_scored_is_refused_naming_store_and_policy():
    """A policy beyond `tree` reads the path probability of candidates whose parent the
    recording may not have scored; such a round cannot be simulated, and the store is
    refused. Under `tree` (never covered) it is simulated, in every round."""
    table = random_trace(5, n_prompts=3, n_rounds=4, level_sizes=[4, 6, 5])
    assert _evaluate(table, "top_m")["draft@B2"].notna().all()  # every parent scored
    scored = table["cand_scored"].to_pylist()
    parent = table["cand_parent"].to_pylist()
    first_parent = parent[0].index(next(p for p in parent[0] if p >= 0))
    scored[0] = [False if i == parent[0][first_parent] else x for i, x in enumerate(scored[0])]
    table = table.set_column(table.schema.get_field_index("cand_scored"), "cand_scored",
                             pa.array(scored, table.schema.field("cand_scored").type))  # fmt: skip
    for policy in ("top_m", "frontier", "record", "pool"):
        acc = PolicyRounds([2, 5], policy, 3, store="rerank.traces=demo")
        plan = EvalPlan([2, 5], rules=["draft", "root"], substitutions=[])
        per_round = evaluate_traces(ds.dataset(table), plan, chunk_rounds=5, consumers=[acc])
        with pytest.raises(
            ValueError,
            match=rf"rerank.traces=demo cannot simulate rerank.score="
            rf"{policy}: in 8.3% of its rounds",
        ):  # 1 of 12
            acc.apply(per_round)
    acc = PolicyRounds([2, 5], "tree", store="rerank.traces=demo")
    plan = EvalPlan([2, 5], rules=["draft", "root"], substitutions=[])
    acc.apply(evaluate_traces(ds.dataset(table), plan, chunk_rounds=5, consumers=[acc]))
    assert acc.simulable_share == 1.0


def test_a_rows_reranker_decodes_alike_under_tree_and_top_m(tmp_path):
    """`rows` reads no row the policy decides (the cache and same-token rows come from the
    verified tree): under top_m it predicts, selects and emits exactly as under tree at T=0,
    and only scores M more prefixes a pass, so its tau under top_m is its tau under tree
    (issue 28's goal under top_m, for the rules that need no extra scoring)."""
    pair = tiny_pair(tmp_path / "models", "llama")
    with one_thread():
        path = fitted_reranker(tmp_path / "rr", pair, 0.0, feature_set="rows")
        predictor = OnlinePredictor(load_online_reranker(str(path), 0.0, "unused"), pair.device)
        runs = {score: [decode_prompt(
            pair.target, pair.drafter, encode_prompt(pair.tokenizer, p.text),
            settings("reranker", 0.0, score=score, top_m=4, max_new_tokens=32), frozenset(),
            p.id, p.task, predictor).rounds for p in PROMPTS[:4]] for score in ("tree", "top_m")}  # fmt: skip
    tree, top = ([x for rounds in runs[s] for x in rounds] for s in ("tree", "top_m"))
    assert len(tree) == len(top) > 10
    for a, b in zip(tree, top, strict=True):
        assert a.emitted == b.emitted and a.tree_size == b.tree_size
        np.testing.assert_array_equal(a.first_logprob, b.first_logprob)
        assert b.scored == a.scored + 4  # the pool holds more than 4 outside a 6-node tree


def test_under_tree_coverage_is_zero_and_the_tree_is_the_first_b_valid_candidates():
    """own_tree_coverage under tree skips the ranking: nothing covered, nothing scored outside
    T, and T's size is that of {u valid: rank(u) < B} computed from the order's ranks."""
    table = random_trace(6, n_prompts=3, n_rounds=5, level_sizes=[4, 6, 5])
    chunk = chunk_of(table)
    rank, valid = ranks_of_order(chunk.order), chunk.ctx.pool.valid
    for b in (2, 5, 40):  # 40: more than the 15-node pools hold
        cov, n_tree, extra = own_tree_coverage(chunk.ctx, chunk.order, b, "tree", 0)
        assert (cov == 0).all() and (extra == 0).all()
        np.testing.assert_array_equal(n_tree, ((rank < b) & valid).sum(-1))
    out = _evaluate(table, "tree")  # the pass's column, in the pass's row order
    at = {k: i for i, k in enumerate(zip(table["prompt_id"].to_pylist(),
                                         table["round_index"].to_pylist(), strict=True))}  # fmt: skip
    rows = [at[k] for k in zip(out["prompt_id"], out["round_index"], strict=True)]
    np.testing.assert_array_equal(out["scored/draft@B5"], ((rank < 5) & valid).sum(-1)[rows])


@pytest.mark.parametrize("seed", [0, 1])
def test_the_compiled_coverage_is_the_torch_routes_bit_for_bit(seed):
    """The CPU kernel (rerank.evaluate.tree_coverage) against the torch route, every policy,
    on pools of varied shapes (padded, partly invalid) and orders that need not rank the
    valid candidates first."""
    table = random_trace(seed, n_prompts=5, n_rounds=8)
    greedy_rows = np.arange(len(table)) % 2 == 0  # half the rounds greedy: one term at most
    temperature = np.where(greedy_rows, 0.0, table["temperature"].to_numpy())
    table = table.set_column(table.schema.get_field_index("temperature"), "temperature",
                             pa.array(temperature, pa.float32()))  # fmt: skip
    chunk = chunk_of(table)
    gen = torch.Generator().manual_seed(seed)
    scored = torch.rand(chunk.ctx.path_prob.shape, generator=gen) < 0.5
    shuffled = torch.argsort(torch.rand(chunk.ctx.path_prob.shape, generator=gen), dim=-1)
    orders = [chunk.order, rank_order(rule_scores(chunk.ctx, "root")), shuffled]
    for policy, order, budget, top_m in itertools.product(
        ["top_m", "frontier", "record", "pool"], orders, [0, 1, 3, 7, 40], [0, 1, 5, 100]
    ):
        with torch_route():
            reference = own_tree_coverage(chunk.ctx, order, budget, policy, top_m, scored)
        pool = chunk.ctx.pool
        for few_terms in (True, False):  # sums tried directly first, or the terms at once
            compiled = compiled_coverage(order, pool.valid, pool.parent, chunk.ctx.path_prob,
                                         budget, policy, top_m, scored, few_terms)  # fmt: skip
            for got, want in zip(compiled, reference, strict=True):
                assert got.dtype == want.dtype and torch.equal(got, want), (policy, budget)
    for greedy in (True, False):  # the whole route, on rounds of each law
        part = chunk_of(table.filter(pa.array(greedy_rows if greedy else ~greedy_rows)))
        assert (part.ctx.pool.temperature == 0).all() == greedy
        for policy in ["top_m", "pool"]:
            got = own_tree_coverage(part.ctx, part.order, 5, policy, 3, part.scored)
            with torch_route():
                want = own_tree_coverage(part.ctx, part.order, 5, policy, 3, part.scored)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    cov = compiled_coverage(chunk.order, pool.valid, pool.parent, chunk.ctx.path_prob, 3,
                            "pool", 0, None, True)[0]  # fmt: skip
    assert (cov > 0).any()  # some rounds are covered at all
    # the rounds whose every parent was scored, for a recording that scored most prefixes
    chunk.__dict__["scored"] = torch.rand(scored.shape, generator=gen) < 0.97
    with torch_route():
        simulable = simulable_rounds(chunk, "top_m")
    assert 0 < simulable.mean() < 1
    np.testing.assert_array_equal(simulable_rounds(chunk, "top_m"), simulable)

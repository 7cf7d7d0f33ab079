"""Issue-14 report tables against hand-computed values (SPEC §10 trie, hand-built traces)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from rerank.evaluate.coverage import coverage_table
from rerank.evaluate.draw_sizes import draw_size_table, size_means
from rerank.evaluate.reports import report_tables
from rerank.evaluate.row_agreement import row_agreement
from specrank.store.trace_schema import TRACE_SCHEMA

U = 0.125  # draft log-prob unit: sums of multiples of 1/8 are exact in float32, so ties are exact

# The full binary trie of depth 3 over a = 0, b = 1 (pool order). Cumulative draft
# scores (units of -U): a 1, b 2, aa 2, ab 4, ba 4, bb 18, aaa 3, aab 4, aba 11, abb 12,
# baa 8, bab 9, bba 19, bbb 20, so the draft order is
#   a, b, aa, aaa, ab, ba, aab | baa, bab, aba, abb, bb, bba, bbb
# and the draft top-7 is the SPEC §10 trie T = {a, b, aa, ab, ba, aaa, aab}.
NAMES = ["a", "b", "aa", "ab", "ba", "bb", "aaa", "aab", "aba", "abb", "baa", "bab", "bba", "bbb"]
PARENT = [-1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
EDGE_Q = [1, 2, 1, 3, 2, 16, 1, 2, 8, 9, 4, 5, 1, 2]
IDX = {n: i for i, n in enumerate(NAMES)}


def trace_row(**over) -> dict:
    """One trace row with neutral defaults (every retained row absent)."""
    token = over.get("cand_token", [int(n[-1] == "b") for n in NAMES])
    n = len(token)
    n1 = sum(p < 0 for p in over.get("cand_parent", PARENT))
    row = {
        "prompt_id": "p0", "task": "qa", "category": "qa", "round_index": 0, "tokens_before": 0,
        "prompt_length": 5, "temperature": 1.0, "rule": "draft", "budget": 7, "root_token": 2,
        "cand_token": token, "cand_parent": PARENT, "cand_depth": [len(s) for s in NAMES],
        "cand_draft_logprob": [-U * q for q in EDGE_Q],
        "cand_expanded": [i < 6 for i in range(n)], "cand_target_prob": [0.5] * n,
        "cand_scored": [True] * n, "cand_in_tree": [False] * n, "cand_target_argmax": [0] * n,
        "root_argmax": 0, "root_entropy": 0.69, "root_top1_prob": 0.5, "accepted_path": [],
        "continuation_token": 3, "covered": False,
        "fl_cache_logprob": [None] * n1, "fl_same_logprob": [None] * n1,
        "fl_prev_logprob": [None] * n1, "cache_age": None, "prev_tree_root_count": None,
        "token_only_tv": [], "token_only_argmax_agree": [],
        "time_draft_ms": 0.0, "time_select_ms": 0.0, "time_verify_ms": 0.0,
        "time_bookkeeping_ms": 0.0,
    }  # fmt: skip
    for k in ("cache", "same", "prev", "matched"):
        row[f"{k}_tv"], row[f"{k}_argmax_agree"] = None, None
    return row | over


def dataset_of(rows: list[dict]) -> ds.Dataset:
    return ds.dataset(pa.Table.from_pylist(rows, schema=TRACE_SCHEMA))


def cov(table: pd.DataFrame, budget: int, scored_set: str, column: str = "coverage") -> float:
    hit = table[(table["budget"] == budget) & (table["scored_set"] == scored_set)]
    assert len(hit) == 1, (budget, scored_set)
    return float(hit[column].iloc[0])


# -- coverage (issue 14.7) --------------------------------------------------------------


def test_spec_trie_scored_as_tree_is_never_covered():
    """SPEC §10: IID uniform binary target, pool = T, Q = T: exhaustive coverage 0."""
    keep = [IDX[n] for n in ["a", "b", "aa", "ab", "ba", "aaa", "aab"]]
    remap = {old: new for new, old in enumerate(keep)}
    row = trace_row(
        cand_token=[int(NAMES[i][-1] == "b") for i in keep],
        cand_parent=[remap.get(PARENT[i], -1) for i in keep],
        cand_depth=[len(NAMES[i]) for i in keep],
        cand_draft_logprob=[-U * EDGE_Q[i] for i in keep],
        cand_expanded=[NAMES[i] in ("a", "b", "aa") for i in keep],
    )
    table = coverage_table(dataset_of([row]), [7], top_ms=[100], frontier_ks=[40])
    assert set(table["scored_set"]) == {"tree", "top100", "recorded", "pool", "frontier40",
                                        "frontier"}  # fmt: skip
    assert (table["coverage"] == 0).all()
    assert (table["frontier_scored"] == 0).all()


def test_trie_coverage_of_scored_sets_sampling():
    """Tree = T (B=7); frontier baa, bab, aba, abb (1/8 each), bb (1/4): 3/4 in all."""
    scored = [n in ("a", "b", "aa", "ab", "ba", "aaa", "aab", "bb", "bba") for n in NAMES]
    data = dataset_of([trace_row(cand_scored=scored)])
    t = coverage_table(data, [3, 7], top_ms=[9, 10, 12], frontier_ks=[1, 4], chunk_rounds=1)
    assert cov(t, 7, "tree") == 0.0
    assert cov(t, 7, "top9") == pytest.approx(1 / 4)  # + baa, bab
    assert cov(t, 7, "top10") == pytest.approx(3 / 8)  # + aba
    assert cov(t, 7, "top12") == pytest.approx(3 / 4)  # + abb, bb
    assert cov(t, 7, "recorded") == pytest.approx(1 / 4)  # bb (bba's parent is outside T)
    assert cov(t, 7, "recorded", "extra_scored") == 2
    assert cov(t, 7, "recorded", "frontier_scored") == 1
    assert cov(t, 7, "frontier1") == pytest.approx(1 / 8)  # baa
    assert cov(t, 7, "frontier4") == pytest.approx(1 / 2)
    assert cov(t, 7, "frontier") == pytest.approx(3 / 4)
    assert cov(t, 7, "pool") == pytest.approx(3 / 4)  # exits below aaa, aab leave the pool
    assert cov(t, 7, "pool", "extra_scored") == 7
    assert cov(t, 7, "pool", "frontier_scored") == 5
    # B=3: T = {a, b, aa}; frontier aaa, aab (1/8), ab, ba, bb (1/4): every exit in the pool
    assert cov(t, 3, "pool") == pytest.approx(1.0)
    assert cov(t, 3, "top9") == pytest.approx(1 / 8 + 1 / 4 + 1 / 4 + 1 / 8)  # aaa ab ba aab
    assert cov(t, 3, "frontier1") == pytest.approx(1 / 8)  # aaa first in draft order


def test_trie_coverage_greedy_is_zero_one():
    """Greedy path b -> ba -> bab: with T (B=7) it exits at bab, draft rank 8."""
    argmax = [0] * len(NAMES)
    argmax[IDX["b"]], argmax[IDX["ba"]] = 0, 1  # argmax at b is a, at ba is b
    row = trace_row(temperature=0.0, root_argmax=1, cand_target_argmax=argmax)
    t = coverage_table(dataset_of([row]), [7], top_ms=[8, 9], frontier_ks=[1, 2])
    assert t["law"].unique().tolist() == ["greedy"]
    assert cov(t, 7, "top8") == 0.0  # baa only
    assert cov(t, 7, "top9") == 1.0
    assert cov(t, 7, "frontier1") == 0.0
    assert cov(t, 7, "frontier2") == 1.0
    assert cov(t, 7, "pool") == 1.0


# -- retained-row agreement (issue 14.6) ------------------------------------------------

# A 5-candidate pool: 0 tok 7 (d1), 1 tok 5 (d1), 2 tok 5 (below 0), 3 tok 9 (below 0), 4 tok 7 (below 1)
SMALL = {
    "cand_token": [7, 5, 5, 9, 7], "cand_parent": [-1, -1, 0, 0, 1], "cand_depth": [1, 1, 2, 2, 2],
    "cand_draft_logprob": [-0.5, -1.0, -0.5, -1.0, -0.5],
    "cand_expanded": [True, True, False, False, False], "cand_target_prob": [0.5] * 5,
    "cand_scored": [True] * 5, "cand_in_tree": [True, True, True, False, False],
    "cand_target_argmax": [0] * 5, "fl_cache_logprob": [None] * 2,
    "fl_same_logprob": [None] * 2, "fl_prev_logprob": [None] * 2,
}  # fmt: skip


def three_rounds() -> list[dict]:
    """Round 0: root 5, accepts 0 (tok 7), continuation 5 -> emits node 2 (scored: covered);
    next token-only list = [root row (on the path), node 1]. Round 1: nothing accepted,
    continuation 9 (no such first-level node: not covered); list = [node 3]. Round 2:
    accepts 1 (tok 5), continuation 7 -> node 4, covered."""
    r0 = trace_row(
        **SMALL,
        round_index=0,
        root_token=5,
        accepted_path=[0],
        continuation_token=5,
        covered=True,
        cache_tv=0.25,
        cache_argmax_agree=True,
    )
    r1 = trace_row(
        **SMALL,
        round_index=1,
        root_token=5,
        accepted_path=[],
        continuation_token=9,
        covered=False,
        matched_tv=0.001,
        matched_argmax_agree=True,
        token_only_tv=[0.75, 0.25],
        token_only_argmax_agree=[False, True],
        cache_tv=0.5,
        cache_argmax_agree=False,
        same_tv=0.375,
        same_argmax_agree=True,
        prev_tv=0.875,
        prev_argmax_agree=False,
    )
    r2 = trace_row(**SMALL, round_index=2, root_token=9, accepted_path=[1],
                   continuation_token=7, covered=True,
                   token_only_tv=[0.5], token_only_argmax_agree=[True],
                   prev_tv=0.625, prev_argmax_agree=True)  # fmt: skip
    return [r2, r0, r1]  # stored out of order, read one round per chunk


def test_row_agreement_on_three_rounds():
    agreement, match = row_agreement(dataset_of(three_rounds()), chunk_rounds=1)
    a = agreement.set_index("row")
    assert (a["law"] == "sampling").all() and (a["rounds"] == 3).all()
    expect = {  # availability, rows, tv_mean, tv_median, argmax_agree
        "matched": (1 / 3, 1, 0.001, 0.001, 1.0),
        "token_only": (2 / 3, 3, 0.5, 0.5, 2 / 3),
        "token_only_path": (1 / 3, 1, 0.75, 0.75, 0.0),
        "token_only_other": (2 / 3, 2, 0.375, 0.375, 1.0),
        "cache": (2 / 3, 2, 0.375, 0.375, 0.5),
        "same": (1 / 3, 1, 0.375, 0.375, 1.0),
        "preceding": (2 / 3, 2, 0.75, 0.75, 0.5),
    }
    for kind, (avail, n, mean, median, agree) in expect.items():
        got = a.loc[kind]
        assert got["availability"] == pytest.approx(avail), kind
        assert got["rows"] == n, kind
        assert got["tv_mean"] == pytest.approx(mean, abs=1e-6), kind
        assert got["tv_median"] == pytest.approx(median, abs=1e-6), kind
        assert got["argmax_agree"] == pytest.approx(agree), kind
    m = match.iloc[0]
    assert m["token_match_tree"] == pytest.approx(2 / 3)  # round 1: no verified prefix ends in 9
    assert m["token_match_scored"] == 1.0
    assert m["address_match"] == pytest.approx(2 / 3)
    assert m["tree_prefixes_ending"] == pytest.approx((2 + 0 + 1) / 3)
    assert m["scored_prefixes_ending"] == pytest.approx((2 + 1 + 2) / 3)
    assert m["unsplit_rounds"] == 0


# -- draw-rule tree sizes (issue 14.8) --------------------------------------------------


def draw_case() -> list[dict]:
    """The binary trie with p(a) = 3/4, p(b) = 1/4 (sampling) and a greedy twin with argmax b."""
    probs = [0.75, 0.25] + [0.5] * 12
    return [
        trace_row(cand_target_prob=probs),
        trace_row(prompt_id="p1", temperature=0.0, root_argmax=1, cand_target_prob=probs),
    ]


def test_draw_sizes_hand_case():
    t = draw_size_table(dataset_of(draw_case()), [3], chunk_rounds=1).set_index("law")
    s = t.loc["sampling"]
    assert s["top_draw_share"] == pytest.approx(0.75)  # the drafter's top first token is a
    assert s["other_first_share"] == pytest.approx(0.25)
    assert s["size_root_draw"] == pytest.approx(3.0)  # 1 + 2 descendants either way
    assert s["size_root_draw_top"] == pytest.approx(3.0)
    assert s["size_root_draw_other"] == pytest.approx(3.0)
    # draft T_3 = {a, b, aa}: after a 2 nodes, after b 1
    assert s["size_pearl"] == pytest.approx(1.75)
    assert s["size_pearl_top"] == pytest.approx(2.0)
    assert s["size_pearl_other"] == pytest.approx(1.0)
    # PEARL sizes by pre-draw budget 4, 5: 2.5, 3.25 -> 3 = 1/3 * 2.5 + 2/3 * 3.25
    assert s["matched_budget"] == pytest.approx(14 / 3)
    assert s["size_pearl_matched"] == pytest.approx(3.0)
    assert s["size_pearl_matched_top"] == pytest.approx((2.25 / 3 + 2 * 3.0 / 3) / 0.75)
    assert s["size_pearl_matched_other"] == pytest.approx(1.0)
    # at budget 5 the tree under a holds aa, aaa, ab: 4 > 3 nodes (p = 3/4); at 4 it does not
    assert s["exceed_share_pearl_matched"] == pytest.approx(2 / 3 * 0.75)
    g = t.loc["greedy"]
    assert g["top_draw_share"] == 0.0  # the target's argmax is b, the drafter's top is a
    assert g["size_root_draw"] == pytest.approx(3.0)
    assert g["size_pearl"] == pytest.approx(1.0)
    assert np.isnan(g["size_pearl_top"])


def test_size_means_of_per_round_columns():
    per_round = pd.DataFrame({
        "prompt_id": ["p0", "p0", "p1"], "task": ["qa"] * 3, "temperature": [1.0] * 3,
        "size/pearl@B8": [2.0, 4.0, 6.0], "size/root_draw@B8": [8.0, 8.0, 5.0],
    })  # fmt: skip
    out = size_means(per_round, n_resamples=20, seed=0).set_index("rule")
    assert out.loc["pearl", "size"] == pytest.approx(4.0)
    assert out.loc["root_draw", "size"] == pytest.approx(7.0)
    assert out.loc["pearl", "size_lo"] >= 3.0 and out.loc["pearl", "size_hi"] <= 6.0


def test_report_tables_one_pass():
    tables = report_tables(dataset_of(three_rounds()), None, [2], 10, 0, chunk_rounds=2)
    assert set(tables) == {"row_agreement", "row_match", "coverage", "draw_sizes"}
    with pytest.raises(ValueError, match="budgets"):
        report_tables(dataset_of(three_rounds()), None, [0], 10, 0)

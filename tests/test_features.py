"""First-level features (SPEC §7): exact values, no look-ahead, missing rows, online = offline."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from features.first_level import FEATURE_DTYPES, first_level_features
from features.from_trace import candidate_table
from features.rounds import RoundArrays
from specrank.store.trace_schema import TRACE_SCHEMA
from tests.fake_traces import random_round, random_trace

LN2 = math.log(2.0)

# A hand-built round (powers of two, so every log is exact):
#   pool idx  token parent depth  q      cumulative q
#   0         5     -1     1      1/2    1/2    expanded
#   1         7     -1     1      1/4    1/4    expanded   (repeats the root token 7)
#   2         9     -1     1      1/8    1/8
#   3         1      0     2      1/2    1/4    expanded
#   4         2      0     2      1/4    1/8
#   5         3      1     2      1/2    1/8
#   6         4      3     3      1/2    1/8
HAND_POOL = {
    "cand_token": [5, 7, 9, 1, 2, 3, 4],
    "cand_parent": [-1, -1, -1, 0, 0, 1, 3],
    "cand_depth": [1, 1, 1, 2, 2, 2, 3],
    "cand_draft_logprob": [math.log(x) for x in (0.5, 0.25, 0.125, 0.5, 0.25, 0.5, 0.5)],
    "cand_expanded": [True, True, False, True, False, False, False],
}
HAND_ROWS = {
    "fl_cache_logprob": [math.log(0.5), math.log(0.25), None],
    "fl_same_logprob": [None, None, None],  # no same-token row this round
    # the root-token entry (index 1) is non-null here on purpose: it must still come out missing
    "fl_prev_logprob": [math.log(0.125), math.log(0.5), math.log(0.25)],
    "fl_matched_logprob": [math.log(0.25), math.log(0.5), math.log(0.125)],
    "fl_token_only_mean_logprob": [math.log(0.25)] * 3,
    "fl_token_only_max_logprob": [math.log(0.5)] * 3,
    "token_only_argmax": [5, 9, 5],  # token 5 is the drafter's top first token: 2 of 3 agree
    "cache_age": 3,
    "prev_tree_root_count": 2,
    "cache_entropy": 1.5,
    "cache_top1_prob": 0.5,
    "cache_argmax": 5,
    "same_entropy": None,
    "same_top1_prob": None,
    "same_argmax": None,
    "prev_entropy": 0.75,
    "prev_top1_prob": 0.25,
    "prev_argmax": 9,
    "matched_entropy": 1.0,
    "matched_top1_prob": 0.5,
    "matched_argmax": 7,
}
_q = np.array([4, 2, 1]) / 7
HAND_EXPECTED: dict[str, list] = {
    "draft_logprob": [-LN2, -2 * LN2, -3 * LN2],
    "draft_prob": [0.5, 0.25, 0.125],
    "draft_rank": [0, 1, 2],
    "draft_prob_share": [4 / 7, 2 / 7, 1 / 7],
    "top_sibling_prob": [0.25, 0.5, 0.5],
    "margin_top_sibling": [LN2, -LN2, -2 * LN2],
    "gap_above": [None, LN2, LN2],
    "gap_below": [LN2, LN2, None],
    "sibling_mass": [0.375, 0.625, 0.75],
    "n_first_level": [3, 3, 3],
    "fl_draft_mass": [0.875] * 3,
    "root_draft_entropy": [float(-(_q * np.log(_q)).sum())] * 3,
    "root_draft_top1": [0.5] * 3,
    "expanded": [True, True, False],
    "subtree_size": [3, 1, 0],
    "subtree_depth": [3, 2, 1],
    "subtree_best_d2": [-2 * LN2, -3 * LN2, None],
    "subtree_best_deepest": [-3 * LN2, -3 * LN2, None],
    "subtree_draft_mass": [0.5, 0.125, 0.0],
    "subtree_draft_mass_rel": [1.0, 0.5, 0.0],
    "prompt_length": [11] * 3,
    "round_index": [2] * 3,
    "tokens_before": [6] * 3,
    "prev_accepted": [3] * 3,
    "repeats_root": [False, True, False],
    "cache_logprob": [-LN2, -2 * LN2, None],
    "cache_gap": [0.0, -LN2, None],
    "same_logprob": [None] * 3,
    "same_gap": [None] * 3,
    "prev_logprob": [-3 * LN2, None, -2 * LN2],
    "prev_gap": [-LN2, None, 0.0],  # the best is over the entries the row keeps (1/4, not 1/2)
    "cache_age": [3] * 3,
    "prev_tree_root_count": [2] * 3,
    "cache_rank": [0, 1, None],
    "cache_entropy": [1.5] * 3,
    "cache_top1": [0.5] * 3,
    "cache_top_is_draft_top": [1.0] * 3,
    "same_rank": [None] * 3,
    "same_entropy": [None] * 3,
    "same_top1": [None] * 3,
    "same_top_is_draft_top": [None] * 3,
    "prev_rank": [1, None, 0],
    "prev_entropy": [0.75] * 3,
    "prev_top1": [0.25] * 3,
    "prev_top_is_draft_top": [0.0] * 3,
    "matched_logprob": [-2 * LN2, -LN2, -3 * LN2],
    "matched_gap": [-LN2, 0.0, -2 * LN2],
    "matched_rank": [1, 0, 2],
    "matched_entropy": [1.0] * 3,
    "matched_top1": [0.5] * 3,
    "matched_top_is_draft_top": [0.0] * 3,
    "token_only_count": [3] * 3,
    "token_only_mean_logprob": [-2 * LN2] * 3,
    "token_only_max_logprob": [-LN2] * 3,
    "token_only_top_agree": [2 / 3] * 3,
}


def _assert_matches(name: str, got: np.ndarray | list, want: list) -> None:
    got = np.asarray([np.nan if v is None else v for v in got], dtype=np.float64)
    want = np.asarray([np.nan if v is None else v for v in want], dtype=np.float64)
    # float32 storage: 1e-6 relative is a few ulps
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=name)


def _hand_round_online() -> RoundArrays:
    return RoundArrays.one_round(
        **{k: np.array(v) for k, v in HAND_POOL.items()},
        root_token=7,
        prompt_length=11,
        round_index=2,
        tokens_before=6,
        prev_accepted=3,
        rows={
            k: np.array([np.nan if x is None else x for x in v], dtype=float)
            if isinstance(v, list) and k.startswith("fl_")
            else v
            for k, v in HAND_ROWS.items()
        },
    )


def _hand_trace() -> pa.Table:
    """Rounds 0..2 of one prompt; round 2 is the hand-built round (round 1 accepted 3 tokens)."""
    rng = np.random.default_rng(7)
    rows = [random_round(rng, "hand", r, [3, 4, 4, 2], tokens_before=2 * r) for r in range(3)]
    rows[1]["accepted_path"] = [0, 3, 7]
    rows[2].update(HAND_POOL, **HAND_ROWS)
    rows[2].update(root_token=7, prompt_length=11, tokens_before=6)
    rows[2].update(cand_target_prob=[0.2, 0.6, 0.1, 0.5, 0.5, 0.5, 0.5], root_argmax=7)
    return pa.Table.from_pylist(rows, schema=TRACE_SCHEMA)


def test_feature_list_is_every_spec_feature() -> None:
    assert list(HAND_EXPECTED) == list(FEATURE_DTYPES)


def test_hand_built_round_online() -> None:
    feats = first_level_features(_hand_round_online())
    for name, want in HAND_EXPECTED.items():
        assert feats[name].dtype == FEATURE_DTYPES[name], name
        _assert_matches(name, feats[name], want)


def test_hand_built_round_from_trace() -> None:
    table = candidate_table(_hand_trace()).to_pylist()
    hand = [row for row in table if row["round_index"] == 2]
    assert [row["cand_index"] for row in hand] == [0, 1, 2]
    assert [row["token"] for row in hand] == [5, 7, 9]
    for name, want in HAND_EXPECTED.items():
        _assert_matches(name, [row[name] for row in hand], want)
    _assert_matches(
        "label_target_prob", [row["label_target_prob"] for row in hand], [0.2, 0.6, 0.1]
    )
    assert [row["label_is_argmax"] for row in hand] == [False, True, False]
    # round 0 has no previous round: missing, not 0
    assert all(row["prev_accepted"] is None for row in table if row["round_index"] == 0)


# -- no look-ahead -----------------------------------------------------------------------------

# Every trace column the drafter cannot know before this round's verification.
OUTCOME_COLUMNS = [
    "cand_target_prob",
    "cand_scored",
    "cand_in_tree",
    "cand_target_argmax",
    "root_argmax",
    "root_entropy",
    "root_top1_prob",
    "accepted_path",
    "continuation_token",
    "covered",
    "cache_tv",
    "cache_argmax_agree",
    "same_tv",
    "same_argmax_agree",
    "prev_tv",
    "prev_argmax_agree",
    "matched_tv",
    "matched_argmax_agree",
    "token_only_tv",
    "token_only_argmax_agree",
    "time_draft_ms",
    "time_select_ms",
    "time_verify_ms",
    "time_bookkeeping_ms",
]


def test_round_arrays_hold_no_outcome() -> None:
    """Structural half of the guarantee: the feature input has no verification outcome."""
    fields = set(RoundArrays.__dataclass_fields__)
    assert not fields & set(OUTCOME_COLUMNS)
    assert "cand_target_prob" not in fields and "root_argmax" not in fields


def _perturbed(trace: pa.Table, row: int, seed: int) -> pa.Table:
    """Redraw the outcome of round `row` and everything about the later rounds of its prompt."""
    rng = np.random.default_rng(seed)
    rows = trace.to_pylist()
    victim = rows[row]
    n = len(victim["cand_token"])
    flip = lambda: bool(rng.random() < 0.5)  # noqa: E731
    victim.update(
        cand_target_prob=[float(x) for x in rng.uniform(0, 1, n)],
        cand_scored=[flip() for _ in range(n)],
        cand_in_tree=[flip() for _ in range(n)],
        cand_target_argmax=[int(x) for x in rng.integers(-1, 12, n)],
        root_argmax=(victim["root_argmax"] + 1 + int(rng.integers(0, 5))) % 12,
        root_entropy=float(rng.uniform(0, 3)),
        root_top1_prob=float(rng.uniform(0, 1)),
        accepted_path=list(range(int(rng.integers(0, 4)))),
        continuation_token=int(rng.integers(0, 12)),
        covered=not victim["covered"],
        token_only_tv=[0.3, 0.9],
        token_only_argmax_agree=[True, False],
    )
    for col in OUTCOME_COLUMNS:
        if col.endswith("_tv") and col != "token_only_tv":
            victim[col] = float(rng.uniform(0, 1))
        elif col.endswith("_agree") and col != "token_only_argmax_agree":
            victim[col] = flip()
        elif col.startswith("time_"):
            victim[col] = float(rng.uniform(0, 9))
    for i, other in enumerate(rows):
        if (
            other["prompt_id"] == victim["prompt_id"]
            and other["round_index"] > victim["round_index"]
        ):
            sizes = [int(rng.integers(1, 6)), int(rng.integers(1, 9))]
            rows[i] = random_round(
                rng, other["prompt_id"], other["round_index"], sizes, other["tokens_before"] + 5
            )
    return pa.Table.from_pylist(rows, schema=TRACE_SCHEMA)


def _same(a: pa.ChunkedArray, b: pa.ChunkedArray) -> bool:
    return a.to_pylist() == b.to_pylist()  # None == None; no NaN in the stored table


@settings(max_examples=25, deadline=None)
@given(trace_seed=st.integers(0, 10_000), pick=st.integers(0, 10_000), seed=st.integers(0, 10_000))
def test_no_look_ahead(trace_seed: int, pick: int, seed: int) -> None:
    trace = random_trace(trace_seed, n_prompts=2, n_rounds=4)
    row = pick % trace.num_rows
    changed = _perturbed(trace, row, seed)
    before, after = candidate_table(trace), candidate_table(changed)
    prompt, r = trace["prompt_id"][row].as_py(), trace["round_index"][row].as_py()

    def untouched(table: pa.Table) -> np.ndarray:  # rounds at or before the perturbed one
        pid = np.array(table["prompt_id"].to_pylist())
        return (pid != prompt) | (table["round_index"].to_numpy() <= r)

    keep_b, keep_a = untouched(before), untouched(after)
    assert keep_b.sum() == keep_a.sum()
    b, a = before.filter(pa.array(keep_b)), after.filter(pa.array(keep_a))
    for name in FEATURE_DTYPES:
        assert _same(b[name], a[name]), f"feature {name} changed when only outcomes/the future did"
    victim = lambda t: t.filter(  # noqa: E731
        pa.array(
            (np.array(t["prompt_id"].to_pylist()) == prompt) & (t["round_index"].to_numpy() == r)
        )
    )
    assert not _same(victim(before)["label_target_prob"], victim(after)["label_target_prob"])


# -- missing rows ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_missing_rows_are_null_never_zero(seed: int) -> None:
    trace = random_trace(seed, n_prompts=3, n_rounds=5)
    table = candidate_table(trace)
    n1 = [sum(d == 1 for d in depths) for depths in trace["cand_depth"].to_pylist()]
    pairs = (
        ("fl_cache_logprob", "cache"),
        ("fl_same_logprob", "same"),
        ("fl_matched_logprob", "matched"),
    )
    for row_name, feat in pairs:
        given = [v for lst, k in zip(trace[row_name].to_pylist(), n1, strict=True) for v in lst[:k]]
        got = table[f"{feat}_logprob"].to_pylist()
        order = _trace_order(trace, table)
        assert [got[i] is None for i in order] == [v is None for v in given]
        gap = table[f"{feat}_gap"].to_pylist()
        assert [g is None for g in gap] == [v is None for v in got]
    cache_absent = [v is None for v in table["cache_age"].to_pylist()]
    logp = table["cache_logprob"].to_pylist()
    assert all(logp[i] is None for i, absent in enumerate(cache_absent) if absent)


def _trace_order(trace: pa.Table, table: pa.Table) -> list[int]:
    """Indices into `table` in the order of the trace's rounds' first-level candidates."""
    key = {
        (p, r, c): i
        for i, (p, r, c) in enumerate(
            zip(
                *(table[k].to_pylist() for k in ("prompt_id", "round_index", "cand_index")),
                strict=True,
            )
        )
    }
    out = []
    for p, r, depths in zip(
        *(trace[k].to_pylist() for k in ("prompt_id", "round_index", "cand_depth")), strict=True
    ):
        out += [key[(p, r, c)] for c in range(sum(d == 1 for d in depths))]
    return out


@pytest.mark.parametrize("seed", range(5))
def test_preceding_row_never_has_the_root_token(seed: int) -> None:
    rows = random_trace(seed, n_prompts=2, n_rounds=6).to_pylist()
    for row in rows:  # a sloppy producer: the preceding row's entry present everywhere
        row["fl_prev_logprob"] = [-1.0] * len(row["fl_prev_logprob"])
        row["cand_token"][0] = row["root_token"]  # and candidate 0 always repeats the root
    table = candidate_table(pa.Table.from_pylist(rows, schema=TRACE_SCHEMA))
    repeats = table["repeats_root"].to_pylist()
    prev = table["prev_logprob"].to_pylist()
    assert any(repeats) and not all(repeats)
    assert all((p is None) == r for p, r in zip(prev, repeats, strict=True))
    gaps = table["prev_gap"].to_pylist()
    assert all((g is None) == r for g, r in zip(gaps, repeats, strict=True))


# -- online (one round) = offline (a batch) --------------------------------------------------


def test_bad_pool_order_is_refused() -> None:
    rounds = _hand_round_online()
    depth = rounds.cand_depth.copy()
    depth[0, [2, 3]] = depth[0, [3, 2]]  # a depth-2 node before a depth-1 node
    with pytest.raises(ValueError, match="not the first entries of its pool"):
        first_level_features(RoundArrays(**{**rounds.__dict__, "cand_depth": depth}))
    parent = rounds.cand_parent.copy()
    parent[0, 6] = 2  # depth-3 node under a depth-1 node
    with pytest.raises(ValueError, match="expected an earlier candidate at depth 2"):
        first_level_features(RoundArrays(**{**rounds.__dict__, "cand_parent": parent}))

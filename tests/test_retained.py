"""Retained rows (SPEC §5): hand-built cases for every rule, then agreement with direct rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decode.stream import DecodeSettings
from pairs.prompts import encode_prompt
from tests.recording import decode_recorded
from tests.tiny_models import one_thread, tiny_pair
from tree import retained as R
from tree.config import DecodeConfig, PoolConfig, SelectConfig

# A hand-built round, pool order:
#   idx    0   1   2   3   4   5   6   7
#   token  7   4   9   4   5   4   7   4
#   parent -1  -1  -1  0   0   1   3   3
#   rank   0   1   5   2   3   4   6   7
#   tree   T   T   .   T   T   T   T   .
#   scored T   T   .   T   T   T   T   T      -> batch rows 1, 2, -, 3, 4, 5, 6, 7
TOKEN = np.array([7, 4, 9, 4, 5, 4, 7, 4])
PARENT = np.array([-1, -1, -1, 0, 0, 1, 3, 3])
RANK = np.array([0, 1, 5, 2, 3, 4, 6, 7])
IN_TREE = np.array([1, 1, 0, 1, 1, 1, 1, 0], dtype=bool)
BATCH_ROW = np.array([1, 2, -1, 3, 4, 5, 6, 7])


def _round(root: int, accepted: list[int], cont: int) -> R.RoundRows:
    return R.RoundRows(root, TOKEN, PARENT, RANK, IN_TREE, BATCH_ROW, accepted, cont)


def test_covered_round_with_a_repeated_continuation_token():
    """Accept 7 -> 4, continue with 4: the emitted address (node 7) was scored."""
    r = _round(root=7, accepted=[0, 3], cont=4)
    assert R.emitted_node(r) == 7
    keep, prev = R.retained_batch_rows(r)
    rows = lambda i: None if i is None else keep[i]  # noqa: E731
    assert rows(prev.matched) == 7  # the row at the emitted address
    assert rows(prev.same) == 2  # highest-ranked verified prefix ending in 4: node 1 (rank 1)
    assert rows(prev.preceding) == 3  # the last accepted node, 3
    assert [keep[i] for i in prev.token_only] == [
        2,
        3,
        5,
    ]  # scored, ends in 4, pool order, not node 7
    assert prev.tree_root_count == 3 and prev.continuation == 4


def test_root_row_is_same_token_row_and_joins_token_only_rows():
    r = _round(root=4, accepted=[0, 3], cont=4)
    keep, prev = R.retained_batch_rows(r)
    assert keep[prev.same] == 0
    assert [keep[i] for i in prev.token_only] == [0, 2, 3, 5]  # root first, not counted in the 24


def test_uncovered_round_with_nothing_accepted():
    """Continuation 9 at the root: node 2 holds the address but was not scored."""
    r = _round(root=7, accepted=[], cont=9)
    assert R.emitted_node(r) == 2
    keep, prev = R.retained_batch_rows(r)
    assert prev.matched is None and prev.same is None and prev.token_only == []
    assert keep[prev.preceding] == 0  # the root's row: nothing was accepted
    assert prev.tree_root_count == 0


def test_token_only_rows_are_capped_at_24_in_pool_order():
    n = 40
    r = R.RoundRows(
        root_token=3,
        token=np.full(n, 5),
        parent=np.full(n, -1),
        rank=np.arange(n),
        in_tree=np.zeros(n, dtype=bool),
        batch_row=np.arange(1, n + 1),
        accepted=[],
        continuation=5,
    )
    keep, prev = R.retained_batch_rows(r)
    assert R.emitted_node(r) == 0 and keep[prev.matched] == 1
    assert [keep[i] for i in prev.token_only] == list(range(2, 26))


def test_cache_writes_keep_the_highest_ranked_prefix_and_the_root_last():
    tokens, rows = R.cache_writes(_round(root=7, accepted=[0, 3], cont=4))
    got = dict(zip(tokens.tolist(), rows.tolist(), strict=True))
    # 7: the root's row beats node 0 (stored after); 4: node 1 (rank 1) beats 3 and 5; 5: node 4.
    assert got == {7: 0, 4: 2, 5: 4}


def test_prompt_rows_come_from_each_token_latest_occurrence():
    tokens, pos = R.prompt_cache_rows([3, 5, 3, 8, 5])
    assert dict(zip(tokens.tolist(), pos.tolist(), strict=True)) == {3: 2, 5: 4, 8: 3}


def test_token_keyed_cache_overwrites_grows_and_refuses_duplicates():
    cache = R.TokenKeyedCache(vocab=10, device=torch.device("cpu"), dtype=torch.bfloat16)
    cache.store(np.array([3, 5]), torch.ones(2, 10), round_index=-1)
    cache.store(np.array([5, 7, 1]), torch.full((3, 10), 2.0), round_index=4)
    row, stored = cache.lookup(5)
    assert stored == 4 and row.dtype == torch.bfloat16 and bool((row == 2).all())
    assert cache.lookup(3)[1] == -1 and cache.lookup(0) is None
    assert cache.n_used == 4 and cache.bank.shape[0] >= 4
    with pytest.raises(ValueError, match="tokens must be distinct"):
        cache.store(np.array([2, 2]), torch.zeros(2, 10), 5)


def test_retained_stats_and_trace_fields_by_hand():
    v = 6
    root_logits = torch.tensor([2.0, 1.0, 0.0, 0.0, -1.0, 0.5])
    cache_row = torch.tensor([0.0, 2.0, 0.0, 0.0, 0.0, 0.0])
    prev_rows = torch.stack([torch.tensor([1.0, 0.0, 3.0, 0.0, 0.0, 0.0]), root_logits])
    cache = R.TokenKeyedCache(v, torch.device("cpu"), torch.float32)
    cache.store(np.array([2]), cache_row[None], round_index=3)
    # Root token 2 (= previous continuation). Rows kept: 0 = preceding, 1 = matched.
    prev = R.PrevRows(
        prev_rows,
        continuation=2,
        same=None,
        preceding=0,
        matched=1,
        token_only=[0],
        tree_root_count=1,
    )
    first_level = torch.tensor([2, 0, 5])
    stats = R.retained_stats(
        cache, prev, 2, root_logits, first_level, law_temperature=1.0, round_index=5
    )
    f = R.trace_fields(stats, first_level.tolist(), root_token=2)

    p_root = torch.softmax(root_logits, -1)
    p_cache = torch.softmax(cache_row, -1)
    p_prev = torch.softmax(prev_rows[0], -1)
    p_prev[2] = 0.0  # the continuation's probability is set to zero, not renormalised
    assert f["cache_tv"] == pytest.approx(0.5 * float((p_cache - p_root).abs().sum()), abs=1e-6)
    assert f["cache_argmax_agree"] is False and f["cache_age"] == 2
    assert f["fl_cache_logprob"] == pytest.approx(
        torch.log(p_cache[first_level]).tolist(), abs=1e-6
    )
    assert f["prev_tv"] == pytest.approx(0.5 * float((p_prev - p_root).abs().sum()), abs=1e-6)
    assert f["prev_argmax_agree"] is True  # argmax 2 is zeroed; the next one is 0 = root's argmax
    assert f["fl_prev_logprob"][0] is None  # the continuation's entry is missing, not -inf
    assert f["fl_prev_logprob"][1:] == pytest.approx(torch.log(p_prev[[0, 5]]).tolist(), abs=1e-6)
    assert f["matched_tv"] == pytest.approx(0.0, abs=1e-6) and f["matched_argmax_agree"] is True
    assert f["same_tv"] is None and f["fl_same_logprob"] == [None, None, None]
    assert f["token_only_tv"] == pytest.approx([f["prev_tv"]]) and f["prev_tree_root_count"] == 1


def test_first_round_has_only_the_prompt_cache_row():
    f = R.trace_fields(None, [1, 2], root_token=3)
    assert (
        f["cache_tv"] is None and f["fl_prev_logprob"] == [None, None] and f["token_only_tv"] == []
    )


# -- the decoder's recorded rows against rows computed directly ----------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    pair = tiny_pair(tmp_path_factory.mktemp("qwen3"), "qwen3")
    prompt = encode_prompt(pair.tokenizer, "aaaa bbbb aaaa bbbb")
    s = DecodeSettings(
        pool=PoolConfig(top_k=6, expand_steps=4, expand=6),
        select=SelectConfig(budget=20, record_top_m=40),
        decode=DecodeConfig(temperature=1.0, max_new_tokens=40),
    )
    with one_thread():
        res = decode_recorded(
            pair.target, pair.drafter, prompt, s, pair.eos_ids, "r", "t", record=True
        )
    return pair, prompt, res


def _row(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        row = model(input_ids=torch.tensor([tokens])).logits[0, -1].float()
    return torch.softmax(row, -1).clone()  # a normal tensor (editable outside inference mode)


def test_recorded_retained_rows_match_direct_rows(recorded):
    pair, prompt, res = recorded
    rounds = res.rounds
    assert (
        rounds[0]["same_tv"] is None
        and rounds[0]["prev_tv"] is None
        and rounds[0]["matched_tv"] is None
    )
    assert rounds[0]["prev_tree_root_count"] is None
    root0 = rounds[0]["root_token"]
    assert (rounds[0]["cache_tv"] is not None) == (root0 in prompt[:-1])
    assert rounds[0]["cache_age"] == (1 if root0 in prompt[:-1] else None)

    tokens = list(prompt)
    covered_seen = same_seen = 0
    for t in range(1, len(rounds)):
        a, b = rounds[t - 1], rounds[t]
        before = list(tokens)  # context of round t - 1, ending in its root
        tokens += [a["cand_token"][i] for i in a["accepted_path"]] + [a["continuation_token"]]
        assert b["root_token"] == a["continuation_token"] == tokens[-1]
        p_root = _row(pair.target, tokens)
        # Preceding row: at the last accepted node of the previous round, continuation zeroed.
        p_prev = _row(pair.target, tokens[:-1])
        p_prev[b["root_token"]] = 0.0
        assert b["prev_tv"] == pytest.approx(0.5 * float((p_prev - p_root).abs().sum()), abs=1e-4)
        fl = b["cand_token"][: b["cand_depth"].count(1)]
        assert [x is None for x in b["fl_prev_logprob"]] == [tok == b["root_token"] for tok in fl]
        # Matched row: present exactly when the previous round was covered, and equal to the root row.
        assert (b["matched_tv"] is not None) == a["covered"]
        if a["covered"]:
            covered_seen += 1
            assert b["matched_tv"] < 1e-4 and b["matched_argmax_agree"]
        # Same-token row and tree count.
        ends = [
            i
            for i, tok in enumerate(a["cand_token"])
            if a["cand_in_tree"][i] and tok == b["root_token"]
        ]
        assert b["prev_tree_root_count"] == len(ends)
        assert (b["same_tv"] is not None) == (a["root_token"] == b["root_token"] or bool(ends))
        if b["same_tv"] is not None:
            same_seen += 1
            if a["root_token"] == b["root_token"]:
                p_same = _row(pair.target, before)
            else:  # highest-ranked verified prefix ending in the continuation (draft rank = score)
                best = max(ends, key=lambda i: (_score(a, i), -a["cand_depth"][i], -i))
                p_same = _row(pair.target, before + _path_tokens(a, best))
            assert b["same_tv"] == pytest.approx(
                0.5 * float((p_same - p_root).abs().sum()), abs=1e-4
            )
        # A cache row stored by the previous round is one round old.
        if a["root_token"] == b["root_token"] or ends:
            assert b["cache_age"] == 1
        assert len(b["token_only_tv"]) <= 25
    assert covered_seen > 0 and same_seen > 0  # both hand-offs were exercised


def _path_tokens(r: dict, i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(r["cand_token"][i])
        i = r["cand_parent"][i]
    return path[::-1]


def _score(r: dict, i: int) -> float:
    total = 0.0
    while i >= 0:
        total += r["cand_draft_logprob"][i]
        i = r["cand_parent"][i]
    return total


def test_recorded_matched_row_is_the_next_root_row_where_covered(recorded):
    """fl_matched_logprob: missing exactly after an uncovered round; else the root row's first level.

    The root row's first-level probabilities are `cand_target_prob[:n1]` of the same round
    (the law temperature is 1 here); batch rounding of the two passes allows 1e-4 in log space.
    The row shapes and token-only aggregates are checked against rows computed directly.
    """
    pair, prompt, res = recorded
    rounds = res.rounds
    assert all(x is None for x in rounds[0]["fl_matched_logprob"])
    assert rounds[0]["token_only_argmax"] == [] and rounds[0]["matched_argmax"] is None
    tokens, seen = list(prompt), 0
    for t in range(1, len(rounds)):
        a, b = rounds[t - 1], rounds[t]
        tokens += [a["cand_token"][i] for i in a["accepted_path"]] + [a["continuation_token"]]
        n1 = b["cand_depth"].count(1)
        fl = b["fl_matched_logprob"]
        assert len(fl) == n1
        assert all((x is None) == (not a["covered"]) for x in fl)
        assert (b["matched_entropy"] is None) == (not a["covered"])
        if a["covered"]:
            seen += 1
            root_first = np.log(np.asarray(b["cand_target_prob"][:n1], dtype=np.float64))
            np.testing.assert_allclose(fl, root_first, atol=1e-4)
            p_root = _row(pair.target, tokens)
            assert b["matched_argmax"] == int(p_root.argmax())
            assert b["matched_top1_prob"] == pytest.approx(float(p_root.max()), abs=1e-4)
            ent = float(-(p_root * torch.log(p_root.clamp_min(1e-30))).sum())
            assert b["matched_entropy"] == pytest.approx(ent, abs=1e-3)
        # preceding row's shape: the row at the last accepted node, continuation zeroed
        p_prev = _row(pair.target, tokens[:-1])
        p_prev[b["root_token"]] = 0.0
        assert b["prev_argmax"] == int(p_prev.argmax())
        assert b["prev_top1_prob"] == pytest.approx(float(p_prev.max()), abs=1e-4)
        # token-only aggregates: null exactly without token-only rows, mean <= max
        k = len(b["token_only_tv"])
        assert len(b["token_only_argmax"]) == k
        mean, top = b["fl_token_only_mean_logprob"], b["fl_token_only_max_logprob"]
        assert all((x is None) == (k == 0) for x in mean + top)
        if k:
            assert all(m <= x + 1e-6 for m, x in zip(mean, top, strict=True))
    assert seen > 0

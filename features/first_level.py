"""First-level candidate features and labels (SPEC §7): the functions shared online and offline.

`first_level_features(rounds)` turns R rounds' pre-verification arrays into
one value per first-level candidate, flattened in (round, pool index) order:
N = sum of n1 over the rounds. The offline extractor calls it on a trace
shard; the online decoder calls it on the round in hand (R = 1, N = n1), so
the two cannot drift. Missing values are NaN (never 0); the candidate table
stores them as nulls.

Draft distribution at the root: the pool holds only the drafter's top n1
first tokens, so `root_draft_entropy` is the entropy of those n1 draft
probabilities renormalised to sum to 1, and `root_draft_top1` is the largest
draft probability itself (the drafter's exact top-1 mass).
"""

from __future__ import annotations

import numpy as np

from features.rounds import RoundArrays
from features.subtree import STATS, pool_subtree_stats

# name -> numpy dtype of every feature `first_level_features` returns (the order is the table's).
FEATURE_DTYPES: dict[str, type] = {
    # the candidate's draft probability among its siblings
    "draft_logprob": np.float32,  # log q(x1)
    "draft_prob": np.float32,  # q(x1)
    "draft_rank": np.int32,  # 0 = the drafter's top first token (ties: pool index)
    "draft_prob_share": np.float32,  # q(x1) / sum of q over the first level
    "top_sibling_prob": np.float32,  # largest q among the other first-level candidates; NaN if none
    "margin_top_sibling": np.float32,  # log q(x1) - log top_sibling_prob; NaN if no sibling
    "gap_above": np.float32,  # log q of the next-higher-ranked sibling - log q(x1); NaN at rank 0
    "gap_below": np.float32,  # log q(x1) - log q of the next-lower-ranked sibling; NaN at the last
    "sibling_mass": np.float32,  # sum of q over the other first-level candidates
    # the draft distribution at the root (round-level)
    "n_first_level": np.int32,
    "fl_draft_mass": np.float32,  # sum of q over the first level
    "root_draft_entropy": np.float32,  # nats, over the renormalised first-level q
    "root_draft_top1": np.float32,  # max q
    # the pool subtree below the candidate
    "expanded": np.bool_,
    **STATS,
    # context
    "prompt_length": np.int32,
    "round_index": np.int32,
    "tokens_before": np.int32,
    "prev_accepted": np.float32,  # NaN at round 0 (integer-valued)
    "repeats_root": np.bool_,  # token == root token
    # retained rows (the "Rows" reranker): log p under the row, minus the row's best first-level log p
    "cache_logprob": np.float32,
    "cache_gap": np.float32,
    "same_logprob": np.float32,
    "same_gap": np.float32,
    "prev_logprob": np.float32,  # NaN for the candidate repeating the root token, always
    "prev_gap": np.float32,
    "cache_age": np.float32,  # NaN without a cache row (integer-valued)
    "prev_tree_root_count": np.float32,  # NaN where the trace has none (integer-valued)
}

LABEL_DTYPES: dict[str, type] = {
    "label_target_prob": np.float32,  # p(x1 | c) at T (the unit-temperature softmax at T = 0)
    "label_is_argmax": np.bool_,  # x1 is the root row's argmax (the greedy label)
}


def first_level_index(n_first_level: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(round_of, cand_index), both [N]: the round and pool index of each output value."""
    n1 = np.asarray(n_first_level, dtype=np.int64)  # [R]
    round_of = np.repeat(np.arange(n1.size), n1)  # [N]
    starts = np.cumsum(n1) - n1  # [R] first output position of each round
    cand_index = np.arange(round_of.size) - starts[round_of]  # [N]
    return round_of, cand_index


def first_level_features(rounds: RoundArrays) -> dict[str, np.ndarray]:
    """Every SPEC §7 feature of every first-level candidate: name -> [N] array (FEATURE_DTYPES)."""
    rounds.check()
    n1 = rounds.n_first_level()  # [R]
    width = int(n1.max(initial=0))
    valid = np.arange(width)[None, :] < n1[:, None]  # [R, W]
    round_of, cand_index = first_level_index(n1)
    flat = round_of * width + cand_index  # [N] positions in the [R, W] grid

    token = rounds.cand_token[:, :width]  # [R, W]
    grid: dict[str, np.ndarray] = {}
    grid |= _draft_features(rounds.cand_draft_logprob[:, :width], valid, n1)
    grid |= pool_subtree_stats(rounds, width)
    grid["expanded"] = rounds.cand_expanded[:, :width]
    grid["repeats_root"] = token == rounds.root_token[:, None]
    grid |= _row_features("cache", rounds.fl_cache_logprob, valid)
    grid |= _row_features("same", rounds.fl_same_logprob, valid)
    # The preceding row's continuation entry was zeroed before use (SPEC §5): the
    # continuation is this round's root token, so that candidate's entry is missing.
    prev = np.where(token == rounds.root_token[:, None], np.nan, rounds.fl_prev_logprob)
    grid |= _row_features("prev", prev.astype(np.float32), valid)
    per_round = {
        "prompt_length": rounds.prompt_length,
        "round_index": rounds.round_index,
        "tokens_before": rounds.tokens_before,
        "prev_accepted": rounds.prev_accepted,
        "cache_age": rounds.cache_age,
        "prev_tree_root_count": rounds.prev_tree_root_count,
    }
    out = {}
    for name, dtype in FEATURE_DTYPES.items():
        value = np.take(grid[name], flat) if name in grid else per_round[name][round_of]
        out[name] = value.astype(dtype, copy=False)
    return out


def first_level_labels(
    cand_token: np.ndarray,
    cand_target_prob: np.ndarray,
    root_argmax: np.ndarray,
    n_first_level: np.ndarray,
) -> dict[str, np.ndarray]:
    """Labels of the first-level candidates, [N] in the order of `first_level_features`.

    cand_token, cand_target_prob: [R, >= max n1] in pool order; root_argmax, n_first_level: [R].
    These come from verification and must never feed a feature.
    """
    round_of, cand_index = first_level_index(n_first_level)
    token = cand_token[round_of, cand_index]
    return {
        "label_target_prob": cand_target_prob[round_of, cand_index].astype(np.float32),
        "label_is_argmax": token == np.asarray(root_argmax)[round_of],
    }


def _draft_features(
    logprob: np.ndarray, valid: np.ndarray, n1: np.ndarray
) -> dict[str, np.ndarray]:
    """Sibling and root-distribution features from the first-level draft log-probs [R, W]."""
    R, width = valid.shape
    lp = np.where(valid, logprob.astype(np.float64), -np.inf)  # [R, W]; padding ranks last
    q = np.exp(lp)  # [R, W], 0 on padding
    mass = q.sum(axis=1)  # [R]
    qn = np.divide(q, mass[:, None], out=np.zeros_like(q), where=mass[:, None] > 0)
    plogp = np.multiply(
        qn, np.log(qn, out=np.zeros_like(qn), where=qn > 0), where=qn > 0, out=np.zeros_like(qn)
    )
    entropy = 0.0 - plogp.sum(axis=1)  # [R]; 0.0 - x, not -x: a point mass gives +0.0

    # rank among siblings: draft log-prob descending, ties by pool index (stable sort)
    order = np.argsort(-lp, axis=1, kind="stable")  # [R, W]
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(width), (R, width)), axis=1)
    srt = np.take_along_axis(lp, order, axis=1)  # [R, W] descending, padding (-inf) last
    has_sibling = (n1 >= 2)[:, None]  # [R, 1]
    second = srt[:, 1:2] if width > 1 else np.full((R, 1), -np.inf)
    top_sibling = np.where(rank == 0, second, srt[:, :1])  # [R, W] best other log q
    above = np.take_along_axis(srt, np.maximum(rank - 1, 0), axis=1)
    below = np.take_along_axis(srt, np.minimum(rank + 1, width - 1), axis=1)
    nan = np.nan
    with np.errstate(invalid="ignore"):  # padding entries (-inf - -inf) are dropped later
        return {
            "draft_logprob": lp,
            "draft_prob": q,
            "draft_rank": rank,
            "draft_prob_share": np.divide(
                q, mass[:, None], out=np.full_like(q, nan), where=mass[:, None] > 0
            ),
            "top_sibling_prob": np.where(has_sibling, np.exp(top_sibling), nan),
            "margin_top_sibling": np.where(has_sibling, lp - top_sibling, nan),
            "gap_above": np.where(rank > 0, above - lp, nan),
            "gap_below": np.where(rank < n1[:, None] - 1, lp - below, nan),
            "sibling_mass": mass[:, None] - q,
            "n_first_level": np.broadcast_to(n1[:, None], (R, width)),
            "fl_draft_mass": np.broadcast_to(mass[:, None], (R, width)),
            "root_draft_entropy": np.broadcast_to(entropy[:, None], (R, width)),
            "root_draft_top1": np.broadcast_to(q.max(axis=1, initial=0.0)[:, None], (R, width)),
        }


def _row_features(name: str, logprob: np.ndarray, valid: np.ndarray) -> dict[str, np.ndarray]:
    """A retained row's log-prob of each candidate and its gap to the row's best first-level one.

    logprob: [R, W] float32, NaN where the row is absent. fmax ignores NaN, so
    the best is taken over the candidates the row has; an absent row stays NaN.
    """
    lp = np.where(valid, logprob, np.nan)  # [R, W]
    best = np.fmax.reduce(lp, axis=1, initial=-np.inf)  # [R]; -inf when the whole row is absent
    best = np.where(np.isneginf(best), np.nan, best)
    return {f"{name}_logprob": lp, f"{name}_gap": lp - best[:, None]}

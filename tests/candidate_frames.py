"""Small synthetic candidate tables (schema v2) with a known signal, for reranker tests.

Per round, 10 first-level candidates with tokens from a Zipf-like vocabulary.
Target logit = token effect + round noise; draft logit = target logit + draft
noise. So the draft probability, the token prior and the retained-row features
(noisy target log probabilities, sometimes missing) all carry signal, and the
labels (target probability, argmax flag) are exact functions of the logits.
The frame goes through `CANDIDATE_SPEC.conform`, so its dtypes are those a
reader of the real table gets.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from features.schema import CANDIDATE_SPEC
from rerank.fit.boosting import Capacity

TASKS = ("coding", "math", "writing")
# Small boosting capacity for quick tests (the paper's is `Capacity()`).
FAST = Capacity(n_iter=60, learning_rate=0.1, max_leaves=15)


def _softmax_with_rest(logits: np.ndarray, rest: float) -> np.ndarray:
    """Probabilities of the candidates when the rest of the vocabulary has logit `rest`."""
    m = np.maximum(logits.max(axis=1, keepdims=True), rest)
    e = np.exp(logits - m)
    return e / (e.sum(axis=1, keepdims=True) + np.exp(rest - m))


def make_candidate_frame(
    n_prompts: int = 40,
    rounds: int = 8,
    n_cands: int = 10,
    temperature: float = 1.0,
    vocab: int = 400,
    seed: int = 0,
    draft_noise: float = 1.0,
    prompt_prefix: str = "synth-",
) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    n_rounds = n_prompts * rounds
    token_effect = rng.normal(0.0, 1.0, vocab)
    zipf = 1.0 / np.arange(1, vocab + 1)
    zipf /= zipf.sum()
    tokens = np.stack([rng.choice(vocab, n_cands, replace=False, p=zipf) for _ in range(n_rounds)])
    s = token_effect[tokens] + rng.normal(0.0, 1.0, tokens.shape)
    p = _softmax_with_rest(s, rest=1.0)
    d = s + rng.normal(0.0, draft_noise, tokens.shape)
    q_all = _softmax_with_rest(d, rest=0.5)
    order = np.argsort(-q_all, axis=1, kind="stable")  # pool index = draft rank
    take = np.take_along_axis
    tokens, p, q = take(tokens, order, 1), take(p, order, 1), take(q_all, order, 1)
    is_argmax = (p == p.max(axis=1, keepdims=True)) & (p.max(axis=1, keepdims=True) > 0.08)

    prompt = np.repeat(np.arange(n_prompts), rounds)
    round_index = np.tile(np.arange(rounds), n_prompts)
    prompt_len = rng.integers(20, 400, n_prompts)[prompt]
    prev_acc = rng.integers(0, 6, n_rounds).astype(float)
    prev_acc[round_index == 0] = np.nan
    root_token = np.where(rng.random(n_rounds) < 0.3, tokens[:, 0], -1)

    def per_cand(x: np.ndarray) -> np.ndarray:
        return np.repeat(x, n_cands)

    logq = np.log(q)
    top = q[:, :1]
    sib_top = np.where(np.arange(n_cands) == 0, q[:, 1:2], top)
    gap_above = np.full_like(logq, np.nan)
    gap_above[:, 1:] = logq[:, :-1] - logq[:, 1:]
    gap_below = np.full_like(logq, np.nan)
    gap_below[:, :-1] = logq[:, :-1] - logq[:, 1:]
    fl_mass = q.sum(axis=1, keepdims=True)
    qn = q / fl_mass
    entropy = -(qn * np.log(qn)).sum(axis=1)
    sub_size = rng.integers(0, 80, tokens.shape)
    sub_mass = q * rng.uniform(0.1, 0.9, tokens.shape)

    def row_feature(avail_rate: float, noise: float) -> tuple[np.ndarray, np.ndarray]:
        lp = np.log(p) + rng.normal(0.0, noise, tokens.shape)
        lp = np.where(rng.random((n_rounds, 1)) < avail_rate, lp, np.nan)
        with np.errstate(invalid="ignore"):
            gap = lp - np.nanmax(np.where(np.isnan(lp), -np.inf, lp), axis=1, keepdims=True)
        return lp, gap

    cache_lp, cache_gap = row_feature(0.7, 0.3)
    same_lp, same_gap = row_feature(0.4, 0.5)
    prev_lp, prev_gap = row_feature(0.6, 0.8)
    repeats = tokens == root_token[:, None]
    prev_lp[repeats] = np.nan
    prev_gap[repeats] = np.nan
    cache_age = np.where(np.isnan(cache_lp[:, 0]), np.nan, rng.integers(1, 30, n_rounds))
    root_count = np.where(rng.random(n_rounds) < 0.8, rng.integers(0, 5, n_rounds), np.nan)
    n = n_rounds * n_cands
    # schema v2's row features: ranks under each row, row shapes, the matched and token-only rows
    extra = {}
    for kind, lp in (("cache", cache_lp), ("same", same_lp), ("prev", prev_lp)):
        absent = np.isnan(lp[:, 0])
        order = np.argsort(-np.nan_to_num(lp, nan=-np.inf), axis=1, kind="stable")
        rank = np.empty_like(lp)
        np.put_along_axis(
            rank, order, np.broadcast_to(np.arange(n_cands, dtype=float), lp.shape), 1
        )
        extra[f"{kind}_rank"] = np.where(np.isnan(lp), np.nan, rank)
        extra[f"{kind}_entropy"] = np.where(absent, np.nan, rng.uniform(0, 3, n_rounds))[:, None]
        extra[f"{kind}_top1"] = np.where(absent, np.nan, rng.uniform(0.1, 1, n_rounds))[:, None]
        extra[f"{kind}_top_is_draft_top"] = np.where(absent, np.nan, rng.random(n_rounds) < 0.5)[
            :, None
        ]
    matched_lp, matched_gap = row_feature(0.5, 0.05)
    only_lp, _ = row_feature(0.5, 0.4)
    only_count = np.where(np.isnan(only_lp[:, 0]), 0, rng.integers(1, 5, n_rounds))
    extra |= {
        "matched_logprob": matched_lp,
        "matched_gap": matched_gap,
        "matched_rank": np.where(
            np.isnan(matched_lp),
            np.nan,
            np.argsort(np.argsort(-np.nan_to_num(matched_lp, nan=-np.inf), axis=1), axis=1),
        ),
        "matched_entropy": np.where(np.isnan(matched_lp[:, :1]), np.nan, 1.0),
        "matched_top1": np.where(np.isnan(matched_lp[:, :1]), np.nan, 0.5),
        "matched_top_is_draft_top": np.where(np.isnan(matched_lp[:, :1]), np.nan, 1.0),
        "token_only_mean_logprob": only_lp,
        "token_only_max_logprob": only_lp + 0.1,
        "token_only_top_agree": np.where(only_count[:, None] > 0, 0.5, np.nan),
    }

    def flat(x: np.ndarray) -> np.ndarray:
        return np.asarray(x).reshape(-1)

    def nullable(x: np.ndarray) -> pa.Array:
        x = flat(x).astype(float)
        return pa.array(np.where(np.isnan(x), 0.0, x), mask=np.isnan(x))

    cols = {
        "prompt_id": [f"{prompt_prefix}{i:06d}" for i in per_cand(prompt)],
        "task": [TASKS[(i // 2) % len(TASKS)] for i in per_cand(prompt)],
        "temperature": np.full(n, temperature),
        "rule": ["draft"] * n,
        "budget": np.full(n, 8),
        "round_index": per_cand(round_index),
        "cand_index": np.tile(np.arange(n_cands), n_rounds),
        "token": flat(tokens),
        "draft_logprob": flat(logq),
        "draft_prob": flat(q),
        "draft_rank": np.tile(np.arange(n_cands), n_rounds),
        "draft_prob_share": flat(qn),
        "top_sibling_prob": flat(sib_top),
        "margin_top_sibling": flat(logq - np.log(sib_top)),
        "gap_above": nullable(gap_above),
        "gap_below": nullable(gap_below),
        "sibling_mass": flat(fl_mass - q),
        "n_first_level": np.full(n, n_cands),
        "fl_draft_mass": per_cand(fl_mass[:, 0]),
        "root_draft_entropy": per_cand(entropy),
        "root_draft_top1": per_cand(top[:, 0]),
        "expanded": np.ones(n, bool),
        "subtree_size": flat(sub_size),
        "subtree_depth": flat(np.minimum(sub_size, 7) + 1),
        "subtree_best_d2": nullable(np.where(sub_size > 0, logq - 1.0, np.nan)),
        "subtree_best_deepest": nullable(np.where(sub_size > 0, logq - 3.0, np.nan)),
        "subtree_draft_mass": flat(sub_mass),
        "subtree_draft_mass_rel": flat(sub_mass / q),
        "prompt_length": per_cand(prompt_len),
        "tokens_before": per_cand(round_index * 3),
        "prev_accepted": nullable(np.repeat(prev_acc, n_cands)),
        "repeats_root": flat(repeats),
        "cache_logprob": nullable(cache_lp),
        "cache_gap": nullable(cache_gap),
        "same_logprob": nullable(same_lp),
        "same_gap": nullable(same_gap),
        "prev_logprob": nullable(prev_lp),
        "prev_gap": nullable(prev_gap),
        "cache_age": nullable(np.repeat(cache_age, n_cands)),
        "prev_tree_root_count": nullable(np.repeat(root_count, n_cands)),
        **{k: nullable(np.broadcast_to(v, tokens.shape)) for k, v in extra.items()},
        "token_only_count": np.repeat(only_count, n_cands),
        "label_target_prob": flat(p),
        "label_is_argmax": flat(is_argmax),
    }
    table = pa.table({k: v if isinstance(v, pa.Array) else pa.array(v) for k, v in cols.items()})
    return CANDIDATE_SPEC.conform(table).to_pandas()

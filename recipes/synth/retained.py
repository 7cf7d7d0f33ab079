"""Retained-row features of synthetic rounds (docs/method.md#retained-rows, #features), consistent across rounds.

Rounds of a prompt are laid out `[n_prompts, n_rounds]`. Each round's root token
is the previous round's continuation, so every *presence* below follows the
the method's rules from the previous round's pool and outcome:

    cache      stored after any earlier round whose tree (or root) ended in the
               root token (age = rounds since), else from the prompt w.p. p_cache
    same       the previous root or previous tree ended in the root token
    preceding  always (the row that generated the continuation)
    matched    the previous round was covered
    token-only the previous round's other scored prefixes ending in the root
               token (at most 24, pool order), plus the previous root row when
               its token equals the continuation

The retained rows themselves are noisy copies of this round's root row:
r = softmax(log p + sigma * eps), with sigma per kind (SynthConfig). The
preceding row's entry for the continuation (= this root token) is set to 0
before it is compared (no renormalisation, as in the paper), and its first-level
log-prob at that token is always null.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recipes.synth.config import SynthConfig
from recipes.synth.rounds import SynthRounds
from tree.retained import TOKEN_ONLY_MAX


@dataclass
class Retained:
    """Per-round retained-row columns. [R] (flattened prompts x rounds) unless noted."""

    root_token: np.ndarray  # int64
    fl_logprob: dict[str, np.ndarray]  # cache/same/prev/matched -> [R, n1] float32
    fl_valid: dict[str, np.ndarray]  # cache/same/prev/matched -> [R, n1] bool
    cache_age: np.ndarray  # int64
    prev_tree_root_count: np.ndarray  # int64
    has_prev_round: np.ndarray  # bool: validity of prev_tree_root_count
    tv: dict[str, np.ndarray]  # cache/same/prev/matched -> [R] float32
    argmax_agree: dict[str, np.ndarray]  # -> [R] bool
    present: dict[str, np.ndarray]  # cache/same/prev/matched -> [R] bool
    token_only_tv: np.ndarray  # [R, 25] float32
    token_only_agree: np.ndarray  # [R, 25] bool
    token_only_count: np.ndarray  # [R] int64: first entries of the two above that exist
    row_entropy: dict[str, np.ndarray]  # cache/same/prev/matched -> [R] float32 (nats)
    row_top1: dict[str, np.ndarray]  # -> [R] float32, the row's largest probability
    row_argmax: dict[str, np.ndarray]  # -> [R] int64
    token_only_argmax: np.ndarray  # [R, 25] int64 (first token_only_count entries exist)
    fl_token_only_mean: np.ndarray  # [R, n1] float32, mean log-prob over the token-only rows
    fl_token_only_max: np.ndarray  # [R, n1] float32, max log-prob over them (NaN: none)


def _token_counts(token: np.ndarray, mask: np.ndarray, vocab: int) -> np.ndarray:
    """Per round, how many masked pool entries end in each token. [R, V] int64."""
    n_rounds = token.shape[0]
    flat = (np.arange(n_rounds)[:, None] * vocab + token)[mask]
    return np.bincount(flat, minlength=n_rounds * vocab).reshape(n_rounds, vocab)


def _shift(a: np.ndarray, n_prompts: int, fill) -> np.ndarray:
    """Previous round's value within each prompt ([R, ...] flattened); `fill` at round 0."""
    b = a.reshape(n_prompts, -1, *a.shape[1:])
    out = np.empty_like(b)
    out[:, 0] = fill
    out[:, 1:] = b[:, :-1]
    return out.reshape(a.shape)


def _noisy(rng: np.random.Generator, root_logp: np.ndarray, sigma: float, n: int) -> np.ndarray:
    """`n` noisy copies of each root row, as probabilities. [R, n, V] float32."""
    eps = rng.standard_normal((root_logp.shape[0], n, root_logp.shape[1]), dtype=np.float32)
    logits = root_logp[:, None, :] + sigma * eps
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    return p


def _root_tokens(rng: np.random.Generator, rounds: SynthRounds, n_prompts: int) -> np.ndarray:
    """Each round's root token: round r-1's continuation, a random token at round 0. [R]."""
    n_per = rounds.root_logp.shape[0] // n_prompts
    first_root = rng.integers(0, rounds.root_logp.shape[1], size=n_prompts)
    root_token = _shift(rounds.outcome.continuation, n_prompts, 0)
    root_token.reshape(n_prompts, n_per)[:, 0] = first_root
    return root_token


def _cache_presence(
    rng: np.random.Generator,
    tree_counts: np.ndarray,
    root_token: np.ndarray,
    round_idx: np.ndarray,
    n_prompts: int,
    p_cache: float,
) -> tuple[np.ndarray, np.ndarray]:
    """(whether the root token's row is cached, its age in rounds). [R] each."""
    n_rounds_total, vocab = tree_counts.shape
    n_per = n_rounds_total // n_prompts
    rows = np.arange(n_rounds_total)
    # Token-keyed cache: after round r the rows of its tree and of its root are
    # stored under their final tokens. last[r, v] = last round <= r storing v.
    stored = tree_counts > 0
    stored[rows, root_token] = True
    last = np.where(stored, round_idx[:, None], -1).reshape(n_prompts, n_per, vocab)
    last = np.maximum.accumulate(last, axis=1).reshape(n_rounds_total, vocab)
    last_before = _shift(last, n_prompts, -1)[rows, root_token]  # [R]
    from_decoding = last_before >= 0
    # whether each token occurs in the prompt (then prefill stored its row), per prompt
    in_prompt = rng.random((n_prompts, vocab)) < p_cache
    from_prompt = ~from_decoding & in_prompt[rows // n_per, root_token]
    cache_age = np.where(from_decoding, round_idx - last_before, round_idx + 1)
    return from_decoding | from_prompt, cache_age


def _token_only_count(
    rounds: SynthRounds,
    root_token: np.ndarray,
    prev_root: np.ndarray,
    matched: np.ndarray,
    has_prev: np.ndarray,
    n_prompts: int,
) -> np.ndarray:
    """How many token-only rows each round has (see the module docstring). [R] int64."""
    rows = np.arange(root_token.shape[0])
    vocab = rounds.root_logp.shape[1]
    scored_counts = _token_counts(rounds.pool.token, rounds.scored, vocab)
    prev_scored = _shift(scored_counts, n_prompts, 0)[rows, root_token]
    # other scored prefixes: the emitted address itself is the matched row
    n_token_only = np.minimum(TOKEN_ONLY_MAX, prev_scored - matched) + (prev_root == root_token)
    return np.where(has_prev, n_token_only, 0)


def _kind_rows(
    rng: np.random.Generator, root_logp: np.ndarray, root_token: np.ndarray, synth: SynthConfig
) -> dict[str, np.ndarray]:
    """The cache, same, preceding and matched rows, noisy copies of the root row. [R, V] each."""
    rows = np.arange(root_logp.shape[0])
    noisy = _noisy(rng, root_logp, synth.retained_noise, 3)  # cache, same, prev
    noisy[rows, 2, root_token] = 0.0  # the preceding row's continuation entry is zeroed
    kinds = {"cache": noisy[:, 0], "same": noisy[:, 1], "prev": noisy[:, 2]}
    kinds["matched"] = _noisy(rng, root_logp, synth.matched_noise, 1)[:, 0]
    return kinds


def _first_level(
    kinds: dict[str, np.ndarray],
    present: dict[str, np.ndarray],
    first_tokens: np.ndarray,
    root_token: np.ndarray,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Each kind's log-prob at the first-level candidates, and its validity. [R, n1] each."""
    fl_logprob, fl_valid = {}, {}
    for k in ("cache", "same", "prev", "matched"):
        with np.errstate(divide="ignore"):  # log 0 at the zeroed entry -> masked below
            fl_logprob[k] = np.log(np.take_along_axis(kinds[k], first_tokens, axis=1))
        fl_valid[k] = np.broadcast_to(present[k][:, None], first_tokens.shape).copy()
    fl_valid["prev"] &= first_tokens != root_token[:, None]
    return fl_logprob, fl_valid


def _token_only_first_level(
    tok_only: np.ndarray, first_tokens: np.ndarray, n_token_only: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(mean, max) log-prob over the existing token-only rows; NaN without any. [R, n1] f32."""
    with np.errstate(divide="ignore"):
        tok_fl = np.log(np.take_along_axis(tok_only, first_tokens[:, None, :], axis=2))
    exists = np.arange(TOKEN_ONLY_MAX + 1)[None, :] < n_token_only[:, None]  # [R, 25]
    count = np.maximum(n_token_only, 1)[:, None]
    with np.errstate(invalid="ignore"):
        fl_mean = np.where(exists[:, :, None], tok_fl, 0.0).sum(axis=1) / count
        fl_max = np.where(exists[:, :, None], tok_fl, -np.inf).max(axis=1)
    none = (n_token_only == 0)[:, None]
    return (
        np.where(none, np.nan, fl_mean).astype(np.float32),
        np.where(none, np.nan, fl_max).astype(np.float32),
    )


def retained_features(
    rng: np.random.Generator, rounds: SynthRounds, n_prompts: int, synth: SynthConfig
) -> Retained:
    """Retained-row features of `n_prompts` prompts' rounds (see the module docstring)."""
    # The generator is drawn in a fixed order (root tokens, prompt cache, kind rows,
    # token-only rows); reordering these calls would change every synthetic store.
    token, in_tree = rounds.pool.token, rounds.in_tree
    n_rounds_total, vocab = rounds.root_logp.shape
    n_per = n_rounds_total // n_prompts
    round_idx = np.tile(np.arange(n_per), n_prompts)  # [R]
    has_prev = round_idx > 0
    rows = np.arange(n_rounds_total)

    root_token = _root_tokens(rng, rounds, n_prompts)
    prev_root = _shift(root_token, n_prompts, -1)
    tree_counts = _token_counts(token, in_tree, vocab)  # [R, V]
    cached, cache_age = _cache_presence(
        rng, tree_counts, root_token, round_idx, n_prompts, synth.p_cache
    )
    prev_tree_root_count = _shift(tree_counts, n_prompts, 0)[rows, root_token]
    same = has_prev & ((prev_root == root_token) | (prev_tree_root_count > 0))
    matched = _shift(rounds.outcome.covered, n_prompts, False)
    n_token_only = _token_only_count(rounds, root_token, prev_root, matched, has_prev, n_prompts)

    root_p = np.exp(rounds.root_logp)  # [R, V]
    root_argmax = rounds.root_argmax
    kinds = _kind_rows(rng, rounds.root_logp, root_token, synth)
    present = {
        "cache": cached,
        "same": same,
        "prev": np.ones(n_rounds_total, dtype=bool),
        "matched": matched,
    }
    first_tokens = token[:, : _n_first(rounds)]  # [R, n1]
    fl_logprob, fl_valid = _first_level(kinds, present, first_tokens, root_token)
    tok_only = _noisy(rng, rounds.root_logp, synth.token_only_noise, TOKEN_ONLY_MAX + 1)
    # Token-only rows at the first-level candidates, aggregated over the rows that exist.
    fl_mean, fl_max = _token_only_first_level(tok_only, first_tokens, n_token_only)
    with np.errstate(divide="ignore", invalid="ignore"):  # 0 * log 0 -> 0
        entropy = {k: -np.nansum(r * np.log(r), axis=-1) for k, r in kinds.items()}
    return Retained(
        root_token=root_token,
        fl_logprob=fl_logprob,
        fl_valid=fl_valid,
        cache_age=cache_age,
        prev_tree_root_count=prev_tree_root_count,
        has_prev_round=has_prev,
        tv={k: 0.5 * np.abs(r - root_p).sum(axis=-1) for k, r in kinds.items()},
        argmax_agree={k: r.argmax(axis=-1) == root_argmax for k, r in kinds.items()},
        present=present,
        token_only_tv=0.5 * np.abs(tok_only - root_p[:, None, :]).sum(axis=-1),
        token_only_agree=tok_only.argmax(axis=-1) == root_argmax[:, None],
        token_only_count=n_token_only,
        row_entropy={k: e.astype(np.float32) for k, e in entropy.items()},
        row_top1={k: r.max(axis=-1) for k, r in kinds.items()},
        row_argmax={k: r.argmax(axis=-1) for k, r in kinds.items()},
        token_only_argmax=tok_only.argmax(axis=-1),
        fl_token_only_mean=fl_mean,
        fl_token_only_max=fl_max,
    )


def _n_first(rounds: SynthRounds) -> int:
    """Number of first-level candidates (depth-1 entries lead the pool)."""
    return int((rounds.depth == 1).sum())

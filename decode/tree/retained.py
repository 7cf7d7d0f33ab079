"""Retained rows (SPEC §5): target rows kept from earlier rounds, judged against the next root row.

After round t the decoder keeps, from round t's verification pass (c = continuation):

- matched row    : the row at the emitted address (accepted path + c), when it was scored;
- token-only rows: up to 24 other scored rows whose final token is c, in pool order
                   (plus the root's row first, not counted, when the root token is c);
- same-token row : the root's row if the root token is c, else the row of the
                   highest-ranked verified prefix ending in c;
- preceding row  : the row at the last accepted node (the root if none), i.e. the row
                   c was drawn from; its probability of c is set to zero before use
                   (not renormalised, as the paper states it) and its entry for c is missing;
- token-keyed cache: token -> row of the latest stored prefix ending in it. Seeded at
                   prefill with each prompt token's row at its latest occurrence (the last
                   prompt token's own row is round 0's root row, computed by its pass, so
                   round 0 sees that token's earlier occurrence, if any); after each round
                   it stores every verified prefix's row under its final token
                   (highest-ranked wins among equal tokens), then the root's row.
                   Age = round index - round stored, prefill counting as round -1.

Round t + 1 evaluates them at its first-level candidates (known once its pool is
grown) and compares them with its root row (known after its pass), so no replay
pass is needed. Rows are kept as logits on the model's device in the model's
dtype and turned into float32 probabilities at the law temperature only when compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

TOKEN_ONLY_MAX = 24


@dataclass
class PrevRows:
    """Rows kept from the previous round for the next one. Row indices point into `rows`."""

    rows: Tensor  # [K, V] logits, model dtype
    continuation: int  # c: the next round's root token
    same: int | None  # index of the same-token row, None if absent
    preceding: int  # index of the preceding row
    matched: int | None  # index of the matched row, None if the round was not covered
    token_only: list[int]  # indices of token-only rows (root row first when it qualifies)
    tree_root_count: int  # verified prefixes ending in c


@dataclass
class RoundRows:
    """What round t's pass and traversal left, in host terms, to build the next PrevRows.

    Arrays are over the pool (pool order); `batch_row` maps a candidate to its row
    in the verification logits (0 = root, -1 = unscored).
    """

    root_token: int
    token: np.ndarray  # [P] int64
    parent: np.ndarray  # [P] int64
    rank: np.ndarray  # [P] int64, 0 = best
    in_tree: np.ndarray  # [P] bool
    batch_row: np.ndarray  # [P] int64
    accepted: list[int]  # pool indices of the accepted path, depth order
    continuation: int


def emitted_node(r: RoundRows) -> int | None:
    """Pool index of the emitted address (accepted path + continuation), if the pool holds it."""
    last = r.accepted[-1] if r.accepted else -1
    hit = np.flatnonzero((r.parent == last) & (r.token == r.continuation))
    return int(hit[0]) if hit.size else None  # siblings carry distinct tokens: at most one


def retained_batch_rows(r: RoundRows) -> tuple[np.ndarray, PrevRows]:
    """Which verification rows to keep (batch rows, [K]) and their roles (indices into them).

    Layout: [same-token?, preceding, matched?, token-only...].
    """
    c = r.continuation
    ends_in_c = r.in_tree & (r.token == c)  # verified prefixes ending in c
    same_row = None
    if r.root_token == c:
        same_row = 0
    elif ends_in_c.any():
        nodes = np.flatnonzero(ends_in_c)
        same_row = int(r.batch_row[nodes[np.argmin(r.rank[nodes])]])  # highest-ranked
    preceding_row = int(r.batch_row[r.accepted[-1]]) if r.accepted else 0
    e = emitted_node(r)
    matched_row = int(r.batch_row[e]) if e is not None and r.batch_row[e] >= 0 else None
    others = (r.batch_row >= 0) & (r.token == c)  # scored prefixes ending in c ...
    if e is not None:
        others[e] = False  # ... other than the emitted address
    token_only_rows = r.batch_row[np.flatnonzero(others)[:TOKEN_ONLY_MAX]]
    if r.root_token == c:  # the root's row joins first, not counted toward the 24
        token_only_rows = np.concatenate([[0], token_only_rows])

    head = [same_row, preceding_row, matched_row]
    slot = np.cumsum([x is not None for x in head]) - 1  # index of each present head row
    keep = np.concatenate([[x for x in head if x is not None], token_only_rows]).astype(np.int64)
    n_head = int(slot[-1]) + 1
    prev = PrevRows(
        rows=torch.empty(0),  # filled by the caller with one index_select
        continuation=c,
        same=None if same_row is None else int(slot[0]),
        preceding=int(slot[1]),
        matched=None if matched_row is None else int(slot[2]),
        token_only=list(range(n_head, len(keep))),
        tree_root_count=int(ends_in_c.sum()),
    )
    return keep, prev


def cache_writes(r: RoundRows) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, batch rows) the token-keyed cache stores after a round, one per token.

    Verified prefixes under their final token, the highest-ranked winning among
    equal tokens; then the root's row under the root token, which wins over all.
    """
    nodes = np.flatnonzero(r.in_tree)
    order = nodes[np.argsort(r.rank[nodes], kind="stable")]  # best first
    tokens = np.concatenate([[r.root_token], r.token[order]])  # root first = highest priority
    rows = np.concatenate([[0], r.batch_row[order]])
    _, first = np.unique(tokens, return_index=True)  # first occurrence = highest priority
    return tokens[first], rows[first]


class TokenKeyedCache:
    """token -> (row logits, round it was stored). Rows live in one growing device bank."""

    def __init__(self, vocab: int, device: torch.device, dtype: torch.dtype) -> None:
        self.bank = torch.empty(0, vocab, device=device, dtype=dtype)  # [capacity, V]
        self.slot = np.full(vocab, -1, dtype=np.int64)  # token -> bank row
        self.stored_round = np.full(vocab, 0, dtype=np.int64)
        self.n_used = 0

    def store(self, tokens: np.ndarray, rows: Tensor, round_index: int) -> None:
        """Store rows [n, V] under distinct `tokens` [n] (overwrites earlier rows)."""
        if len(np.unique(tokens)) != len(tokens):
            raise ValueError("TokenKeyedCache.store: tokens must be distinct (dedupe first)")
        new = tokens[self.slot[tokens] < 0]
        self.slot[new] = self.n_used + np.arange(len(new))
        self.n_used += len(new)
        if self.n_used > self.bank.shape[0]:  # grow by doubling: amortised O(1) per row
            grow = max(self.n_used, 2 * self.bank.shape[0]) - self.bank.shape[0]
            pad = self.bank.new_empty(grow, self.bank.shape[1])
            self.bank = torch.cat([self.bank, pad])
        index = torch.as_tensor(self.slot[tokens], device=self.bank.device)
        self.bank.index_copy_(0, index, rows.to(self.bank.dtype))
        self.stored_round[tokens] = round_index

    def lookup(self, token: int) -> tuple[Tensor, int] | None:
        """(row [V], stored round) for `token`, or None."""
        s = self.slot[token]
        return None if s < 0 else (self.bank[s], int(self.stored_round[token]))


def prompt_cache_rows(context: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(distinct tokens, position of each one's latest occurrence) in `context`."""
    rev = np.asarray(context[::-1], dtype=np.int64)
    tokens, first_rev = np.unique(rev, return_index=True)
    return tokens, len(context) - 1 - first_rev


@dataclass
class RetainedStats:
    """Device tensors comparing retained rows with this round's root row (see `retained_stats`)."""

    tv: Tensor  # [K'] float32
    agree: Tensor  # [K'] bool
    first_level_logp: Tensor  # [K', n1] float32 at the first-level candidates
    cache_index: int | None  # index of the cache row in the K' rows
    cache_age: int | None
    prev: PrevRows | None  # offsets of its rows are shifted by `prev_offset`
    prev_offset: int


def retained_stats(
    cache: TokenKeyedCache,
    prev: PrevRows | None,
    root_token: int,
    root_row: Tensor,
    first_level_tokens: Tensor,
    law_temperature: float,
    round_index: int,
) -> RetainedStats | None:
    """TV and argmax agreement of every retained row with the root row, and their first-level log-probs.

    All rows in one batched op (no per-row loop). Rows: [cache row?] + prev.rows.
    """
    parts, cache_index, cache_age = [], None, None
    hit = cache.lookup(root_token)
    if hit is not None:
        parts.append(hit[0][None])
        cache_index, cache_age = 0, round_index - hit[1]
    offset = len(parts)
    if prev is not None:
        parts.append(prev.rows)
    if not parts:
        return None
    rows = torch.cat(parts)  # [K', V] model dtype
    logp = torch.log_softmax(rows.float() / law_temperature, dim=-1)  # [K', V] float32
    if prev is not None:
        # Preceding row: its probability of the continuation (= this root token) is zeroed.
        logp[offset + prev.preceding, root_token] = float("-inf")
    root_p = torch.softmax(root_row.float() / law_temperature, dim=-1)  # [V]
    tv = 0.5 * (logp.exp() - root_p).abs().sum(-1)  # [K']
    agree = logp.argmax(-1) == root_p.argmax()
    fl = logp[:, first_level_tokens]  # [K', n1]
    return RetainedStats(tv, agree, fl, cache_index, cache_age, prev, offset)


def _row_stats(
    tv: list[float], agree: list[bool], i: int | None, offset: int = 0
) -> tuple[float | None, bool | None]:
    return (None, None) if i is None else (tv[offset + i], agree[offset + i])


def trace_fields(
    stats: RetainedStats | None, first_level_tokens: list[int], root_token: int
) -> dict:
    """The retained-row columns of a trace row (nulls where a row is absent). Host sync here."""
    n1 = len(first_level_tokens)
    out = {
        "fl_cache_logprob": [None] * n1,
        "fl_same_logprob": [None] * n1,
        "fl_prev_logprob": [None] * n1,
        "cache_age": None,
        "prev_tree_root_count": None,
        "token_only_tv": [],
        "token_only_argmax_agree": [],
    }
    for k in ("cache", "same", "prev", "matched"):
        out[f"{k}_tv"], out[f"{k}_argmax_agree"] = None, None
    if stats is None:
        return out
    tv, agree, fl = stats.tv.tolist(), stats.agree.tolist(), stats.first_level_logp.tolist()
    if stats.cache_index is not None:
        out["cache_tv"], out["cache_argmax_agree"] = _row_stats(tv, agree, stats.cache_index)
        out["fl_cache_logprob"] = fl[stats.cache_index]
        out["cache_age"] = stats.cache_age
    p = stats.prev
    if p is not None:
        o = stats.prev_offset  # prev's row indices are shifted past the cache row
        out["same_tv"], out["same_argmax_agree"] = _row_stats(tv, agree, p.same, o)
        out["prev_tv"], out["prev_argmax_agree"] = _row_stats(tv, agree, p.preceding, o)
        out["matched_tv"], out["matched_argmax_agree"] = _row_stats(tv, agree, p.matched, o)
        if p.same is not None:
            out["fl_same_logprob"] = fl[o + p.same]
        # The continuation's entry of the preceding row is missing, not -inf.
        out["fl_prev_logprob"] = [
            None if tok == root_token else v
            for tok, v in zip(first_level_tokens, fl[o + p.preceding], strict=True)
        ]
        out["token_only_tv"] = [tv[o + i] for i in p.token_only]
        out["token_only_argmax_agree"] = [agree[o + i] for i in p.token_only]
        out["prev_tree_root_count"] = p.tree_root_count
    return out

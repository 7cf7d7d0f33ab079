"""Retained rows (docs/method.md#retained-rows): target rows kept from earlier rounds, judged against the next root row.

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


def retained_batch_rows(r: RoundRows, token_only: bool = True) -> tuple[np.ndarray, PrevRows]:
    """Which verification rows to keep (batch rows, [K]) and their roles (indices into them).

    Layout: [same-token?, preceding, matched?, token-only...]; `token_only=False` keeps none
    of the token-only rows (a decoder under `selection.policies.NO_TOKEN_ONLY`).
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
    if not token_only:
        token_only_rows = token_only_rows[:0]

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


# retained rows with a role (docs/method.md#retained-rows)
ROW_KINDS = ("cache", "same", "prev", "matched")


@dataclass
class RetainedRows:
    """Every retained row of a round at the law temperature, before verification (device tensors).

    Rows: [cache row?] + prev.rows. The preceding row's entry for the continuation
    (= this round's root token) is -inf: its probability is zeroed, not renormalised.
    """

    logp: Tensor  # [K', V] float32
    first_level_logp: Tensor  # [K', n1] float32 at the first-level candidates
    entropy: Tensor  # [K'] nats
    top1: Tensor  # [K'] the row's largest probability
    argmax: Tensor  # [K'] int64, the row's most probable token
    cache_index: int | None  # index of the cache row in the K' rows
    cache_age: int | None
    prev: PrevRows | None  # offsets of its rows are shifted by `prev_offset`
    prev_offset: int

    def index(self, kind: str) -> int | None:
        """Row index of `kind` (ROW_KINDS) in the K' rows, None when absent."""
        if kind == "cache":
            return self.cache_index
        if self.prev is None:
            return None
        i = {"same": self.prev.same, "prev": self.prev.preceding, "matched": self.prev.matched}[
            kind
        ]
        return None if i is None else self.prev_offset + i

    def token_only_index(self) -> list[int]:
        return [] if self.prev is None else [self.prev_offset + i for i in self.prev.token_only]


def retained_rows(
    cache: TokenKeyedCache,
    prev: PrevRows | None,
    root_token: int,
    first_level_tokens: Tensor,
    law_temperature: float,
    round_index: int,
) -> RetainedRows | None:
    """The round's retained rows as log-probs with their summaries, in one batched op.

    Known before verification: the online reranker's features read them, and the
    recorder compares them with the root row afterwards (`retained_stats`).
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
    p = logp.exp()
    # 0 * log 0 = 0: entries whose probability underflows contribute nothing.
    entropy = -(p * logp).nan_to_num(0.0, 0.0, 0.0).sum(-1)
    top1, argmax = p.max(-1)
    fl = logp[:, first_level_tokens]  # [K', n1]
    return RetainedRows(logp, fl, entropy, top1, argmax, cache_index, cache_age, prev, offset)


@dataclass
class RetainedStats:
    """The retained rows compared with this round's root row (see `retained_stats`)."""

    rows: RetainedRows
    tv: Tensor  # [K'] float32
    agree: Tensor  # [K'] bool


def retained_stats(
    cache: TokenKeyedCache,
    prev: PrevRows | None,
    root_token: int,
    root_row: Tensor,
    first_level_tokens: Tensor,
    law_temperature: float,
    round_index: int,
) -> RetainedStats | None:
    """TV and argmax agreement of every retained row with the root row (after verification)."""
    rows = retained_rows(cache, prev, root_token, first_level_tokens, law_temperature, round_index)
    if rows is None:
        return None
    root_p = torch.softmax(root_row.float() / law_temperature, dim=-1)  # [V]
    tv = 0.5 * (rows.logp.exp() - root_p).abs().sum(-1)  # [K']
    agree = rows.logp.argmax(-1) == root_p.argmax()
    return RetainedStats(rows, tv, agree)


def row_inputs(rows: RetainedRows | None, first_level_tokens: np.ndarray, root_token: int) -> dict:
    """What the first-level features read from the retained rows, as host values.

    `fl_<kind>_logprob` [n1] float32 (NaN where the row is absent; the preceding
    row's entry for the continuation is missing), the token-only rows aggregated
    at each candidate (mean, max log-prob; NaN without token-only rows), their
    argmaxes, and each row's entropy, top-1 mass and argmax (None when absent).
    One host transfer. The recorder stores these (`trace_fields`); the online
    reranker feeds them to the same feature functions.
    """
    n1 = len(first_level_tokens)
    nan_row = np.full(n1, np.nan, dtype=np.float32)
    out: dict = {f"fl_{k}_logprob": nan_row for k in ROW_KINDS}
    out |= {"fl_token_only_mean_logprob": nan_row, "fl_token_only_max_logprob": nan_row}
    out |= {"token_only_argmax": np.zeros(0, dtype=np.int64), "cache_age": None}
    out["prev_tree_root_count"] = (
        None if rows is None or rows.prev is None else (rows.prev.tree_root_count)
    )
    for k in ROW_KINDS:
        out[f"{k}_entropy"] = out[f"{k}_top1_prob"] = out[f"{k}_argmax"] = None
    if rows is None:
        return out
    out["cache_age"] = rows.cache_age
    fl = rows.first_level_logp.cpu().numpy()  # [K', n1]
    summary = torch.stack([rows.entropy, rows.top1]).cpu().numpy()  # [2, K']
    argmax = rows.argmax.cpu().numpy()
    for k in ROW_KINDS:
        i = rows.index(k)
        if i is None:
            continue
        out[f"fl_{k}_logprob"] = fl[i]
        out[f"{k}_entropy"], out[f"{k}_top1_prob"] = float(summary[0, i]), float(summary[1, i])
        out[f"{k}_argmax"] = int(argmax[i])
    if out["fl_prev_logprob"] is not nan_row:  # the continuation's entry is missing, not -inf
        tokens = np.asarray(first_level_tokens)
        out["fl_prev_logprob"] = np.where(tokens == root_token, np.nan, out["fl_prev_logprob"])
    only = rows.token_only_index()
    if only:
        out["fl_token_only_mean_logprob"] = fl[only].mean(axis=0)
        out["fl_token_only_max_logprob"] = fl[only].max(axis=0)
        out["token_only_argmax"] = argmax[only]
    return out


def _row_stats(
    tv: list[float], agree: list[bool], i: int | None
) -> tuple[float | None, bool | None]:
    return (None, None) if i is None else (tv[i], agree[i])


def _nullable(values: np.ndarray) -> list[float | None]:
    return [None if np.isnan(v) else float(v) for v in values]


def trace_fields(
    stats: RetainedStats | None, first_level_tokens: list[int], root_token: int
) -> dict:
    """The retained-row columns of a trace row (nulls where a row is absent). Host sync here."""
    rows = None if stats is None else stats.rows
    inputs = row_inputs(rows, np.asarray(first_level_tokens, dtype=np.int64), root_token)
    out = {}
    for name, value in inputs.items():
        if name.startswith("fl_"):
            out[name] = _nullable(value)
        elif name == "token_only_argmax":
            out[name] = value.tolist()
        else:
            out[name] = value
    for k in ROW_KINDS:
        out[f"{k}_tv"], out[f"{k}_argmax_agree"] = None, None
    out["token_only_tv"], out["token_only_argmax_agree"] = [], []
    if stats is None:
        return out
    tv, agree = stats.tv.tolist(), stats.agree.tolist()
    for k in ROW_KINDS:
        out[f"{k}_tv"], out[f"{k}_argmax_agree"] = _row_stats(tv, agree, rows.index(k))
    out["token_only_tv"] = [tv[i] for i in rows.token_only_index()]
    out["token_only_argmax_agree"] = [agree[i] for i in rows.token_only_index()]
    return out

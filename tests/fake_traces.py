"""Small random trace tables (trace schema v4; `draft_confidence` left null) for the feature tests.

Values are random but honour the trace contract: pool order, first-level
candidates first, retained rows aligned with them (nulls where absent, the
preceding row's root-token entry null), whole prompts with consecutive rounds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from specrank.store.trace_schema import TRACE_SCHEMA

VOCAB = 12  # small, so tokens repeat (root token among candidates, same-token rows)


def random_pool(rng: np.random.Generator, level_sizes: list[int]) -> dict[str, list]:
    """A random trie in pool order: per-candidate parent, depth, token, draft log-prob, expanded."""
    parent, depth, prev = [], [], [-1]
    start = 0
    for d, size in enumerate(level_sizes, start=1):
        parent += [int(p) for p in rng.choice(prev, size=size)] if d > 1 else [-1] * size
        depth += [d] * size
        prev = list(range(start, start + size))
        start += size
    n = len(parent)
    expanded = [False] * n
    for p in parent:
        if p >= 0:
            expanded[p] = True
    return {
        "cand_parent": parent,
        "cand_depth": depth,
        "cand_token": [int(t) for t in rng.integers(0, VOCAB, size=n)],
        "cand_draft_logprob": [
            float(x) for x in np.log(rng.uniform(0.01, 0.3, size=n)).astype(np.float32)
        ],
        "cand_expanded": expanded,
    }


def _maybe_row(rng: np.random.Generator, n1: int, p_present: float) -> list[float | None]:
    if rng.random() >= p_present:
        return [None] * n1
    return [
        None if rng.random() < 0.1 else float(np.log(rng.uniform(1e-4, 1.0))) for _ in range(n1)
    ]


def _v3_rows(rng: np.random.Generator, n1: int, round_index: int) -> dict[str, Any]:
    """Trace v3's row columns: matched row, token-only aggregates and argmaxes, role-row shapes."""
    out: dict[str, Any] = {}
    n_only = 0 if round_index == 0 else int(rng.integers(0, 4))
    out["fl_matched_logprob"] = _maybe_row(rng, n1, 0.0 if round_index == 0 else 0.5)
    agg = _maybe_row(rng, n1, 1.0 if n_only else 0.0)
    out["fl_token_only_mean_logprob"] = agg
    out["fl_token_only_max_logprob"] = [None if v is None else v / 2 for v in agg]
    out["token_only_argmax"] = [int(t) for t in rng.integers(0, VOCAB, size=n_only)]
    for kind in ("cache", "same", "prev", "matched"):
        present = rng.random() < 0.7
        out[f"{kind}_entropy"] = float(rng.uniform(0, 3)) if present else None
        out[f"{kind}_top1_prob"] = float(rng.uniform(0.1, 1)) if present else None
        out[f"{kind}_argmax"] = int(rng.integers(0, VOCAB)) if present else None
    return out


def random_round(
    rng: np.random.Generator,
    prompt_id: str,
    round_index: int,
    level_sizes: list[int],
    tokens_before: int,
) -> dict[str, Any]:
    pool = random_pool(rng, level_sizes)
    n, n1 = len(pool["cand_parent"]), level_sizes[0]
    root_token = int(rng.integers(0, VOCAB))
    prev_row = _maybe_row(rng, n1, 0.0 if round_index == 0 else 0.9)
    # the preceding row's continuation entry is missing: the continuation is this root token
    prev_row = [None if pool["cand_token"][i] == root_token else v for i, v in enumerate(prev_row)]
    has_cache = rng.random() < 0.7
    accepted = [0, *[i for i in range(n1, n) if pool["cand_parent"][i] == 0][:1]]
    parents = set(pool["cand_parent"])
    return {
        "prompt_id": prompt_id,
        "task": ["writing", "coding"][hash(prompt_id) % 2],
        "category": "fake",  # trace schema v2: the prompt's finer label
        "round_index": round_index,
        "tokens_before": tokens_before,
        "prompt_length": 17,
        "temperature": 1.0,
        "rule": "draft",
        "budget": 8,
        "root_token": root_token,
        **pool,
        "cand_target_prob": [float(x) for x in rng.uniform(0, 0.5, size=n).astype(np.float32)],
        # a recording pass scores every parent (SPEC §4), and more
        "cand_scored": [bool(x) or i in parents for i, x in enumerate(rng.random(n) < 0.5)],
        "cand_in_tree": [bool(x) for x in rng.random(n) < 0.3],
        "cand_target_argmax": [int(x) for x in rng.integers(-1, VOCAB, size=n)],
        "root_argmax": int(rng.integers(0, VOCAB)),
        "root_entropy": float(rng.uniform(0, 3)),
        "root_top1_prob": float(rng.uniform(0.1, 1)),
        "accepted_path": accepted[: int(rng.integers(0, len(accepted) + 1))],
        "continuation_token": int(rng.integers(0, VOCAB)),
        "covered": bool(rng.random() < 0.5),
        "fl_cache_logprob": _maybe_row(rng, n1, 1.0 if has_cache else 0.0),
        "fl_same_logprob": _maybe_row(rng, n1, 0.0 if round_index == 0 else 0.6),
        "fl_prev_logprob": prev_row,
        "cache_age": int(rng.integers(0, 9)) if has_cache else None,
        "prev_tree_root_count": None if round_index == 0 else int(rng.integers(0, 4)),
        "cache_tv": None,
        "cache_argmax_agree": None,
        "same_tv": None,
        "same_argmax_agree": None,
        "prev_tv": None,
        "prev_argmax_agree": None,
        "matched_tv": None,
        "matched_argmax_agree": None,
        "token_only_tv": [],
        "token_only_argmax_agree": [],
        **_v3_rows(rng, n1, round_index),
        "time_draft_ms": 0.0,
        "time_select_ms": 0.0,
        "time_verify_ms": 0.0,
        "time_bookkeeping_ms": 0.0,
    }


def random_trace(
    seed: int, n_prompts: int = 3, n_rounds: int = 4, level_sizes: list[int] | None = None
) -> pa.Table:
    """Whole prompts with consecutive rounds; pool shapes vary between rounds unless given."""
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(n_prompts):
        tokens = 0
        for r in range(n_rounds):
            sizes = level_sizes or [
                int(rng.integers(1, 6)),
                int(rng.integers(0, 7)),
                int(rng.integers(0, 5)),
            ]
            sizes = [s for s in sizes if s > 0] if sizes[1] else sizes[:1]
            row = random_round(rng, f"p{p}", r, sizes, tokens)
            tokens += len(row["accepted_path"]) + 1
            rows.append(row)
    order = rng.permutation(len(rows))  # shards need not be sorted
    return pa.Table.from_pylist([rows[i] for i in order], schema=TRACE_SCHEMA)

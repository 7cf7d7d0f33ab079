"""First-level features of the round in hand (R = 1), for the online decoder.

The same functions `features.extract` runs on a trace shard
(`RoundArrays.one_round` -> `first_level.first_level_features`), fed from the
live pool and the retained rows, so a reranker sees exactly the inputs it was
trained on (tests hold the values equal to those of a recorded trace).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from decode.tree import retained as R
from decode.tree.pool import Pool
from features.first_level import first_level_features
from features.rounds import RoundArrays

# The row features when the model reads none (or no row is retained yet).
NO_ROWS = {
    "fl_cache_logprob": None,
    "fl_same_logprob": None,
    "fl_prev_logprob": None,
    "cache_age": None,
    "prev_tree_root_count": None,
}


def first_level_rows(
    cache: R.TokenKeyedCache,
    prev: R.PrevRows | None,
    root: int,
    first_tokens: Tensor,
    law_temperature: float,
    round_index: int,
) -> dict:
    """`fl_*` arrays [n1] (None where a row is absent), `cache_age`, `prev_tree_root_count`.

    The same ops as `retained_stats` on the rows the features read (cache, same-token,
    preceding), so the values are bitwise those a recorded trace holds.
    """
    rows, names, age = [], [], None
    hit = cache.lookup(root)
    if hit is not None:
        rows.append(hit[0][None])
        names.append("cache")
        age = round_index - hit[1]
    if prev is not None:
        if prev.same is not None:
            rows.append(prev.rows[prev.same][None])
            names.append("same")
        rows.append(prev.rows[prev.preceding][None])
        names.append("prev")
    out = {"fl_cache_logprob": None, "fl_same_logprob": None, "fl_prev_logprob": None}
    if rows:
        logp = torch.log_softmax(torch.cat(rows).float() / law_temperature, dim=-1)  # [k, V]
        fl = logp[:, first_tokens].cpu().numpy()  # [k, n1]
        for name, values in zip(names, fl, strict=True):
            out[f"fl_{name}_logprob"] = values
    if out["fl_prev_logprob"] is not None:  # the continuation's entry is missing, not -inf
        tokens = first_tokens.cpu().numpy()
        out["fl_prev_logprob"] = np.where(tokens == root, np.nan, out["fl_prev_logprob"])
    out["cache_age"] = age
    out["prev_tree_root_count"] = None if prev is None else prev.tree_root_count
    return out


@dataclass
class RoundContext:
    """What a round's features read besides the pool and the rows."""

    root: int
    prompt_length: int
    round_index: int
    tokens_before: int
    prev_accepted: int | None


def round_features(pool_host: dict[str, np.ndarray], ctx: RoundContext, rows: dict) -> dict:
    """SPEC §7 features of the round's first-level candidates: name -> [n1] (FEATURE_DTYPES)."""
    ra = RoundArrays.one_round(
        cand_token=pool_host["token"],
        cand_parent=pool_host["parent"],
        cand_depth=pool_host["depth"],
        cand_draft_logprob=pool_host["draft_logprob"],
        cand_expanded=pool_host["expanded"],
        root_token=ctx.root,
        prompt_length=ctx.prompt_length,
        round_index=ctx.round_index,
        tokens_before=ctx.tokens_before,
        prev_accepted=ctx.prev_accepted,
        **rows,
    )
    return first_level_features(ra)


def pool_to_host(pool: Pool) -> dict[str, np.ndarray]:
    """The pool arrays the features read, in one transfer per dtype."""
    ints = torch.stack([pool.token, pool.parent, pool.depth]).cpu().numpy()
    return {
        "token": ints[0],
        "parent": ints[1],
        "depth": ints[2],
        "draft_logprob": pool.draft_logprob.cpu().numpy(),
        "expanded": pool.expanded.cpu().numpy(),
    }

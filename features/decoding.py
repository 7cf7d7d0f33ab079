"""First-level features of the round in hand (R = 1), for the online decoder.

The same functions `features.extract` runs on a trace shard
(`first_level.features_of_blocks`, which `first_level_features` calls), fed from
the live pool and the retained rows (`RoundBlocks.one_round`), so a reranker sees
exactly the inputs it was trained on (tests hold the values equal to those of a
recorded trace).
"""

from __future__ import annotations

import numpy as np
import torch

from features.first_level import FirstLevelFeatures, features_of_blocks
from features.rounds import RoundBlocks
from tree import retained as R
from tree.pool import Pool
from tree.round_record import RoundContext


def first_level_rows(rows: R.RetainedRows | None, first_tokens: np.ndarray, root: int) -> dict:
    """The retained-row inputs of the round's features (`features.rounds.ROW_INPUTS`).

    rows: `tree.retained.retained_rows` of the round (None: no row retained);
    first_tokens: the first-level tokens [n1] on the host. `row_inputs` is the function
    whose output the recorder stores, so the values are bitwise those a recorded trace holds.
    """
    return R.row_inputs(rows, first_tokens, root)


def no_rows(n_first: int) -> dict:
    """The row inputs when the model reads no rows: every row absent."""
    return R.row_inputs(None, np.zeros(n_first, dtype=np.int64), -1)


def round_features(
    pool_host: dict[str, np.ndarray], ctx: RoundContext, rows: dict
) -> FirstLevelFeatures:
    """docs/method.md#features features of the round's first-level candidates: name -> [n1] (FEATURE_DTYPES)."""
    blocks = RoundBlocks.one_round(
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
        rows=rows,
    )
    return features_of_blocks(blocks)


def pool_to_host(pool: Pool) -> dict[str, np.ndarray]:
    """The pool arrays the features read, as numpy (on a CPU: views; else two transfers)."""
    if pool.token.device.type == "cpu":
        names = ("token", "parent", "depth", "draft_logprob", "expanded")
        return {name: getattr(pool, name).numpy() for name in names}
    ints = torch.stack([pool.token, pool.parent, pool.depth]).cpu().numpy()
    return {
        "token": ints[0],
        "parent": ints[1],
        "depth": ints[2],
        "draft_logprob": pool.draft_logprob.cpu().numpy(),
        "expanded": pool.expanded.cpu().numpy(),
    }

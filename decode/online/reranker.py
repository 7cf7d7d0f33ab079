"""The one place decoding meets a fitted reranker: log phat of the round's first level.

Per round (R = 1), before verification:

    retained rows  -> first-level log-probs (features.online.first_level_rows)
    pool + context -> first-level features (features.online.round_features)
    features       -> log phat [n1] on the decoding device (rerank.online.OnlinePredictor)

and the selector then ranks by log phat(x1) + log q(x2) + ... like the offline evaluator.
"""

from __future__ import annotations

from torch import Tensor

from decode.online.stream import Stream
from decode.tree.pool import Pool
from features.online import NO_ROWS, RoundContext, first_level_rows, pool_to_host, round_features
from rerank.online import OnlinePredictor


def reranker_first_factor(
    stream: Stream,
    task: str,
    pool: Pool,
    predictor: OnlinePredictor,
    ctx: RoundContext,
    law_temp: float,
    rows_needed: bool,
) -> tuple[Tensor, dict]:
    """log phat [n1] for this round's first-level candidates, and the features it came from."""
    host = pool_to_host(pool)  # host sync: the features are numpy
    first = pool.token[: pool.n_first]
    rows = NO_ROWS
    if rows_needed:
        rows = first_level_rows(
            stream.row_cache, stream.prev, ctx.root, first, law_temp, ctx.round_index
        )
    feats = round_features(host, ctx, rows)
    X = predictor.design(feats, host["token"][: pool.n_first], task)
    return predictor.first_logprob(X), feats

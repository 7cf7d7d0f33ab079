"""The one place decoding meets a fitted reranker: log phat of the round's first level.

Per round (R = 1), before verification:

    retained rows  -> first-level log-probs (tree.retained, features.decoding.first_level_rows)
    pool + context -> first-level features (features.decoding.round_features)
    features       -> log phat [n1] on the decoding device (rerank.serving.OnlinePredictor)

and the selector then ranks by log phat(x1) + log q(x2) + ... like the offline evaluator.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from torch import Tensor

from decode.stream import Stream
from features.decoding import first_level_rows, no_rows, pool_to_host, round_features
from rerank.serving import OnlinePredictor
from tree import retained as R
from tree.pool import Pool
from tree.round_record import RoundContext


def reranker_first_factor(
    stream: Stream,
    task: str,
    pool: Pool,
    predictor: OnlinePredictor,
    ctx: RoundContext,
    law_temp: float,
    rows_needed: bool,
    marks: list[float] | None = None,
) -> tuple[Tensor, Mapping]:
    """log phat [n1] for this round's first-level candidates, and the features it came from.

    marks: when given, perf_counter() is appended after each step (PHASES; `bench_online`).
    """
    n1 = pool.n_first
    retained = None
    if rows_needed:  # queued before the host sync: on a GPU it runs right behind drafting
        retained = R.retained_rows(
            stream.row_cache, stream.prev, ctx.root, pool.token[:n1], law_temp, ctx.round_index
        )
    host = pool_to_host(pool)  # host sync: the features are numpy
    _mark(marks)
    first = host["token"][:n1]
    rows = first_level_rows(retained, first, ctx.root) if rows_needed else no_rows(n1)
    _mark(marks)
    feats = round_features(host, ctx, rows)
    _mark(marks)
    X = predictor.design(feats, first, task)
    _mark(marks)
    logp = predictor.first_logprob(X)
    _mark(marks)
    return logp, feats


# what `marks` times, in order (the first mark is the caller's, before the call)
PHASES = ("rows_and_pool", "row_inputs", "features", "design", "predict")


def _mark(marks: list[float] | None) -> None:
    if marks is not None:
        marks.append(time.perf_counter())

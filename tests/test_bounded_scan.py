"""The fused kernel's top-k heap stops its draft-order scan where no later candidate can
enter (`selection.kernels._stop_below`, `selection.fused._bounded_top_k`): the values stay
those of the whole scan and of torch's ranking, and a NaN draft factor it would not reach is
refused before it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from selection import fused
from selection.context import pool_context
from selection.ranking import kernel_valid, rank_order, torch_route
from selection.values import evaluate_pools, lead_factor_scores
from tests.random_pools import random_pool_batch

LEVELS = [10, 60, 60, 60, 60]  # 250 candidates: a top 8 or 30 takes the heap, not the sort
AT = np.int64([0, 3, 7])


def _pools(top_m: int):
    rng = np.random.default_rng(3)
    pool = random_pool_batch(rng, 80, LEVELS, temperature=1.0)
    ctx = pool_context(pool, top_m)
    return rng, pool, ctx


def _values(pool, ctx, lead, k, draft):
    valid, has_valid = kernel_valid(ctx.restrict, ctx.draft)
    n = pool.shape[0]
    values, curve, status = fused.rules_lead_values(
        pool.draft_logprob.numpy(), pool.parent.numpy(), lead.numpy()[None], ctx.path_prob.numpy(),
        valid, has_valid, k,
        AT, False, np.zeros(n, np.bool_), False,
        np.zeros((n, 3), np.float32), np.zeros((0, 0), np.float32), *ctx.sparse_mass,
        rank_order(ctx.draft, ctx.restrict).numpy(), draft,
    )  # fmt: skip
    return values[0], curve[0], status  # the one rule's


@pytest.mark.parametrize("top_m", [0, 90])
@pytest.mark.parametrize("spread", [0.3, 3.0])
def test_the_bounded_scan_gives_the_whole_scans_and_torchs_values(top_m, spread):
    rng, pool, ctx = _pools(top_m)
    for upto, n_lead in ((1, 10), (2, 70)):
        noise = rng.normal(0, spread, (80, n_lead)).astype(np.float32)
        lead = pool.draft_logprob[:, :n_lead] + torch.from_numpy(noise)  # some above 0
        lead[rng.random((80, n_lead)) < 0.1] = torch.nan  # draft's factor kept there
        lead[rng.random((80, n_lead)) < 0.05] = -torch.inf
        with torch_route():
            order = rank_order(lead_factor_scores(ctx, lead, upto=upto), ctx.restrict)
        mass = torch.cumsum(torch.gather(ctx.path_prob, -1, order), -1).numpy()
        for k in (8, 30):
            bounded = _values(pool, ctx, lead, k, ctx.draft.numpy())
            whole = _values(pool, ctx, lead, k, np.zeros((1, 0), np.float32))
            assert bounded[2] == whole[2] == 0
            np.testing.assert_array_equal(bounded[0], whole[0])
            np.testing.assert_array_equal(bounded[0], mass[:, AT])
            # the stop is taken: draft scores lowered past the first k of the draft
            # order (a broken contract) end the scan before candidates that enter the top k
            lowered = ctx.draft.numpy().copy()
            tail = rank_order(ctx.draft, ctx.restrict).numpy()[:, k:]
            np.put_along_axis(lowered, tail, np.float32(-1e9), axis=1)
            lowered[:, :n_lead] = ctx.draft.numpy()[:, :n_lead]  # the lift stays the true one
            assert not np.array_equal(_values(pool, ctx, lead, k, lowered)[0], whole[0])


def test_a_nan_draft_factor_past_the_stop_is_refused_before_any_scan():
    # the scan does not reach the draft order's tail, so it does not check it: a NaN draft
    # log-probability there is refused where the draft scores are built, before any rule
    _, pool, ctx = _pools(0)
    lead = pool.draft_logprob[:, :10].clone()
    assert _values(pool, ctx, lead, 8, ctx.draft.numpy())[2] == 0
    last = rank_order(ctx.draft, None).numpy()[0, -1]
    pool.draft_logprob[0, last] = torch.nan
    with pytest.raises(ValueError, match="draft log-probabilities must be <= 0 or -inf"):
        evaluate_pools(pool, [8], ["draft"], first_factors={"lead": lead})

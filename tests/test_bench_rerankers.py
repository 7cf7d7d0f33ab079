"""The LightGBM-vs-HGB benchmark's equal-loss arithmetic (bench/bench_rerankers.py)."""

from __future__ import annotations

import math

import pytest

from bench.bench_rerankers import bench_law, iterations_to
from rerank.fit.boosting import Capacity
from selection.rules import MODEL_KINDS
from tests.candidate_frames import make_candidate_frame


def test_iterations_to_interpolates_between_grid_points():
    curve = {10: 0.5, 20: 0.3, 30: 0.2}
    assert iterations_to(curve, 0.25) == pytest.approx(25.0)
    assert iterations_to(curve, 0.3) == 20.0
    assert iterations_to(curve, 0.9) == 10.0  # already there at the first grid point
    assert math.isnan(iterations_to(curve, 0.1))  # never reached


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_equal_loss_times_lie_within_the_full_fits(temperature):
    frame = make_candidate_frame(n_prompts=24, rounds=6, temperature=temperature)
    law = "greedy" if temperature == 0 else "sampling"
    res = bench_law(frame, law, Capacity(n_iter=30, learning_rate=0.1, max_leaves=7))
    finals = [res[k]["curve"][30] for k in MODEL_KINDS]
    assert res["target"] == max(finals)
    for kind in MODEL_KINDS:
        r = res[kind]
        assert sorted(r["curve"]) == [10, 20, 30]
        assert r["curve"][math.ceil(r["iters"] / 10) * 10] <= res["target"]
        assert 1 <= r["iters"] <= 30
        # interpolated between the two measured fits (timings only, no order assumed)
        assert min(r["t1"], r["t"]) - 1e-9 <= r["t_equal"] <= max(r["t1"], r["t"]) + 1e-9

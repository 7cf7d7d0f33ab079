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


def test_full_job_interleaves_pairs_and_reports_their_ratios(monkeypatch, tmp_path):
    """`--pairs`: the trees alternate which runs first, and each pair's ratio is its own."""
    import bench.bench_rerankers as br

    runs, cpu = [], {"baseline": [100.0, 110.0, 90.0], "current": [60.0, 70.0, 63.0]}

    def fake_run(root, overrides, tmp):
        name = "baseline" if root == tmp_path else "current"
        runs.append(name)
        return {"wall_s": 1.0, "cpu_s": cpu[name].pop(0), "peak_gib": 1.0, "run": tmp}

    monkeypatch.setattr(br, "run_job", fake_run)
    monkeypatch.setattr(br, "CACHE", tmp_path)
    checked = []
    monkeypatch.setattr(br, "_same_model_checks", lambda run, *a: checked.append(run) or {})
    out = br.full_job(tmp_path / "t", tmp_path / "f", tmp_path, pairs=3)
    assert runs == ["baseline", "current", "current", "baseline", "baseline", "current"]
    q = out["ratios"]
    assert q["each"] == pytest.approx([0.6, 70 / 110, 0.7])
    assert (q["n"], q["low"], q["high"]) == (3, pytest.approx(0.6), pytest.approx(0.7))
    assert q["median"] == pytest.approx(70 / 110)
    assert [p["baseline"]["cpu_s"] for p in out["pairs"]] == [100.0, 110.0, 90.0]
    assert checked == [out["pairs"][0]["baseline"]["run"]]  # the first pair's baseline models

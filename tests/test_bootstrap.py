"""The vectorised prompt bootstrap equals a slow reference loop; self-gains are zero."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from specrank.statistics.bootstrap import (
    PromptSums,
    bootstrap_means,
    percentile_interval,
    relative_gain,
    resample_weights,
    task_resample_weights,
    weighted_means,
)


def _rounds(seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(12):
        task = ["qa", "coding", "writing"][p % 3]
        for r in range(rng.integers(1, 9)):
            a = rng.gamma(2.0)
            rows.append(
                {"prompt_id": f"p{p}", "task": task, "round": r, "draft": a, "root": a * 1.1 + 0.05}
            )
    return pd.DataFrame(rows)


def _slow_means(
    frame: pd.DataFrame, counts: np.ndarray, prompts: np.ndarray, weighting: str
) -> dict:
    """Reference: materialise the resampled rounds and average them explicitly."""
    parts = []
    for copy, (pid, n) in enumerate(zip(prompts, counts, strict=True)):
        for k in range(int(n)):
            part = frame[frame.prompt_id == pid].copy()
            part["copy"] = f"{copy}-{k}"
            parts.append(part)
    data = pd.concat(parts)
    if weighting == "round":
        return data[["draft", "root"]].mean().to_dict()
    if weighting == "prompt":
        return data.groupby("copy")[["draft", "root"]].mean().mean().to_dict()
    return data.groupby("task")[["draft", "root"]].mean().mean().to_dict()


@pytest.mark.parametrize("weighting", ["round", "prompt", "task"])
def test_vectorised_bootstrap_matches_slow_loop(weighting):
    frame = _rounds()
    stats = PromptSums.from_rounds(frame, ["draft", "root"])
    if weighting == "task":
        w = task_resample_weights(stats.tasks, 20, seed=1)
    else:
        w = resample_weights(len(stats.prompts), 20, seed=1)
    fast = weighted_means(stats, weighting, w)
    for b in range(20):
        ref = _slow_means(frame, w[b], stats.prompts, weighting)
        assert fast[b, 0] == pytest.approx(ref["draft"], rel=1e-12)
        assert fast[b, 1] == pytest.approx(ref["root"], rel=1e-12)


def test_point_estimates_are_plain_means():
    frame = _rounds(3)
    stats = PromptSums.from_rounds(frame, ["draft", "root"])
    point, draws = bootstrap_means(stats, "round", n_resamples=50, seed=0)
    assert point[0] == pytest.approx(frame["draft"].mean())
    assert draws.shape == (50, 2)


def test_gain_of_a_rule_against_itself_is_exactly_zero():
    stats = PromptSums.from_rounds(_rounds(4), ["draft", "root"])
    for weighting in ("round", "prompt", "task"):
        point, draws = bootstrap_means(stats, weighting, n_resamples=200, seed=2)
        gains = relative_gain(draws[:, 0], draws[:, 0])
        assert (gains == 0).all()
        iv = percentile_interval(relative_gain(point[0], point[0]), gains)
        assert (iv.estimate, iv.low, iv.high) == (0.0, 0.0, 0.0)


def test_interval_covers_a_known_gain():
    stats = PromptSums.from_rounds(_rounds(5), ["draft", "root"])
    point, draws = bootstrap_means(stats, "round", n_resamples=2000, seed=3)
    iv = percentile_interval(
        relative_gain(point[1], point[0]), relative_gain(draws[:, 1], draws[:, 0])
    )
    assert iv.low <= iv.estimate <= iv.high
    assert iv.low > 0.1  # root = 1.1 * draft + 0.05 in every round: the gain exceeds 10%


def test_prompts_with_two_task_labels_are_refused():
    frame = _rounds()
    frame.loc[frame.index[0], "task"] = "other"
    with pytest.raises(ValueError, match="more than one task"):
        PromptSums.from_rounds(frame, ["draft"])


def test_matched_pearl_hits_the_target_size_in_every_resample():
    from rerank.report.summary import matched_pearl

    rng = np.random.default_rng(0)
    n_prompts, width = 15, 40
    rounds = rng.integers(1, 6, n_prompts).astype(float)
    # per-round curves are non-decreasing; per-prompt sums are sums of such curves
    size = np.cumsum(rng.random((n_prompts, width)), axis=1) * rounds[:, None]
    value = np.cumsum(rng.random((n_prompts, width)) * 0.1, axis=1) * rounds[:, None]
    w = resample_weights(n_prompts, 50, seed=1)
    mean_size = (w @ size) / (w @ rounds)[:, None]
    target = mean_size[:, 10] + 0.37 * (mean_size[:, 11] - mean_size[:, 10])
    mean_value = (w @ value) / (w @ rounds)[:, None]
    v, b = matched_pearl(mean_value, mean_size, target)
    np.testing.assert_allclose(b, 11.37, rtol=1e-9)  # budgets are 1-based: between 11 and 12
    np.testing.assert_allclose(
        v, mean_value[:, 10] + 0.37 * (mean_value[:, 11] - mean_value[:, 10])
    )
    # a target beyond the whole pool cannot be matched
    v2, _ = matched_pearl(mean_value, mean_size, mean_size[:, -1] + 1.0)
    assert np.isnan(v2).all()


def test_node_equivalent_budget_is_the_first_draft_budget_reaching_the_value():
    from rerank.report.summary import node_equivalent_budget

    curve = np.array([[0.5, 1.0, 1.5, 1.5, 2.0]] * 5)
    value = np.array([1.0, 1.2, 1.5, 2.5, 1.0 + 1e-12])
    got = node_equivalent_budget(curve, value)
    # 1.0 at budget 2; 1.2 first reached at 3; 1.5 at 3 (not the plateau's end);
    # beyond the pool: NaN; a summation-order hair above a draft value: still that budget
    np.testing.assert_array_equal(got, [2.0, 3.0, 3.0, np.nan, 2.0])


def test_the_products_run_on_one_blas_thread_and_the_count_comes_back(monkeypatch) -> None:
    from threadpoolctl import threadpool_info

    from specrank.statistics import bootstrap

    def blas_threads() -> set[int]:
        return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}

    before, inside = blas_threads(), []
    own = bootstrap._weighted_means
    monkeypatch.setattr(bootstrap, "_weighted_means",
                        lambda *a: inside.append(blas_threads()) or own(*a))  # fmt: skip
    frame = pd.DataFrame({"prompt_id": ["a", "a", "b", "c"], "task": ["t"] * 4,
                          "v": [1.0, 2.0, 3.0, 4.0]})  # fmt: skip
    stats = PromptSums.from_rounds(frame, ["v"])
    got = bootstrap.weighted_means(stats, "round", resample_weights(3, 50, 0))
    assert inside == [{1}]
    assert blas_threads() == before
    np.testing.assert_allclose(got[:, 0], (resample_weights(3, 50, 0) @ [3.0, 3.0, 4.0])
                               / (resample_weights(3, 50, 0) @ [2.0, 1.0, 1.0]))  # fmt: skip

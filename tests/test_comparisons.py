"""Paired comparisons between rules, both node-budget directions, the paper's top-1 agreement."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from rerank.evaluate.curves import PromptCurves
from rerank.fit.predict import FirstFactorPredictions
from rerank.fit.quality import prediction_quality
from rerank.report.comparisons import check_comparisons, compare, parse_comparisons
from rerank.report.summary import law_draws, summarise_draws
from specrank.statistics.bootstrap import resample_weights

N_RES = 300


def _rounds(seed: int = 0) -> pd.DataFrame:
    """Per-round values of three rules for 8 prompts of 2 tasks, uneven round counts."""
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(8):
        for r in range(2 + p % 3):
            draft = rng.uniform(1, 3)
            rows.append({"prompt_id": f"p{p}", "task": "ab"[p % 2], "temperature": 1.0,
                         "round_index": r, "draft@B8": draft, "root@B8": draft + rng.uniform(0, 1),
                         "rows_lgbm@B8": draft + rng.normal(0.1, 0.3)})  # fmt: skip
    return pd.DataFrame(rows)


def _slow_round_gains(frame: pd.DataFrame, a: str, b: str) -> tuple[float, np.ndarray]:
    """Reference: resample prompts with the same counts, recompute round-weighted means by hand."""
    prompts = sorted(frame["prompt_id"].unique())
    w = resample_weights(len(prompts), N_RES, 0)
    point = frame[a].mean() / frame[b].mean() - 1
    draws = []
    for counts in w:
        parts = [frame[frame["prompt_id"] == p] for p, c in zip(prompts, counts, strict=True)
                 for _ in range(int(c))]  # fmt: skip
        sample = pd.concat(parts)
        draws.append(sample[a].mean() / sample[b].mean() - 1)
    return point, np.array(draws)


def test_paired_comparison_equals_a_slow_reference():
    frame = _rounds()
    draws = law_draws(frame, N_RES, seed=0, weightings=("round",))
    got = compare(draws, [("rows_lgbm", "root")]).iloc[0]
    point, ref = _slow_round_gains(frame, "rows_lgbm@B8", "root@B8")
    lo, hi = np.percentile(ref, [2.5, 97.5])
    assert got["gain"] == pytest.approx(point, rel=1e-12)
    assert got["gain_lo"] == pytest.approx(lo, rel=1e-9)
    assert got["gain_hi"] == pytest.approx(hi, rel=1e-9)


def test_a_rule_against_itself_is_zero_and_swapping_flips_the_sign():
    draws = law_draws(_rounds(1), N_RES, seed=0)
    same = compare(draws, [("root", "root")])
    assert len(same) == 3  # round, prompt, task weighting
    assert (same[["gain", "gain_lo", "gain_hi", "emitted_gain"]].to_numpy() == 0).all()
    ab = compare(draws, [("root", "draft")]).set_index("weighting")
    ba = compare(draws, [("draft", "root")]).set_index("weighting")
    assert (np.sign(ab["gain"]) == -np.sign(ba["gain"])).all()
    assert (np.sign(ab["emitted_gain"]) == -np.sign(ba["emitted_gain"])).all()
    # root is draft plus a non-negative amount in every round: every resample agrees
    assert (ab["gain_lo"] >= 0).all() and (ba["gain_hi"] <= 0).all()


def test_comparisons_use_the_summarys_resamples():
    """The comparison against draft is the summary's gain vs draft, interval included."""
    draws = law_draws(_rounds(2), N_RES, seed=3)
    summary = summarise_draws(draws).set_index(["weighting", "rule"])
    comp = compare(draws, [("rows_lgbm", "draft")]).set_index("weighting")
    for weighting in ("round", "prompt", "task"):
        s = summary.loc[(weighting, "rows_lgbm")]
        for k in ("gain", "gain_lo", "gain_hi"):
            assert comp.loc[weighting, k] == pytest.approx(s[k], rel=1e-12)


def test_comparison_settings_are_parsed_and_checked():
    assert parse_comparisons(["rows:base", "root_draw:pearl"], "hgb") == [
        ("rows_hgb", "base_hgb"),
        ("root_draw", "pearl"),
    ]
    for bad in ("rows", "rows:", ":base", "a:b:c"):
        with pytest.raises(ValueError, match=r"entries must read 'rule_a:rule_b'"):
            parse_comparisons([bad], "hgb")
    with pytest.raises(ValueError, match=r"does not evaluate: \['iso_q1'\]; its rules are"):
        check_comparisons([("iso_q1", "draft")], {"draft", "root"})


def test_node_budgets_in_both_directions():
    """Draft reaches root's value at B=2 at budget 3; root reaches draft's value at B=2 at 1."""
    frame = pd.DataFrame(
        [
            {
                "prompt_id": f"p{i}",
                "task": "t",
                "temperature": 0.0,
                "round_index": 0,
                "draft@B2": 1.0,
                "root@B2": 2.0,
            }
            for i in range(2)
        ]
    )
    curves = PromptCurves()
    keys = [(0.0, "p0"), (0.0, "p1")]
    curves.sums["draft"] = {k: np.array([0.5, 1.0, 2.0, 2.5]) for k in keys}
    curves.sums["root"] = {k: np.array([1.0, 2.0, 2.5, 3.0]) for k in keys}
    summary = summarise_draws(law_draws(frame, 50, weightings=("round",), curves=curves))
    root = summary[summary["rule"] == "root"].iloc[0]
    assert root["node_budget"] == 3.0  # smallest B with draft curve >= 2.0
    assert root["rule_budget"] == 1.0  # smallest B with root curve >= draft@B2 = 1.0
    assert summary[summary["rule"] == "draft"].iloc[0]["node_budget"] == 2.0


def test_top1_agreement_is_the_papers():
    """Greedy: rounds whose first level lacks the argmax do not count; sampling: the most
    probable first-level candidate, not the overall argmax flag."""
    keys = {"rule": "draft", "budget": 8, "fold": 0}
    rows = [
        # greedy round 0: argmax at cand 1; the predictor ranks cand 1 first -> hit
        (0.0, "p0", 0, 0, 0.9, 0.2, 0, 0.3), (0.0, "p0", 0, 1, 0.1, 0.8, 1, 0.6),
        # greedy round 1: the argmax is not on the first level -> not counted
        (0.0, "p0", 1, 0, 0.7, 0.9, 0, 0.2), (0.0, "p0", 1, 1, 0.3, 0.1, 0, 0.1),
        # sampling round: cand 0 is the most probable first-level candidate; pred ranks 1 first
        (1.0, "p1", 0, 0, 0.6, 0.3, 0, 0.5), (1.0, "p1", 0, 1, 0.4, 0.7, 0, 0.2),
    ]  # fmt: skip
    cols = ["temperature", "prompt_id", "round_index", "cand_index", "draft_prob", "rows_lgbm",
            "label_is_argmax", "label_target_prob"]  # fmt: skip
    frame = pd.DataFrame(rows, columns=cols).assign(**keys)
    preds = FirstFactorPredictions(
        frame.drop(columns=["draft_prob", "label_is_argmax", "label_target_prob"]),
        ["rows_lgbm"], {}, {},
    )  # fmt: skip
    q = prediction_quality(frame.drop(columns=["rows_lgbm", "fold"]), preds)
    q = q[q["fold"] == "all"].set_index(["temperature", "predictor"])
    assert q.loc[(0.0, "rows_lgbm"), "top1_agreement"] == 1.0  # one eligible round, a hit
    assert q.loc[(0.0, "rows_lgbm"), "top1_rounds"] == 1
    assert q.loc[(0.0, "draft_prob"), "top1_agreement"] == 0.0  # draft ranks cand 0 first
    assert q.loc[(1.0, "rows_lgbm"), "top1_agreement"] == 0.0
    assert q.loc[(1.0, "draft_prob"), "top1_agreement"] == 1.0


def test_breakdown_gains_are_the_summary_of_each_groups_rounds():
    """A group's gain and interval = the round-weighted summary of that group's rounds alone."""
    from rerank.report.breakdowns import breakdown_gains

    frame = _rounds(4)
    frame["category"] = frame["task"] + "_x"
    frame["draft_top_is_argmax"] = True
    frame["root_entropy"] = np.random.default_rng(0).uniform(size=len(frame))
    got = breakdown_gains(frame, N_RES, seed=5)
    for task in ("a", "b"):
        part = frame[frame["task"] == task]
        ref = summarise_draws(law_draws(part, N_RES, seed=5, weightings=("round",)))
        ref = ref.set_index("rule")
        row = got[(got["by"] == "task") & (got["group"] == task)].set_index("rule")
        for rule in ("root", "rows_lgbm"):
            for k in ("accepted", "gain", "gain_lo", "gain_hi"):
                assert row.loc[rule, k] == pytest.approx(ref.loc[rule, k], rel=1e-12), (task, k)
    assert set(got["by"]) == {"task", "category", "entropy_quintile", "draft_top_is_argmax"}

"""Rules compared in one online run (`run.rules`, decode.compare): order, pairing, ratios, the
offline prediction beside the realized tau, and the refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest

import decode.session as session
from decode.compare import rule_specs
from decode.config import RunConfig
from decode.metrics import expected_values
from decode.predicted import (
    minus_first,
    offline_prompt_sums,
    offline_text,
    predicted_rounds,
    recorded_tokens,
)
from decode.run import run_online
from decode.session import Arm, arm_order, decode_all
from pairs.config import DataConfig, PromptSource
from pairs.prompts import Prompt
from specrank.settings.config import MlflowConfig
from specrank.store.trace_schema import trace_store
from tests.online_fixtures import PROMPTS, fitted_reranker, settings
from tests.tiny_models import one_thread, tiny_model_config, tiny_pair


def _data(tmp_path: Path, prompts: list[Prompt]) -> DataConfig:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": p.id, "task": p.task, "prompt": p.text}) + "\n"
                            for p in prompts))  # fmt: skip
    return DataConfig(name="tiny", sources=[PromptSource(kind="jsonl", path=str(path))])


def test_rule_order_rotates_with_the_prompt_position():
    assert [arm_order(["a", "b"], i) for i in range(4)] == [["a", "b"], ["b", "a"]] * 2
    leads = [arm_order(["a", "b", "c"], i)[0] for i in range(6)]
    assert leads == ["a", "b", "c", "a", "b", "c"]
    assert sorted(arm_order(["a", "b", "c"], 4)) == ["a", "b", "c"]  # every rule, once


def test_decode_all_alternates_the_rules_across_prompts(tmp_path, monkeypatch):
    """The decoding loop itself, not only the helper: which rule decodes first at each prompt
    (and at a Ray shard's `start`), every rule and budget once per prompt."""
    pair = tiny_pair(tmp_path / "models", "llama")
    calls: list[tuple[str, str, int]] = []
    real = session.decode_prompt

    def spy(target, drafter, prompt, s, *args, **kw):
        calls.append((args[1], s.rule, s.base.select.budget))  # (prompt id, rule, budget)
        return real(target, drafter, prompt, s, *args, **kw)

    monkeypatch.setattr(session, "decode_prompt", spy)
    arms = [Arm("draft", settings("draft", max_new_tokens=4)),
            Arm("root", settings("root", max_new_tokens=4))]  # fmt: skip
    run = RunConfig(warmup_prompts=0, baseline=False, progress=False, budgets=[3])
    with one_thread():
        out = decode_all(pair, PROMPTS[:4], arms, run)
    firsts = [next(r for p, r, _ in calls if p == q.id) for q in PROMPTS[:4]]
    assert firsts == ["draft", "root", "draft", "root"]
    for q in PROMPTS[:4]:
        assert sorted((r, b) for p, r, b in calls if p == q.id) == [
            ("draft", 3), ("draft", 6), ("root", 3), ("root", 6)
        ]  # fmt: skip
    assert {label: sorted(b) for label, b in out.items()} == {"draft": [3, 6], "root": [3, 6]}
    calls.clear()
    with one_thread():
        decode_all(pair, PROMPTS[:2], arms, run, start=3)  # a shard starting at position 3
    assert [next(r for p, r, _ in calls if p == q.id) for q in PROMPTS[:2]] == ["root", "draft"]


def test_rules_in_one_run_are_paired_and_logged(tmp_path):
    """draft, a fitted reranker and root decode every prompt at T=0: each rule's output is the
    target's greedy output; the ratios are the rules' own tau over draft's, recomputed here from
    the prompt tables; the first rule's ratio is 1; tables, plot and metrics reach MLflow."""
    model_cfg = tiny_model_config(tmp_path / "models", "llama")
    with one_thread():
        saved = fitted_reranker(tmp_path / "rr", tiny_pair(tmp_path / "models", "llama"), 0.0)
    tracking = MlflowConfig(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}", experiment="cmp")
    run = RunConfig(rules=["draft", f"reranker:{saved}", "root"], warmup_prompts=1,
                    bootstrap_resamples=200, progress=False, seen_prompts="allow")  # fmt: skip
    s = settings("draft", max_new_tokens=16)
    config = {"run": dataclasses.asdict(run)}
    with one_thread():
        report = run_online(model_cfg, _data(tmp_path, PROMPTS[:4]), s, run, tracking, config,
                            tmp_path / "out")  # fmt: skip
    labels = ["draft", "reranker_rows_lgbm", "root"]
    table = report.compare.set_index("rule")
    assert list(table.index) == labels and (table["prompts"] == 4).all()
    for label in labels:
        p = report.prompts[report.prompts["rule"] == label]
        assert p["prompt_id"].tolist() == [q.id for q in PROMPTS[:4]]
        assert table.loc[label, "tau"] == pytest.approx(p["emitted"].sum() / p["rounds"].sum())
        m = report.metrics
        assert m[f"online/{label}/greedy_output_matches_baseline"] == 1.0
        assert m[f"online/{label}/tau"] == pytest.approx(table.loc[label, "tau"])
        row = table.loc[label]
        for name in ("tau_ratio", "tokens_per_s_ratio"):
            assert row[f"{name}_lo"] <= row[name] <= row[f"{name}_hi"]
    rounds = report.rounds.groupby("rule")["scored"].mean()  # what each pass scored: its tree
    assert table["scored_prefixes"].to_dict() == pytest.approx(rounds.to_dict())
    assert (table["scored_prefixes"] <= 6).all()  # run.score=tree at B=6
    draft_tau = table.loc["draft", "tau"]
    assert table.loc["root", "tau_ratio"] == pytest.approx(table.loc["root", "tau"] / draft_tau)
    first = table.loc["draft"]
    assert (first["tau_ratio"], first["tau_ratio_lo"], first["tau_ratio_hi"]) == (1.0, 1.0, 1.0)
    assert report.metrics["compare/B6/root/tau_ratio"] == table.loc["root", "tau_ratio"]
    assert set(report.groups["rule"]) == set(labels)
    data = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri).get_run(report.run_id)
    assert data.data.tags["rule"] == "+".join(labels) and data.data.tags["reranker"] == str(saved)
    client = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri)
    logged = {f.path for d in ("tables", "plots") for f in client.list_artifacts(report.run_id, d)}
    assert {"tables/online_compare.csv", "plots/online_compare.png"} <= logged


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The tiny pair's model config and a recording of PROMPTS (draft at B=6, T=0, 24 new
    tokens, run.score=record: decode.record's rounds) with its rows."""
    root = tmp_path_factory.mktemp("recorded")
    pair = tiny_pair(root / "models", "llama")
    with one_thread():
        fitted_reranker(root / "rr", pair, 0.0)  # records PROMPTS into rr/traces
    rows = trace_store(root / "rr" / "traces").dataset().to_table().to_pylist()
    return tiny_model_config(root / "models", "llama"), rows


def _offline_frame(rows: list[dict]) -> pd.DataFrame:
    """The recording's keys, with its rule and budget as rerank.transfer writes them."""
    return pd.DataFrame({k: [r[k] for r in rows]
                         for k in ("prompt_id", "temperature", "rule", "budget")})  # fmt: skip


def _renewal_tau(frame: pd.DataFrame, col: str, recorded: str) -> float:
    """By hand: sum_p L_p / sum_p (L_p / v_p) over the frame's prompts, L_p = the recording's
    tokens (its column + 1 summed), v_p = `col`'s mean + 1 there."""
    g = frame.groupby("prompt_id")
    tokens, v = g[recorded].sum() + g.size(), g[col].mean() + 1
    return float(tokens.sum() / (tokens / v).sum())


def test_offline_prediction_of_a_separate_recording_meets_the_realized_tau(tmp_path, recorded):
    """A separate recording of the same prompts (decode.record's rounds, draft at B=6, T=0)
    gives each rule's offline prediction. Draft's recorded rounds are the online rounds, so
    realized equals predicted exactly; root's prediction is its own offline mean."""
    model_cfg, rows = recorded
    frame = _offline_frame(rows)
    frame["draft@B6"] = expected_values(rows, "draft", 6)
    frame["root@B6"] = expected_values(rows, "root", 6)
    path = tmp_path / "offline.parquet"
    frame.drop(columns="root@B6").to_parquet(path)
    run = RunConfig(rules=["draft", "root"], offline=str(path), warmup_prompts=0,
                    baseline=False, bootstrap_resamples=100, progress=False)  # fmt: skip
    s = settings("draft")  # 24 new tokens, as the recording
    data = _data(tmp_path, PROMPTS)
    with pytest.raises(ValueError, match=r"no offline value 'root@B6' \(rule root at B=6\)"):
        run_online(model_cfg, data, s, run, None, {}, tmp_path / "o0")  # before any decode
    frame.to_parquet(path)
    with one_thread():
        report = run_online(model_cfg, data, s, run, None, {}, tmp_path / "o")
    off = report.offline.set_index("rule")
    assert off.loc["draft", "realized_minus_offline"] == pytest.approx(0.0, abs=1e-12)
    assert off.loc["draft", "realized_minus_offline_lo"] == pytest.approx(0.0, abs=1e-12)
    assert off.loc["draft", "realized_minus_offline_hi"] == pytest.approx(0.0, abs=1e-12)
    assert frame[["rule", "budget"]].drop_duplicates().values.tolist() == [["draft", 6]]
    assert off.loc["root", "offline_tau"] == pytest.approx(
        _renewal_tau(frame, "root@B6", "draft@B6")
    )
    assert off.loc["root", "offline_round_mean"] == pytest.approx(1 + frame["root@B6"].mean())
    # root emits more per round than draft, on some prompts more than on others: the two differ
    assert off.loc["root", "offline_tau"] != pytest.approx(off.loc["root", "offline_round_mean"])
    # against the first rule (draft, exact here): root's own part is its whole difference
    assert (off["against_first"] == "draft").all()
    assert off.loc["draft", "minus_first"] == pytest.approx(0.0, abs=1e-12)
    assert off.loc["root", "minus_first"] == pytest.approx(
        off.loc["root", "realized_minus_offline"]
    )
    assert report.metrics["offline/B6/root/offline_tau"] == off.loc["root", "offline_tau"]


def test_draft_at_b_plus_m_is_predicted_by_draft_scored(tmp_path, recorded):
    """Under run.score=top_m (B=6, M=2) draft@+2's offline prediction is draft_scored@B6:
    draft's tree of B + M = 8 nodes at the recorded rounds, here draft at 8 of the recording
    by hand; an offline run of another M (10 prefixes a pass) is refused, naming both."""
    model_cfg, rows = recorded
    frame = _offline_frame(rows)
    frame["draft@B6"] = expected_values(rows, "draft", 6)
    frame["draft_scored@B6"] = expected_values(rows, "draft", 8)
    # draft at 8 differs from draft at 6 here, so the prediction below names its column
    assert frame["draft_scored@B6"].mean() > frame["draft@B6"].mean()
    frame["scored/draft@B6"] = 10.0
    path = tmp_path / "offline.parquet"
    frame.to_parquet(path)
    run = RunConfig(rules=["draft", "draft@+2"], score="top_m", score_top_m=2, offline=str(path),
                    warmup_prompts=0, baseline=False, bootstrap_resamples=100, progress=False)  # fmt: skip
    s, data = settings("draft", score="top_m", top_m=2), _data(tmp_path, PROMPTS)
    with pytest.raises(ValueError, match=r"draft@\+2 is predicted by draft_scored@B6, .* B \+ M "
                       r"= 8 nodes, but .* at most 10\.0 prefixes"):  # fmt: skip
        run_online(model_cfg, data, s, run, None, {}, tmp_path / "o0")  # before any decode
    frame["scored/draft@B6"] = 8.0
    frame.to_parquet(path)
    with one_thread():
        report = run_online(model_cfg, data, s, run, None, {}, tmp_path / "o")
    off = report.offline.set_index("rule")
    assert off.loc["draft_plus2", "offline_rule"] == "draft_scored"
    assert off.loc["draft_plus2", "offline_tau"] == pytest.approx(
        _renewal_tau(frame, "draft_scored@B6", "draft@B6")
    )
    assert off.loc["draft", "realized_minus_offline"] == pytest.approx(0.0, abs=1e-12)


def test_the_offline_comparison_prints_its_interval_as_a_share_of_tau():
    """Issue 28's bound is +-3% of tau: the printed line gives the interval's ends as shares."""
    table = pd.DataFrame({"budget": [8], "rule": ["reranker_rows_lgbm"], "realized_tau": [2.5],
                          "offline_tau": [2.52], "offline_round_mean": [2.6],
                          "realized_minus_offline": [-0.02], "realized_minus_offline_lo": [-0.1],
                          "realized_minus_offline_hi": [0.05],
                          "against_first": ["reranker_rows_lgbm"]})  # fmt: skip
    line = offline_text(table, "x").splitlines()[1]
    assert "offline  2.520 (round mean 2.600)" in line
    assert line.endswith("diff -0.020 [-0.100, +0.050] = [-4.0%, +2.0%] of realized tau")


def test_a_rules_offline_gap_minus_the_first_rules_is_paired_by_prompt():
    # rule gap over p0, p1: 30/15 - 33/15 = -0.2; the first rule's over the same prompts:
    # 15/6 - 12/6 = +0.5 (its p9, which the rule did not decode, would make it 14.7)
    cols = ["real", "real_rounds", "pred", "pred_rounds"]
    rule = pd.DataFrame([[10, 5, 8, 5], [20, 10, 25, 10]], index=["p0", "p1"], columns=cols)
    first = pd.DataFrame([[9, 3, 6, 3], [100, 1, 0, 1], [6, 3, 6, 3]], index=["p1", "p9", "p0"],
                         columns=cols)  # fmt: skip
    iv = minus_first(rule, first, 500, 0)
    assert iv.estimate == pytest.approx(-0.7)
    assert iv.low <= iv.estimate <= iv.high and iv.low < iv.high
    with pytest.raises(ValueError, match="no prompt was decoded by both"):
        minus_first(rule, first.drop(index=["p0", "p1"]), 500, 0)
    table = pd.DataFrame({"budget": [8, 8], "rule": ["draft", "reranker_rows_lgbm"],
                          "realized_tau": [2.5, 2.6], "offline_tau": [2.5, 2.7],
                          "offline_round_mean": [2.5, 2.7], "realized_minus_offline": [0.0, -0.1],
                          "realized_minus_offline_lo": [0.0, -0.2],
                          "realized_minus_offline_hi": [0.0, 0.0],
                          "against_first": ["draft", "draft"], "minus_first": [0.0, -0.1],
                          "minus_first_lo": [0.0, -0.15], "minus_first_hi": [0.0, -0.05]})  # fmt: skip
    lines = offline_text(table, "x").splitlines()
    assert lines[1].endswith("of realized tau")  # the first rule: nothing to subtract
    assert lines[2].endswith("of realized tau; minus draft's -0.100 [-0.150, -0.050]")


def test_offline_values_refuse_missing_prompts_and_laws():
    values = pd.DataFrame({"prompt_id": ["p0", "p0", "p1"], "temperature": [0.0] * 3,
                           "draft@B8": [1.0, 2.0, 0.0]})  # fmt: skip
    sums, rounds = offline_prompt_sums(values, "draft", 8, 0.0, ["p1", "p0"], "x")
    assert sums.tolist() == [1.0, 5.0] and rounds.tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match=r"1 of the run's 2 prompts .*\['p9'\]"):
        offline_prompt_sums(values, "draft", 8, 0.0, ["p0", "p9"], "x")
    with pytest.raises(ValueError, match=r"no rounds of the sampling law"):
        offline_prompt_sums(values, "draft", 8, 1.0, ["p0"], "x")
    with pytest.raises(ValueError, match=r"no offline value 'root@B8'.*\['draft@B8'\]"):
        offline_prompt_sums(values, "root", 8, 0.0, ["p0"], "x")


def test_the_prediction_weighs_each_prompt_by_the_rules_own_rounds():
    """Prompt a: 100 recorded tokens, 2 a round (50 rounds), where a rule emits 4 a round;
    prompt b: 100 tokens, 1 a round (100 rounds), the rule too. Decoding both, the rule takes
    25 + 100 rounds for 200 tokens: tau 1.6. The mean over the recorded rounds says
    (50 x 4 + 100 x 1) / 150 = 2.0, weighing a by the recording's 50 rounds, not the rule's 25."""
    values = pd.DataFrame({"prompt_id": ["a"] * 50 + ["b"] * 100, "temperature": 0.0,
                           "rule": "draft", "budget": 8, "draft@B8": [1.0] * 50 + [0.0] * 100,
                           "root@B8": [3.0] * 50 + [0.0] * 100})  # fmt: skip
    tokens = recorded_tokens(values, 0.0, ["b", "a"], "x")
    assert tokens.tolist() == [100.0, 100.0]
    sums, rounds = offline_prompt_sums(values, "root", 8, 0.0, ["b", "a"], "x")
    assert predicted_rounds(tokens, sums, rounds).tolist() == [100.0, 25.0]
    assert sums.sum() / rounds.sum() == 2.0
    # the recording's own rule is predicted by its own rounds
    sums, rounds = offline_prompt_sums(values, "draft", 8, 0.0, ["b", "a"], "x")
    assert predicted_rounds(tokens, sums, rounds).tolist() == rounds.tolist() == [100.0, 50.0]
    with pytest.raises(ValueError, match=r"no 'rule' and 'budget' columns"):
        recorded_tokens(values.drop(columns="budget"), 0.0, ["a"], "x")
    with pytest.raises(ValueError, match=r"no offline value 'draft@B59' of the recording's own "
                       r"tree \(draft at B=59\)"):  # fmt: skip
        recorded_tokens(values.assign(budget=59), 0.0, ["a"], "x")
    with pytest.raises(ValueError, match=r"1 of the run's 2 prompts .*\['p9'\]"):
        recorded_tokens(values, 0.0, ["a", "p9"], "x")


def test_rule_lists_are_checked_by_name():
    assert rule_specs([], "draft", None)[0].rule == "draft"
    specs = rule_specs(["draft", "reranker", "reranker:b"], "draft", "a")
    assert [(p.rule, p.reranker) for p in specs] == [("draft", None), ("reranker", "a"),
                                                     ("reranker", "b")]  # fmt: skip
    with pytest.raises(ValueError, match=r"run.rules\[1\]' must be one of"):
        rule_specs(["draft", "oracle"], "draft", None)
    with pytest.raises(ValueError, match=r"run.rules\[0\]' must be one of .*'draft:x'"):
        rule_specs(["draft:x"], "draft", None)
    with pytest.raises(ValueError, match="must not repeat a rule"):
        rule_specs(["draft", "draft"], "draft", None)
    with pytest.raises(ValueError, match=r"run.rules\[0\]=reranker names no model"):
        rule_specs(["reranker"], "draft", None)
    with pytest.raises(ValueError, match=r"run\.rule=reranker needs run\.reranker"):
        rule_specs([], "reranker", None)


def test_a_rule_at_extra_budget_is_parsed_and_refused_where_it_means_nothing():
    specs = rule_specs(["draft", "draft@+4", "root_draw@+12", "draft@-4"], "draft", None)
    assert [(p.rule, p.extra_budget) for p in specs] == [("draft", 0), ("draft", 4),
                                                         ("root_draw", 12), ("draft", -4)]  # fmt: skip
    for bad in (["draft", "draft@+0"], ["draft", "draft@4"], ["draft", "reranker@+4:x"],
                ["draft@+4", "root"], ["draft", "draft@-0"], ["draft", "draft@--2"]):  # fmt: skip
        with pytest.raises(ValueError, match=r"run.rules\[\d\]' with '@' must be <rule>@\+N"):
            rule_specs(bad, "draft", None)


def test_draft_at_b_plus_m_scores_its_tree_in_the_same_run(tmp_path, monkeypatch):
    """Under run.score=top_m (M=4, B=6) `draft@+4` decodes at B + M = 10 scoring its tree
    only, paired with draft at B=6 (which scores its tree and M more): both lossless, every
    prompt by both; a budget beyond the pool is refused before any model."""
    model_cfg = tiny_model_config(tmp_path / "models", "llama")
    calls: list[tuple[str, int, str]] = []
    real = session.decode_prompt

    def spy(target, drafter, prompt, s, *args, **kw):
        calls.append((args[1], s.base.select.budget, s.score))
        return real(target, drafter, prompt, s, *args, **kw)

    monkeypatch.setattr(session, "decode_prompt", spy)
    s = settings("draft", score="top_m", max_new_tokens=12)
    run = RunConfig(rules=["draft", "draft@+4"], score="top_m", score_top_m=4, warmup_prompts=0,
                    bootstrap_resamples=50, progress=False)  # fmt: skip
    with one_thread():
        report = run_online(model_cfg, _data(tmp_path, PROMPTS[:2]), s, run, None, {},
                            tmp_path / "o")  # fmt: skip
    table = report.compare.set_index("rule")
    assert list(table.index) == ["draft", "draft_plus4"]
    assert sorted(set(calls)) == sorted({(q.id, b, sc) for q in PROMPTS[:2]
                                         for b, sc in ((6, "top_m"), (10, "tree"))})  # fmt: skip
    rounds = report.rounds.groupby("rule")["scored"].mean()
    assert table["scored_prefixes"].to_dict() == pytest.approx(rounds.to_dict())
    for label in table.index:
        assert report.metrics[f"online/{label}/greedy_output_matches_baseline"] == 1.0
    too_big = dataclasses.replace(run, rules=["draft", "draft@+100000"])
    with pytest.raises(ValueError, match=r"run.rules\[1\] \(draft@\+100000\) at budget 6"):
        run_online(model_cfg, _data(tmp_path, PROMPTS[:2]), s, too_big, None, {}, tmp_path / "x")


def test_several_rules_refuse_trace_recording(tmp_path):
    model_cfg = tiny_model_config(tmp_path / "models", "llama")
    run = RunConfig(rules=["draft", "root"], score="record", record_traces=True,
                    traces_out=str(tmp_path / "t"), progress=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"record_traces=true writes one rule's rounds.*names 2"):
        run_online(model_cfg, _data(tmp_path, PROMPTS[:2]), settings("draft", score="record"),
                   run, None, {}, tmp_path / "o")  # fmt: skip
    assert not np.any([p.exists() for p in (tmp_path / "t", tmp_path / "o")])

"""The main job end to end on small synthetic traces, and invariants of the evaluation."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from bench.bench_rerankers import same_model_values
from bench.pool_pass import ROOT, child_pass
from features.extract import extract
from features.schema import candidate_store
from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.job import write_synthetic_traces
from rerank.config import BoosterConfig, RerankConfig
from rerank.evaluate.pool_chunks import ROUND_KEYS
from rerank.evaluate.values import EvalPlan, evaluate_traces
from rerank.report.summary import choose_mixture_weights
from rerank.train import train_and_evaluate
from specrank.settings.config import MlflowConfig
from specrank.store.trace_schema import trace_store
from tree.config import PoolConfig, SelectConfig

# Small pools keep model fits and evaluation to seconds: 6 first-level
# candidates, 3 further steps, 6 expansions per step.
POOL = PoolConfig(top_k=6, expand_steps=3, expand=6)
SELECT = SelectConfig(rule="draft", budget=8, record_top_m=20)


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("job")
    job = SynthJobConfig(toy_prompts=32, rounds_per_prompt=24, prompts_per_shard=8)
    write_synthetic_traces(root / "traces", job, POOL, SELECT, SynthConfig(), seed=0)
    extract(root / "traces", root / "features", log=lambda _: None)
    return root / "traces", root / "features"


def _config(traces: Path, features: Path, **kw) -> RerankConfig:
    base = RerankConfig(
        traces=str(traces),
        features=str(features),
        booster=BoosterConfig(kind="lgbm", n_threads=1),
        n_resamples=300,
        calibration_edges=20_000,
        chunk_rounds=256,
    )
    return replace(base, **kw)


def test_main_job_logs_a_complete_run(stores, tmp_path):
    traces, features = stores
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = train_and_evaluate(
        _config(traces, features),
        MlflowConfig(tracking_uri=uri, experiment="t"),
        {"a": {"b": 1}},
        0,
        tmp_path / "out",
    )
    rules = set(result.summary["rule"])
    expected = {"draft", "root", "depth_two", "oracle", "root_draw", "pearl", "pearl_commit",
                "base_lgbm", "rows_lgbm", "iso_q1", "per_depth", "sub_cache", "sub_same",
                "sub_prev", "mix_cache", "mix_same", "mix_prev", "pearl_matched"}  # fmt: skip
    assert expected <= rules
    assert set(result.summary["law"]) == {"greedy", "sampling"}
    # the paper's temperature pairs: today's drafting is T_d = 0 (decode.draft_temperature null)
    pairs = set(zip(result.summary["law"], result.summary["pair"], strict=True))
    assert pairs == {("greedy", "0|0"), ("sampling", "1|0")}
    assert "== sampling (T_t|T_d 1|0):" in result.table
    assert set(result.summary["weighting"]) == {"round", "prompt", "task"}
    matched = result.summary[result.summary["rule"] == "pearl_matched"]
    assert set(matched["weighting"]) == {"round", "prompt", "task"}  # matched in every weighting
    # draft against itself: exactly zero gain, zero-width interval
    d = result.summary[result.summary["rule"] == "draft"]
    assert (d[["gain", "gain_lo", "gain_hi"]].to_numpy() == 0).all()
    assert "gain vs draft" in result.table and "draft B" in result.table
    # the default decoder's policy (tree): every pass scores its tree alone, so the decoder
    # without a root pass is never covered and draft at the scored count is draft
    rw0 = result.summary[result.summary["weighting"] == "round"].set_index(
        ["law", "budget", "rule"]
    )
    for law in ("greedy", "sampling"):
        for b in (8, 59):
            assert rw0.loc[(law, b, "root_if_covered"), "gain"] == 0.0
            assert rw0.loc[(law, b, "draft_scored"), "accepted"] == pytest.approx(
                rw0.loc[(law, b, "draft"), "accepted"])  # fmt: skip
            n_pool = result.per_round["scored/draft@B" + str(b)].max()
            assert (rw0.loc[(law, b), "scored_prefixes"] == min(b, n_pool)).all()
    assert "scored set: rerank.score=tree, simulated in 100.0% of the rounds" in result.table
    # ... and every table by rule gives each rule's prefixes per pass (a comparison: both)
    cmp0 = result.comparisons[result.comparisons["weighting"] == "round"]
    for side in ("a", "b"):
        want = [rw0.loc[(r.law, r.budget, getattr(r, side)), "scored_prefixes"]
                for r in cmp0.itertuples()]  # fmt: skip
        np.testing.assert_array_equal(cmp0[f"scored_prefixes_{side}"], want)
    gains = pd.read_csv(tmp_path / "out" / "breakdown_gains.csv")
    assert gains["scored_prefixes"].notna().all()
    # every table names the budget its rounds were recorded at (the fake store's select.budget)
    for frame in (result.summary, result.comparisons, result.breakdowns):
        assert set(frame["recorded_budget"]) == {str(SELECT.budget)}
    assert f"features from rounds recorded at B={SELECT.budget}" in result.table
    # the paper's paired claims, every law, budget and weighting, printed after the table
    pairs = set(zip(result.comparisons["a"], result.comparisons["b"], strict=True))
    learned = ("base_lgbm", "rows_lgbm", "rows_extra_lgbm")  # rows_matched: not by default
    assert pairs == {("rows_lgbm", "base_lgbm"), ("rows_lgbm", "draft"), ("base_lgbm", "draft"),
                     ("root", "draft"), ("root_draw", "pearl"), ("root_draw", "pearl_matched"),
                     ("pearl", "pearl_commit"), ("rows_extra_lgbm", "rows_lgbm"),
                     ("root_if_covered", "draft_scored"),
                     *((r, "rank_control") for r in (*learned, "iso_q1", "per_depth"))}  # fmt: skip
    assert len(result.comparisons) == len(pairs) * 2 * 2 * 3  # laws x budgets x weightings
    assert "paired comparisons" in result.table
    # the variant table: every learned rule at both laws and budgets, with its quality
    variants = pd.read_csv(tmp_path / "out" / "variants.csv")
    halves = pd.read_csv(tmp_path / "out" / "halves.csv")  # the split, one row per task
    assert halves["task"].iloc[-1] == "all" and len(halves) > 1
    assert (
        halves.iloc[:-1][["prompts_0", "prompts_1"]].sum().tolist()
        == halves.iloc[-1][["prompts_0", "prompts_1"]].tolist()
    )
    assert set(variants["rule"]) == {*learned, "rank_control", "iso_q1"}
    assert len(variants) == 5 * 2 * 2 and variants["squared_error"].notna().all()
    control = variants[variants["rule"] == "rank_control"]
    assert (control["gain_over_control"] == 0).all()
    assert variants["gain_over_control"].notna().all() and "learned rules" in result.table
    # the other direction of node budgets: root and the rerankers reach draft's value at B
    for rule in ("root", "base_lgbm", "rows_lgbm"):
        assert result.summary.loc[result.summary["rule"] == rule, "rule_budget"].notna().all()
    # node-equivalent budgets (every weighting): the draft budget reaching each rule's value
    rw = result.summary.set_index(["weighting", "law", "budget", "rule"])
    assert rw.index.is_unique and rw["node_budget"].notna().any()
    for (weighting, law, b, rule), r in rw.iterrows():
        own = rw.loc[(weighting, law, b, "draft"), "node_budget"]
        assert own <= b  # draft reaches its own value by its own budget
        if rule in ("root", "oracle"):  # at least as good as draft: needs at least as many nodes
            assert np.isnan(r["node_budget"]) or r["node_budget"] >= own
        assert (
            np.isnan(r["node_budget"])
            or r["node_budget_lo"] <= r["node_budget"] <= r["node_budget_hi"]
        )
    # MLflow: params, tags, namespaced metrics, artifacts, two child runs
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(result.run_id)
    assert run.data.params["a.b"] == "1"
    assert run.data.tags["trace_fingerprint"] == trace_store(traces).fingerprint()
    assert (run.data.tags["pair_greedy"], run.data.tags["pair_sampling"]) == ("t0_d0", "t1_d0")
    assert "gain/greedy/B8/rows_lgbm" in run.data.metrics
    assert run.data.metrics["node_budget/greedy/B8/draft"] <= 8
    paths = {f.path for f in client.list_artifacts(result.run_id, "tables")}
    assert "tables/summary.csv" in paths
    children = client.search_runs(
        [run.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{result.run_id}'"
    )
    assert sorted(c.data.tags["fold"] for c in children) == ["0", "1"]
    assert any((tmp_path / "out" / "rerankers").iterdir())


def test_a_runs_saved_predictions_give_its_rule_values_again(stores, tmp_path):
    """`bench_rerankers --full-job --baseline`'s check: a run's out-of-fold predictions,
    evaluated again from its files, give every per-round rule value it wrote, exactly."""
    traces, features = stores
    cfg = _config(traces, features, feature_sets=["rows"], calibrators=["iso_q1", "per_depth"])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    train_and_evaluate(cfg, MlflowConfig(tracking_uri=uri), {}, 0, tmp_path / "out")
    same = same_model_values(tmp_path / "out", traces, features, rerank=cfg)
    assert same["columns"] > 20 and same["identical"] == same["columns"], same
    assert same["max_abs_diff"] == 0.0


@pytest.mark.slow
def test_the_pool_pass_bench_child_gives_a_runs_values(stores, tmp_path):
    """`bench.pool_pass`'s child, run from this tree in its own interpreter, evaluates a
    run's saved predictions to every per-round rule value the run wrote."""
    traces, features = stores
    cfg = _config(traces, features, feature_sets=["rows"], calibrators=["iso_q1", "per_depth"])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    train_and_evaluate(cfg, MlflowConfig(tracking_uri=uri), {}, 0, tmp_path / "out")
    values = tmp_path / "values.parquet"
    settings = {"calibration_edges": cfg.calibration_edges, "chunk_rounds": cfg.chunk_rounds}
    got = child_pass(ROOT, traces, features, tmp_path / "out" / "oof_predictions.parquet", values,
                     settings)  # fmt: skip
    then = pd.read_parquet(tmp_path / "out" / "per_round_values.parquet")
    assert got["rounds"] == len(then) and got["pass_s"] > 0
    now = pd.read_parquet(values)
    cols = [c for c in then.columns if "@B" in c]
    assert len(cols) > 20 and all(now[c].equals(then[c]) for c in cols)


def test_candidate_table_from_other_traces_is_refused(stores, tmp_path):
    traces, _ = stores
    other = tmp_path / "other"
    job = SynthJobConfig(toy_prompts=4, rounds_per_prompt=3, prompts_per_shard=2)
    write_synthetic_traces(other / "traces", job, POOL, SELECT, SynthConfig(), seed=5)
    extract(other / "traces", other / "features", log=lambda _: None)
    with pytest.raises(ValueError, match=r"re-run `python -m features\.extract`"):
        train_and_evaluate(
            _config(traces, other / "features"),
            MlflowConfig(tracking_uri=f"sqlite:///{tmp_path}/m.db"),
            {},
            0,
            tmp_path,
        )


def _first_level_truth(traces: Path) -> pd.DataFrame:
    """Exact first-level target probabilities as a 'predictions' table (a perfect reranker)."""
    t = trace_store(traces).read(columns=[*ROUND_KEYS, "cand_target_prob", "cand_depth"])
    n1 = pc.list_value_length(pc.list_slice(t["cand_depth"], 0, POOL.top_k)).to_numpy()
    rows = np.repeat(np.arange(t.num_rows), n1)
    frame = t.select(ROUND_KEYS).take(pa.array(rows)).to_pandas()
    frame["cand_index"] = np.concatenate([np.arange(n) for n in n1])
    probs = np.stack(t["cand_target_prob"].to_numpy(zero_copy_only=False))[:, : POOL.top_k]
    frame["exact"] = probs.reshape(-1)
    return frame


def test_perfect_predictions_select_like_the_root_row(stores):
    traces, _ = stores
    frame = evaluate_traces(
        trace_store(traces).dataset(),
        EvalPlan(budgets=[4, 8], substitutions=[]),
        _first_level_truth(traces),
        ["exact"],
    )
    sampled = frame[frame["temperature"] > 0]
    for b in (4, 8):
        np.testing.assert_allclose(sampled[f"exact@B{b}"], sampled[f"root@B{b}"], atol=1e-6)
        np.testing.assert_allclose(frame[f"exact@B{b}"], frame[f"root_softmax@B{b}"], atol=1e-6)


def test_a_round_without_predictions_is_refused(stores):
    traces, _ = stores
    preds = _first_level_truth(traces)
    first = preds[ROUND_KEYS].iloc[0]
    gap = (preds[ROUND_KEYS] == first).all(axis=1)  # every candidate of one round
    with pytest.raises(
        ValueError, match=r"predictions 'exact' lack first-level candidates of 1 rounds"
    ):
        evaluate_traces(
            trace_store(traces).dataset(),
            EvalPlan(budgets=[4], substitutions=[]),
            preds[~gap],
            ["exact"],
        )


def test_mixture_weight_is_chosen_on_the_other_half():
    rng = np.random.default_rng(0)
    n = 200
    frame = pd.DataFrame(
        {
            "prompt_id": [f"p{i % 20}" for i in range(n)],
            "task": "qa",
            "temperature": np.float32(1.0),
            "fold": np.arange(n) % 20 % 2,
            "draft@B8": rng.random(n),
            "mix_cache_w0.25@B8": rng.random(n),
            "mix_cache_w0.5@B8": rng.random(n),
        }
    )
    base, weights = choose_mixture_weights(frame)
    # rewrite fold-0 values so that w=0.5 is far better there: fold 0's own choice must not move
    changed = frame.copy()
    changed.loc[changed["fold"] == 0, "mix_cache_w0.5@B8"] += 10
    _, weights2 = choose_mixture_weights(changed)
    w0 = weights.set_index("fold").loc[0, "w"]
    assert weights2.set_index("fold").loc[0, "w"] == w0
    assert weights2.set_index("fold").loc[1, "w"] == 0.5  # fold 1 learns from fold 0
    assert "mix_cache@B8" in base and base["mix_cache@B8"].notna().all()


@pytest.mark.parametrize("shuffle", [False, True])
def test_permuted_labels_carry_no_gain(stores, tmp_path, shuffle):
    """Leakage guard: with labels shuffled across prompts the Rows reranker gains nothing."""
    traces, features = stores
    if shuffle:
        table = candidate_store(features).read()
        frame = table.to_pandas()
        rng = np.random.default_rng(1)
        for _t, part in frame.groupby("temperature"):
            idx = part.index.to_numpy()
            for col in ("label_target_prob", "label_is_argmax"):
                frame.loc[idx, col] = frame.loc[rng.permutation(idx), col].to_numpy()
        features = tmp_path / "shuffled"
        store = candidate_store(features)
        store.open_for_writing(candidate_store(stores[1]).manifest()["config"])
        store.write_shard("00000", pa.Table.from_pandas(frame, preserve_index=False))
    result = train_and_evaluate(
        _config(traces, features, feature_sets=["rows"], calibrators=[], substitutions=[]),
        MlflowConfig(tracking_uri=f"sqlite:///{tmp_path}/m.db"),
        {},
        0,
        tmp_path / "out",
    )
    s = result.summary
    row = s[
        (s["rule"] == "rows_lgbm")
        & (s["weighting"] == "round")
        & (s["law"] == "sampling")
        & (s["budget"] == 8)
    ].iloc[0]
    if shuffle:
        assert row["gain_lo"] <= 0.0  # no significant gain once labels carry no information
    else:
        assert row["gain_lo"] > 0.0  # real labels: the reranker beats draft selection

"""The acceptance-estimator report (issue 68): its metrics against hand-computed values, vLLM's
logistic estimator's halves and online refit, the calibration dump's schema, and the report
of `rerank.train` / `rerank.transfer` on a small synthetic store."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sklearn.calibration import calibration_curve
from sklearn.metrics import brier_score_loss, log_loss, roc_auc_score

from bench.bench_acceptance import report as bench_report
from rerank.config import BoosterConfig, RerankConfig, TransferConfig
from rerank.report.acceptance import law_sets, set_table
from rerank.report.acceptance_dump import (
    DUMP_SCHEMA,
    DUMP_SPEC,
    DUMP_VERSION,
    read_dump,
    write_dump,
)
from rerank.report.acceptance_metrics import (
    ECE_BINS,
    PromptWeights,
    concordance,
    ece_bin,
    metric_draws,
)
from rerank.report.acceptance_vllm import (
    DAMPING,
    INITIAL,
    RIDGE,
    crossfit_logistic,
    logit_q_feature,
    online_refit,
)
from rerank.train import train_and_evaluate
from rerank.transfer import transfer
from specrank.settings.config import MlflowConfig
from specrank.store.tables import SchemaError
from tests.small_jobs import small_stores

# six candidates of three prompts: two of them tie at 0.45 across the event
PRED = np.array([0.1, 0.45, 0.35, 0.78, 0.12, 0.45])
EVENT = np.array([0, 0, 1, 1, 1, 1])
EXACT = np.array([0.2, 0.1, 0.5, 0.9, 0.3, 0.6])
PROMPTS = np.array(["a", "a", "b", "b", "c", "c"])


def _draws(pred=PRED, resamples=50):
    weights = PromptWeights.of(PROMPTS, resamples, seed=3)
    labels = {"event": EVENT.astype(float), "exact": EXACT}
    return metric_draws(pred, EVENT, labels, weights), weights


def test_metrics_equal_hand_computed_values():
    out, _ = _draws()
    # AUROC: 6 (event, non-event) pairs right, 1 wrong, the tie (0.45, 0.45) one half: 5.5 / 8
    assert out[("auroc", "event")][0] == pytest.approx(5.5 / 8)
    # Brier: squared errors 0.01, 0.2025, 0.4225, 0.0484, 0.7744, 0.3025
    assert out[("brier", "event")][0] == pytest.approx(1.7603 / 6)
    # ECE, 15 bins of width 1/15: {0.1, 0.12} in bin 1: |0.1 + 0.12 - 1| = 0.78; 0.35 in bin 5:
    # 0.65; {0.45, 0.45} in bin 6: |0.9 - 1| = 0.1; 0.78 in bin 11: 0.22; over 6 candidates
    assert list(ece_bin(PRED)) == [1, 6, 5, 11, 1, 6]
    assert out[("ece", "event")][0] == pytest.approx(1.75 / 6)
    hand = -(math.log(0.9) + math.log(0.55) + math.log(0.35) + math.log(0.78) + math.log(0.12)
             + math.log(0.45)) / 6  # fmt: skip
    assert out[("log_loss", "event")][0] == pytest.approx(hand)
    # against the exact p(c): Brier 0.2243 / 6; ECE (|-0.28| + |-0.15| + |0.2| + |-0.12|) / 6
    assert out[("brier", "exact")][0] == pytest.approx(0.2243 / 6)
    assert out[("ece", "exact")][0] == pytest.approx(0.75 / 6)
    # ... and as scikit-learn computes them
    assert out[("auroc", "event")][0] == pytest.approx(roc_auc_score(EVENT, PRED))
    assert out[("brier", "event")][0] == pytest.approx(brier_score_loss(EVENT, PRED))
    assert out[("log_loss", "event")][0] == pytest.approx(log_loss(EVENT, PRED))
    soft = log_loss(
        np.r_[np.ones(6), np.zeros(6)], np.r_[PRED, PRED], sample_weight=np.r_[EXACT, 1 - EXACT]
    )
    assert out[("log_loss", "exact")][0] == pytest.approx(soft)
    # the bins are calibration_curve's: its non-empty bins' means, in order
    true, mean = calibration_curve(EVENT, PRED, n_bins=ECE_BINS, strategy="uniform")
    bins = ece_bin(PRED)
    assert mean == pytest.approx([PRED[bins == b].mean() for b in np.unique(bins)])
    assert true == pytest.approx([EVENT[bins == b].mean() for b in np.unique(bins)])


def test_resampled_figures_are_prompt_weighted_and_paired():
    out, weights = _draws()
    # each resample is the figure with every candidate weighted by its prompt's count
    for b in range(5):
        w = weights.draws[b][weights.code]
        if w[EVENT == 1].sum() and w[EVENT == 0].sum():
            assert out[("auroc", "event")][1][b] == pytest.approx(
                roc_auc_score(EVENT, PRED, sample_weight=w)
            )
        assert out[("brier", "event")][1][b] == pytest.approx(
            np.average((PRED - EVENT) ** 2, weights=w))  # fmt: skip
    # the concordance matrix counts pairs across prompts: a's negatives under b's positives
    c = concordance(PRED, EVENT.astype(bool), weights.code, 3)
    assert c.sum() == 5.5 and c[1, 0] == 1.0 + 2.0 and c[2, 0] == 1.0 + 1.5
    # two estimators drawn with the same weights: the difference is paired, 0 against itself
    other, _ = _draws(PRED * 0.5)
    assert np.array_equal(_draws()[0][("ece", "event")][1], out[("ece", "event")][1])
    assert not np.array_equal(other[("ece", "event")][1], out[("ece", "event")][1])


def _frame(rng, prompts=12, rounds=30, width=3) -> pd.DataFrame:
    """Report rows of one sampling law: `width` candidates per round, the top one first."""
    n = prompts * rounds * width
    q = rng.uniform(0.01, 0.99, n)
    keys = np.arange(n)
    return pd.DataFrame({
        "prompt_id": [f"p{k // (rounds * width)}" for k in keys], "task": "qa",
        "temperature": np.float32(1.0), "rule": "draft", "budget": 8,
        "round_index": (keys // width) % rounds, "cand_index": keys % width,
        "token": keys % width, "fold": (keys // (rounds * width)) % 2, "draft_prob": q,
        "draft_rank": keys % width, "margin_top_sibling": rng.normal(0, 1, n),
        "label_is_argmax": False, "label_target_prob": np.clip(q + rng.normal(0, 0.1, n), 0, 1),
        "event": rng.random(n) < q, "root_entropy": rng.random(n), "order": keys // width,
    })  # fmt: skip


def test_the_logistic_estimator_sees_only_training_half_prompts():
    rng = np.random.default_rng(0)
    x, fold = rng.normal(size=400), np.repeat([0, 1], 200)
    # opposite laws in the two halves: each half is predicted by the other's slope
    noisy = x + rng.normal(size=400)
    label = np.where(fold == 0, noisy > 0, noisy < 0).astype(float)
    pred = crossfit_logistic(x, label, fold)
    for half, sign in ((0, -1), (1, 1)):
        by_x = pred[fold == half][np.argsort(x[fold == half])]
        assert (sign * np.diff(by_x) > 0).all(), half  # falls with x in half 0, rises in 1
        assert sign * (by_x[-1] - by_x[0]) > 0.5
    # a half's own labels never reach its predictions; the other half's do
    changed = np.where(fold == 0, rng.random(400), label)
    again = crossfit_logistic(x, changed, fold)
    assert np.array_equal(again[fold == 0], pred[fold == 0])
    assert not np.allclose(again[fold == 1], pred[fold == 1])
    # the same through the report: relabel half 0's prompts, its vLLM predictions stay
    frame = _frame(rng)
    before = law_sets(frame, [], crossfit=True)
    half0 = frame["fold"] == 0
    frame.loc[half0, "label_target_prob"] = rng.random(int(half0.sum()))
    after = law_sets(frame, [], crossfit=True)
    for b, a in zip(before, after, strict=True):
        held = frame["fold"].to_numpy()[b.rows] == 0
        for name in ("vllm_logit_q", "vllm_margin"):
            assert np.array_equal(a.preds[name][held], b.preds[name][held]), name
            assert not np.array_equal(a.preds[name][~held], b.preds[name][~held]), name


def test_the_online_refit_is_vllms_damped_newton_step():
    f, y = np.array([1.0, -1.0, 2.0, 0.5]), np.array([1.0, 0.0, 1.0, 1.0])
    pred = online_refit(f, y, np.array([0, 1, 2, 3]), interval=2)
    w, b = INITIAL
    p = 1 / (1 + np.exp(-(w * f[:2] + b)))
    assert pred[:2] == pytest.approx(p)
    # one refit from the window's sufficient statistics (vLLM's _refit_kernel, one position)
    wt, r, damp = p * (1 - p), y[:2] - p, 2 / (2 + DAMPING)
    a, bb, c = wt @ f[:2] ** 2 + RIDGE, wt @ f[:2], wt.sum() + RIDGE
    step_w = (r @ f[:2] - bb * r.sum() / c) / (a - bb * bb / c) * damp
    step_b = (r.sum() - bb * step_w) / c * damp
    assert pred[2:] == pytest.approx(1 / (1 + np.exp(-((w + step_w) * f[2:] + b + step_b))))

    # prequential: a window's own labels never reach its predictions
    def refit(labels: list[float]) -> np.ndarray:
        return online_refit(f, np.array(labels), np.arange(4), interval=2)

    assert np.array_equal(refit([1, 0, 0, 0]), refit([1, 0, 1, 1]))
    moved = refit([0, 0, 1, 1])  # the first window's labels move the second's predictions only
    assert np.array_equal(moved[:2], pred[:2]) and not np.allclose(moved[2:], pred[2:])
    with pytest.raises(ValueError, match="recording order"):
        online_refit(f, y, np.array([0, 2, 1, 3]))
    assert logit_q_feature(np.array([0.5, 1.0, 0.0])) == pytest.approx([0.0, 40.0, -40.0])


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    """`rerank.train` on a small store with the report and without it, and a transfer run."""
    root = tmp_path_factory.mktemp("acceptance")
    traces, features = small_stores(root, prompts=8, rounds=12, per_shard=4)
    cfg = RerankConfig(traces=str(traces), features=str(features), feature_sets=["base", "rows"],
                       booster=BoosterConfig(kind="lgbm", n_threads=1), budgets=[8],
                       n_resamples=200, calibration_edges=5_000, chunk_rounds=16,
                       fits=None)  # fmt: skip
    uri = MlflowConfig(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    on = train_and_evaluate(cfg, uri, {}, 0, root / "on")
    off = train_and_evaluate(replace(cfg, acceptance=False), uri, {}, 0, root / "off")
    moved = transfer(cfg, TransferConfig(rerankers=str(root / "on" / "rerankers"), fold=0), uri,
                     {}, 0, root / "transfer")  # fmt: skip
    return {"root": root, "on": on, "off": off, "transfer": moved, "cfg": cfg}


def test_train_reports_every_estimator_law_and_set(job):
    root, table = job["root"], job["on"].acceptance.table
    assert {"acceptance.csv", "acceptance_reliability.csv", "acceptance_dump.parquet",
            "acceptance_advantage.png", "acceptance_reliability.png"} <= {
        p.name for p in (root / "on").iterdir()}  # fmt: skip
    assert not list((root / "off").glob("acceptance*"))  # rerank.acceptance=false: none of it
    assert set(table["candidates"]) == {"top", "all"} and set(table["law"]) == {
        "greedy",
        "sampling",
    }
    assert set(table["estimator"]) == {
        "draft_prob",
        "base_lgbm",
        "rows_lgbm",
        "rank_control",
        "iso_q1",
        "vllm_online",
        "vllm_logit_q",
        "vllm_margin",
    }
    assert (table["reference"] == "rows_lgbm").all()
    assert set(table.loc[table["law"] == "greedy", "label"]) == {"event"}
    assert set(table.loc[table["law"] == "sampling", "label"]) == {"event", "exact"}
    ref = table[table["estimator"] == "rows_lgbm"]
    assert (ref["advantage"] == 0).all() and (ref["advantage_lo"] == 0).all()
    top = table[(table["candidates"] == "top") & (table["estimator"] == "draft_prob")]
    rounds = job["on"].per_round.groupby("temperature").size()
    assert sorted(top.groupby("law")["n"].first()) == sorted(rounds)  # one top candidate a round
    record = json.loads((root / "on" / "mlflow_run.json").read_text())
    assert "acceptance/greedy/top/auroc_event/vllm_logit_q" in record["metrics"]
    assert "acceptance_adv_lo/sampling/all/brier_exact/draft_prob" in record["metrics"]
    assert "== acceptance estimators at depth 1" in (root / "on" / "results.txt").read_text()
    rel = job["on"].acceptance.reliability
    assert set(rel["by"]) == {"all", "task", "entropy_half"}
    assert set(rel.loc[rel["by"] == "entropy_half", "group"]) == {"low", "high"}


def test_the_dump_round_trips_its_declared_schema(job, tmp_path):
    run, report = job["root"] / "on", job["on"].acceptance
    dump = read_dump(run / "acceptance_dump.parquet")
    assert dump.equals(report.dump) and dump.schema.remove_metadata() == DUMP_SCHEMA
    d = dump.to_pandas()
    every = report.table[report.table["candidates"] == "all"]
    assert len(d) == every.groupby("law")["n"].first().sum()  # every first-level candidate
    greedy = d[d["law"] == "greedy"]
    assert (greedy["event"] == greedy["label_is_argmax"]).all()  # X1 is the argmax at T=0
    assert (greedy["p_exact"] == greedy["event"]).all()
    assert d["reranker_rows_extra"].isna().all() and d["reranker_rows"].notna().all()
    assert d.loc[~d["is_top"], "vllm_logit_q_top"].isna().all()
    assert d.loc[d["is_top"], "vllm_logit_q_top"].notna().all()
    assert (d.groupby(["law", "prompt_id", "round_index"])["event"].sum() <= 1).all()
    # another version, a missing column, a null where none is declared: refused
    old = dump.replace_schema_metadata({**dump.schema.metadata, b"specrank.version": b"0"})
    pq.write_table(old, tmp_path / "old.parquet")
    with pytest.raises(SchemaError, match=f"acceptance_dump table v{DUMP_VERSION}, found "
                       "acceptance_dump v0"):  # fmt: skip
        read_dump(tmp_path / "old.parquet")
    pq.write_table(dump.drop_columns(["event"]), tmp_path / "short.parquet")
    with pytest.raises(SchemaError, match=r"missing column\(s\) \['event'\]"):
        read_dump(tmp_path / "short.parquet")
    holes = dump.set_column(dump.schema.get_field_index("token"), "token",
                            pa.array([None] * len(dump), pa.int32()))  # fmt: skip
    with pytest.raises(SchemaError, match="token holds"):
        DUMP_SPEC.conform(holes)
    write_dump(tmp_path / "again.parquet", dump)
    assert read_dump(tmp_path / "again.parquet").equals(dump)


def test_the_bench_recomputes_the_run_from_its_dump(job, capsys):
    cfg, run = job["cfg"], job["root"] / "on"
    table, text, _ = bench_report(run, cfg.n_resamples, seed=0)
    keys = ["law", "candidates", "estimator", "metric", "label"]
    logged = pd.read_csv(run / "acceptance.csv")
    both = logged.merge(table, on=keys, suffixes=("", "_bench"), validate="one_to_one")
    assert len(both) == len(logged) == len(table)
    for col in ("value", "value_lo", "value_hi", "advantage", "advantage_lo", "advantage_hi"):
        assert np.allclose(both[col], both[f"{col}_bench"], rtol=1e-12, equal_nan=True), col
    assert "rows_lgbm's advantage" in text


def test_transfer_reports_the_saved_rerankers_without_a_training_half(job):
    table = job["transfer"].text
    moved = job["root"] / "transfer"
    acc = pd.read_csv(moved / "acceptance.csv")
    assert set(acc["estimator"]) == {"draft_prob", "base_lgbm", "rows_lgbm", "vllm_online"}
    assert "not fitted here" in table
    dump = read_dump(moved / "acceptance_dump.parquet").to_pandas()
    assert (dump["fold"] == 0).all() and dump["vllm_logit_q_all"].isna().all()
    # fold 0's models on the training store give rerank.train's held-out values of half 0
    trained = job["on"].acceptance.dump.to_pandas()
    half = trained[trained["fold"] == 0].sort_values(
        ["law", "prompt_id", "round_index", "cand_index"]
    )
    dump = dump.sort_values(["law", "prompt_id", "round_index", "cand_index"])
    assert np.array_equal(half["reranker_rows"].to_numpy(), dump["reranker_rows"].to_numpy())
    assert np.array_equal(half["event"].to_numpy(), dump["event"].to_numpy())


def test_a_set_table_names_its_reference_and_sizes():
    frame = _frame(np.random.default_rng(1))
    frame["ref"] = frame["draft_prob"] ** 0.5
    sets = law_sets(frame, ["ref"], crossfit=True)
    rows = pd.DataFrame(set_table(frame, sets[0], "ref", 100, 0))
    assert sets[0].candidates == "top" and len(sets[0].rows) == 12 * 30
    assert (rows["n"] == 12 * 30).all() and (rows["prompts"] == 12).all()
    assert set(rows["estimator"]) == {
        "draft_prob",
        "ref",
        "vllm_online",
        "vllm_logit_q",
        "vllm_margin",
    }

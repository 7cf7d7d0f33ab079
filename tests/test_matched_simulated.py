"""The matched row under top_m / frontier / pool (rerank.evaluate.matched): its features from
the next root row against the recorder's own matched row, the fitting availability from
draft's trees, a learned rule's App. D.10 recursion on its own trees against a hand walk over
the rounds, and the job's with/without predictions out of fold."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from decode.recording import record_traces
from features.from_trace import MATCHED_FEATURES, candidate_table, next_root_matched
from rerank.config import BoosterConfig, RerankConfig, TransferConfig
from rerank.evaluate.matched import held_after, next_root_rows
from rerank.evaluate.policy import PolicyRounds, for_policy, own_tree_coverage, policy_text
from rerank.evaluate.pool_chunks import ROUND_KEYS, chunk_of
from rerank.evaluate.values import EvalPlan, LearnedFactors, evaluate_traces
from rerank.fit.persist import load_reranker
from rerank.job.fitting import law_frame
from rerank.train import train_and_evaluate
from rerank.transfer import transfer
from selection.ranking import rank_order
from selection.values import evaluate_pools, lead_factor_scores
from specrank.settings.config import MlflowConfig
from specrank.store.trace_schema import trace_store
from tests.fake_traces import random_trace
from tests.online_fixtures import PROMPTS, settings
from tests.small_jobs import small_stores
from tests.tiny_models import one_thread, tiny_pair


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_next_root_row_is_the_recorded_matched_row(tmp_path, temperature):
    """Where the recording held the matched row (its set covered the previous round), its
    features equal those computed from the round's own root row, to float32 rounding of two
    passes (the tree pass that scored the emitted address, the next pass's root)."""
    pair = tiny_pair(tmp_path / "models", "llama")
    s = settings(temperature=temperature, score="record", record=True).base
    with one_thread():
        record_traces(tmp_path / "traces", pair, PROMPTS, s, 4, {"test": "m"}, progress=False)
    table = trace_store(tmp_path / "traces").dataset().to_table()
    recorded = candidate_table(table).to_pandas()
    derived = next_root_matched(table)
    held = recorded["matched_logprob"].notna().to_numpy()
    assert held.any() and not held.all()  # some rounds covered, some not
    for name in MATCHED_FEATURES:
        got, want = derived[name][held], recorded[name].to_numpy(np.float64)[held]
        if name in ("matched_rank", "matched_top_is_draft_top"):
            assert (got == want).mean() > 0.97, name  # a near-tie may swap two ranks
        else:
            np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4, err_msg=name)
    assert np.isfinite(derived["matched_logprob"]).all()  # every round has its root row


def _store(tmp_path, temperature: float, seed: int = 3) -> tuple[pa.Table, ds.Dataset]:
    table = random_trace(seed, n_prompts=5, n_rounds=7, level_sizes=[4, 6, 5])
    table = table.set_column(table.schema.get_field_index("temperature"), "temperature",
                             pa.array(np.full(len(table), temperature), pa.float32()))  # fmt: skip
    pq.write_table(table, tmp_path / "shard.parquet")  # one shard: whole prompts
    return table, ds.dataset(tmp_path / "shard.parquet")


def _by_hand_predecessor(table: pa.Table) -> list[int | None]:
    keys = list(zip(table["prompt_id"].to_pylist(), table["round_index"].to_pylist(), strict=True))
    at = {k: i for i, k in enumerate(keys)}
    return [at.get((p, r - 1)) for p, r in keys]


def test_fitting_holds_the_row_after_rounds_draft_trees_covered(tmp_path):
    """At T=0 a round holds the row exactly when its predecessor's draft tree (of the first
    budget) was covered; a prompt's first round never does. At T>0 it is a draw with that
    probability: the share held follows the coverage, and the draws do not depend on the
    rows' order."""
    table, dataset = _store(tmp_path, 0.0)
    rows = next_root_rows(dataset, "top_m", 3, 2, seed=0)
    chunk = chunk_of(table)
    cov = own_tree_coverage(chunk.ctx, chunk.order, 2, "top_m", 3)[0].numpy()
    assert set(np.unique(cov)) == {0.0, 1.0}
    want_round = np.array(
        [False if j is None else bool(cov[j]) for j in _by_hand_predecessor(table)]
    )
    frame = candidate_table(table).to_pandas()
    held = rows.held[rows.positions(frame)]
    round_of = frame.groupby(ROUND_KEYS, sort=False).ngroup().to_numpy()
    first_rows = pd.Series(np.arange(len(frame))).groupby(round_of).first().to_numpy()
    keys = frame.iloc[first_rows][["prompt_id", "round_index"]].itertuples(index=False)
    ids, rounds = table["prompt_id"].to_pylist(), table["round_index"].to_pylist()
    index = {(p, r): i for i, (p, r) in enumerate(zip(ids, rounds, strict=True))}
    want = np.array([want_round[index[(p, r)]] for p, r in keys])[round_of]
    np.testing.assert_array_equal(held, want)
    assert held.any() and not held.all()
    fit = for_policy(frame, "top_m", rows, "fit")
    np.testing.assert_array_equal(fit["matched_logprob"].notna(), held)
    assert for_policy(frame, "top_m", rows, "with")["matched_logprob"].notna().all()
    assert for_policy(frame, "top_m", rows, "without")["matched_logprob"].isna().all()
    assert (fit["token_only_count"] == 0).all()  # no token-only row beyond `record`
    # T>0: 4,000 rounds of two series each with coverage 0.3 (first rounds: never held)
    n = 4000
    keys = pd.DataFrame({"prompt_id": np.repeat(["a", "b"], n // 2), "temperature": 1.0,
                         "rule": "draft", "budget": 8, "round_index": np.tile(np.arange(n // 2), 2)})  # fmt: skip
    h = held_after(keys, np.full(n, 0.3), seed=0)
    assert not h[0] and not h[n // 2]
    assert abs(h.mean() - 0.3) < 0.03  # 4 sd of a binomial share at n = 4,000 is 0.029
    shuffled = np.random.default_rng(1).permutation(n)
    np.testing.assert_array_equal(held_after(keys.iloc[shuffled], np.full(n, 0.3), 0), h[shuffled])
    assert (held_after(keys, np.full(n, 0.3), 1) != h).any()  # another seed, other draws


def _predictions(table: pa.Table, seed: int) -> pd.DataFrame:
    """Random phat with and without the row for every first-level candidate of `table`."""
    rng = np.random.default_rng(seed)
    frame = candidate_table(table).to_pandas()[[*ROUND_KEYS, "cand_index"]]
    for v in ("with", "without"):
        frame[f"{v}/r"] = rng.uniform(0.01, 1.0, len(frame))
    return frame


def _walk(prev: list[int | None], rounds: list[int], cov_with, cov_without) -> np.ndarray:
    """h of every row, rounds taken in index order (a predecessor first)."""
    h = np.zeros(len(prev))
    for i in sorted(range(len(prev)), key=rounds.__getitem__):
        p = prev[i]
        h[i] = 0.0 if p is None else h[p] * cov_with[p] + (1 - h[p]) * cov_without[p]
    return h


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_simulated_rule_follows_its_own_trees(tmp_path, temperature):
    """h_0 = 0, h_t+1 = h_t cov(T_with) + (1 - h_t) cov(T_without), walked by hand over the
    (shuffled) rounds; the value is h V(T_with) + (1 - h) V(T_without), with the V's from the
    compiled route (`evaluate_pools`), not the torch ranking the simulation uses."""
    table, dataset = _store(tmp_path, temperature)
    preds = _predictions(table, 5)
    names = ["with/r", "without/r"]
    acc = PolicyRounds([2, 5], "top_m", 3, simulated=["r"],
                       factors=LearnedFactors.from_predictions(preds, names))  # fmt: skip
    plan = EvalPlan([2, 5], rules=["draft", "root"], substitutions=[])
    out = acc.apply(evaluate_traces(dataset, plan, chunk_rounds=6, consumers=[acc]))
    chunk = chunk_of(table)
    factors = LearnedFactors.from_predictions(preds, names)
    row, width = factors.rows(chunk.keys), chunk.ctx.levels[0][1]
    first = {v: factors.matrix(row, f"{v}/r", width) for v in ("with", "without")}
    values = evaluate_pools(chunk.pool, [2, 5], ["draft"], first_factors=first)
    prev = _by_hand_predecessor(table)
    for j, b in enumerate((2, 5)):
        cov = {v: own_tree_coverage(chunk.ctx, rank_order(lead_factor_scores(chunk.ctx, f)), b,
                                    "top_m", 3)[0].numpy() for v, f in first.items()}  # fmt: skip
        want_h = _walk(prev, table["round_index"].to_pylist(), cov["with"], cov["without"])
        np.testing.assert_allclose(out[f"held/r@B{b}"], want_h, rtol=1e-12)
        if temperature == 0:
            assert set(np.unique(want_h)) == {0.0, 1.0}
        else:
            assert ((want_h > 0) & (want_h < 1)).any()
        want = (
            want_h * values["with"][:, j].double().numpy()
            + (1 - want_h) * values["without"][:, j].double().numpy()
        )
        np.testing.assert_allclose(out[f"r@B{b}"], want, rtol=1e-6)
        assert out[f"scored/r@B{b}"].eq(min(b + 3, 15)).all()  # top_m: B + M, within 15 nodes


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """`rerank.train` under top_m (M = 4) with rows_matched on a small synthetic store."""
    root = tmp_path_factory.mktemp("job")
    traces, features = small_stores(root, 16, 10, 4)
    config = RerankConfig(
        traces=str(traces), features=str(features), feature_sets=["rows_matched"], score="top_m",
        score_top_m=4, booster=BoosterConfig(kind="lgbm", n_threads=1), n_resamples=50,
        calibration_edges=5_000, chunk_rounds=16, budgets=[8], calibrators=[],
    )  # fmt: skip
    tracking = MlflowConfig(tracking_uri=f"sqlite:///{root}/m.db")
    with one_thread():
        train_and_evaluate(config, tracking, {}, 0, root / "run", None)
    return config, tracking, root


def test_the_job_predicts_both_variants_out_of_fold(job):
    """The fits read the matched row where draft's trees held it; the held-out phat with the
    row, without it and as fitted are each the prediction of the saved model that did not see
    the row's prompt (the cross-fit's forest route against the library's)."""
    config, _, root = job
    traces, features, out = Path(config.traces), Path(config.features), root / "run"
    oof = pd.read_parquet(out / "oof_predictions.parquet")
    rows = next_root_rows(trace_store(traces).dataset(), "top_m", 4, 8, seed=0)
    per_round = pd.read_parquet(out / "per_round_values.parquet")
    held = per_round["held/rows_matched_lgbm@B8"]
    assert (held > 0).any() and (held < 1).any()
    for t, part in oof.groupby("temperature"):
        law = "T0" if t == 0 else "T1"
        models = [load_reranker(out / "rerankers" / f"rows_matched_lgbm_{law}_fold{f}")
                  for f in (0, 1)]  # fmt: skip
        for variant, column in (("fit", "rows_matched_lgbm"), ("with", "with/rows_matched_lgbm"),
                                ("without", "without/rows_matched_lgbm")):  # fmt: skip
            frame = law_frame(features, "top_m", float(t), next_root=rows, variant=variant)
            key = _keys(frame)
            got = pd.Series(part[column].to_numpy(), _keys(part).to_numpy())
            for f, model in enumerate(models):
                at = key.isin(got.index[part["fold"].to_numpy() == f]).to_numpy()
                assert at.any()
                assert not set(model.train_prompts) & set(frame["prompt_id"][at].astype(str))
                np.testing.assert_allclose(got[key[at]].to_numpy(), model.predict_phat(frame[at]),
                                           rtol=1e-9, err_msg=f"{variant} T={t} fold {f}")  # fmt: skip


def _keys(frame: pd.DataFrame) -> pd.Series:
    return frame[[*ROUND_KEYS, "cand_index"]].astype(str).agg("|".join, axis=1)


def test_transfer_simulates_the_rule_as_the_job_did(job, tmp_path):
    """`rerank.transfer` of fold 0's models on the training store, its prompts skipped: the
    other half's rounds get the job's simulated values exactly (the recursion is per prompt,
    and fold 0's models predicted that half in the job)."""
    config, tracking, root = job
    result = transfer(config, TransferConfig(rerankers=str(root / "run" / "rerankers"), fold=0,
                                             seen_prompts="skip"), tracking, {}, 0, tmp_path)  # fmt: skip
    got = result.evaluation.per_round
    want = pd.read_parquet(root / "run" / "per_round_values.parquet")
    cols = [*ROUND_KEYS, "rows_matched_lgbm@B8", "held/rows_matched_lgbm@B8",
            "scored/rows_matched_lgbm@B8"]  # fmt: skip
    merged = got[cols].merge(want[cols], on=ROUND_KEYS, suffixes=("", "_job"))
    assert len(merged) == len(got) and 0 < len(got) < len(want)
    for c in cols[len(ROUND_KEYS) :]:
        np.testing.assert_allclose(merged[c], merged[f"{c}_job"], rtol=1e-9, err_msg=c)


def test_the_table_names_the_budget_a_simulated_fit_took_its_availability_from():
    summary = pd.DataFrame({"weighting": "round", "law": "greedy", "budget": [8, 8, 59, 59],
                            "rule": ["draft", "root_if_covered"] * 2,
                            "scored_prefixes": [40.0, 40.0, 91.0, 91.0]})  # fmt: skip
    text = policy_text(summary, "top_m", 32, 1.0, ["rows_matched_lgbm"], 8)
    assert "greedy B=59: 91.0 (91.0)" in text
    assert "rows_matched_lgbm: fitted on the matched row as draft's trees at B=8" in text
    assert "at B=[59] that fit is kept" in text
    one_budget = policy_text(summary[summary["budget"] == 8], "top_m", 32, 1.0,
                             ["rows_matched_lgbm"], 8)  # fmt: skip
    assert "fitted on" not in one_budget

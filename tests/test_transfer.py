"""`rerank.transfer`: saved rerankers judged on a trace store without refitting (issue 28.5).

On the store they were fitted on, fold k's models evaluate exactly half k and give
`rerank.train`'s out-of-fold predictions and rule values bit for bit; a prompt they
were trained on is skipped or refused; a task they never saw is warned and tabled.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from features.extract import extract
from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.job import write_synthetic_traces
from rerank.config import TransferConfig
from rerank.evaluate.pool_chunks import ROUND_KEYS
from rerank.train import train_and_evaluate
from rerank.transfer import transfer
from specrank.settings.config import MlflowConfig
from specrank.settings.errors import Refusal
from tests.test_rerank_job import POOL, SELECT, _config

KEYS = [*ROUND_KEYS, "cand_index"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small store, `rerank.train` on it (rows and rows_extra), its run folder."""
    root = tmp_path_factory.mktemp("transfer")
    job = SynthJobConfig(toy_prompts=24, rounds_per_prompt=16, prompts_per_shard=8)
    write_synthetic_traces(root / "traces", job, POOL, SELECT, SynthConfig(), seed=0)
    extract(root / "traces", root / "features", log=lambda _: None)
    cfg = _config(root / "traces", root / "features", feature_sets=["rows", "rows_extra"],
                  calibrators=["iso_q1"], n_resamples=200)  # fmt: skip
    tracking = MlflowConfig(tracking_uri=f"sqlite:///{root / 'mlflow.db'}", experiment="t")
    train_and_evaluate(cfg, tracking, {}, 0, root / "train")
    return root, cfg, tracking


@pytest.mark.parametrize("fold", [0, 1])
def test_on_its_own_store_a_fold_gives_the_out_of_fold_predictions_and_values(trained, fold):
    root, cfg, tracking = trained
    settings = TransferConfig(rerankers=str(root / "train" / "rerankers"), fold=fold)
    result = transfer(cfg, settings, tracking, {}, 0, root / f"transfer{fold}")
    oof = pd.read_parquet(root / "train" / "oof_predictions.parquet")
    half = oof[oof["fold"] == fold]
    pred = pd.read_parquet(root / f"transfer{fold}" / "oof_predictions.parquet")
    assert set(pred["prompt_id"]) == set(half["prompt_id"])  # exactly half `fold`
    joined = half.merge(pred, on=KEYS, suffixes=("_train", "_transfer"), validate="1:1")
    assert len(joined) == len(half) == len(pred)
    for rule in ("rows_lgbm", "rows_extra_lgbm"):
        assert np.array_equal(joined[f"{rule}_train"], joined[f"{rule}_transfer"])
    # the rules' per-round values on those prompts are the training run's
    train_rounds = pd.read_parquet(root / "train" / "per_round_values.parquet")
    train_rounds = train_rounds[train_rounds["fold"] == fold]
    keys = [k for k in ROUND_KEYS if k in train_rounds]
    both = train_rounds.merge(result.evaluation.per_round, on=keys, suffixes=("_a", "_b"))
    assert len(both) == len(train_rounds) == len(result.evaluation.per_round)
    compared = [c[:-2] for c in both if c.endswith("_a") and ("lgbm" in c or "draft" in c)]
    assert len(compared) >= 4
    for c in compared:
        assert np.array_equal(both[f"{c}_a"].to_numpy(), both[f"{c}_b"].to_numpy()), c
    assert "iso_q1" not in set(result.evaluation.summary["rule"])  # a fit: not transferred
    assert result.tasks["known"].all()


def test_a_trained_prompt_is_refused_when_asked_and_a_missing_fold_is_named(trained, tmp_path):
    root, cfg, tracking = trained
    refuse = TransferConfig(rerankers=str(root / "train" / "rerankers"), seen_prompts="refuse")
    with pytest.raises(ValueError, match=r"trained on 12 of the store's 24 prompts"):
        transfer(cfg, refuse, tracking, {}, 0, tmp_path / "a")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(Refusal, match=r"holds no reranker of fold 0"):
        transfer(cfg, TransferConfig(rerankers=str(empty)), tracking, {}, 0, tmp_path / "b")
    with pytest.raises(ValueError, match=r"'transfer.fold' must be"):
        transfer(cfg, TransferConfig(fold=2), tracking, {}, 0, tmp_path / "c")
    # the policy is checked against the saved models' sets (rows, rows_extra), not the
    # setting's (which hold rows_matched)
    top = replace(cfg, score="top_m", score_top_m=4, feature_sets=["base", "rows_matched"])
    rr = TransferConfig(rerankers=str(root / "train" / "rerankers"))
    out = transfer(top, rr, tracking, {}, 0, tmp_path / "d").evaluation.summary
    assert "rows_matched_lgbm" not in set(out["rule"])
    assert (out.loc[out["rule"] == "root_if_covered", "scored_prefixes"] > 0).all()


def test_another_suite_with_a_task_the_models_never_saw_is_warned(trained, caplog):
    root, cfg, tracking = trained
    job = SynthJobConfig(toy_prompts=32, rounds_per_prompt=12, prompts_per_shard=8,
                         tasks=["qa", "rag"])  # fmt: skip
    write_synthetic_traces(root / "other", job, POOL, SELECT, SynthConfig(), seed=5)
    extract(root / "other", root / "other_features", log=lambda _: None)
    other = replace(cfg, traces=str(root / "other"), features=str(root / "other_features"))
    settings = TransferConfig(rerankers=str(root / "train" / "rerankers"))
    with caplog.at_level(logging.WARNING, logger="rerank.serving"):
        result = transfer(other, settings, tracking, {}, 0, root / "transfer_other")
    assert "never saw the task(s) ['rag']" in caplog.text
    tasks = result.tasks.set_index("task")
    assert not tasks.loc["rag", "known"] and tasks.loc["qa", "known"]
    # ids 24-31 were never trained on; of 0-23 the fold-1 half (the models' training) is skipped
    assert result.evaluation.per_round["prompt_id"].nunique() == 32 - 12
    assert (root / "transfer_other" / "transfer_tasks.csv").exists()
    assert set(result.evaluation.summary["law"]) == {"greedy", "sampling"}

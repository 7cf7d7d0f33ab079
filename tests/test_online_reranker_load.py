"""`run.reranker` is refused with a clear message when missing, tampered, mismatched or of the wrong law.

(Loading from an MLflow URI, runs:/<id>/rerankers/<name>, is exercised by the whole
run in tests/test_online_run.py.)
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest

from features.registry import BY_NAME
from pairs.prompts import Prompt
from rerank.evaluate.policy import for_policy
from rerank.fit.models import fit_reranker
from rerank.fit.persist import RerankerLoadError, save_reranker
from rerank.serving import (
    check_feature_availability,
    load_online_reranker,
    split_features,
    unknown_tasks,
    unseen_prompts,
)
from specrank.settings.errors import Refusal
from tests.candidate_frames import FAST, make_candidate_frame
from tests.tiny_models import one_thread


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A greedy Rows reranker saved by rerank.fit.persist (fitted on a synthetic table)."""
    root = tmp_path_factory.mktemp("saved")
    frame = make_candidate_frame(n_prompts=16, rounds=5, temperature=0.0, seed=4)
    with one_thread():
        model = fit_reranker(frame, "rows", "lgbm", "greedy", n_threads=1, capacity=FAST)
    return model, save_reranker(model, root / "rows_lgbm_T0_fold0")


def test_a_good_reranker_loads(saved):
    model, path = saved
    got = load_online_reranker(str(path), 0.0, "unused")
    assert got.features == model.features and got.law == "greedy"


def test_missing_folder_or_sidecar(tmp_path):
    with pytest.raises(Refusal, match=r"run.reranker: no such folder '.*nowhere'"):
        load_online_reranker(str(tmp_path / "nowhere"), 0.0, "unused")
    (tmp_path / "empty").mkdir()
    with pytest.raises(Refusal, match=r"no reranker.json \(not a folder written by"):
        load_online_reranker(str(tmp_path / "empty"), 0.0, "unused")
    with pytest.raises(ValueError, match=r"run.rule=reranker needs run.reranker="):
        load_online_reranker(None, 0.0, "unused")


def test_tampered_model_or_sidecar(saved, tmp_path):
    _, path = saved
    model_file = shutil.copytree(path, tmp_path / "m") / "model.txt"
    model_file.write_text(model_file.read_text().replace("learning_rate", "learning_rate ", 1))
    with pytest.raises(RerankerLoadError, match=r"model file model.txt was modified or corrupted"):
        load_online_reranker(str(tmp_path / "m"), 0.0, "unused")
    sidecar = shutil.copytree(path, tmp_path / "s") / "reranker.json"
    meta = json.loads(sidecar.read_text())
    meta["law"] = "sampling"  # passes the law check below, but not the content hash
    sidecar.write_text(json.dumps(meta))
    with pytest.raises(RerankerLoadError, match=r"reranker.json was modified after saving"):
        load_online_reranker(str(tmp_path / "s"), 1.0, "unused")


def test_feature_mismatched_reranker(saved, tmp_path):
    model, _ = saved
    renamed = [*model.features[:-1], "mystery_feature"]  # not today's Rows feature list
    path = save_reranker(dataclasses.replace(model, features=renamed), tmp_path / "odd")
    with pytest.raises(RerankerLoadError) as err:
        load_online_reranker(str(path), 0.0, "unused")
    assert "features in the model but not expected: ['mystery_feature']" in str(err.value)
    assert "features expected but not in the model: ['token_prior']" in str(err.value)
    reordered = [model.features[1], model.features[0], *model.features[2:]]
    path = save_reranker(dataclasses.replace(model, features=reordered), tmp_path / "order")
    with pytest.raises(RerankerLoadError, match="feature order differs"):
        load_online_reranker(str(path), 0.0, "unused")


def test_law_mismatch(saved):
    _, path = saved
    with pytest.raises(
        ValueError,
        match=r"holds a greedy model, but decode.temperature=1.0 .* use the regressor saved for T>0",
    ):
        load_online_reranker(str(path), 1.0, "unused")


def test_prompts_the_reranker_was_trained_on_are_refused_or_skipped(saved):
    _, path = saved
    model = load_online_reranker(str(path), 0.0, "unused")
    held_out = [Prompt("held-out-1", "coding", "a"), Prompt("held-out-2", "writing", "b")]
    seen = Prompt(model.train_prompts[0], "coding", "c")
    assert unseen_prompts(model, held_out, "refuse") == held_out  # disjoint: all decoded
    with pytest.raises(ValueError, match=r"trained on 1 of the 3 prompts.*seen_prompts=skip"):
        unseen_prompts(model, [*held_out, seen], "refuse")
    assert unseen_prompts(model, [*held_out, seen], "skip") == held_out
    assert unseen_prompts(model, [*held_out, seen], "allow") == [*held_out, seen]
    with pytest.raises(ValueError, match="nothing is left to decode"):
        unseen_prompts(model, [seen], "skip")
    with pytest.raises(ValueError, match="lists no training prompts"):
        unseen_prompts(dataclasses.replace(model, train_prompts=()), held_out, "skip")
    with pytest.raises(ValueError, match=r"'run\.seen_prompts' must be one of"):
        unseen_prompts(model, held_out, "ignore")


def test_a_task_the_model_never_saw_is_warned(saved, caplog):
    model, _ = saved
    known = model.categories[0]
    prompts = [
        Prompt("a", known, "x"),
        Prompt("b", "unseen_task", "y"),
        Prompt("c", "unseen_task", "z"),
    ]
    with caplog.at_level("WARNING", logger="rerank.serving"):
        assert unknown_tasks(model, prompts) == {"unseen_task": 2}
    assert "never saw the task(s) ['unseen_task'] (prompts: [2])" in caplog.text
    assert "missing (NaN)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rerank.serving"):
        assert unknown_tasks(model, prompts[:1]) == {}
    assert not caplog.text


def test_a_reranker_whose_trees_read_rows_the_scored_set_never_gives_is_refused(saved, caplog):
    """The guard counts the features the model's trees split on (`split_features`, checked
    against LightGBM's own split counts): a model fitted where the matched and token-only rows
    are there is refused under a policy that never gives them, listing those it reads; the same
    set fitted under `tree` (its rows missing in every training row) reads none of them."""
    model, _ = saved  # rows: no matched-row feature, fine under every scored set
    assert check_feature_availability(model, "tree", allow=False) == []
    frame = make_candidate_frame(n_prompts=16, rounds=5, temperature=0.0, seed=4)
    with one_thread():
        matched = fit_reranker(frame, "rows_matched", "lgbm", "greedy", n_threads=1, capacity=FAST)
        under_tree = fit_reranker(for_policy(frame, "tree"), "rows_matched", "lgbm", "greedy",
                                  n_threads=1, capacity=FAST)  # fmt: skip
    counts = matched.estimator.feature_importance("split")
    read = split_features(matched)
    assert read == {f for f, n in zip(matched.features, counts, strict=True) if n > 0}
    group = {f: BY_NAME[f].group for f in matched.features if f in BY_NAME}
    never_tree = [
        f for f in matched.features if f in read and group.get(f) in ("matched", "token_only")
    ]
    only = [f for f in never_tree if group[f] == "token_only"]
    assert "matched_logprob" in never_tree and only  # both rows are informative in the frame
    with pytest.raises(ValueError) as err:
        check_feature_availability(matched, "tree", allow=False)
    msg = str(err.value)
    assert "always missing under run.score=tree" in msg and str(never_tree) in msg
    assert "run.allow_missing_features=true" in msg and "(record)" in msg
    # under top_m the matched row comes after covered rounds; no token-only row is kept
    with pytest.raises(ValueError, match=re.escape(str(only))):
        check_feature_availability(matched, "top_m", allow=False)
    assert check_feature_availability(matched, "record", allow=False) == []
    assert not set(never_tree) & split_features(under_tree)
    assert check_feature_availability(under_tree, "tree", allow=False) == []
    with caplog.at_level("WARNING", logger="rerank.serving"):
        assert check_feature_availability(matched, "tree", allow=True) == never_tree
    assert "decoded anyway" in caplog.text

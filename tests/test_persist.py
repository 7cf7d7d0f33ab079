"""Saved rerankers: identical round trip; tampered or mismatched files refused with reasons."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import skops.io as sio
from sklearn.preprocessing import FunctionTransformer

from features.schema import CANDIDATE_VERSION
from rerank.fit.halves import prompt_halves
from rerank.fit.models import FittedReranker, feature_list
from rerank.fit.out_of_fold import crossfit_predict
from rerank.fit.persist import (
    MODEL_FILES,
    SIDECAR,
    RerankerLoadError,
    _content_sha,
    load_reranker,
    read_sidecar,
    save_reranker,
)
from specrank.store.tables import sha256_file
from tests.candidate_frames import FAST, make_candidate_frame


@functools.cache
def crossfit(kind: str, law: str) -> tuple[pd.DataFrame, FittedReranker, np.ndarray]:
    frame = make_candidate_frame(
        n_prompts=16, rounds=5, temperature=0.0 if law == "greedy" else 1.0, seed=9
    )
    folds = prompt_halves(frame["prompt_id"].to_numpy())
    res = crossfit_predict(frame, "rows", kind, law, folds, n_threads=1, capacity=FAST)
    return frame, res.models[0], res.phat[folds == 0]


def _rewrite_sidecar(path: Path, **changes) -> None:
    """Edit the sidecar AND refresh its own hash, so only the intended difference remains."""
    meta = read_sidecar(path)
    meta.update(changes)
    meta["sidecar_sha256"] = _content_sha(meta)
    (path / SIDECAR).write_text(json.dumps(meta))


@pytest.mark.parametrize("law", ["greedy", "sampling"])
@pytest.mark.parametrize("kind", ["hgb", "lgbm"])
def test_round_trip_gives_identical_predictions(tmp_path, kind, law) -> None:
    frame, model, oof = crossfit(kind, law)
    folds = prompt_halves(frame["prompt_id"].to_numpy())
    path = save_reranker(model, tmp_path / "m", extra={"fold": 0})
    assert sorted(p.name for p in path.iterdir()) == sorted([SIDECAR, MODEL_FILES[kind]])
    loaded = load_reranker(
        path,
        expected_features=feature_list("rows"),
        expected_fingerprint=model.train_fingerprint,
    )
    # Bit-identical to the out-of-fold predictions made before saving.
    np.testing.assert_array_equal(loaded.predict_phat(frame[folds == 0], n_threads=1), oof)
    np.testing.assert_array_equal(loaded.predict_phat(frame, 1), model.predict_phat(frame, 1))
    assert (loaded.kind, loaded.law, loaded.features, loaded.categories) == (
        model.kind,
        model.law,
        model.features,
        model.categories,
    )
    assert loaded.train_prompts == model.train_prompts and loaded.capacity == model.capacity
    meta = read_sidecar(path)
    assert meta["candidate_schema_version"] == CANDIDATE_VERSION
    assert meta["model_sha256"] == sha256_file(path / MODEL_FILES[kind])
    assert meta["extra"] == {"fold": 0}


@pytest.mark.parametrize("kind", ["hgb", "lgbm"])
def test_a_tampered_model_file_is_refused(tmp_path, kind) -> None:
    path = save_reranker(crossfit(kind, "sampling")[1], tmp_path / "m")
    model_file = path / MODEL_FILES[kind]
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 1
    model_file.write_bytes(bytes(data))
    with pytest.raises(RerankerLoadError, match=f"{MODEL_FILES[kind]} was modified or corrupted"):
        load_reranker(path)


def test_an_edited_sidecar_is_refused(tmp_path) -> None:
    path = save_reranker(crossfit("lgbm", "sampling")[1], tmp_path / "m")
    meta = read_sidecar(path)
    meta["token_prior"]["mean"] = 0.9  # hand edit, hash not refreshed
    (path / SIDECAR).write_text(json.dumps(meta))
    with pytest.raises(RerankerLoadError, match=f"{SIDECAR} was modified after saving"):
        load_reranker(path)


def test_a_wrong_schema_version_is_refused(tmp_path) -> None:
    path = save_reranker(crossfit("lgbm", "sampling")[1], tmp_path / "m")
    _rewrite_sidecar(path, candidate_schema_version=CANDIDATE_VERSION + 98)
    with pytest.raises(RerankerLoadError) as err:
        load_reranker(path)
    assert err.value.differences == [
        f"candidate schema version: expected {CANDIDATE_VERSION}, found {CANDIDATE_VERSION + 98}"
    ]


def test_feature_and_fingerprint_mismatches_are_listed_together(tmp_path) -> None:
    model = crossfit("hgb", "greedy")[1]
    path = save_reranker(model, tmp_path / "m")
    base = feature_list("base")
    with pytest.raises(RerankerLoadError) as err:
        load_reranker(path, expected_features=[*base, "new_feature"], expected_fingerprint="abc")
    diffs = err.value.differences
    assert len(diffs) == 3, diffs
    assert diffs[0] == "features expected but not in the model: ['new_feature']"
    assert diffs[1].startswith("features in the model but not expected: ['cache_logprob'")
    assert "training-data fingerprint: expected abc, found" in diffs[2]
    assert all(d in str(err.value) for d in diffs)  # the message lists every difference
    swapped = feature_list("rows")
    swapped[0], swapped[1] = swapped[1], swapped[0]
    with pytest.raises(RerankerLoadError, match="feature order differs"):
        load_reranker(path, expected_features=swapped)


def test_skops_types_outside_the_allow_list_are_refused_before_loading(tmp_path) -> None:
    path = save_reranker(crossfit("hgb", "sampling")[1], tmp_path / "m")
    model_file = path / MODEL_FILES["hgb"]
    # A valid skops file whose loading would build a callable to os.system.
    sio.dump(FunctionTransformer(func=os.system), model_file)
    _rewrite_sidecar(path, model_sha256=sha256_file(model_file))
    with pytest.raises(RerankerLoadError, match=r"outside the allow-list: .*system"):
        load_reranker(path)


def test_saving_over_a_non_empty_folder_is_refused(tmp_path) -> None:
    model = crossfit("lgbm", "sampling")[1]
    path = save_reranker(model, tmp_path / "m")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_reranker(model, path)
    save_reranker(model, path, overwrite=True)
    load_reranker(path)


def test_a_truncated_sidecar_is_refused_naming_the_folder(tmp_path):
    _, model, _ = crossfit("hgb", "greedy")
    path = save_reranker(model, tmp_path / "m")
    text = (path / SIDECAR).read_text()
    (path / SIDECAR).write_text(text[: len(text) // 2])
    with pytest.raises(RerankerLoadError, match=rf"{path}(.|\n)*{SIDECAR} is not valid JSON"):
        load_reranker(path)


@pytest.mark.parametrize("kind", ["hgb", "lgbm"])
def test_swapped_features_with_a_fresh_sidecar_hash_are_refused(tmp_path, kind):
    """The feature order is checked against the model file itself, not only the sidecar."""
    _, model, _ = crossfit(kind, "greedy")
    path = save_reranker(model, tmp_path / "m")
    features = list(model.features)
    features[0], features[1] = features[1], features[0]
    _rewrite_sidecar(path, features=features)
    with pytest.raises(RerankerLoadError, match="feature order differs"):
        load_reranker(path)  # no expected list passed: the model's own names catch it

"""Online features are exactly those `features.extract` computes from the run's own trace.

The online reranker computes each round's first-level features before
verification. Recording the same run (run.score=record, record) and extracting its
trace must give the same values, bit for bit, for every feature (retained-row
features included), the same design matrix and the same phat.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from decode.loop import decode_prompt
from features.extract import extract
from features.first_level import FEATURE_DTYPES
from features.schema import candidate_store
from pairs.models import load_model_pair
from pairs.prompts import encode_prompt
from rerank.fit.design import design_matrix
from rerank.serving import ROW_READING, OnlinePredictor, load_online_reranker
from specrank.store.trace_schema import TRACE_SCHEMA, trace_store
from tests.online_fixtures import PROMPTS, fitted_reranker, settings
from tests.tiny_models import one_thread, tiny_model_config

KEYS = ["prompt_id", "round_index", "cand_index"]


def record_and_extract(root, temperature: float, kind: str, device: str = "cpu"):
    """An online reranker run, recorded, and the candidate table extracted from its trace."""
    with one_thread():
        cfg = dataclasses.replace(tiny_model_config(root / "models", "llama"), device=device)
        pair = load_model_pair(cfg)
        # rows_matched reads every feature: the paper's rows, the extra row features, the
        # matched and token-only rows (so the decoder keeps all of them)
        path = fitted_reranker(
            root / "rr", pair, temperature, kind=kind, feature_set="rows_matched"
        )
        model = load_online_reranker(str(path), temperature, "unused")
        predictor = OnlinePredictor(model, pair.device, "forest")  # on CUDA: torch ops there
        s = settings("reranker", temperature, score="record", record=True, max_new_tokens=40)
        runs = []
        for p in PROMPTS[:5]:
            ids = encode_prompt(pair.tokenizer, p.text)
            r = decode_prompt(
                pair.target, pair.drafter, ids, s, frozenset(), p.id, p.task, predictor, True
            )
            runs.append((p, r))
    store = trace_store(root / "traces")
    store.open_for_writing({"test": "online features"})
    rows = [x.fields for _, r in runs for x in r.rounds]
    store.write_shard("000", pa.Table.from_pylist(rows, schema=TRACE_SCHEMA))
    extract(root / "traces", root / "features", log=lambda _: None)
    frame = candidate_store(root / "features").read().to_pandas()
    frame = frame.sort_values(KEYS, kind="stable").reset_index(drop=True)
    return runs, frame, predictor


@pytest.fixture(scope="module", params=[(0.0, "lgbm"), (1.0, "hgb")], ids=["T0-lgbm", "T1-hgb"])
def online_run(request, tmp_path_factory):
    temperature, kind = request.param
    return record_and_extract(tmp_path_factory.mktemp("feat"), temperature, kind)


def _online_table(runs) -> pd.DataFrame:
    parts = []
    for p, r in runs:
        for i, x in enumerate(r.rounds):
            n1 = len(x.first_logprob)
            part = pd.DataFrame({k: np.asarray(v) for k, v in x.features.items()})
            part["prompt_id"], part["task"], part["round_index"] = p.id, p.task, i
            part["cand_index"] = np.arange(n1)
            part["log_phat"] = x.first_logprob
            parts.append(part)
    return pd.concat(parts).sort_values(KEYS, kind="stable").reset_index(drop=True)


def _floats(col: pd.Series) -> np.ndarray:
    return pd.to_numeric(col).to_numpy(dtype=np.float64, na_value=np.nan)


def test_every_feature_equals_the_extracted_one(online_run):
    check_features(*online_run)


@pytest.mark.gpu
def test_every_feature_equals_the_extracted_one_on_cuda(tmp_path):
    runs, frame, predictor = record_and_extract(tmp_path, 1.0, "hgb", "cuda")
    assert predictor.torch_forest is not None  # phat on the device
    check_features(runs, frame, predictor)


def check_features(runs, frame, _predictor) -> None:
    online = _online_table(runs)
    assert len(online) == len(frame) > 100
    assert (online[KEYS].to_numpy() == frame[KEYS].to_numpy()).all()
    for name in FEATURE_DTYPES:
        np.testing.assert_array_equal(_floats(online[name]), _floats(frame[name]), err_msg=name)
    # Every retained row shows up (in a whole round at least) for the comparison to mean something.
    for name in sorted(ROW_READING):
        assert np.isfinite(_floats(frame[name])).sum() >= 3, name


def test_design_matrix_and_phat_equal_the_offline_ones(online_run):
    runs, frame, predictor = online_run
    online = _online_table(runs)
    m = predictor.model
    tokens = frame["token"].to_numpy()
    offline_X = design_matrix(frame, m.features, m.categories, m.token_prior.transform(tokens))
    online_X = np.concatenate(
        [
            predictor.design(
                x.features,
                frame.loc[
                    frame["prompt_id"].eq(p.id) & frame["round_index"].eq(i), "token"
                ].to_numpy(),
                p.task,
            )
            for p, r in sorted(runs, key=lambda pr: pr[0].id)
            for i, x in enumerate(r.rounds)
        ]
    )
    np.testing.assert_array_equal(online_X, offline_X)
    # The online route (library for lgbm, the forest walk for hgb) vs the library on the
    # extracted table: float32 logs of phat agree to float32 rounding (phat to 1e-12).
    offline_log_phat = np.log(m.predict_phat(frame, n_threads=1)).astype(np.float32)
    np.testing.assert_allclose(online["log_phat"].to_numpy(), offline_log_phat, rtol=0, atol=1e-6)

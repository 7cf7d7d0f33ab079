"""The pipeline's stages on the shipped pocket semi-AR drafters (`model=pocket_dspark`,
`model=pocket_domino`) at debug size: `make run`'s three stages (record both laws, extract,
train), then `decode.run` comparing draft with one of the rerankers `rerank.train` saved,
each stage as `make run` starts it (RUN_ARGS routed, `SPECRANK_ROUTED=1`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from features.schema import candidate_store
from specrank.settings.cli import ROUTED_ENV
from specrank.settings.paths import PROJECT_ROOT
from specrank.store.trace_schema import trace_store
from tests.recording import make_run_stages

# what each kind's rows are corrected by, as its manifest names it
CONDITIONALS = {"dspark": "Markov head", "domino": "GRU"}
RERANKER = "rows_lgbm_T0_fold0"  # greedy law, fitted on one half of the prompts


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("kind", ["dspark", "domino"])
def test_make_run_then_decode_run_with_a_fitted_reranker(tmp_path, kind):
    """Record (both laws, the default suite's first 6 + 6 prompts), extract, train; then
    `decode.run 'run.rules=[draft,reranker:<saved>]' run.seen_prompts=skip` on the same
    prompts decodes the half the reranker was not fitted on, both rules lossless at T=0."""
    make_run_stages(f"pocket_{kind}", tmp_path)
    store = trace_store(tmp_path / "t")
    models = store.manifest()["models"]
    assert models["drafter_kind"] == kind and models["target_layer_ids"] == "0,1,2"
    assert CONDITIONALS[kind] in models["pool_conditionals"]
    rounds = store.read(columns=["prompt_id", "temperature"]).to_pandas()
    assert rounds.groupby("temperature")["prompt_id"].nunique().to_dict() == {0.0: 12, 1.0: 12}
    candidates = candidate_store(tmp_path / "f").read(columns=["prompt_id"])
    assert candidates.num_rows > len(rounds)  # several candidates a round
    summary = pd.read_csv(tmp_path / "h" / "summary.csv")
    assert {"greedy", "sampling"} <= set(summary.loc[summary["rule"] == "rows_lgbm", "law"])
    saved = tmp_path / "h" / "rerankers" / RERANKER
    fitted_on = set(json.loads((saved / "reranker.json").read_text())["train_prompts"])

    args = [f"model=pocket_{kind}", "debug=default", "data.sources.0.limit=6",
            "data.sources.1.limit=6", f"run.rules=[draft,reranker:{saved}]",
            "run.seen_prompts=skip", f"hydra.run.dir={tmp_path}/r",
            f"mlflow.tracking_uri=sqlite:///{tmp_path}/ml.db"]  # fmt: skip
    res = subprocess.run([sys.executable, "-m", "decode.run", *args], cwd=PROJECT_ROOT,
                         capture_output=True, text=True, timeout=1500,
                         env={**os.environ, ROUTED_ENV: "1"})  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "r"
    prompts = pd.read_csv(out / "online_prompts.csv")
    assert set(prompts["rule"]) == {"draft", "reranker_rows_lgbm"}
    decoded = set(prompts["prompt_id"].astype(str))
    assert len(decoded) == 6 and not decoded & fitted_on  # the other half only
    metrics = json.loads((out / "online_summary.json").read_text())
    for rule in ("draft", "reranker_rows_lgbm"):
        assert metrics[f"online/{rule}/tau"] >= 1.0
        assert metrics[f"online/{rule}/greedy_output_matches_baseline"] == 1.0
    assert (out / "online_compare.csv").is_file()

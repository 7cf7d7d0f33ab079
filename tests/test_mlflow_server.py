"""`rerank.train` against a real MLflow tracking server, read back over its REST API (issue 8).

Starts `mlflow server` on 127.0.0.1 (SQLite backend, a free port, proxied
artifacts in a temporary folder), runs the main job at debug size with the
server's http:// URI, then reads params, tags, metrics, child runs, tables and
a saved reranker back over plain HTTP — no MLflow client on the reading side —
and stops the server by its own process group.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict
from io import BytesIO
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest

from bench.mlflow_server import group_alive, mlflow_server, stop_server
from features.extract import extract
from features.schema import candidate_store
from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.job import write_synthetic_traces
from rerank.config import BoosterConfig, RerankConfig
from rerank.evaluate.pool_chunks import ROUND_KEYS
from rerank.fit.persist import load_reranker
from rerank.report.runs import read_csv_table
from rerank.train import train_and_evaluate
from specrank.settings.config import MlflowConfig
from specrank.store.trace_schema import trace_store
from tree.config import PoolConfig, SelectConfig


def _get(url: str, endpoint: str, **query: str) -> bytes:
    full = f"{url}{endpoint}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(full, timeout=30) as r:
        assert r.status == 200, f"GET {full}: expected 200, found {r.status}"
        return r.read()


def _get_json(url: str, endpoint: str, **query: str) -> dict:
    return json.loads(_get(url, endpoint, **query))


def _post_json(url: str, endpoint: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"{url}{endpoint}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _list(url: str, run_id: str, path: str) -> dict[str, dict]:
    listing = _get_json(url, "/api/2.0/mlflow/artifacts/list", run_id=run_id, path=path)
    return {f["path"]: f for f in listing.get("files", [])}


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("served")
    job = SynthJobConfig(toy_prompts=8, rounds_per_prompt=8, prompts_per_shard=4)
    pool, select = PoolConfig(top_k=6, expand_steps=3, expand=6), SelectConfig("draft", 8, 20)
    write_synthetic_traces(root / "traces", job, pool, select, SynthConfig(), seed=0)
    extract(root / "traces", root / "features", log=lambda _: None)
    return root / "traces", root / "features"


def test_train_logs_to_a_real_tracking_server(stores, tmp_path):
    traces, features = stores
    rerank = RerankConfig(
        traces=str(traces),
        features=str(features),
        booster=BoosterConfig(kind="lgbm", n_threads=1),
        feature_sets=["rows"],
        calibrators=["iso_q1"],
        substitutions=["cache"],
        n_resamples=200,
        calibration_edges=20_000,
        chunk_rounds=256,
    )
    config = {"rerank": asdict(rerank), "seed": 0}
    server_root = tmp_path / "server"
    previous_uri = mlflow.get_tracking_uri()
    with mlflow_server(server_root) as (url, proc):
        try:
            result = train_and_evaluate(
                rerank,
                MlflowConfig(tracking_uri=url, experiment="served", run_name="over-http"),
                config,
                0,
                tmp_path / "out",
            )
        finally:
            mlflow.set_tracking_uri(previous_uri)  # train_and_evaluate sets it process-wide
        rid = result.run_id

        # -- params, tags, metrics -------------------------------------------------------
        run = _get_json(url, "/api/2.0/mlflow/runs/get", run_id=rid)["run"]
        assert run["info"]["status"] == "FINISHED"
        assert run["info"]["run_name"] == "over-http"
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        assert params["rerank.booster.kind"] == "lgbm"
        assert params["rerank.n_resamples"] == "200"
        assert params["seed"] == "0"
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert tags["trace_fingerprint"] == trace_store(traces).fingerprint()
        assert tags["rerank_model"] == "lgbm"
        assert tags["git_sha"]
        metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
        s = result.summary
        row = s[(s["rule"] == "rows_lgbm") & (s["law"] == "sampling") & (s["budget"] == 8)
                & (s["weighting"] == "round")].iloc[0]  # fmt: skip
        assert metrics["gain/sampling/B8/rows_lgbm"] == pytest.approx(row["gain"], rel=1e-12)
        assert metrics["accepted/sampling/B59/root"] > 0
        assert "sq_error/sampling/rows_lgbm" in metrics

        # -- one child run per fold ----------------------------------------------------
        children = _post_json(
            url,
            "/api/2.0/mlflow/runs/search",
            {
                "experiment_ids": [run["info"]["experiment_id"]],
                "filter": f"tags.mlflow.parentRunId = '{rid}'",
            },
        )["runs"]
        folds = sorted(
            t["value"] for c in children for t in c["data"]["tags"] if t["key"] == "fold"
        )
        assert folds == ["0", "1"]

        # -- artifacts: proxied by the server, stored in its --artifacts-destination ------
        artifact_uri = run["info"]["artifact_uri"]
        assert artifact_uri.startswith("mlflow-artifacts:/"), artifact_uri
        prefix = artifact_uri.removeprefix("mlflow-artifacts:").strip("/")

        def download(path: str) -> bytes:
            return _get(url, f"/api/2.0/mlflow-artifacts/artifacts/{prefix}/{path}")

        tables = _list(url, rid, "tables")
        expected = {"summary.csv", "breakdowns.csv", "prediction_quality.csv",
                    "mixture_weights.csv", "per_round_values.parquet",
                    "oof_predictions.parquet", "results.txt"}  # fmt: skip
        assert {f"tables/{f}" for f in expected} <= set(tables)
        assert (server_root / "artifacts" / prefix / "tables" / "summary.csv").is_file()
        assert not (Path.cwd() / "mlartifacts" / prefix).exists()
        summary = read_csv_table(BytesIO(download("tables/summary.csv")))  # as the notebook reads
        pd.testing.assert_frame_equal(
            summary, result.summary.reset_index(drop=True), check_dtype=False, rtol=1e-12
        )
        assert json.loads(download("config/resolved_config.json")) == json.loads(json.dumps(config))
        assert {"plots/gain_vs_budget_sampling.png", "plots/reliability_sampling.png"} <= set(
            _list(url, rid, "plots")
        )

        # -- the saved reranker: download, verify, reproduce the logged predictions ------
        name = "rows_lgbm_T1_fold0"
        files = _list(url, rid, f"rerankers/{name}")
        assert set(files) == {f"rerankers/{name}/model.txt", f"rerankers/{name}/reranker.json"}
        local = tmp_path / "downloaded" / name
        local.mkdir(parents=True)
        for path in files:
            data = download(path)
            assert data == (tmp_path / "out" / path).read_bytes(), f"{path} differs from local"
            (local / Path(path).name).write_bytes(data)
        model = load_reranker(local)  # verifies hashes, schema version, feature list
        oof = pd.read_parquet(BytesIO(download("tables/oof_predictions.parquet")))

    assert proc.returncode is not None, "the server process is still running"
    assert not group_alive(proc.pid), "a process of the server's group outlived it"

    # the model never saw the prompts it predicts for; its predictions there are the logged ones
    candidates = candidate_store(features).read().to_pandas()
    held_out = candidates[
        (candidates["temperature"] == 1.0) & ~candidates["prompt_id"].isin(model.train_prompts)
    ]
    assert len(held_out) > 0
    logged = held_out[[*ROUND_KEYS, "cand_index"]].merge(
        oof, on=[*ROUND_KEYS, "cand_index"], how="left", validate="one_to_one"
    )
    np.testing.assert_allclose(model.predict_phat(held_out), logged["rows_lgbm"], rtol=1e-9)


# slow: about 40 s (a server started, a job, a server stopped, a second job); the soak's
# --tracking-server case (bench/soak.py) runs the same fault
@pytest.mark.slow
def test_a_server_stopped_mid_run_loses_nothing_and_the_folder_is_logged_later(
    stores, tmp_path, monkeypatch
):
    """The server dies after the tables are written: the failure is named, the folder is
    complete, and `python -m specrank.tracking.log_run` logs it once a server is back."""
    import rerank.train as train_module
    from specrank.tracking.run_record import TrackingError

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once, not after minutes
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    traces, features = stores
    rerank = RerankConfig(traces=str(traces), features=str(features), feature_sets=["rows"],
                          calibrators=[], substitutions=[], reports=False, n_resamples=50,
                          budgets=[8], booster=BoosterConfig(n_threads=1, n_iter=5))  # fmt: skip
    server_root, out = tmp_path / "server", tmp_path / "out"
    previous_uri = mlflow.get_tracking_uri()
    with mlflow_server(server_root) as (url, proc):
        real_write = train_module.write_record

        def then_stop(folder, record):  # the record is the folder's last file
            path = real_write(folder, record)
            stop_server(proc)
            return path

        monkeypatch.setattr(train_module, "write_record", then_stop)
        try:
            with pytest.raises(TrackingError) as err:
                train_and_evaluate(rerank, MlflowConfig(tracking_uri=url, experiment="stopped"),
                                   {"seed": 0}, 0, out)  # fmt: skip
        finally:
            mlflow.set_tracking_uri(previous_uri)
    message = str(err.value)
    assert f"MLflow logging to {url} failed" in message
    assert f"python -m specrank.tracking.log_run {out}" in message
    for name in ("summary.csv", "comparisons.csv", "results.txt", "mlflow_run.json"):
        assert (out / name).is_file(), name
    with mlflow_server(server_root) as (url2, _):  # the same store, a new server
        done = subprocess.run(
            [sys.executable, "-m", "specrank.tracking.log_run", str(out), "--tracking-uri", url2],
            capture_output=True, text=True, timeout=240, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        rid = json.loads((out / "mlflow_logged.json").read_text())["run_id"]
        run = _get_json(url2, "/api/2.0/mlflow/runs/get", run_id=rid)["run"]
        assert run["info"]["status"] == "FINISHED"
        metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
        summary = pd.read_csv(out / "summary.csv")
        row = summary[(summary["rule"] == "rows_lgbm") & (summary["law"] == "sampling")
                      & (summary["weighting"] == "round")].iloc[0]  # fmt: skip
        assert metrics["gain/sampling/B8/rows_lgbm"] == pytest.approx(row["gain"], rel=1e-12)
        assert "tables/summary.csv" in _list(url2, rid, "tables")

"""Faults placed by hooks (`specrank.runtime.faults`): a full disk while a shard or a results table is
written, a kill mid-write, a free-space refusal, an MLflow run left RUNNING by a kill.

Each fault names the file; every shard finished before it stays readable; the rerun
completes with what an uninterrupted run writes. The soak (`bench/soak.py`) does the same
with kills at random moments over the whole pipeline.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import mlflow
import pandas as pd
import pytest

import decode.record as record
import specrank.store.files as files
from decode.config import TraceConfig
from decode.stream import DecodeSettings
from features.extract import extract
from pairs.config import DataConfig, PromptSource
from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.job import write_synthetic_traces
from rerank.config import BoosterConfig, RerankConfig
from rerank.train import train_and_evaluate
from specrank.runtime import faults
from specrank.settings.config import MlflowConfig
from specrank.store.files import DiskSpaceError
from specrank.store.trace_schema import trace_store
from specrank.tracking.run_record import LOGGED, RECORD, RunRecord, log_record, write_record
from tests.tiny_models import tiny_model_config
from tree.config import PoolConfig, SelectConfig

ROOT = Path(__file__).resolve().parents[1]
POOL = PoolConfig(top_k=4, expand_steps=2, expand=4)
JOB = SynthJobConfig(toy_prompts=8, rounds_per_prompt=4, prompts_per_shard=2)


def _synth(out: Path):
    return write_synthetic_traces(out, JOB, POOL, SelectConfig(budget=8), SynthConfig(), 0)


@pytest.fixture()
def inject(monkeypatch):
    """Set SPECRANK_FAULTS for this process, with the hit counters reset."""

    def set_(spec: str) -> None:
        faults._hits.clear()
        monkeypatch.setenv(faults.FAULTS_ENV, spec)

    yield set_
    faults._hits.clear()


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name or ".claim" in p.name)


def test_a_malformed_fault_spec_is_refused(inject):
    inject("shard_write@0=kill")
    with pytest.raises(ValueError, match=r"SPECRANK_FAULTS: expected entries 'point@n=action'"):
        faults.point("shard_write")


def test_a_full_disk_while_a_shard_is_written(tmp_path, inject, monkeypatch):
    clean = _synth(tmp_path / "clean")
    inject("shard_write@3=enospc")
    out = tmp_path / "traces"
    with pytest.raises(
        OSError, match=r"shard-00002\.parquet: cannot write shard '00002'.*No space"
    ):
        _synth(out)
    store = trace_store(out)
    assert store.done_shards() == ["00000", "00001"]  # the finished ones, readable
    assert store.read().num_rows == 2 * 2 * JOB.rounds_per_prompt
    assert _leftovers(out) == []
    monkeypatch.delenv(faults.FAULTS_ENV)
    assert _synth(out).fingerprint == clean.fingerprint  # the rerun completes the same store


def test_a_full_disk_while_a_results_table_is_written(tmp_path, inject, monkeypatch):
    traces, features = tmp_path / "t", tmp_path / "f"
    _synth(traces)
    extract(traces, features, log=lambda _: None)
    rerank = RerankConfig(traces=str(traces), features=str(features), feature_sets=["rows"],
                          calibrators=[], substitutions=[], reports=False, n_resamples=20, budgets=[8],
                          booster=BoosterConfig(n_threads=1, n_iter=5))  # fmt: skip
    tracking = MlflowConfig(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}", experiment="t")
    inject("table_write@2=enospc")
    with pytest.raises(OSError, match=r"comparisons\.csv: cannot write \(No space"):
        train_and_evaluate(rerank, tracking, {}, 0, tmp_path / "run1")
    assert (tmp_path / "run1" / "summary.csv").exists()  # written whole before the fault
    assert not (tmp_path / "run1" / RECORD).exists()  # no record: the folder is unfinished
    assert not any(".tmp" in p.name for p in (tmp_path / "run1").iterdir())
    monkeypatch.delenv(faults.FAULTS_ENV)
    result = train_and_evaluate(rerank, tracking, {}, 0, tmp_path / "run2")
    first = pd.read_csv(tmp_path / "run1" / "summary.csv")
    pd.testing.assert_frame_equal(first, pd.read_csv(tmp_path / "run2" / "summary.csv"))
    assert result.run_id == json.loads((tmp_path / "run2" / LOGGED).read_text())["run_id"]


def test_a_kill_while_a_shard_is_written_and_the_rerun(tmp_path):
    clean = _synth(tmp_path / "clean")
    out = tmp_path / "traces"
    cmd = [sys.executable, "-m", "decode.synth_traces", f"paths.synthetic={out}",
           f"hydra.run.dir={tmp_path / 'h'}", "synth_job.toy_prompts=8", "synth_job.rounds_per_prompt=4",
           "synth_job.prompts_per_shard=2", "pool.top_k=4", "pool.expand_steps=2", "pool.expand=4",
           "select.budget=8"]  # fmt: skip
    env = {**os.environ, faults.FAULTS_ENV: "shard_write@2=kill"}
    killed = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, timeout=240)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert trace_store(out).done_shards() == ["00000"]
    assert any(".tmp" in name for name in _leftovers(out))  # the killed writer's temp file
    env.pop(faults.FAULTS_ENV)
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert trace_store(out).fingerprint() == clean.fingerprint
    assert _leftovers(out) == []


def test_recording_and_extraction_refuse_a_disk_without_room(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(files.shutil, "disk_usage", lambda _: usage(10**9, 10**9, 10**6))

    def refuse(*_a, **_k):
        raise AssertionError("a model was loaded before the free space was checked")

    monkeypatch.setattr(record, "load_model_pair", refuse)
    model = tiny_model_config(tmp_path / "m", "llama")
    data = DataConfig(name="t", sources=[PromptSource(kind="humaneval", limit=8)])
    with pytest.raises(
        DiskSpaceError,
        match=r"decode.record: about 7.3 MB will be written to .*"
        r"but its disk has 1.0 MB free.*paths.traces",
    ):
        record.run_record(model, data, DecodeSettings(), TraceConfig(out_dir=str(tmp_path / "t")),
                          {})  # fmt: skip
    monkeypatch.setattr(shutil, "disk_usage", shutil.disk_usage)
    traces = tmp_path / "synth"
    _synth(traces)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda _: usage(10**9, 10**9, 10))
    with pytest.raises(DiskSpaceError, match=r"features.extract: .* 0.0 MB free"):
        extract(traces, tmp_path / "features", log=lambda _: None)


_LOG_KILLED = """
import sys
from specrank.tracking.run_record import log_record
log_record(sys.argv[1])
"""


def test_a_run_left_running_by_a_kill_is_marked_killed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    folders = []
    for name in ("killed", "next"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "t.csv").write_text("a\n1\n")
        write_record(folder, RunRecord(uri, "e", name, {"x": 1}, {}, {"m": 1.0}, [("t.csv", "t")]))
        folders.append(folder)
    env = {**os.environ, faults.FAULTS_ENV: "run_logging@1=kill"}
    r = subprocess.run([sys.executable, "-c", _LOG_KILLED, str(folders[0])], env=env, cwd=ROOT,
                       capture_output=True, timeout=240)  # fmt: skip
    assert r.returncode == -9, r.stderr[-2000:]
    client = mlflow.MlflowClient(tracking_uri=uri)
    (killed,) = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert killed.info.status == "RUNNING"
    log_record(folders[1])
    assert client.get_run(killed.info.run_id).info.status == "KILLED"
    with pytest.raises(ValueError, match=r"already logged as MLflow run"):
        log_record(folders[1])
    log_record(folders[0])  # the killed run's folder, logged again later
    statuses = sorted(r.info.status for r in client.search_runs(
        [client.get_experiment_by_name("e").experiment_id]))  # fmt: skip
    assert statuses == ["FINISHED", "FINISHED", "KILLED"]


def test_a_new_sqlite_tracking_store_is_created_whole(tmp_path):
    """Built aside and renamed (a kill mid-migration once left a store no run could open)."""
    from specrank.tracking.train_runs import ensure_sqlite_store

    uri = f"sqlite:///{tmp_path / 'db' / 'm.db'}"
    ensure_sqlite_store(uri)
    assert sorted(p.name for p in (tmp_path / "db").iterdir()) == ["m.db"]
    client = mlflow.MlflowClient(tracking_uri=uri)
    client.create_experiment("x")
    ensure_sqlite_store(uri)  # an existing store is left as it is
    assert client.get_experiment_by_name("x") is not None

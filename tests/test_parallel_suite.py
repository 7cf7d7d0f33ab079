"""Recording on many workers end to end (slow): Ray actors and submitit jobs vs one process.

A store recorded on 2 Ray CPU workers, or by submitit_local jobs each over a range
of shards, holds the rows of a single-process recording (timing columns aside) at
both laws (per-prompt seeds: no draw depends on the worker), with the same summary;
a worker SIGKILLed mid-run has its shard redone on the other, and a rerun redoes
nothing. Online runs decode on Ray what they decode in one process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from hydra import compose
from omegaconf import OmegaConf

import decode.record as record
from decode.config import RunConfig
from decode.recording import RecordReport
from decode.run import run_online
from decode.stream import DecodeSettings
from pairs.config import DataConfig, PromptSource
from specrank.runtime.parallel import ParallelConfig
from specrank.store.tables import SchemaError
from specrank.store.trace_schema import trace_store
from tests.online_fixtures import PROMPTS, settings
from tests.tiny_models import one_thread, tiny_model_config
from tests.toy_workers import lean_ray

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster():
    with lean_ray():
        yield


LAWS = (0.0, 1.0)  # greedy and sampling: per-prompt seeds make draws independent of the worker


def _table(out: Path) -> pa.Table:
    t = trace_store(out).read()
    t = t.drop_columns([c for c in t.column_names if c.startswith("time_")])
    return t.sort_by([("prompt_id", "ascending"), ("round_index", "ascending")])


def _summary(r: RecordReport) -> tuple:
    return (r.prompts_decoded, r.shards_written, r.shards_skipped, r.rounds, r.tokens, r.accepted)


def _record(cfg) -> RecordReport:
    """What `decode.record`'s main does with a composed config, returning the report."""
    s = DecodeSettings(pool=OmegaConf.to_object(cfg.pool), select=OmegaConf.to_object(cfg.select),
                       decode=OmegaConf.to_object(cfg.decode))  # fmt: skip
    with one_thread():
        return record.run_record(
            OmegaConf.to_object(cfg.model), OmegaConf.to_object(cfg.data), s,
            OmegaConf.to_object(cfg.trace), record.manifest_sections(cfg),
            OmegaConf.to_object(cfg.parallel),
        )  # fmt: skip


def _tiny_overrides(tmp_path: Path) -> list[str]:
    model = tiny_model_config(tmp_path / "models", "qwen3")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": p.id, "task": p.task, "prompt": p.text}) + "\n"
                               for p in PROMPTS[:6]))  # fmt: skip
    return [
        f"model.name={model.name}", f"model.target={model.target}",
        f"model.drafter={model.drafter}", "data.name=tiny",
        f"data.sources=[{{kind:jsonl,path:'{prompts}'}}]", "trace.prompts_per_shard=2",
        "trace.progress=false", "pool.top_k=4", "pool.expand_steps=3", "pool.expand=3",
        "select.budget=6", "select.record_top_m=12", "decode.max_new_tokens=16",
    ]  # fmt: skip


def test_ray_recording_equals_single_process_at_both_laws(hydra_conf, ray_cluster, tmp_path):
    """Tiny models, 3 shards per law on 2 CPU workers: the same rows and summary as one process."""
    base = _tiny_overrides(tmp_path)
    for law in LAWS:
        one = _record(compose("record", overrides=[*base, f"paths.traces={tmp_path / 'one'}",
                                                   f"decode.temperature={law}"]))  # fmt: skip
        two = _record(compose("record", overrides=[
            *base, f"paths.traces={tmp_path / 'ray'}", f"decode.temperature={law}",
            "launcher=ray", "parallel.workers=2"]))  # fmt: skip
        assert _summary(two) == _summary(one) and one.shards_written == 3
    assert (
        trace_store(tmp_path / "ray").done_shards() == trace_store(tmp_path / "one").done_shards()
    )
    assert _table(tmp_path / "ray").equals(_table(tmp_path / "one"))
    assert trace_store(tmp_path / "ray").manifest()["config"] == trace_store(
        tmp_path / "one").manifest()["config"]  # fmt: skip
    again = _record(compose("record", overrides=[*base, f"paths.traces={tmp_path / 'ray'}",
                                                 "launcher=ray", "parallel.workers=2"]))  # fmt: skip
    assert (again.shards_written, again.shards_skipped) == (0, 3)  # resumed: nothing redone
    with pytest.raises(SchemaError, match=r"differing keys: \['select.budget'\]"):  # before loading
        _record(compose("record", overrides=[*base, f"paths.traces={tmp_path / 'ray'}",
                                             "select.budget=5", "launcher=ray"]))  # fmt: skip


def test_online_run_on_ray_decodes_what_one_process_decodes(ray_cluster, tmp_path):
    """Two rules in one run, 4 prompts in shards of 3: each prompt's rules on one actor, in the
    single process's order (the second shard starts at position 3), the same rounds."""
    model = tiny_model_config(tmp_path / "models", "llama")
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": p.id, "task": p.task, "prompt": p.text}) + "\n"
                            for p in PROMPTS[:4]))  # fmt: skip
    data = DataConfig(name="tiny", sources=[PromptSource(kind="jsonl", path=str(path))])
    run = RunConfig(rules=["draft", "root"], warmup_prompts=1, bootstrap_resamples=50,
                    progress=False)  # fmt: skip
    s = settings("draft", 1.0, max_new_tokens=12)
    reports = {}
    for name, p in (("one", None), ("ray", ParallelConfig(backend="ray", workers=2))):
        with one_thread():
            reports[name] = run_online(model, data, s, run, None, {}, tmp_path / name,
                                       prompts_per_shard=3, parallel=p)  # fmt: skip
    keep = ["rule", "prompt_id", "round_index", "tau", "accepted", "tree_size", "passes",
            "root_entropy"]  # fmt: skip
    assert set(reports["one"].rounds["rule"]) == {"draft", "root"}
    assert reports["ray"].rounds[keep].equals(reports["one"].rounds[keep])
    assert reports["ray"].prompts["tokens"].tolist() == reports["one"].prompts["tokens"].tolist()
    for rule in ("draft", "root"):
        key = f"online/{rule}/tau"
        assert reports["ray"].metrics[key] == reports["one"].metrics[key]


# -- the debug suite (slow): Ray with a worker killed mid-run, and submitit_local jobs ---------


def _debug(out: Path, law: float, *extra: str):
    return compose("record", overrides=["debug=default", f"paths.traces={out}",
                                        f"decode.temperature={law}", *extra])  # fmt: skip


@pytest.fixture(scope="module")
def debug_reference(tmp_path_factory):
    """The debug suite recorded at both laws in this process: what every other way must equal."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    out = tmp_path_factory.mktemp("reference") / "traces"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        reports = {law: _record(_debug(out, law)) for law in LAWS}
    GlobalHydra.instance().clear()
    return out, reports


@pytest.mark.timeout(900)  # the debug suite twice at both laws, on 2 shared cores
def test_debug_suite_on_ray_with_a_worker_killed_mid_run(hydra_conf, ray_cluster, debug_reference,
                                                         tmp_path):  # fmt: skip
    ref, ref_reports = debug_reference
    out = tmp_path / "traces"
    killed: list[int] = []
    stop = threading.Event()

    def kill_the_first_claimant() -> None:  # SIGKILL, as an OOM killer or a preemption would
        while not stop.is_set() and not killed:
            for claim in out.glob("shard-*.claim-*"):
                try:
                    pid = json.loads(claim.read_text())["pid"]
                except (FileNotFoundError, json.JSONDecodeError):
                    continue  # released (or being created) just now
                assert pid != os.getpid()  # the driver never writes a shard itself
                if (out / claim.name.replace(".claim-0", ".done")).exists():
                    continue  # committed already: a kill now would not be mid-shard
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                break
            time.sleep(0.005)

    watcher = threading.Thread(target=kill_the_first_claimant, daemon=True)
    watcher.start()
    reports = {law: _record(_debug(out, law, "launcher=ray", "parallel.workers=2")) for law in LAWS}
    stop.set()
    watcher.join()
    assert len(killed) == 1 and sum(r.workers_lost for r in reports.values()) == 1
    for law in LAWS:  # the final summary is the single-process one
        assert _summary(reports[law]) == _summary(ref_reports[law])
    table = _table(out)
    keys = table.select(["prompt_id", "round_index", "temperature"]).to_pandas()
    assert not keys.duplicated().any()
    assert table.equals(_table(ref))  # nothing missing, nothing twice, identical rows
    assert not list(out.glob("shard-*.claim-*")) and not list(out.glob(".*tmp*"))
    rerun = {law: _record(_debug(out, law, "launcher=ray", "parallel.workers=2")) for law in LAWS}
    assert all(r.shards_written == 0 for r in rerun.values())
    assert _table(out).equals(_table(ref))


@pytest.mark.timeout(900)
def test_debug_suite_as_submitit_local_jobs_records_the_same_shards(debug_reference, tmp_path):
    ref, _ = debug_reference
    out = tmp_path / "traces"
    cmd = [sys.executable, "-m", "decode.record", "-m", "launcher=submitit_local",
           "parallel.parts=2", "debug=default", f"paths.traces={out}",
           f"hydra.sweep.dir={tmp_path / 'sweep'}"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.name.isdigit())
    assert jobs == ["0", "1", "2", "3"]  # 2 laws x 2 ranges of shards
    assert trace_store(out).done_shards() == trace_store(ref).done_shards()
    assert _table(out).equals(_table(ref))

"""Recording on many workers, the fast part: shard ranges, settings, claims, Ray dealing.

Invariants: every shard is written exactly once whatever the number of writers
and whatever dies (a killed process, a dead Ray actor); a half-written shard is
redone; of writers with different configs one is accepted; bad settings are
refused before any model loads. End to end on Ray and submitit (slow): test_parallel_suite.py.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hydra import compose
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import OmegaConf

import decode.record as record
from decode.config import RunConfig, TraceConfig
from decode.run import run_online
from decode.stream import DecodeSettings
from pairs.config import DataConfig, PromptSource
from specrank.runtime.parallel import ParallelConfig, check_launcher, check_parallel, deal, part_of
from specrank.store.claims import HOST, ClaimLost, claim_files, release
from specrank.store.shard_store import ShardStore
from specrank.store.tables import SchemaError
from tests.online_fixtures import settings
from tests.tiny_models import tiny_model_config
from tests.toy_workers import TOY, ToyWorker, lean_ray, toy_table


def _leftovers(root: Path) -> list[str]:
    """Files other than the manifest, shards and markers (claims, temp files)."""
    keep = ("manifest.json",)
    return sorted(
        p.name
        for p in root.iterdir()
        if p.name not in keep and p.suffix not in (".parquet", ".done")
    )


# -- ranges and settings ----------------------------------------------------------------------


@given(n=st.integers(0, 60), parts=st.integers(1, 12))
def test_part_of_splits_into_contiguous_ranges_covering_every_shard_once(n, parts):
    ids = [f"{i:03d}" for i in range(n)]
    ranges = [part_of(ids, k, parts) for k in range(parts)]
    assert [s for r in ranges for s in r] == ids  # contiguous, in order, each once
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    ("kwargs", "device", "message"),
    [
        ({"backend": "dask"}, "cpu", r"'parallel.backend' must be one of \['local', 'ray'\]"),
        ({"workers": 0}, "cpu", r"'parallel.workers' must be an int in the range \[1, inf\)"),
        ({"parts": 3, "part": 3}, "cpu", r"'parallel.part' must be an int in the range \[0, 2\]"),
        (
            {"claim_stale_s": 0},
            "cpu",
            r"'parallel.claim_stale_s' must be a number in the range \(0",
        ),
        ({"address": ""}, "cpu", r"'parallel.address' must be null or a Ray address"),
        ({"backend": "ray", "parts": 2}, "cpu", r"parallel.parts=2 with parallel.backend=ray"),
        ({"backend": "ray"}, "cuda:1", r"model.device=cuda:1 with parallel.backend=ray"),
    ],
)
def test_bad_parallel_settings_are_refused_by_name(kwargs, device, message):
    with pytest.raises(ValueError, match=message):
        check_parallel(ParallelConfig(**kwargs), device)


def test_a_job_launcher_outside_multirun_is_refused():
    with pytest.raises(
        ValueError, match=r"launcher=slurm submits one job per range .* run with -m"
    ):
        check_launcher("slurm", multirun=False)
    check_launcher("slurm", multirun=True)
    check_launcher("ray", multirun=False)


def test_launcher_options_compose(hydra_conf):
    ray_cfg = compose("record", overrides=["launcher=ray", "parallel.workers=4"])
    assert ray_cfg.parallel.backend == "ray" and ray_cfg.parallel.workers == 4
    slurm = compose("record", overrides=["launcher=slurm", "parallel.parts=8"],
                    return_hydra_config=True)  # fmt: skip
    assert slurm.hydra.launcher._target_.endswith("SlurmLauncher")
    params = OmegaConf.to_container(slurm.hydra.sweeper.params, resolve=True)
    assert params == {"decode.temperature": "0,1", "parallel.part": "range(0,8)"}
    assert compose("run", overrides=["launcher=ray"]).parallel.backend == "ray"


def test_bad_settings_fail_before_models_load(tmp_path):
    data = DataConfig(name="d", sources=[PromptSource(kind="jsonl", path=str(tmp_path / "no"))])
    model = tiny_model_config(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match=r"parallel.workers"):
        record.run_record(model, data, DecodeSettings(), TraceConfig(out_dir=str(tmp_path / "o")),
                          {}, ParallelConfig(backend="ray", workers=0))  # fmt: skip
    with pytest.raises(ValueError, match=r"parallel.parts=2: an online run"):
        run_online(model, data, settings(), RunConfig(), None, {}, tmp_path / "r",
                   parallel=ParallelConfig(parts=2))  # fmt: skip


# -- claims: one writer per shard ---------------------------------------------------------------

_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import pyarrow as pa
    import pyarrow.parquet as pq
    from specrank.store.shard_store import ShardStore
    from specrank.store.tables import TableSpec

    root, log, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    spec = TableSpec("toy", 1, pa.schema([("shard", pa.string()), ("writer", pa.int64())]))
    store = ShardStore(root, spec, claim_poll_s=0.02)
    store.open_for_writing({"toy": 1})
    (log.parent / f"ready-{os.getpid()}").touch()
    while not (log.parent / "go").exists():
        time.sleep(0.01)
    if mode == "die":  # killed half-way through writing the shard's file
        def dying(table, where, **kw):
            with open(where, "wb") as f:
                f.write(b"PAR1 half a shard")
            os._exit(9)
        pq.write_table = dying

    def build(sid):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {sid}\\n")
        time.sleep(0.03)
        return pa.table({"shard": [sid], "writer": [os.getpid()]})

    store.write_pending([f"{i:02d}" for i in range(int(sys.argv[4]))], build)
    """
)


def _writers(tmp_path: Path, n_procs: int, n_shards: int, mode: str = "ok") -> list[int]:
    """Start `n_procs` writer processes together on one store; their exit codes."""
    root, log = tmp_path / "store", tmp_path / "log.txt"
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(root), str(log), mode, str(n_shards)])
        for _ in range(n_procs)
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < n_procs and time.monotonic() < deadline:
        time.sleep(0.02)
    (tmp_path / "go").touch()  # all at once: they race for the same shards
    return [p.wait(timeout=120) for p in procs]


def test_concurrent_writers_never_write_the_same_shard(tmp_path):
    assert _writers(tmp_path, 3, 16) == [0, 0, 0]
    built = (tmp_path / "log.txt").read_text().split()[1::2]
    assert sorted(built) == [f"{i:02d}" for i in range(16)]  # each shard built exactly once
    table = ShardStore(tmp_path / "store", TOY).read()
    assert sorted(table["shard"].to_pylist()) == sorted(built)
    assert _leftovers(tmp_path / "store") == []  # claims released, no temp files


def test_a_shard_half_written_by_a_killed_writer_is_redone(tmp_path):
    assert _writers(tmp_path, 1, 1, mode="die") == [9]
    root = tmp_path / "store"
    left = _leftovers(root)
    assert len(left) == 2 and left[0].startswith(".shard-00.parquet.tmp-")  # its half file
    assert left[1] == "shard-00.claim-0"  # and its claim: the owner's pid is gone
    store = ShardStore(root, TOY)
    run = store.write_pending(["00"], toy_table)
    assert (run.written, run.waited) == (1, 0)  # taken over at once (same host, dead pid)
    assert store.read().equals(toy_table("00").cast(TOY.schema))
    assert _leftovers(root) == []


def test_a_live_claim_is_waited_for_a_stale_one_taken_over_and_the_loser_never_commits(tmp_path):
    first = ShardStore(tmp_path, TOY, claim_stale_s=60)
    first.open_for_writing({"toy": 1})
    second = ShardStore(tmp_path, TOY, claim_stale_s=60)
    held = first.claim("a")
    assert held is not None and second.claim("a") is None  # live (our own pid, fresh)
    # Another host's claim is live while its heartbeat is fresh, whatever its pid here.
    other = tmp_path / "shard-b.claim-0"
    other.write_text(json.dumps({"owner": "x", "host": "elsewhere/boot", "pid": 2**22 + 7}))
    assert HOST != "elsewhere/boot" and second.claim("b") is None
    past = time.time() - 120  # no heartbeat for two minutes: its owner is presumed gone
    os.utime(held.path, (past, past))
    os.utime(other, (past, past))
    taken = second.claim("a")
    assert taken is not None and taken.path.name == "shard-a.claim-1"
    assert second.claim("b") is not None and not other.exists()
    assert not held.held() and not held.refresh() and held.lost
    # the superseded writer tries to commit under its claim: refused, nothing written
    with pytest.raises(ClaimLost, match="taken over"):
        first.write_shard("a", toy_table("a"), held)
    assert not first.is_done("a") and not list(tmp_path.glob(".shard-a.parquet.tmp-*"))
    assert second.write_shard("a", toy_table("a"), taken)
    assert [g for g, _ in claim_files(tmp_path, "a")] == [1]


def test_a_waiting_writer_skips_the_shard_another_finishes(tmp_path):
    first = ShardStore(tmp_path, TOY)
    first.open_for_writing({"toy": 1})
    held = first.claim("a")
    second = ShardStore(tmp_path, TOY, claim_poll_s=0.02)
    out = {}
    waiter = threading.Thread(target=lambda: out.update(run=second.write_pending(["a"], toy_table)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()  # waiting on the live claim
    first.write_shard("a", toy_table("a"), held)
    release(held)
    waiter.join(10)
    assert (out["run"].written, out["run"].skipped, out["run"].waited) == (0, 1, 1)


def test_writers_starting_together_with_different_configs_are_refused_but_one(tmp_path):
    barrier, results = threading.Barrier(6), []

    def start(i: int) -> None:
        store = ShardStore(tmp_path / "s", TOY)
        barrier.wait()
        try:
            store.open_for_writing({"run": i})
            results.append(("ok", i))
        except SchemaError as err:
            results.append(("refused", str(err)))

    threads = [threading.Thread(target=start, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in results if r[0] == "ok"]
    assert len(ok) == 1 and ShardStore(tmp_path / "s", TOY).manifest()["config"] == {
        "run": ok[0][1]
    }
    assert all("differing keys: ['run']" in r[1] for r in results if r[0] == "refused")


# -- dealing shards to Ray actors ------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    with lean_ray():
        yield


def _deal(tmp_path: Path, **worker):
    store = ShardStore(tmp_path, TOY)
    store.open_for_writing({"toy": 1})
    ids = [f"{i:02d}" for i in range(8)]
    dead = []
    dealt = deal(ids, functools.partial(ToyWorker, str(tmp_path), **worker),
                 ParallelConfig(backend="ray", workers=2), gpu=False,
                 on_dead=lambda sid, owner: dead.append((sid, store.break_claims(sid, owner))),
                 progress=False)  # fmt: skip
    return store, ids, dealt, dead


def test_a_dead_worker_s_shard_is_dealt_to_another(ray_cluster, tmp_path):
    store, ids, dealt, dead = _deal(tmp_path, die_on="03")
    assert list(dealt.results) == ids and sum(dealt.results.values()) == len(ids)
    assert (dealt.lost_workers, dealt.retried) == (1, ["03"])
    assert [sid for sid, _ in dead] == ["03"]  # its claim voided by the driver
    assert store.done_shards() == ids
    assert sorted(p.name.split("-")[1] for p in tmp_path.glob("built-*")) == ids  # once each
    assert sorted(store.read()["shard"].to_pylist()) == ids
    assert not list(tmp_path.glob("shard-*.claim-*"))
    assert len(set(dealt.infos)) == 2  # two actors, two processes


def test_an_error_in_the_shard_code_fails_the_run_and_is_not_retried(ray_cluster, tmp_path):
    with pytest.raises(ValueError, match="shard 02 is bad"):
        _deal(tmp_path, raise_on="02")
    assert not list(tmp_path.glob("built-02-*")) and not list(tmp_path.glob("shard-*.claim-*"))


def test_more_workers_than_the_cluster_holds_are_refused(ray_cluster, tmp_path):
    with pytest.raises(ValueError, match=r"parallel.workers=3 needs 3 CPUs .* has 2"):
        deal(["a"], lambda: None, ParallelConfig(backend="ray", workers=3), gpu=False)

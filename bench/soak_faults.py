"""The soak's two outside faults (`python -m bench.soak --full-disk --tracking-server`).

`full_disk`: a 4 MB tmpfs (mounting needs root) holds the traces and a training run folder.
A disk already full is refused before recording starts, with the figure; a disk filled
while recording makes the next shard write fail naming the shard, the shards before it
stay readable, and the rerun (space freed) equals the reference; a disk full when
`rerank.train` writes its tables fails naming the table, and the rerun completes.
`tracking_server`: a real `mlflow server` stopped while `rerank.train` writes its tables:
the run fails naming the logging failure and the command, its folder is complete, and
`python -m specrank.tracking.log_run` logs it to the restarted server.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.mlflow_server import mlflow_server, stop_server
from bench.soak_stages import ROOT, read_phase, run, same_store, stage_commands, start
from specrank.store.trace_schema import trace_store


def _fill(folder: Path, leave: int) -> Path:
    """A ballast file that leaves `leave` bytes free on the disk of `folder`."""
    ballast = folder / "ballast"
    free = shutil.disk_usage(folder).free
    with open(ballast, "ab") as f:
        f.write(b"\0" * max(free - leave, 0))
    return ballast


def _wait_phase(phase_file: Path, proc: subprocess.Popen, words: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        phase = read_phase(phase_file)
        if words in phase:
            return phase
        time.sleep(0.02)
    raise AssertionError(f"phase '{words}' not reached (last: {read_phase(phase_file)})")


def _line(text: str, words: str) -> str:
    """The last line of `text` holding `words` (the error a stage printed)."""
    return [x for x in text.splitlines() if words in x][-1]


def _expect(cond: bool, what: str, proc_err: str) -> None:
    if not cond:
        raise AssertionError(f"{what}; stderr tail:\n{proc_err[-2000:]}")


def _fails_on_full_disk(mnt: Path, leave: int, cmd: list[str], words: str, error: str) -> str:
    """`cmd` run with `leave` bytes free on `mnt`: it must fail saying `words`; its error line."""
    ballast = _fill(mnt, leave)
    try:
        failed = run(cmd)
    finally:
        ballast.unlink()
    _expect(failed.returncode != 0 and words in failed.stderr,
            f"a full disk was not named ('{words}')", failed.stderr)  # fmt: skip
    return _line(failed.stderr, error)


def full_disk(root: Path) -> dict:
    mnt = root / "tmpfs"
    mnt.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    out: dict[str, str] = {}
    try:
        traces = mnt / "traces"
        cmd = [*stage_commands(root, "disk")["record"][:-2], f"paths.traces={traces}",
               f"hydra.sweep.dir={root / 'disk' / 'h_record'}"]  # fmt: skip
        out["before_start"] = _fails_on_full_disk(mnt, 50_000, cmd, "MB free", "DiskSpaceError")
        phase_file = root / "disk_phase.txt"
        phase_file.unlink(missing_ok=True)
        proc = start(cmd, phase_file)
        deadline = time.monotonic() + 600
        while not (list(traces.glob("*.done")) and read_phase(phase_file).startswith("building")):
            _expect(time.monotonic() < deadline and proc.poll() is None,
                    "recording ended before a second shard was built", "")  # fmt: skip
            time.sleep(0.005)
        proc.send_signal(signal.SIGSTOP)  # held while building the next shard: fill the disk
        ballast = _fill(mnt, 4096)
        proc.send_signal(signal.SIGCONT)
        proc.wait()
        err = proc.stderr.read()
        _expect(proc.returncode != 0 and "cannot write shard" in err and "No space" in err,
                "a full disk mid-recording was not named", err)  # fmt: skip
        out["mid_run"] = _line(err, "OSError")
        kept = trace_store(traces).read().num_rows  # every finished shard still reads
        ballast.unlink()
        again = run(cmd)
        _expect(again.returncode == 0, "the rerun after freeing space failed", again.stderr)
        same_store(traces, root / "ref" / "traces", "trace")
        out["rows_kept_before_rerun"] = str(kept)
        train = [*stage_commands(root, "disk")["train"][:-1], f"hydra.run.dir={mnt / 'train'}"]
        out["tables"] = _fails_on_full_disk(mnt, 60_000, train, ".csv: cannot write", "OSError")
        done = run([*train[:-1], f"hydra.run.dir={mnt / 'train2'}"])
        _expect(done.returncode == 0, "the training rerun after freeing space failed", done.stderr)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
    return out


def tracking_server(root: Path) -> dict:
    server_root, folder = root / "server", root / "served_train"
    env = {**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    with mlflow_server(server_root) as (url, server):
        cmd = [
            *stage_commands(root, "served", tracking=url)["train"][:-1],
            f"hydra.run.dir={folder}",
        ]
        phase_file = root / "server_phase.txt"
        phase_file.unlink(missing_ok=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env | {"SPECRANK_PHASE_FILE": str(phase_file)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        _wait_phase(phase_file, proc, "writing tables", 900)
        stop_server(server)
        proc.wait()
        err = proc.stderr.read()
    _expect(proc.returncode != 0 and f"MLflow logging to {url} failed" in err
            and f"python -m specrank.tracking.log_run {folder}" in err,
            "the stopped server was not named with the command", err)  # fmt: skip
    _expect((folder / "mlflow_run.json").is_file(), "the run folder is not complete", err)
    with mlflow_server(server_root) as (url2, _):
        logged = subprocess.run(
            [sys.executable, "-m", "specrank.tracking.log_run", str(folder), "--tracking-uri", url2],
            cwd=ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        _expect(logged.returncode == 0, "log_run failed", logged.stderr)
        import mlflow

        runs = mlflow.MlflowClient(tracking_uri=url2).search_runs(
            [e.experiment_id for e in mlflow.MlflowClient(tracking_uri=url2).search_experiments()]
        )
        statuses = sorted(r.info.status for r in runs if not r.data.tags.get("mlflow.parentRunId"))
    return {"failure": _line(err, "error: MLflow logging")[:160] + " ...",
            "logged_later": logged.stdout.strip().splitlines()[-1], "runs": ",".join(statuses)}  # fmt: skip

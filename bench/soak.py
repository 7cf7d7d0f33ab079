"""Fault soak: SIGKILL every stage at seeded random moments, rerun until done, compare.

    python -m bench.soak                       # >= 20 kills over the four stages
    python -m bench.soak --full-disk --tracking-server   # + a small mounted disk, a real server

On the debug suite (pocket models, `debug=default`, 3 + 3 prompts, both laws), each of
`decode.record -m`, `features.extract`, `rerank.train` and `decode.run run.record_traces=true`
is first run once uninterrupted (the reference), then started again into fresh outputs and
SIGKILLed: at a random moment of its reference duration, or by a hook while a shard or a
table is being written (`SPECRANK_FAULTS`, `specrank.runtime.faults`). Each kill's phase is read
from `SPECRANK_PHASE_FILE`. The stage is then rerun until it exits 0, and:
- record, extract, online traces: the store equals the reference in every non-timing column,
  with no duplicate rounds and no temp or claim file left;
- train: every results table equals the reference's (timing columns aside), LightGBM models
  byte for byte; no MLflow run is left RUNNING (a killed one is marked KILLED).
`--full-disk` records and trains on a small tmpfs (root needed) filled up mid-run: the error
names the file, earlier shards stay readable, the rerun completes; a full disk before the
start is refused with the figure. `--tracking-server` stops a real `mlflow server` while
`rerank.train` writes its tables: the failure is named and `python -m specrank.tracking.log_run`
logs the folder once the server is back. Prints one JSON line per kill and a summary.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import signal
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.soak_stages import (
    mlflow_statuses,
    read_phase,
    run,
    same_run_folder,
    same_store,
    stage_commands,
    start,
    while_writing,
)


def compare(name: str, root: Path, out: str, attempt: int) -> None:
    """A finished episode's outputs against the reference (see the module docstring)."""
    got, ref = root / out, root / "ref"
    if name == "train":
        same_run_folder(got / f"h_train_{attempt}", ref / "h_train_0")
        statuses = mlflow_statuses(f"sqlite:///{got / 'mlflow.db'}")
        if statuses.get("RUNNING"):
            raise AssertionError(f"{out}: MLflow runs left RUNNING: {dict(statuses)}")
        return
    folder, kind = {"record": ("traces", "trace"), "extract": ("features", "candidates"),
                    "online": ("online", "trace")}[name]  # fmt: skip
    same_store(got / folder, ref / folder, kind)


def _attempt(cmd: list[str], phase_file: Path, hook: str | None, delay: float) -> dict:
    """One start of a stage, killed by `hook` or after `delay` seconds (if still running)."""
    phase_file.unlink(missing_ok=True)
    t0, phase = time.perf_counter(), ""
    proc = start(cmd, phase_file, hook)
    try:
        proc.wait(timeout=None if hook else delay)
    except subprocess.TimeoutExpired:
        phase = read_phase(phase_file)
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    phase = read_phase(phase_file) if hook else phase
    killed = proc.returncode == -signal.SIGKILL
    if not killed and proc.returncode != 0:
        raise AssertionError(f"{cmd[2]} failed without a kill:\n{proc.stderr.read()[-3000:]}")
    return {"kill": hook or "random", "after_s": round(time.perf_counter() - t0, 2),
            "phase": phase if killed else "finished before the kill", "killed": killed}  # fmt: skip


# Kills per episode before the stage is left to finish: the resumable stages keep their
# finished shards across kills; rerank.train starts over, so one kill, then the rerun.
KILLS_PER_EPISODE = {"record": 3, "extract": 3, "online": 3, "train": 1}


def soak_stage(name: str, root: Path, rng: random.Random, ref_s: float, kills: int,
               hooks: list[str], out: list[dict], max_episodes: int = 12) -> None:  # fmt: skip
    """Episodes on fresh outputs: each starts the stage, kills it (by a hook, else at a random
    moment of the reference duration) up to KILLS_PER_EPISODE times, reruns it until it
    finishes, then compares. Until `kills` random kills and every hook have landed."""
    pending, landed, phase_file = list(hooks), 0, root / "phase.txt"
    for episode in range(max_episodes):
        if landed >= kills and not pending:
            return
        tag = f"soak/{name}-{episode}"
        for attempt in itertools.count():
            hook = pending.pop(0) if pending and attempt == 0 else None
            delay = rng.uniform(0.2, 1.0) * ref_s  # the first fifth: imports
            if attempt >= KILLS_PER_EPISODE[name]:
                delay = 3600.0  # left to finish
            cmd = stage_commands(root, tag, attempt)[name]
            rec = {"stage": name, "episode": episode} | _attempt(cmd, phase_file, hook, delay)
            print(json.dumps(rec), flush=True)
            out.append(rec)
            landed += rec["killed"] and hook is None
            if not rec["killed"]:
                # kill moments follow the fastest full run seen (the reference may have paid
                # for first-run compilation)
                ref_s = min(ref_s, rec["after_s"]) if attempt == 0 else ref_s
                compare(name, root, tag, attempt)
                break
    raise AssertionError(f"{name}: {landed} random kills landed in {max_episodes} episodes")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random-kills", type=int, default=4, help="per stage, at random moments")
    ap.add_argument("--root", type=Path, default=None, help="default: a new temporary folder")
    ap.add_argument("--full-disk", action="store_true", help="a small tmpfs filled mid-run (root)")
    ap.add_argument("--tracking-server", action="store_true", help="a real mlflow server stopped")
    args = ap.parse_args(argv)
    root = args.root or Path(tempfile.mkdtemp(prefix="specrank-soak-"))
    rng = random.Random(args.seed)
    t_start = time.perf_counter()
    ref, durations = stage_commands(root, "ref"), {}
    for name, cmd in ref.items():  # the uninterrupted reference, timed
        t0 = time.perf_counter()
        done = run(cmd)
        if done.returncode != 0:
            raise RuntimeError(f"reference {name} failed:\n{done.stderr[-3000:]}")
        durations[name] = time.perf_counter() - t0
    print(json.dumps({"reference_s": {k: round(v, 1) for k, v in durations.items()}}), flush=True)
    # hooks: kills while a shard, its marker or a results table is written, and in logging
    hooks = {
        "record": ["shard_write@2=kill", "shard_marker@3=kill"],
        "extract": ["shard_write@1=kill", "shard_marker@2=kill"],
        "train": ["table_write@3=kill", "run_logging@1=kill"],
        "online": ["shard_write@1=kill"],
    }
    kills: list[dict] = []
    for name in ref:
        soak_stage(name, root, rng, durations[name], args.random_kills, hooks[name], kills)
    summary = {
        "kills": sum(k["killed"] for k in kills),
        "while_writing": sum(k["killed"] and while_writing(k["phase"]) for k in kills),
        "phases": dict(Counter(k["phase"].split(" of ")[0] for k in kills if k["killed"])),
        "lost_or_duplicated": 0,  # every comparison above passed
    }
    if args.full_disk:
        from bench.soak_faults import full_disk

        summary["full_disk"] = full_disk(root)
    if args.tracking_server:
        from bench.soak_faults import tracking_server

        summary["tracking_server"] = tracking_server(root)
    summary["seconds"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps({"summary": summary}), flush=True)
    return summary


if __name__ == "__main__":
    main()

"""Fault-injection points and phase marks, for the fault soak (`bench/soak.py`) and the tests.

Both do nothing unless their environment variable is set (one lookup per call).

    SPECRANK_FAULTS="shard_write@2=kill,table_write@1=enospc"
        the n-th time this process reaches `point`, `action` happens there:
        kill    SIGKILL itself (a kill placed while a shard or a table is being written)
        enospc  OSError(ENOSPC) naming the file, as a full disk raises it
    SPECRANK_FAULT_COUNTS=<dir>
        count the hits in that folder instead of in this process: "the n-th time any
        process reaches `point`" (Ray workers, whose retried task runs in a new process)
    SPECRANK_PHASE_FILE=<path>
        every `phase(name)` writes the process's current phase there, so a process killed
        from outside can be told what it was doing

Points: `shard_write` (a shard's temp file is written, not yet renamed: `ShardStore`),
`shard_marker` (the shard is renamed, its completion marker not yet written),
`table_write` (a results table's temp file is written: `specrank.store.files.atomic_write`),
`fit_saved` (a finished fit is kept for a rerun: `rerank.fit.resume`) and
`run_logging` (an MLflow run is started, nothing logged to it yet: `specrank.tracking.run_record`) and
`ray_task` (a Ray worker of `rerank.train launcher=ray` starts a fit or a trace shard) and
`fit_node` (a Ray Train worker of `rerank.booster.fit_nodes` has grown a tree and is about to
combine its held-out loss with the other nodes').
"""

from __future__ import annotations

import errno
import os
import signal
from collections import Counter
from pathlib import Path

from specrank.settings.errors import Refusal

FAULTS_ENV = "SPECRANK_FAULTS"
COUNTS_ENV = "SPECRANK_FAULT_COUNTS"
PHASE_ENV = "SPECRANK_PHASE_FILE"
ACTIONS = ("kill", "enospc")
_hits: Counter[str] = Counter()


def _plan(spec: str) -> dict[tuple[str, int], str]:
    """`point@n=action,...` -> {(point, n): action}; a malformed entry is refused by name."""
    plan = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        where, _, action = entry.partition("=")
        name, _, n = where.partition("@")
        if not (name and n.isdigit() and int(n) >= 1 and action in ACTIONS):
            raise Refusal(
                f"{FAULTS_ENV}: expected entries 'point@n=action' with n >= 1 and action in "
                f"{list(ACTIONS)}; got {entry!r}"
            )
        plan[(name, int(n))] = action
    return plan


def point(name: str, path: Path | str | None = None) -> None:
    """A place a fault may be injected (`SPECRANK_FAULTS`); `path` is the file being written."""
    spec = os.environ.get(FAULTS_ENV)
    if not spec:
        return
    n = _hit(name)
    action = _plan(spec).get((name, n))
    if action == "kill":
        phase(f"killed at {name} #{n}")
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))


def _hit(name: str) -> int:
    """This hit's number: counted in this process, or across processes (`COUNTS_ENV`)."""
    shared = os.environ.get(COUNTS_ENV)
    if not shared:
        _hits[name] += 1
        return _hits[name]
    n = 1
    while True:  # the hit that creates `<name>.<n>` first is the n-th (O_EXCL: no race)
        try:
            os.close(os.open(Path(shared) / f"{name}.{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return n
        except FileExistsError:
            n += 1


def phase(name: str) -> None:
    """Record the process's current phase (`SPECRANK_PHASE_FILE`), for a kill to be told apart."""
    target = os.environ.get(PHASE_ENV)
    if target:
        Path(target).write_text(f"{name}\n")

"""Shard claims: at most one process writes a shard of a store, on one machine or many.

A writer claims shard X by creating `shard-X.claim-<g>` exclusively: a complete
temp file is hard-linked to that name, which fails if the name exists. `link`
is atomic on local filesystems and on NFS (where `O_CREAT | O_EXCL` was not,
before NFSv3), so of two writers racing for X exactly one gets it. The claim
holds the owner (host, boot id, pid and a random token) and its mtime is the
owner's heartbeat, refreshed by a thread while the shard is built.

A claim is *stale*, and may be taken over, when its owner is gone: on the same
host (same hostname and boot id) its pid no longer exists; on any host it has
not been refreshed for `stale_s` seconds. Taking over creates generation g + 1
(again exclusively: two writers that both find g stale race for g + 1, and one
wins) and removes the older ones. An owner that finds its claim gone or
superseded has lost it and must not commit (`ShardStore.write_shard` checks
just before its rename). What this cannot rule out: a live owner that stops
refreshing for longer than `stale_s` (paused, or a clock skew between hosts
larger than that) and then commits after it was superseded; readers would then
refuse the shard by its hash, naming it, never read it silently.

`write_claimed` is the loop behind `ShardStore.write_pending`: claim, build,
write, release, and wait for the shards other writers hold.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from specrank.runtime import faults

if TYPE_CHECKING:  # annotations only
    import pyarrow as pa

_GEN = re.compile(r"\.claim-(\d+)$")


class ClaimLost(RuntimeError):
    """This writer's claim on a shard was taken over (it was judged gone): it must not commit."""


@dataclass
class ShardRun:
    """What one `ShardStore.write_pending` call did."""

    written: int = 0
    skipped: int = 0  # already finished (completion marker present), by us or another writer
    rows: int = 0  # rows in the shards written by this call
    write_seconds: float = 0.0  # Parquet writing + fsync + hashing
    waited: int = 0  # shards found claimed by another live writer and waited for


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: the hostname alone names the host
        return ""


HOST = f"{socket.gethostname()}/{_boot_id()}"


def new_owner() -> str:
    """A token naming this process uniquely across hosts (host, pid, random part)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def create_exclusive(path: Path, data: bytes, owner: str) -> bool:
    """Write `data` to `path` only if `path` does not exist; True if this call created it.

    The content is complete before the name appears (temp file, fsync, link), so a
    reader never sees half of it.
    """
    tmp = path.with_name(f".{path.name}.new-{owner.replace(':', '-')}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:
            # NFS may report a failed link that succeeded (a lost reply to a retried
            # call); the link count of the temp file says which (open(2), O_EXCL notes).
            if os.stat(tmp).st_nlink == 2:
                return True
            raise
        return True
    finally:
        tmp.unlink(missing_ok=True)


@dataclass
class Claim:
    """A claim held by this process on one shard."""

    shard_id: str
    path: Path
    owner: str
    lost: bool = False  # set by the heartbeat when the claim was taken over

    def held(self) -> bool:
        """True while the claim file is ours and no newer generation exists."""
        info = read_claim(self.path)
        if info is None or info.get("owner") != self.owner:
            return False
        gen = claim_generation(self.path)
        return all(g <= gen for g, _ in claim_files(self.path.parent, self.shard_id))

    def refresh(self) -> bool:
        """Heartbeat: touch the claim; False (and `lost`) once it is no longer ours."""
        if not self.held():
            self.lost = True
            return False
        try:
            os.utime(self.path)
        except FileNotFoundError:
            self.lost = True
            return False
        return True


def claim_generation(path: Path) -> int:
    m = _GEN.search(path.name)
    if m is None:
        raise ValueError(f"{path}: not a claim file (expected a name ending in .claim-<n>)")
    return int(m.group(1))


def claim_files(root: Path, shard_id: str) -> list[tuple[int, Path]]:
    """The claim files of one shard, oldest generation first."""
    out = []
    for p in root.glob(f"shard-{shard_id}.claim-*"):
        m = _GEN.search(p.name)
        if m is not None:
            out.append((int(m.group(1)), p))
    return sorted(out)


def read_claim(path: Path) -> dict[str, Any] | None:
    """A claim's content; None when the file is gone (released meanwhile)."""
    try:
        info = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        # Claims appear complete (created by link), so this is damage, not a race.
        raise ValueError(
            f"{path}: a shard claim that is not valid JSON ({err}); delete it if no "
            f"writer of this store is running"
        ) from err
    if not isinstance(info, dict):
        raise ValueError(f"{path}: a shard claim must be a JSON object, found {info!r}")
    return info


def is_stale(path: Path, info: dict[str, Any], stale_s: float) -> bool:
    """Whether the owner of a claim is gone (see the module docstring)."""
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return True
    if age > stale_s:
        return True
    pid = info.get("pid")
    return info.get("host") == HOST and isinstance(pid, int) and not pid_alive(pid)


def take(root: Path, shard_id: str, owner: str, stale_s: float) -> Claim | None:
    """Claim a shard for `owner`; None when a live writer holds it or another won the race."""
    files = claim_files(root, shard_id)
    gen = 0
    if files:
        last_gen, last = files[-1]
        info = read_claim(last)
        if info is not None and not is_stale(last, info, stale_s):
            return None
        gen = last_gen + 1
    path = root / f"shard-{shard_id}.claim-{gen}"
    info = {"owner": owner, "host": HOST, "pid": os.getpid(), "claimed_at": time.time()}
    if not create_exclusive(path, json.dumps(info).encode(), owner):
        return None
    for _, old in files:  # owners gone: their claims are void
        old.unlink(missing_ok=True)
    return Claim(shard_id, path, owner)


def release(claim: Claim) -> None:
    """Remove the claim if it is still ours (a superseding writer's is left alone)."""
    info = read_claim(claim.path)
    if info is not None and info.get("owner") == claim.owner:
        claim.path.unlink(missing_ok=True)


def break_claims(root: Path, shard_id: str, owner: str) -> int:
    """Remove `owner`'s claims on a shard (its process is known dead); the count removed."""
    n = 0
    for _, path in claim_files(root, shard_id):
        info = read_claim(path)
        if info is not None and info.get("owner") == owner:
            path.unlink(missing_ok=True)
            n += 1
    return n


class heartbeat:  # lower-case: reads as a context manager
    """Refresh a claim every `interval` seconds on a thread while the block runs."""

    def __init__(self, claim: Claim, interval: float) -> None:
        self.claim, self.interval = claim, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="claim-heartbeat")

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            if not self.claim.refresh():
                return

    def __enter__(self) -> Claim:
        self._thread.start()
        return self.claim

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class ClaimableStore(Protocol):
    """What the claim loop needs of a store (`specrank.store.shard_store.ShardStore`, which
    imports this module: a protocol keeps the two from importing each other)."""

    root: Path
    owner: str
    claim_stale_s: float
    claim_poll_s: float

    def is_done(self, shard_id: str) -> bool: ...
    def pending(self, shard_ids: Sequence[str]) -> list[str]: ...
    def claim(self, shard_id: str) -> Claim | None: ...
    def write_shard(self, shard_id: str, table: pa.Table, claim: Claim | None = None) -> bool: ...


def claim_shard(store: ClaimableStore, shard_id: str) -> Claim | None:
    """`ShardStore.claim`: take the claim, unless the shard got finished meanwhile.

    Temp files a killed writer left for this shard are removed (the shard is ours now).
    """
    claim = take(store.root, shard_id, store.owner, store.claim_stale_s)
    if claim is not None and store.is_done(shard_id):  # finished just before we claimed
        release(claim)
        return None
    if claim is not None:
        for left in store.root.glob(f".shard-{shard_id}.parquet.tmp-*"):
            left.unlink(missing_ok=True)
    return claim


def write_claimed(
    store: ClaimableStore,
    shard_ids: Sequence[str],
    build: Callable[[str], pa.Table],
    after: Callable[[str, pa.Table], None] | None = None,
) -> ShardRun:
    """`ShardStore.write_pending`'s loop (its docstring says what it guarantees)."""
    todo = store.pending(shard_ids)
    run = ShardRun(skipped=len(shard_ids) - len(todo))
    interval = store.claim_stale_s / 10  # heartbeats per stale period: a missed few are fine
    waited: set[str] = set()
    while todo:
        busy = []
        for sid in todo:
            claim = store.claim(sid)
            if claim is None:
                if store.is_done(sid):
                    run.skipped += 1
                else:
                    busy.append(sid)
                continue
            try:
                with heartbeat(claim, interval):
                    faults.phase(f"building shard {sid}")
                    table = build(sid)
                    t0 = time.perf_counter()
                    store.write_shard(sid, table, claim)
                    run.write_seconds += time.perf_counter() - t0
            except ClaimLost:
                busy.append(sid)  # the writer that took it over finishes it
                continue
            finally:
                release(claim)
            run.written += 1
            run.rows += table.num_rows
            if after is not None:
                after(sid, table)
        waited |= set(busy)
        if busy:
            time.sleep(store.claim_poll_s)
        todo = busy
    run.waited = len(waited)
    return run

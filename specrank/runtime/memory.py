"""Keep freed heap memory in the process during batched evaluation.

The evaluator allocates and frees the same few hundred MB of tensors for every
chunk of rounds. With glibc's defaults, blocks that large are mmap'ed and
returned to the OS on free, so every chunk pays the page faults again: about
30% of evaluation time at paper scale (bench/select_values.py, measured with
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ set by hand). Raising both
thresholds keeps the memory for reuse; peak memory does not grow, since the
chunks have the same shapes. One arena for every thread: the job fits and
evaluates in worker threads, and glibc would give each thread an arena of its
own, where the blocks the main thread freed cannot be reused (peak memory then
grows by each thread's share). A no-op where glibc's mallopt is unavailable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import pyarrow as pa

_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_THRESHOLD = 2**30  # 1 GiB: every chunk-sized block stays on the heap
_GLIBC_DEFAULT = 128 * 1024  # glibc's own M_MMAP_THRESHOLD and M_TRIM_THRESHOLD


@cache
def _libc() -> ctypes.CDLL | None:
    """The C library, or None where there is none to find. Looked up once: `find_library`
    runs `ldconfig -p` in a child process, and the heap is returned often (about 130 times
    in the default job)."""
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


def _thresholds(threshold: int) -> bool:
    """Set glibc's mmap and trim thresholds to `threshold` and one arena for every thread;
    True if every setting took effect."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    ok_mmap = libc.mallopt(_M_MMAP_THRESHOLD, threshold)
    ok_trim = libc.mallopt(_M_TRIM_THRESHOLD, threshold)
    ok_arena = libc.mallopt(_M_ARENA_MAX, 1)
    return bool(ok_mmap and ok_trim and ok_arena)


def retain_freed_heap() -> bool:
    """Ask glibc to keep freed large blocks; True if the setting took effect."""
    return _thresholds(_THRESHOLD)


def return_freed_heap() -> bool:
    """Undo `retain_freed_heap` (glibc's default thresholds; still one arena) and release what
    is free now; True if the setting took effect.

    After the evaluation pass: the job's tail allocates each large frame once, so a kept
    block is never reused and resident memory only climbs (at 3x the paper it rose from 3.7
    to 6.8 GiB over the tail, measured with /proc/self/statm). Blocks from 128 KiB are then
    mapped for themselves and returned to the OS when freed.
    """
    ok = _thresholds(_GLIBC_DEFAULT)
    release_freed_heap()
    return ok


@contextmanager
def heap_retained() -> Iterator[None]:
    """Freed large blocks kept for reuse inside the block (`retain_freed_heap`), returned to
    the OS after it (`return_freed_heap`): around a chunked pass, not the work after it."""
    retain_freed_heap()
    try:
        yield
    finally:
        return_freed_heap()


def release_freed_heap() -> None:
    """Return the free pages of the heap (and of Arrow's pool) to the OS now.

    Between the job's phases, and inside the evaluation pass (`GrowthTrim`): long-lived
    small results allocated between a chunk's large blocks fragment the heap that
    `retain_freed_heap` keeps, which then grows with the chunks; trimming brings resident
    memory back to what is in use. A no-op without glibc.
    """
    pa.default_memory_pool().release_unused()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def resident_bytes() -> int | None:
    """This process's resident memory in bytes (`/proc/self/statm`); None without procfs."""
    if not os.path.exists("/proc/self/statm"):
        return None
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class GrowthTrim:
    """Return the heap's free pages (`release_freed_heap`) once resident memory has grown by
    `growth` bytes since the last return. Called after each chunk of a pass on the kept heap,
    it holds resident memory to what the pass held at the last return plus `growth` and what
    one chunk adds, at any number of chunks.

    A return costs page faults: the freed blocks of the chunks still in flight are touched
    afresh, so returning by growth rather than every few chunks faults less at the same
    peak; never returning lets resident memory climb with the chunks (figures:
    docs/benchmarks.md). Without procfs
    the growth is unknown, and every `fallback_every`-th call returns the pages.
    """

    def __init__(self, growth: int, fallback_every: int = 4) -> None:
        self.growth, self.fallback_every = growth, fallback_every
        self.base, self.calls, self.trims = resident_bytes(), 0, 0

    def __call__(self) -> bool:
        """Check once (after a chunk); True if the pages were returned now."""
        self.calls += 1
        now = resident_bytes()
        if now is None:  # no procfs: then `base` is None too
            due = self.calls % self.fallback_every == 0
        else:
            due = now - self.base >= self.growth
        if due:
            release_freed_heap()
            self.base, self.trims = resident_bytes(), self.trims + 1
        return due

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

import pyarrow as pa

_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_THRESHOLD = 2**30  # 1 GiB: every chunk-sized block stays on the heap


def retain_freed_heap() -> bool:
    """Ask glibc to keep freed large blocks; True if the setting took effect."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt"):
        return False
    ok_mmap = libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)
    ok_trim = libc.mallopt(_M_TRIM_THRESHOLD, _THRESHOLD)
    ok_arena = libc.mallopt(_M_ARENA_MAX, 1)
    return bool(ok_mmap and ok_trim and ok_arena)


def release_freed_heap() -> None:
    """Return the free pages of the heap (and of Arrow's pool) to the OS now.

    Between the job's phases, and every few evaluation chunks: long-lived small
    results allocated between a chunk's large blocks fragment the heap that
    `retain_freed_heap` keeps, which then grows by tens of MB a chunk at paper
    scale; trimming keeps resident memory at what is in use (7-11% slower on 90
    paper-scale chunks, trimming every 4 or every chunk). A no-op without glibc.
    """
    pa.default_memory_pool().release_unused()
    name = ctypes.util.find_library("c")
    if name is not None and hasattr(libc := ctypes.CDLL(name), "malloc_trim"):
        libc.malloc_trim(0)

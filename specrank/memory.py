"""Keep freed heap memory in the process during batched evaluation.

The evaluator allocates and frees the same few hundred MB of tensors for every
chunk of rounds. With glibc's defaults, blocks that large are mmap'ed and
returned to the OS on free, so every chunk pays the page faults again: about
30% of evaluation time at paper scale (bench/select_values.py, measured with
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ set by hand). Raising both
thresholds keeps the memory for reuse; peak memory does not grow, since the
chunks have the same shapes. A no-op where glibc's mallopt is unavailable.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3
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
    return bool(ok_mmap and ok_trim)

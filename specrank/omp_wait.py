"""OpenMP's wait policy for the offline jobs (`rerank.train`, `rerank.transfer`).

torch, LightGBM and numba's parallel kernels each run OpenMP (libgomp) thread teams. By
default a libgomp thread that has finished its share spins (GOMP_SPINCOUNT) before it
sleeps. The training job runs several teams at once on few cores (the pass's workers,
a fit), so spinning threads hold cores that working ones wait for. With
OMP_WAIT_POLICY=PASSIVE a waiting thread sleeps at once. It changes no computed value, only
where the CPU time goes (README "Benchmarks": the default job's CPU seconds with and without).

libgomp reads the variable once, when it is loaded, so the entry package's `__init__` calls
this before anything imports torch. A value the user set is kept. Standard library only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

from specrank.interpreter import module_command

PASSIVE_COMMANDS = ("rerank.train", "rerank.transfer")


def passive_openmp_waits(
    commands: tuple[str, ...] = PASSIVE_COMMANDS,
    argv: list[str] | None = None,
    environ: MutableMapping[str, str] = os.environ,
) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE (unless already set) when this process is
    `python -m <one of commands>`; True when it is one of them."""
    command = module_command(list(getattr(sys, "orig_argv", [])) if argv is None else argv)
    if command is None or command[1] not in commands:
        return False
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return True

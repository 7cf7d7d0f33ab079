"""specrank.omp_wait: the offline jobs wait passively in OpenMP unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specrank.omp_wait import PASSIVE_COMMANDS, passive_openmp_waits
from specrank.paths import PROJECT_ROOT


@pytest.mark.parametrize(
    ("argv", "before", "after"),
    [
        (["python", "-m", "rerank.train", "rerank.sweep=true"], None, "PASSIVE"),
        (["python", "-m", "rerank.transfer"], None, "PASSIVE"),
        (["python", "-m", "rerank.train"], "ACTIVE", "ACTIVE"),  # the user's choice stays
        (["python", "-m", "decode.run"], None, None),  # a decoder is not one of them
        (["python", "-c", "import rerank.train"], None, None),
    ],
)
def test_the_policy_is_set_for_the_offline_jobs_only(argv, before, after) -> None:
    env = {} if before is None else {"OMP_WAIT_POLICY": before}
    is_job = passive_openmp_waits(PASSIVE_COMMANDS, argv, env)
    assert is_job == (argv[1] == "-m" and argv[2] in PASSIVE_COMMANDS)
    assert env.get("OMP_WAIT_POLICY") == after


def test_the_entry_package_sets_it_before_libgomp_loads() -> None:
    """`python -m rerank.train` imports the package `rerank` first; by the end of its
    `__init__` the variable is set and no OpenMP runtime is loaded yet (libgomp reads the
    variable once, when loaded)."""
    code = ("import sys, os; sys.orig_argv = [sys.executable, '-m', 'rerank.train']; "
            "import rerank; maps = open('/proc/self/maps').read(); "
            "print(os.environ.get('OMP_WAIT_POLICY'), 'libgomp' in maps or 'libiomp' in maps, "
            "'torch' in sys.modules)")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, env=env, check=True,
                         capture_output=True, text=True).stdout.split()  # fmt: skip
    assert out == ["PASSIVE", "False", "False"]

"""The fault soak (`python -m bench.soak`) as a slow test: >= 20 kills, >= 5 while writing,
nothing lost or duplicated; a full disk (a mounted tmpfs, where this process may mount) and
a stopped tracking server included."""

from __future__ import annotations

import os
import shutil

import pytest

from bench.soak import main


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_fault_soak(tmp_path):
    args = ["--root", str(tmp_path), "--random-kills", "4", "--tracking-server"]
    if os.geteuid() == 0 and shutil.which("mount"):
        args.append("--full-disk")
    summary = main(args)
    assert summary["kills"] >= 20 and summary["while_writing"] >= 5
    assert summary["lost_or_duplicated"] == 0
    assert summary["tracking_server"]["runs"] == "FINISHED"

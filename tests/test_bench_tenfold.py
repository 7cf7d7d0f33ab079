"""bench.tenfold reads its figures from `/usr/bin/time -v`'s report."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import tenfold

REPORT = """\
\tCommand being timed: "python -m rerank.train"
\tUser time (seconds): 616.05
\tSystem time (seconds): 12.40
\tPercent of CPU this job got: 140%
\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:07:18.96
\tMaximum resident set size (kbytes): 3687564
\tExit status: 0
"""


def test_the_time_report_gives_wall_cpu_and_peak() -> None:
    got = tenfold.parse_time(REPORT)
    assert got["wall_s"] == pytest.approx(3600 + 7 * 60 + 18.96)
    assert got["cpu_s"] == pytest.approx(628.45)
    assert got["peak_gib"] == pytest.approx(3687564 / 2**20)
    short = tenfold.parse_time(REPORT.replace("1:07:18.96", "7:18.96"))
    assert short["wall_s"] == pytest.approx(438.96)


def test_a_report_without_the_peak_is_refused() -> None:
    with pytest.raises(ValueError, match="peak_kib"):
        tenfold.parse_time(REPORT.replace("Maximum resident", "Minimum resident"))


def test_a_machine_without_gnu_time_is_told_what_to_install(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(tenfold, "TIME", str(tmp_path / "no-time"))
    with pytest.raises(RuntimeError, match="apt install time"):
        tenfold.timed(["true"], tmp_path / "log")
    assert not Path(tmp_path / "log").exists()


def test_the_traces_are_generated_by_as_many_processes_as_asked(monkeypatch, tmp_path) -> None:
    started, exit_codes = [], iter([0, 0, 0, 1])  # the last call's second helper fails

    class Helper:
        def __init__(self, cmd, cwd):
            started.append(cmd)

        def wait(self):
            return next(exit_codes)

    monkeypatch.setattr(tenfold.subprocess, "Popen", Helper)
    monkeypatch.setattr(tenfold, "paper_traces", lambda prompts, rounds: tmp_path / f"{prompts}")
    assert tenfold.generated(46, 3) == tmp_path / "46"
    assert len(started) == 2 and "paper_traces(46, 261)" in started[0][-1]
    assert tenfold.generated(46, 1) == tmp_path / "46" and len(started) == 2  # no helper
    with pytest.raises(RuntimeError, match=r"exit codes \[0, 1\]"):
        tenfold.generated(46, 3)

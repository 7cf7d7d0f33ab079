"""bench.stage_memory wraps the job's stages where the job looks them up, and a stage's
peak holds what it allocated."""

from __future__ import annotations

import time
import types

import numpy as np
import pytest

from bench import stage_memory


def test_a_stage_s_peak_holds_what_it_allocated_and_after_what_it_kept():
    peaks = stage_memory.StagePeaks(every_s=0.005)
    owner = types.SimpleNamespace()

    def stage():
        block = np.ones(256 * 2**20 // 8)  # 256 MiB, touched
        del block
        return np.ones(64 * 2**20 // 8)  # 64 MiB kept

    owner.stage = stage
    peaks.wrap(owner, "stage", "a stage")
    kept = owner.stage()
    ((name, before, peak, after, _),) = peaks.rows
    assert name == "a stage" and kept.nbytes == 64 * 2**20
    assert peak - before > 0.2  # GiB: the 256 MiB block was seen
    assert after - before > 0.04  # the 64 MiB it returned


def test_every_stage_the_bench_names_exists(monkeypatch):
    import rerank.evaluate.policy as policy
    import rerank.evaluate.reports as reports
    import rerank.fit.out_of_fold as halves
    import rerank.job.evaluation as evaluation
    import rerank.job.fitting as fitting
    import rerank.train as train

    wrapped = []
    peaks = stage_memory.StagePeaks()
    monkeypatch.setattr(
        peaks, "wrap", lambda owner, attr, name: wrapped.append(getattr(owner, attr))
    )
    stage_memory.wrap_stages(peaks)
    assert train.fit_rerankers in wrapped and fitting.law_frame in wrapped
    assert halves.LawFits.crossfit in wrapped and evaluation.evaluate_traces in wrapped
    assert policy.PolicyRounds.apply in wrapped and reports.ReportAccumulators.tables in wrapped
    assert len(wrapped) == 13


def test_a_nested_stage_leaves_the_outer_stage_s_peak_whole():
    peaks = stage_memory.StagePeaks(every_s=0.005)
    owner = types.SimpleNamespace()
    owner.inner = lambda: None

    def outer():
        block = np.ones(256 * 2**20 // 8)  # 256 MiB, freed before the inner stage starts
        # held until the sampler has seen it: on a busy machine (the suite's two workers)
        # its thread may not run between the fill and the free
        held, deadline = stage_memory.resident_gib(), time.monotonic() + 10
        while max(peaks.active.values()) < held - 0.01 and time.monotonic() < deadline:
            time.sleep(0.005)
        del block
        owner.inner()

    owner.outer = outer
    peaks.wrap(owner, "inner", "inner")
    peaks.wrap(owner, "outer", "outer")
    owner.outer()
    (inner, outer_row) = peaks.rows
    assert inner[0] == "inner" and outer_row[0] == "outer"
    assert outer_row[2] - outer_row[1] > 0.2 and inner[2] - inner[1] < 0.2


def test_wrap_named_finds_module_functions_and_methods():
    import rerank.evaluate.coverage as coverage
    import rerank.evaluate.reports as reports

    original = reports.agreement_tables, coverage.CoverageRounds.table
    peaks = stage_memory.StagePeaks()
    try:
        stage_memory.wrap_named(peaks, "rerank.evaluate.reports:agreement_tables")
        stage_memory.wrap_named(peaks, "rerank.evaluate.coverage:CoverageRounds.table")
        assert reports.agreement_tables is not original[0]
        assert coverage.CoverageRounds.table is not original[1]
    finally:
        reports.agreement_tables, coverage.CoverageRounds.table = original
    for bad in ("rerank.evaluate.reports", "rerank.evaluate.reports:no_such_function"):
        with pytest.raises(ValueError, match=bad):
            stage_memory.wrap_named(peaks, bad)

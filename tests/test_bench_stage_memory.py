"""bench.stage_memory wraps the job's stages where the job looks them up, and a stage's
peak holds what it allocated."""

from __future__ import annotations

import types

import numpy as np

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
    import rerank.fit.halves as halves
    import rerank.job.evaluation as evaluation
    import rerank.job.fitting as fitting
    import rerank.train as train

    wrapped = []
    peaks = stage_memory.StagePeaks()
    monkeypatch.setattr(
        peaks, "wrap", lambda owner, attr, name: wrapped.append(getattr(owner, attr))
    )
    stage_memory.wrap_stages(peaks)
    assert train.fit in wrapped and fitting.law_frame in wrapped
    assert halves.LawFits.crossfit in wrapped and evaluation.evaluate_traces in wrapped
    assert policy.PolicyRounds.apply in wrapped and reports.ReportAccumulators.tables in wrapped
    assert len(wrapped) == 13

"""`rerank.train launcher=ray` (rerank.on_ray): the cross-fits and the pass over the trace
files as Ray tasks on a local 2-CPU cluster give exactly one process's results, and a task
whose worker is killed (SIGKILL, as an OOM killer or a lost node) is dealt again (slow: four
actors start their interpreters, about a minute on 2 cores). The default run checks the same
tasks dealt in this process, their workers pickled as Ray pickles them, in reverse order."""

from __future__ import annotations

from pathlib import Path

import cloudpickle
import pandas as pd
import pytest

from rerank import on_ray
from rerank.config import RerankConfig
from rerank.train import train_and_evaluate
from specrank.runtime import faults
from specrank.runtime.parallel import Dealt, ParallelConfig
from specrank.settings.config import MlflowConfig
from specrank.store.trace_schema import trace_store
from tests.small_jobs import run_small_job, small_stores
from tests.toy_workers import lean_ray

SETS = ["rows"]  # x 2 laws: 2 fit tasks of 2 halves each
TABLES = ["summary.csv", "comparisons.csv", "breakdown_gains.csv", "prediction_quality.csv"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> tuple[Path, Path]:
    return small_stores(tmp_path_factory.mktemp("on_ray"), 12, 6, 3)


def _run(stores: tuple[Path, Path], out: Path, parallel: ParallelConfig | None) -> Path:
    return run_small_job(stores, out, parallel, SETS)


@pytest.mark.slow
def test_training_on_ray_equals_one_process_and_redoes_a_killed_worker_s_task(
    stores, tmp_path, monkeypatch
):
    files = len(trace_store(stores[0]).dataset().files)
    assert files >= 4  # several trace files, so the pass is several tasks
    one = _run(stores, tmp_path / "one", None)
    counts = tmp_path / "counts"
    counts.mkdir()
    # Set before the cluster starts, so its workers inherit them: the first fit task's worker
    # and the first trace file's (hit 4: after the 2 fit tasks, one of them dealt twice) die.
    monkeypatch.setenv(faults.FAULTS_ENV, "ray_task@1=kill,ray_task@4=kill")
    monkeypatch.setenv(faults.COUNTS_ENV, str(counts))
    with lean_ray():
        two = _run(stores, tmp_path / "ray", ParallelConfig(backend="ray", workers=2))
    hits = sorted(int(p.suffix[1:]) for p in counts.glob("ray_task.*"))
    assert hits == list(range(1, len(SETS) * 2 + files + 2 + 1))  # every task once, two twice
    _same_runs(one, two)
    models = sorted((one / "rerankers").glob("*/model.txt"))
    assert len(models) == len(SETS) * 2 * 2
    for model in models:  # byte for byte
        assert (two / "rerankers" / model.parent.name / "model.txt").read_bytes() == (
            model.read_bytes()
        ), model
    kept = [p for p in (tmp_path / "ray" / "fits").iterdir() if not p.name.startswith(".")]
    assert len(kept) == len(models)  # the workers kept every finished fit, for a rerun


@pytest.mark.slow
def test_the_simulated_matched_row_on_ray_equals_one_process(stores, tmp_path):
    """rerank.score=top_m with rows_matched on a local 2-CPU cluster (about a minute)."""
    sets = ["rows_matched"]
    one = run_small_job(stores, tmp_path / "one", None, sets, score="top_m")
    with lean_ray():
        two = run_small_job(stores, tmp_path / "ray", ParallelConfig(backend="ray", workers=2),
                            sets, score="top_m")  # fmt: skip
    _same_runs(one, two)


def _same_runs(one: Path, two: Path) -> None:
    for table in TABLES:
        pd.testing.assert_frame_equal(pd.read_csv(two / table), pd.read_csv(one / table))
    for table in ("per_round_values.parquet", "oof_predictions.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(two / table), pd.read_parquet(one / table))


def _in_process_deal(shard_ids, factory, p, gpu, cpus_per_worker=1, **_):
    """`specrank.runtime.parallel.deal` without Ray: the worker factory must pickle (Ray ships it to
    each actor that way), and the tasks run last to first (the merge must follow the store)."""
    assert cloudpickle.dumps(factory)
    worker = factory()
    results = {sid: worker(sid) for sid in reversed(shard_ids)}
    return Dealt({sid: results[sid] for sid in shard_ids}, [], 0, [])


@pytest.mark.parametrize("score", ["tree", "top_m"])
def test_the_ray_tasks_dealt_in_this_process_give_one_process_s_results(
    stores, tmp_path, monkeypatch, score
):
    """top_m: rows_matched's matched row simulated on each rule's own trees, fitted on
    draft's, the workers handed the simulated rows with the fit tasks and the pass."""
    sets = SETS if score == "tree" else ["rows_matched"]
    one = run_small_job(stores, tmp_path / "one", None, sets, score=score)
    monkeypatch.setattr(on_ray, "deal", _in_process_deal)
    two = run_small_job(stores, tmp_path / "tasks", ParallelConfig(backend="ray", workers=2),
                        sets, score=score)  # fmt: skip
    _same_runs(one, two)
    if score == "top_m":
        values = pd.read_parquet(two / "per_round_values.parquet")
        # the equality covers simulated values: some rounds hold the row, some do not
        assert 0 < values["held/rows_matched_lgbm@B8"].mean() < 1


def test_training_split_into_ranges_is_refused_before_reading(tmp_path):
    config = RerankConfig(traces=str(tmp_path / "none"), features=str(tmp_path / "none"))
    with pytest.raises(ValueError, match=r"parallel.parts=2: rerank.train is one job"):
        train_and_evaluate(config, MlflowConfig(), {}, 0, tmp_path / "out",
                           ParallelConfig(parts=2))  # fmt: skip

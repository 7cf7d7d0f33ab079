"""Resumable training (`rerank.fits`, rerank.fit.resume): a run stopped between fits keeps the
finished ones; a rerun of the same store and settings takes them, fits only the rest, and
gives the results of a run that was never stopped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from features.extract import extract
from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.job import write_synthetic_traces
from rerank.config import BoosterConfig, RerankConfig
from rerank.fit import out_of_fold
from rerank.fit.models import fit_reranker
from rerank.fit.out_of_fold import SavedFit
from rerank.fit.persist import RerankerLoadError
from rerank.fit.resume import FitFolder
from rerank.train import train_and_evaluate
from specrank.runtime import faults
from specrank.settings.config import MlflowConfig
from tests.candidate_frames import FAST, make_candidate_frame
from tree.config import PoolConfig, SelectConfig

ROOT = Path(__file__).resolve().parents[1]
POOL = PoolConfig(top_k=4, expand_steps=2, expand=4)
JOB = SynthJobConfig(toy_prompts=12, rounds_per_prompt=6, prompts_per_shard=4)
SETS = ["rows"]  # x 2 laws x 2 halves = 4 fits


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("resume")
    write_synthetic_traces(root / "traces", JOB, POOL, SelectConfig(budget=8), SynthConfig(), 0)
    extract(root / "traces", root / "features", log=lambda _: None)
    return root / "traces", root / "features"


def _config(stores: tuple[Path, Path], fits: Path | None) -> RerankConfig:
    return RerankConfig(
        traces=str(stores[0]), features=str(stores[1]), feature_sets=SETS,
        booster=BoosterConfig(kind="lgbm", n_threads=1), n_resamples=200,
        calibration_edges=5_000, chunk_rounds=64, reports=False, budgets=[8],
        fits=None if fits is None else str(fits),
    )  # fmt: skip


def _run(config: RerankConfig, tmp_path: Path, name: str) -> pd.DataFrame:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    train_and_evaluate(config, MlflowConfig(tracking_uri=uri), {}, 0, tmp_path / name)
    return pd.read_csv(tmp_path / name / "summary.csv")


def _saved(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def test_a_stopped_run_resumes_from_its_finished_fits(stores, tmp_path, monkeypatch):
    clean = _run(_config(stores, None), tmp_path, "clean")
    fits = tmp_path / "fits"
    monkeypatch.setenv(faults.FAULTS_ENV, "fit_saved@3=enospc")  # stopped after 3 fits
    faults._hits.clear()
    with pytest.raises(OSError, match="No space left"):
        _run(_config(stores, fits), tmp_path, "stopped")
    monkeypatch.delenv(faults.FAULTS_ENV)
    assert len(_saved(fits)) == 3
    calls = []
    fit = out_of_fold.fit_estimator
    monkeypatch.setattr(
        out_of_fold, "fit_estimator", lambda *a, **k: calls.append(1) or fit(*a, **k)
    )
    resumed = _run(_config(stores, fits), tmp_path, "resumed")
    assert len(calls) == 4 - 3  # only the fit the stopped run had not finished
    assert len(_saved(fits)) == 4
    pd.testing.assert_frame_equal(resumed, clean)
    for model in (tmp_path / "clean" / "rerankers").glob("*/model.txt"):  # byte for byte
        taken = tmp_path / "resumed" / "rerankers" / model.parent.name / "model.txt"
        assert taken.read_bytes() == model.read_bytes(), taken


@pytest.mark.slow  # two interpreter starts and two jobs: about 45 s on 2 cores
def test_a_kill_between_fits_and_the_rerun(stores, tmp_path):
    """`python -m rerank.train` killed (SIGKILL) right after its second fit was kept; the
    default run stops the job between fits in-process (above)."""
    fits, uri = tmp_path / "fits", f"sqlite:///{tmp_path / 'mlflow.db'}"
    cmd = [sys.executable, "-m", "rerank.train", f"paths.traces={stores[0]}",
           f"paths.features={stores[1]}", f"paths.fits={fits}", f"mlflow.tracking_uri={uri}",
           f"rerank.feature_sets=[{','.join(SETS)}]", "rerank.booster.n_threads=1",
           "rerank.n_resamples=200", "rerank.calibration_edges=5000", "rerank.reports=false",
           "rerank.chunk_rounds=64", "rerank.budgets=[8]"]  # fmt: skip
    env = {**os.environ, faults.FAULTS_ENV: "fit_saved@2=kill"}
    killed = subprocess.run([*cmd, f"hydra.run.dir={tmp_path / 'h1'}"], env=env, cwd=ROOT,
                            capture_output=True, timeout=300)  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert len(_saved(fits)) == 2
    env.pop(faults.FAULTS_ENV)
    done = subprocess.run([*cmd, f"hydra.run.dir={tmp_path / 'h2'}"], env=env, cwd=ROOT,
                          capture_output=True, timeout=300, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "halves' fits taken from" in done.stdout + done.stderr
    assert len(_saved(fits)) == 4
    assert not [p for p in fits.iterdir() if p.name.startswith(".")]  # no partial fit left


def test_a_kept_fit_that_does_not_match_is_refused_by_name(tmp_path):
    """A kept fit is taken only as it was saved: a different training fingerprint or a
    held-out prediction count that does not match is refused, naming the file."""
    frame = make_candidate_frame(n_prompts=8, rounds=3, temperature=1.0, seed=2)
    model = fit_reranker(frame, "base", "lgbm", "sampling", sorted(frame["task"].unique()),
                         n_threads=1, capacity=FAST)  # fmt: skip
    store = FitFolder(tmp_path / "fits")
    assert store.load("k", 5, model.features, model.train_fingerprint) is None
    store.save("k", SavedFit(model, np.linspace(0.1, 0.5, 5), 1.5))
    taken = store.load("k", 5, model.features, model.train_fingerprint)
    np.testing.assert_array_equal(taken.phat, np.linspace(0.1, 0.5, 5))
    assert taken.seconds == 1.5 and taken.model.train_fingerprint == model.train_fingerprint
    with pytest.raises(ValueError, match=r"phat.npy: expected 6 held-out predictions"):
        store.load("k", 6, model.features, model.train_fingerprint)
    with pytest.raises(RerankerLoadError, match="fingerprint"):
        store.load("k", 5, model.features, "another")

"""A small synthetic store and `rerank.train`'s job on it, for the tests of the job on Ray."""

from __future__ import annotations

from pathlib import Path

from features.extract import extract
from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.job import write_synthetic_traces
from rerank.config import BoosterConfig, RerankConfig
from rerank.train import train_and_evaluate
from specrank.runtime.parallel import ParallelConfig
from specrank.settings.config import MlflowConfig
from tree.config import PoolConfig, SelectConfig


def small_stores(root: Path, prompts: int, rounds: int, per_shard: int) -> tuple[Path, Path]:
    """(traces, features) of a synthetic store: both laws, a pool of 4 x 2 steps."""
    job = SynthJobConfig(toy_prompts=prompts, rounds_per_prompt=rounds, prompts_per_shard=per_shard)
    pool = PoolConfig(top_k=4, expand_steps=2, expand=4)
    write_synthetic_traces(root / "traces", job, pool, SelectConfig(budget=8), SynthConfig(), 0)
    extract(root / "traces", root / "features", log=lambda _: None)
    return root / "traces", root / "features"


def run_small_job(stores: tuple[Path, Path], out: Path, parallel: ParallelConfig | None,
                  feature_sets: list[str], fit_nodes: int = 1,
                  fits: Path | None = None, score: str = "tree") -> Path:  # fmt: skip
    """The job at a small size (LightGBM on one thread, budget 8): its run folder."""
    config = RerankConfig(
        traces=str(stores[0]), features=str(stores[1]), feature_sets=feature_sets,
        booster=BoosterConfig(kind="lgbm", n_threads=1, fit_nodes=fit_nodes), n_resamples=200,
        calibration_edges=5_000, chunk_rounds=16, budgets=[8], fits=str(fits or out / "fits"),
        score=score, score_top_m=3,
    )  # fmt: skip
    uri = f"sqlite:///{out / 'mlflow.db'}"
    train_and_evaluate(config, MlflowConfig(tracking_uri=uri), {}, 0, out / "run", parallel)
    return out / "run"

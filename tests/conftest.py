"""Fixtures shared by several test files."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import specrank.settings.config  # noqa: F401  (registers the Hydra schema)
from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.job import write_synthetic_traces
from specrank.store.trace_schema import trace_store
from tree.config import PoolConfig, SelectConfig

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture()
def hydra_conf():
    """Hydra initialised on the project's conf/ for `compose`, cleared afterwards."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


@pytest.fixture(scope="session")
def fast_traces(tmp_path_factory):
    """A small synthetic trace store (16 prompts x 12 rounds; top-k 6, 3 steps) as a dataset:
    the fast paths' and the report scans' references run on it."""
    root = tmp_path_factory.mktemp("fast")
    job = SynthJobConfig(toy_prompts=16, rounds_per_prompt=12, prompts_per_shard=4)
    pool, select = (
        PoolConfig(top_k=6, expand_steps=3, expand=6),
        SelectConfig(budget=8, record_top_m=20),
    )
    write_synthetic_traces(root / "traces", job, pool, select, SynthConfig(), seed=3)
    return trace_store(root / "traces").dataset()

"""What the online benches share: the model pair, the benchmark prompts, the warm-up count."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from omegaconf import OmegaConf

from pairs.config import DataConfig, ModelConfig
from pairs.models import ModelPair, load_model_pair
from pairs.prompts import Prompt, load_prompts
from specrank.settings.paths import project_path
from tests.tiny_models import build_tiny_pair

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(__file__).resolve().parent / ".cache"


def load_pair(model: str, device: str, dtype: str) -> tuple[ModelPair, str]:
    """The pocket pair (conf/model/pocket.yaml) when its weights exist, else a tiny random pair."""
    cfg = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "conf/model/pocket.yaml")
        )
    )
    target = project_path(cfg.target)
    if model == "pocket" or (model == "auto" and any(target.glob("*.safetensors"))):
        cfg = dataclasses.replace(cfg, target=str(target), drafter=str(project_path(cfg.drafter)))
        name = "pocket"
    else:
        root = CACHE / "tiny_pair"
        if not (root / "target" / "config.json").exists():
            build_tiny_pair(root, "llama", hidden=128, layers=4)
        cfg = ModelConfig(name="tiny", target=str(root / "target"), drafter=str(root / "drafter"))
        name = "tiny"
    return load_model_pair(dataclasses.replace(cfg, device=device, dtype=dtype)), name


def suite_prompts(n_bench: int, n_fit: int) -> tuple[list[Prompt], list[Prompt]]:
    """Benchmark prompts (the default suite's sources, first n_bench) and disjoint fitting prompts."""
    data = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(DataConfig), OmegaConf.load(ROOT / "conf/data/default.yaml")
        )
    )
    sources = [
        dataclasses.replace(
            s, path=None if s.path is None else str(project_path(s.path)), limit=None
        )
        for s in data.sources
    ]
    per_source = [load_prompts(dataclasses.replace(data, sources=[s])) for s in sources]
    k = -(-n_bench // len(per_source))  # bench prompts taken from each source in turn
    bench = [p for ps in per_source for p in ps[:k]][:n_bench]
    fit = [p for ps in per_source for p in ps[k : k + -(-n_fit // len(per_source))]][:n_fit]
    return bench, fit


def warmup_count(given: int | None, device: str, n_prompts: int) -> int:
    """Untimed warm-up decodes of each rule (and of target-only) before any timing: `given`,
    else 1 on a CPU and every prompt on CUDA.

    Why every prompt on CUDA: on the H200 leases (docs/benchmarks.md), after one warm-up prompt the
    first temperature measured ran 2-10x slower than the same decodes repeated later in the
    process (target-only 37 tok/s, then 263 on the same prompts; draft at B=8 21, then 94),
    whichever temperature came first. The slow rounds are spread over the whole first pass
    (new cache lengths, new shapes), so one full untimed pass is what warms them.
    """
    if given is not None:
        if given < 0:
            raise ValueError(f"--warmup-prompts: expected >= 0, got {given}")
        return min(given, n_prompts)
    return n_prompts if str(device).startswith("cuda") else min(1, n_prompts)

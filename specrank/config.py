"""The root Hydra schema: one config tree shared by every entry point.

Each stage owns its section's dataclass (`decode.config`, `decode.synth.rounds`,
`features.config`, ...); this module only composes them and registers the
schema, so a typo in any override fails at compose time with Hydra's
"Did you mean" message. Entry points convert their section with
`OmegaConf.to_object` and pass typed values down.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from decode.config import (
    DataConfig,
    DecodeConfig,
    ModelConfig,
    PoolConfig,
    SelectConfig,
    TraceConfig,
)
from decode.online.config import RunConfig
from decode.pocket.config import PocketConfig
from decode.synth.rounds import SynthConfig
from features.config import FeaturesConfig
from rerank.config import MlflowConfig, RerankConfig

# A short random id in Hydra's run dir, so two runs started in the same second
# never share (and overwrite) an output folder.
OmegaConf.register_new_resolver("run_uid", lambda: uuid.uuid4().hex[:6], replace=True)


@dataclass
class PathsConfig:
    """Where stages read and write. Relative paths resolve against the project root."""

    traces: str = "data_out/traces"  # trace store written by decode.record
    synthetic: str = "data_out/synthetic_traces"  # trace store written by decode.synth
    features: str = "data_out/features"  # candidate table written by features.extract


@dataclass
class SynthJobConfig:
    """`python -m decode.synth`: how many synthetic prompts and rounds to write.

    Shard s runs at temperatures[s % len]; paper scale (365,922 rounds) is
    `synth_job.prompts=1402 synth_job.rounds_per_prompt=261`.
    """

    prompts: int = 64
    rounds_per_prompt: int = 40
    prompts_per_shard: int = 16
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    tasks: list[str] = field(default_factory=lambda: ["writing", "coding", "math_reasoning", "qa"])


@dataclass
class Config:
    paths: PathsConfig = field(default_factory=PathsConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    select: SelectConfig = field(default_factory=SelectConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    synth_job: SynthJobConfig = field(default_factory=SynthJobConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    pocket: PocketConfig = field(default_factory=PocketConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    rerank: RerankConfig = field(default_factory=RerankConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    run: RunConfig = field(default_factory=RunConfig)  # python -m decode.run
    seed: int = 0


def register_configs() -> None:
    ConfigStore.instance().store(name="config_schema", node=Config)


register_configs()

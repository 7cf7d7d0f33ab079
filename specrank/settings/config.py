"""The root Hydra schema: one config tree shared by every entry point.

Each stage owns its sections: its config module holds a `SECTIONS` mapping
(section name -> dataclass) and names that module under the entry-point group
`specrank.config` in `pyproject.toml`. This module imports none of them by
name (the kernel sits below every stage); `register_configs` loads the
declared modules, composes their sections into one schema and registers it,
so a typo in any override fails at compose time. Entry points convert their
section with `OmegaConf.to_object` and pass typed values down.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from importlib.metadata import entry_points

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from specrank.settings.fields import setting

ENTRY_POINT_GROUP = "specrank.config"

# A short random id in Hydra's run dir, so two runs started in the same second
# never share (and overwrite) an output folder.
OmegaConf.register_new_resolver("run_uid", lambda: uuid.uuid4().hex[:6], replace=True)


@dataclass
class PathsConfig:
    """Where stages read and write. Relative paths resolve against the project root."""

    traces: str = setting("data_out/traces", "trace store written by decode.record")
    synthetic: str = setting(
        "data_out/synthetic_traces", "trace store written by decode.synth_traces"
    )
    features: str = setting("data_out/features", "candidate table written by features.extract")
    # beside the table they fit on, so a rerun of the same store finds them
    fits: str = setting(
        "${paths.features}.fits", "finished fits of rerank.train, taken by a rerun (rerank.fits)"
    )


@dataclass
class MlflowConfig:
    """Where runs are logged (`rerank.train`, `decode.run`): shared by the stages that log."""

    tracking_uri: str = setting(
        "sqlite:///mlflow.db",
        "MLflow tracking URI; a relative sqlite path resolves against the project root",
    )
    experiment: str = setting("specrank", "MLflow experiment the runs are logged to")
    run_name: str | None = setting(None, "MLflow run name (null: MLflow picks one)")


KERNEL_SECTIONS = {"paths": PathsConfig, "mlflow": MlflowConfig}


def stage_sections() -> dict[str, type]:
    """Every stage's sections, from the modules declared under `specrank.config`."""
    found = entry_points(group=ENTRY_POINT_GROUP)
    if not found:
        raise RuntimeError(
            f"no '{ENTRY_POINT_GROUP}' entry points: the project is not installed "
            f"(run `make setup`, or `pip install -e .` in the project folder)"
        )
    sections: dict[str, type] = {}
    owner: dict[str, str] = {}
    for ep in sorted(found, key=lambda e: e.name):
        module = ep.load()
        declared = getattr(module, "SECTIONS", None)
        if not isinstance(declared, dict):
            raise TypeError(
                f"{ep.value}: a stage config module must define SECTIONS = {{name: dataclass}}"
            )
        for name, cls in declared.items():
            if name in sections or name in KERNEL_SECTIONS:
                raise ValueError(
                    f"config section '{name}' is declared twice: by {owner.get(name, 'specrank')} "
                    f"and by {ep.value}"
                )
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"{ep.value}: section '{name}' must be a dataclass, got {cls!r}")
            sections[name], owner[name] = cls, ep.value
    return sections


def schema() -> type:
    """The root schema dataclass: the kernel's sections, every stage's, and `seed`."""
    sections = {**KERNEL_SECTIONS, **stage_sections()}
    fields = [(name, cls, field(default_factory=cls)) for name, cls in sections.items()]
    seed = setting(
        0, "the job's seed: synthetic traces, the fits and their bootstrap, online shards"
    )
    return dataclasses.make_dataclass("Config", [*fields, ("seed", int, seed)])


def register_configs() -> None:
    ConfigStore.instance().store(name="config_schema", node=schema())


register_configs()

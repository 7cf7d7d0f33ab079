"""What `decode.record` and `decode.run` check and resolve before any model loads: the
prompt list, the model folders, the launcher."""

from __future__ import annotations

import dataclasses

import specrank.settings.config  # noqa: F401  (registers the Hydra schema `config_schema`)
from pairs.config import DataConfig, ModelConfig
from pairs.prompts import Prompt, load_prompts
from specrank.runtime.parallel import check_launcher
from specrank.settings.errors import Refusal
from specrank.settings.paths import project_path


def check_prompts(prompts: list[Prompt], data: DataConfig) -> None:
    """Refuse an empty prompt list by name (it would record an empty store and fail in train)."""
    if not prompts:
        sources = [src.path or src.kind for src in data.sources]
        raise Refusal(
            f"data={data.name}: the prompt sources {sources} hold no prompts; expected at least one"
        )


def resolve_inputs(model: ModelConfig, data: DataConfig) -> tuple[ModelConfig, list]:
    """Model folders and prompt files resolved against the project root; prompts loaded."""
    model = dataclasses.replace(
        model, target=str(project_path(model.target)), drafter=str(project_path(model.drafter))
    )
    sources = [
        dataclasses.replace(src, path=None if src.path is None else str(project_path(src.path)))
        for src in data.sources
    ]
    return model, load_prompts(dataclasses.replace(data, sources=sources))


def check_job_launcher() -> None:
    """launcher=slurm / submitit_local outside -m is refused (under Hydra; tests call main bare)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized():
        hc = HydraConfig.get()
        check_launcher(hc.runtime.choices.get("launcher"), hc.mode == RunMode.MULTIRUN)

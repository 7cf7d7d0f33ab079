"""`python -m decode.record`: decode prompts speculatively and record one trace row per round.

    python -m decode.record model=pocket data=paper decode.temperature=0 select.budget=59

One shard = `trace.prompts_per_shard` consecutive prompts (id `t0.0-b59-00003`).
Each prompt's decoding depends only on the models, the settings and its own
seeded generator, so a killed run restarted with the same config skips the
finished shards and writes the rest exactly as an uninterrupted run would
(timing columns aside: they are measurements). Bits hold for the same torch
thread count, machine and library versions: float32 reductions round differently
on another number of threads (`selection.ranking.compiled_route` keeps numba
from changing torch's count mid-run; tests/test_select_kernels.py).

The same holds across processes and machines, so shards can be recorded anywhere:
`launcher=ray parallel.workers=N` deals the pending shards to N Ray actors, each with
its own model pair (`decode.shard_workers`); `launcher=slurm parallel.parts=N` runs
N Hydra submitit jobs, each over its range of shards (`parallel.part`). Either way
one store results, equal to a single-process recording (tests/test_parallel_suite.py).
"""

from __future__ import annotations

import logging

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

import specrank.settings.config  # noqa: F401  (registers the Hydra schema `config_schema`)
from decode.config import TraceConfig, manifest_view
from decode.inputs import check_job_launcher, check_prompts, resolve_inputs
from decode.recording import RecordReport, record_bytes, record_traces, recording_settings
from decode.shard_workers import record_on_ray
from decode.stream import DecodeSettings
from pairs.config import DataConfig, ModelConfig
from pairs.models import load_model_pair
from pairs.positions import check_prompt_lengths
from specrank.runtime import faults
from specrank.runtime.parallel import ParallelConfig, check_parallel
from specrank.settings.checks import check_int
from specrank.settings.cli import exits_on_refusal, run_entry_point
from specrank.settings.paths import CONF_DIR, project_path
from specrank.store.files import check_free_space

log = logging.getLogger(__name__)


def run_record(
    model: ModelConfig,
    data: DataConfig,
    settings: DecodeSettings,
    trace: TraceConfig,
    manifest_config: dict,
    parallel: ParallelConfig | None = None,
) -> RecordReport:
    """Load the models and prompts named by the configs, then record (or resume) the traces.

    Every setting and the prompt list are checked before the models load. With
    `parallel.backend=ray` the models load in the Ray workers, not here.
    """
    parallel = parallel or ParallelConfig()
    recording_settings(settings).check()
    check_int("trace.prompts_per_shard", trace.prompts_per_shard, 1)
    check_parallel(parallel, model.device)
    model, prompts = resolve_inputs(model, data)
    check_prompts(prompts, data)
    prompts = check_prompt_lengths(model, prompts, settings.decode.max_new_tokens, settings.pool,
                                   data.long_prompts)  # fmt: skip
    out = project_path(trace.out_dir)
    check_free_space(out, record_bytes(out, prompts, settings, trace.prompts_per_shard, parallel),
                     "decode.record", "paths.traces (trace.out_dir)")  # fmt: skip
    if parallel.backend == "ray":
        report = record_on_ray(out, model, prompts, settings, trace.prompts_per_shard,
                               manifest_config, parallel, trace.progress)  # fmt: skip
    else:
        faults.phase("loading models")
        pair = load_model_pair(model)
        report = record_traces(out, pair, prompts, settings, trace.prompts_per_shard,
                               manifest_config, trace.progress, parallel=parallel)  # fmt: skip
    log.info(
        "traces in %s: %d shards written, %d skipped, %d rounds, %.1f tokens/s, %.2f accepted/round"
        "%s",
        out,
        report.shards_written,
        report.shards_skipped,
        report.rounds,
        report.tokens_per_s,
        report.accepted / max(report.rounds, 1),
        f" ({report.workers_lost} Ray worker(s) died; their shards were redone)"
        if report.workers_lost
        else "",
    )
    return report


def manifest_sections(cfg: DictConfig) -> dict:
    """The resolved config sections that determine trace content (paths and progress excluded)."""
    sections = manifest_view(
        {k: OmegaConf.to_container(cfg[k], resolve=True)
         for k in ("model", "data", "pool", "select", "decode")}
    )  # fmt: skip
    # The temperature is a shard key (shard ids and rows carry it), so one store
    # holds both laws: `-m decode.temperature=0,1` fills one trace folder.
    del sections["decode"]["temperature"]
    sections["trace"] = {"prompts_per_shard": cfg.trace.prompts_per_shard}
    return sections


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="record")
@exits_on_refusal
def main(cfg: DictConfig) -> None:
    check_job_launcher()
    if cfg.model.device == "cpu":
        # One intra-op thread: with torch's default 2 threads on a shared 2-core
        # machine a pocket-pair run took 529 s against 43.5 s (measured back to back).
        torch.set_num_threads(1)
    settings = DecodeSettings(
        pool=OmegaConf.to_object(cfg.pool),
        select=OmegaConf.to_object(cfg.select),
        decode=OmegaConf.to_object(cfg.decode),
    )
    with torch.inference_mode():
        run_record(
            OmegaConf.to_object(cfg.model),
            OmegaConf.to_object(cfg.data),
            settings,
            OmegaConf.to_object(cfg.trace),
            manifest_sections(cfg),
            OmegaConf.to_object(cfg.parallel),
        )


if __name__ == "__main__":
    run_entry_point(main, stage="decode.record")

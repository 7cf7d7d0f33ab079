"""`python -m decode.run`: decode prompts online with a selection rule; speed, tau and values to MLflow.

    python -m decode.run rule=draft                              # EAGLE-style draft ranking
    python -m decode.run rule=reranker reranker=<saved folder>   # a fitted first-level reranker
    python -m decode.run rule=reranker reranker=runs:/<id>/rerankers/rows_lgbm_T0_fold0
    python -m decode.run rule=root_draw decode.temperature=1 select.budget=8
    python -m decode.run rule=pearl run.score=record run.record_traces=true   # + traces, offline values
    python -m decode.run rule=draft select.budget=8 run.budgets=[16]         # + budget elasticity
    python -m decode.run launcher=ray parallel.workers=8                     # prompts over 8 GPUs

`rule=` and `reranker=` are short for `run.rule=` and `run.reranker=`. Every
prompt is decoded twice in the same run, speculatively and target-only (the
speedup baseline), in an order alternating with the prompt's position, after
`run.warmup_prompts` untimed decodes. Results: tables in the Hydra run folder
and one MLflow run (metrics `online/...`; with run.score=record also the rule's
offline expected value `accepted/<T>/B<b>/<rule>` beside the realized one
`realized/<T>/B<b>/<rule>`, as `rerank.train` names them). With `run.budgets`
every prompt is also decoded at those budgets (`online/B<b>/...`) and seed 003's
budget elasticity d ln TPS = d ln tau + d ln eta between consecutive budgets is
logged under `online/elasticity/B<b1>_B<b2>/...` with paired prompt-bootstrap
intervals. Printed after the groups table: per-stage medians beside means, the
elasticity, and the entropy split (from the target-only baseline).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

import specrank.config  # noqa: F401  (registers the Hydra schema `config_schema`)
from decode.config import EDGE_MODES, RunConfig, manifest_view
from decode.inputs import check_job_launcher, check_prompts, resolve_inputs
from decode.metrics import PromptTiming, round_table
from decode.session import (
    RunReport,
    TraceShards,
    decode_all,
    log_to_mlflow,
    print_report,
    rule_label,
    summarize,
)
from decode.settings import OnlineSettings
from decode.shard_workers import PairInfo, run_on_ray
from decode.stream import DecodeSettings
from pairs.config import DataConfig, ModelConfig
from pairs.models import load_model_pair
from pairs.positions import check_prompt_lengths
from pairs.prompts import Prompt
from rerank.fit.models import FittedReranker
from rerank.serving import (
    PREDICTORS,
    SEEN_PROMPTS,
    OnlinePredictor,
    check_feature_availability,
    load_online_reranker,
    unknown_tasks,
    unseen_prompts,
)
from selection.rules import RULES
from specrank.checks import check_choice, check_int
from specrank.cli import expand_short_overrides, run_entry_point
from specrank.config import MlflowConfig
from specrank.parallel import ParallelConfig, check_parallel
from specrank.paths import CONF_DIR, project_path
from specrank.run_record import TrackingError
from tree.pool import pool_size

log = logging.getLogger(__name__)


def check_run(s: OnlineSettings, run: RunConfig, prompts_per_shard: int) -> None:
    """Every setting of an online run (decode, select, pool, run, trace), scikit-learn style."""
    s.check()
    check_choice("run.predictor", run.predictor, PREDICTORS)
    check_choice("run.seen_prompts", run.seen_prompts, SEEN_PROMPTS)
    check_int("run.warmup_prompts", run.warmup_prompts, 0)
    check_int("run.bootstrap_resamples", run.bootstrap_resamples, 1)
    if run.torch_threads is not None:
        check_int("run.torch_threads", run.torch_threads, 1)
    check_int("trace.prompts_per_shard", prompts_per_shard, 1)
    n_pool = pool_size(s.base.pool)
    for i, b in enumerate(run.budgets):
        check_int(f"run.budgets[{i}]", b, 1, n_pool)
    if s.entry.predictor and not run.reranker:
        raise ValueError("run.rule=reranker needs run.reranker=<folder or MLflow URI>; got none")


def run_online(model: ModelConfig, data: DataConfig, s: OnlineSettings, run: RunConfig,
               tracking: MlflowConfig | None, config: dict, out_dir: Path, seed: int = 0,
               prompts_per_shard: int = 8,
               parallel: ParallelConfig | None = None) -> RunReport:  # fmt: skip
    """Load models, prompts and the reranker named by the configs; decode; report; log.

    `parallel.backend=ray`: the prompts are decoded on Ray actors, `trace.prompts_per_shard`
    at a time (`decode.shard_workers.run_on_ray`); the report is made here from all of them.
    """
    parallel = parallel or ParallelConfig()
    _check_online(s, run, prompts_per_shard, parallel, model.device)
    if run.torch_threads is not None:
        torch.set_num_threads(run.torch_threads)
    model, prompts = _checked_prompts(model, data, s)
    # An MLflow URI resolves against the run's tracking store; a folder needs none.
    uri = (tracking or MlflowConfig()).tracking_uri
    fitted = None
    if s.entry.predictor:
        fitted = load_online_reranker(run.reranker, s.base.decode.temperature, uri)
        prompts = unseen_prompts(fitted, prompts, run.seen_prompts)
        unknown_tasks(fitted, prompts)
        check_feature_availability(fitted, run.score, run.allow_missing_features)
    keys = ("model", "data", "pool", "select", "decode", "run")
    manifest = manifest_view({k: config.get(k) for k in keys})

    def trace_shards(ids: dict) -> TraceShards | None:
        if not run.record_traces:
            return None
        return TraceShards(project_path(run.traces_out), s, manifest, ids, prompts_per_shard,
                           len(prompts))  # fmt: skip

    if parallel.backend == "ray":
        timings, info = run_on_ray(model, prompts, s, run, uri, parallel, prompts_per_shard)
        traces = trace_shards(info.ids)
        for i, timing in enumerate(timings[s.base.select.budget] if traces else ()):
            traces.add(i, timing)
    else:
        timings, info, traces = _decode_here(model, prompts, s, run, fitted, trace_shards,
                                             out_dir)  # fmt: skip
    # summarize reads only the pair's eos ids, which PairInfo carries without weights.
    report = summarize(timings, s, run, info, info.label, seed)
    if traces is not None:
        log.info("%d trace rows written to %s (%d finished shards of the same config kept)",
                 traces.rows, traces.store.root, traces.kept)  # fmt: skip
    if tracking is not None:
        tags = {"rule": info.label, "score": s.score, "device": info.device}
        if info.route is not None:
            tags |= {"reranker": str(run.reranker), "predictor": info.route}
        report.run_id = log_to_mlflow(report, tracking, config, tags, out_dir)
    return report


def _check_online(s: OnlineSettings, run: RunConfig, prompts_per_shard: int,
                  parallel: ParallelConfig, device: str) -> None:  # fmt: skip
    """Every setting, before anything loads; an online run cannot be split into job ranges."""
    check_run(s, run, prompts_per_shard)
    check_parallel(parallel, device)
    if parallel.parts > 1:
        raise ValueError(
            f"parallel.parts={parallel.parts}: an online run's report needs every prompt in one "
            f"process; spread decode.run over Ray workers (launcher=ray parallel.workers=N)"
        )


def _checked_prompts(model: ModelConfig, data: DataConfig,
                     s: OnlineSettings) -> tuple[ModelConfig, list[Prompt]]:  # fmt: skip
    """The resolved model config and the prompts, checked (lengths against the pool)."""
    model, prompts = resolve_inputs(model, data)
    check_prompts(prompts, data)
    dec = s.base
    prompts = check_prompt_lengths(model, prompts, dec.decode.max_new_tokens, dec.pool,
                                   data.long_prompts)  # fmt: skip
    return model, prompts


def _decode_here(
    model: ModelConfig,
    prompts: list[Prompt],
    s: OnlineSettings,
    run: RunConfig,
    fitted: FittedReranker | None,
    trace_shards: Callable[[dict], TraceShards | None],
    out_dir: Path,
) -> tuple[dict[int, list[PromptTiming]], PairInfo, TraceShards | None]:
    """Decode every prompt in this process; after a failure the finished ones are kept."""
    pair = load_model_pair(model)
    predictor = None
    if s.entry.predictor:
        predictor = OnlinePredictor(fitted, pair.device, run.predictor)
    traces = trace_shards(pair.ids)
    finished: list[PromptTiming] = []

    def on_prompt(i: int, by_budget: dict[int, PromptTiming]) -> None:
        finished.append(by_budget[s.base.select.budget])
        if traces is not None:
            traces.add(i, finished[-1])

    try:
        with torch.inference_mode():
            timings = decode_all(pair, prompts, s, run, predictor, on_prompt)
    except BaseException:
        keep_finished(out_dir, finished, len(prompts), traces)
        raise
    route = None if predictor is None else predictor.route
    info = PairInfo(pair.eos_ids, pair.ids, str(pair.device), rule_label(s.rule, predictor),
                    route)  # fmt: skip
    return timings, info, traces


def keep_finished(out_dir: Path, finished: list[PromptTiming], n_prompts: int,
                  traces: TraceShards | None) -> None:  # fmt: skip
    """After a failure: the finished prompts' rounds to `out_dir`, where the log names them."""
    if not finished:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "partial_rounds.parquet"
    round_table(finished).to_parquet(path, index=False)
    where = f"; their trace shards in {traces.store.root}" if traces is not None else ""
    log.error("decode.run failed after %d of %d prompts: their rounds are kept in %s%s",
              len(finished), n_prompts, path, where)  # fmt: skip


# Bare `rule=` / `reranker=` on the command line (the documented short form) mean the
# fields of the `run` section; Hydra itself only knows the long form.
_SHORT_OVERRIDES = {"rule": "run.rule", "reranker": "run.reranker"}


def expand_run_overrides(argv: list[str]) -> list[str]:
    return expand_short_overrides(argv, _SHORT_OVERRIDES)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="run")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    check_job_launcher()
    run: RunConfig = OmegaConf.to_object(cfg.run)
    base = DecodeSettings(
        pool=OmegaConf.to_object(cfg.pool),
        select=OmegaConf.to_object(cfg.select),
        decode=OmegaConf.to_object(cfg.decode),
    )
    # run.score=record reports realized vs offline expected values, which are computed from
    # each round's trace row: build the rows then too (written only with record_traces).
    entry = RULES.get(run.rule)  # an unknown rule is refused by check_run, naming the choices
    build_rows = run.record_traces or (
        run.score in EDGE_MODES and entry is not None and entry.has_offline_value
    )
    s = OnlineSettings(base, run.rule, run.score, build_rows, run.top_m)
    try:
        report = run_online(
            OmegaConf.to_object(cfg.model), OmegaConf.to_object(cfg.data), s, run,
            OmegaConf.to_object(cfg.mlflow), OmegaConf.to_container(cfg, resolve=True),
            Path(HydraConfig.get().runtime.output_dir), cfg.seed, cfg.trace.prompts_per_shard,
            OmegaConf.to_object(cfg.parallel),
        )  # fmt: skip
    except TrackingError as err:  # the run's tables are complete: say how to log them later
        sys.exit(f"error: {err}")
    print_report(report)
    print(f"MLflow run {report.run_id}")


if __name__ == "__main__":
    run_entry_point(main, _SHORT_OVERRIDES, stage="decode.run")

"""`python -m decode.run`: decode prompts online with a selection rule; speed, tau and values to MLflow.

    python -m decode.run rule=draft                              # EAGLE-style draft ranking
    python -m decode.run rule=reranker reranker=<saved folder>   # a fitted first-level reranker
    python -m decode.run rule=reranker reranker=runs:/<id>/rerankers/rows_lgbm_T0_fold0
    python -m decode.run rule=root_draw decode.temperature=1 select.budget=8
    python -m decode.run rule=pearl run.score=record run.record_traces=true   # + traces, offline values
    python -m decode.run rule=draft select.budget=8 run.budgets=[16]         # + budget elasticity
    python -m decode.run launcher=ray parallel.workers=8                     # prompts over 8 GPUs
    python -m decode.run 'run.rules=[draft,reranker:<folder>,root_draw]'     # one interleaved run

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
elasticity, and the entropy split (from the target-only baseline). With `run.rules`
several rules decode every prompt in one interleaved run, compared with the first
(`decode.compare`); `run.offline` puts an offline prediction beside each.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

import specrank.settings.config  # noqa: F401  (registers the Hydra schema `config_schema`)
from decode.compare import (
    RuleSpec,
    combine_reports,
    paired_ratios,
    plot_ratios,
    ratios_text,
    rule_specs,
    unique_labels,
)
from decode.config import RunConfig, manifest_view
from decode.inputs import check_job_launcher, check_prompts, resolve_inputs
from decode.metrics import PromptTiming, round_table
from decode.predicted import (
    check_offline,
    offline_metrics,
    offline_rule,
    offline_text,
    offline_values,
    realized_vs_offline,
)
from decode.session import (
    Arm,
    RunReport,
    TraceShards,
    decode_all,
    log_to_mlflow,
    offline_name,
    print_report,
    rule_label,
    run_budgets,
    summarize,
)
from decode.settings import OnlineSettings, for_rule
from decode.shard_workers import PairInfo, pair_info, run_on_ray, with_predictors
from decode.stream import DecodeSettings
from pairs.config import DataConfig, ModelConfig
from pairs.models import load_model_pair
from pairs.positions import check_prompt_lengths
from pairs.prompts import Prompt
from rerank.fit.models import FittedReranker
from rerank.serving import (
    PREDICTORS,
    SEEN_PROMPTS,
    check_feature_availability,
    load_online_reranker,
    unknown_tasks,
    unseen_prompts,
)
from specrank.runtime.parallel import ParallelConfig, check_parallel
from specrank.settings.checks import check_choice, check_int
from specrank.settings.cli import exits_on_refusal, expand_short_overrides, run_entry_point
from specrank.settings.config import MlflowConfig
from specrank.settings.errors import Refusal
from specrank.settings.paths import CONF_DIR, project_path
from specrank.statistics.laws import pair_key, pair_label
from specrank.tracking.run_record import TrackingError
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


def run_online(model: ModelConfig, data: DataConfig, s: OnlineSettings, run: RunConfig,
               tracking: MlflowConfig | None, config: dict, out_dir: Path, seed: int = 0,
               prompts_per_shard: int = 8,
               parallel: ParallelConfig | None = None) -> RunReport:  # fmt: skip
    """Load models, prompts and the rerankers named by the configs; decode; report; log.

    `s` holds the decode settings and `run.rule`'s; with `run.rules` every rule of the list
    decodes every prompt in one interleaved run (`decode.compare`), each with `s`'s decode
    settings. `parallel.backend=ray`: the prompts are decoded on Ray actors,
    `trace.prompts_per_shard` at a time, every rule of a prompt on one actor
    (`decode.shard_workers.run_on_ray`); the report is made here from all of them.
    """
    parallel = parallel or ParallelConfig()
    s.check()  # run.rule first: rule_specs reads its entry
    specs = rule_specs(run.rules, s.rule, run.reranker)
    settings = _rule_settings(s, specs, run)
    _check_online(settings, run, prompts_per_shard, parallel, model.device)
    # An MLflow URI resolves against the run's tracking store; a folder needs none.
    uri = (tracking or MlflowConfig()).tracking_uri
    offline = offline_values(run.offline, uri) if run.offline else None  # before any model
    if run.torch_threads is not None:
        torch.set_num_threads(run.torch_threads)
    model, prompts = _checked_prompts(model, data, s)
    arms, names, prompts = _plan_arms(specs, settings, run, uri, prompts)
    if offline is not None:  # every rule, budget and prompt must have its prediction: checked now
        check_offline(offline, list(names.values()), run_budgets(s, run),
                      s.base.decode.temperature, [p.id for p in prompts], run.score_top_m, run.offline)  # fmt: skip
    keys = ("model", "data", "pool", "select", "decode", "run")
    manifest = manifest_view({k: config.get(k) for k in keys})

    def trace_shards(ids: dict) -> TraceShards | None:
        if not run.record_traces:
            return None
        return TraceShards(project_path(run.traces_out), s, manifest, ids, prompts_per_shard,
                           len(prompts))  # fmt: skip

    if parallel.backend == "ray":
        timings, info = run_on_ray(model, prompts, arms, run, uri, parallel, prompts_per_shard)
        traces = trace_shards(info.ids)
        for i, timing in enumerate(timings[arms[0].label][s.base.select.budget] if traces else ()):
            traces.add(i, timing)
    else:
        timings, info, traces = _decode_here(model, prompts, arms, run, uri, trace_shards, out_dir)
    if traces is not None:
        log.info("%d trace rows written to %s (%d finished shards of the same config kept)",
                 traces.rows, traces.store.root, traces.kept)  # fmt: skip
    # summarize reads only the pair's eos ids, which PairInfo carries without weights.
    reports = {a.label: summarize(timings[a.label], a.s, run, info, a.label, seed) for a in arms}
    report = reports[arms[0].label]
    if len(arms) > 1:
        ratios = paired_ratios(timings, info.eos_ids, run.bootstrap_resamples, seed)
        report = combine_reports(reports, ratios)
    if offline is not None:
        report.offline = realized_vs_offline(timings, names, offline, s.base.decode.temperature,
                                             info.eos_ids, run.bootstrap_resamples, seed,
                                             run.offline)  # fmt: skip
        report.offline_source = run.offline
        report.metrics |= offline_metrics(report.offline)
    if tracking is not None:
        report.run_id = _log(report, arms, info, run, tracking, config, out_dir)
    return report


def _rule_settings(
    s: OnlineSettings, specs: list[RuleSpec], run: RunConfig
) -> list[OnlineSettings]:
    """Each rule's settings; `<rule>@+N` scores its tree only (the baseline at as many scored
    prefixes as the others), and each budget + N must fit the pool."""
    if not run.rules:
        return [s]
    out = []
    for i, p in enumerate(specs):
        st = for_rule(s, p.rule, run.record_traces)
        if p.extra_budget:
            st = dataclasses.replace(st, score="tree")
            for b in run_budgets(s, run):
                check_int(f"run.rules[{i}] ({p.rule}@{p.extra_budget:+d}) at budget {b}",
                          b + p.extra_budget, 1, pool_size(s.base.pool))  # fmt: skip
        out.append(st)
    return out


def _budget_suffix(extra: int) -> str:
    return "" if not extra else f"_plus{extra}" if extra > 0 else f"_minus{-extra}"


def _plan_arms(specs: list[RuleSpec], settings: list[OnlineSettings], run: RunConfig, uri: str,
               prompts: list[Prompt]) -> tuple[list[Arm], dict[str, str | None], list[Prompt]]:  # fmt: skip
    """The run's rules with their labels and offline names, and the prompts every one of them
    may decode: each reranker is loaded with every check, its training prompts refused or
    skipped for all rules (`run.seen_prompts`; the rules stay paired), its unseen tasks
    warned, its features checked against `run.score`."""
    fitted: list[FittedReranker | None] = []
    for spec, st in zip(specs, settings, strict=True):
        if spec.reranker is None:
            fitted.append(None)
            continue
        f = load_online_reranker(spec.reranker, st.base.decode.temperature, uri)
        prompts = unseen_prompts(f, prompts, run.seen_prompts)
        unknown_tasks(f, prompts)
        check_feature_availability(f, run.score, run.allow_missing_features)
        fitted.append(f)
    # `<rule>@+N` / `@-N` is labelled <rule>_plus<N> / _minus<N> (MLflow keys take no '@',
    # '+' or '-'); only draft@+<run.score_top_m> under top_m has an offline prediction (`offline_rule`)
    labels = unique_labels([rule_label(p.rule, f) + _budget_suffix(p.extra_budget)
                            for p, f in zip(specs, fitted, strict=True)])  # fmt: skip
    arms = [Arm(label, st, p.reranker, f, extra_budget=p.extra_budget)
            for label, st, p, f in zip(labels, settings, specs, fitted, strict=True)]  # fmt: skip
    names = {a.label: offline_rule(p, offline_name(p.rule, f), run.score, run.score_top_m)
             for a, p, f in zip(arms, specs, fitted, strict=True)}  # fmt: skip
    return arms, names, prompts


def _log(report: RunReport, arms: list[Arm], info: PairInfo, run: RunConfig,
         tracking: MlflowConfig, config: dict, out_dir: Path) -> str:  # fmt: skip
    """The report's tables (and with several rules the ratios' plot) to MLflow."""
    dec = arms[0].s.base.decode
    tags = {"rule": "+".join(a.label for a in arms), "score": arms[0].s.score,
            "device": info.device, "verifier": dec.verifier,
            "pair": pair_key(dec.temperature, dec.draft_temperature)}  # fmt: skip
    sources = [a.reranker for a in arms if a.reranker]
    if sources:
        routes = sorted({r for r in info.routes.values() if r})
        tags |= {"reranker": ",".join(sources), "predictor": ",".join(routes)}
    if run.offline:
        tags["offline"] = run.offline
    plots: tuple[str, ...] = ()
    if not report.compare.empty:
        out_dir.mkdir(parents=True, exist_ok=True)
        plots = (plot_ratios(report.compare, out_dir / "online_compare.png").name,)
    return log_to_mlflow(report, tracking, config, tags, out_dir, plots)


def _check_online(settings: list[OnlineSettings], run: RunConfig, prompts_per_shard: int,
                  parallel: ParallelConfig, device: str) -> None:  # fmt: skip
    """Every setting, before anything loads; an online run cannot be split into job ranges."""
    for st in settings:
        check_run(st, run, prompts_per_shard)
    check_parallel(parallel, device)
    if parallel.parts > 1:
        raise Refusal(
            f"parallel.parts={parallel.parts}: an online run's report needs every prompt in one "
            f"process; spread decode.run over Ray workers (launcher=ray parallel.workers=N)"
        )
    if len(settings) > 1 and run.record_traces:
        raise Refusal(
            f"run.record_traces=true writes one rule's rounds, but run.rules names "
            f"{len(settings)}; record each rule in its own run (run.rule=<rule>)"
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
    arms: list[Arm],
    run: RunConfig,
    uri: str,
    trace_shards: Callable[[dict], TraceShards | None],
    out_dir: Path,
) -> tuple[dict[str, dict[int, list[PromptTiming]]], PairInfo, TraceShards | None]:
    """Decode every prompt in this process; after a failure the finished ones are kept."""
    pair = load_model_pair(model)
    arms = with_predictors(arms, pair, run, uri)
    traces = trace_shards(pair.ids)
    finished: list[PromptTiming] = []
    primary = arms[0].s.base.select.budget

    def on_prompt(i: int, by_budget: dict[int, PromptTiming]) -> None:
        finished.append(by_budget[primary])
        if traces is not None:
            traces.add(i, finished[-1])

    try:
        with torch.inference_mode():
            timings = decode_all(pair, prompts, arms, run, on_prompt)
    except BaseException:
        keep_finished(out_dir, finished, len(prompts), traces)
        raise
    return timings, pair_info(pair, arms), traces


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
@exits_on_refusal
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
    # each round's trace row: for_rule builds the rows then too (written only with
    # record_traces). An unknown rule is refused by check_run, naming the choices.
    s = for_rule(OnlineSettings(base, run.rule, run.score, False, run.score_top_m), run.rule,
                 run.record_traces)  # fmt: skip
    try:
        report = run_online(
            OmegaConf.to_object(cfg.model), OmegaConf.to_object(cfg.data), s, run,
            OmegaConf.to_object(cfg.mlflow), OmegaConf.to_container(cfg, resolve=True),
            Path(HydraConfig.get().runtime.output_dir), cfg.seed, cfg.trace.prompts_per_shard,
            OmegaConf.to_object(cfg.parallel),
        )  # fmt: skip
    except TrackingError as err:  # the run's tables are complete: say how to log them later
        sys.exit(f"error: {err}")
    print(f"== T_t|T_d {pair_label(base.decode.temperature, base.decode.draft_temperature)}, "
          f"verifier {base.decode.verifier}")  # fmt: skip
    print_report(report)
    if not report.compare.empty:
        print(ratios_text(report.compare))
    if not report.offline.empty:
        print(offline_text(report.offline, report.offline_source))
    print(f"MLflow run {report.run_id}")


if __name__ == "__main__":
    run_entry_point(main, _SHORT_OVERRIDES, stage="decode.run")

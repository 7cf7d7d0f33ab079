"""Typed settings of the entry points `decode.record` and `decode.run` (`trace:` and `run:`
sections; see `specrank.settings.config`).

On the command line `rule=<...>` and `reranker=<...>` are short for `run.rule=<...>` and
`run.reranker=<...>` (see `decode.run`). Pool, budget, temperature, verifier, output limit
and seed come from the shared `pool`, `select` and `decode` sections (`tree.config`),
exactly as for `decode.record`.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from specrank.settings.fields import setting


@dataclass
class TraceConfig:
    """How traces are stored: the folder `decode.record` writes, and the shard size of its
    store and of `decode.run`'s."""

    out_dir: str = setting(
        MISSING,
        "trace store folder; `decode.record` sets it to paths.traces. A store holds one "
        "configuration (both temperatures share it) and refuses another",
    )
    prompts_per_shard: int = setting(
        8,
        "consecutive prompts per shard: the unit a rerun resumes from (finished shards are kept) "
        "and, under Ray, the unit dealt to a worker",
    )
    progress: bool = setting(True, "show a progress bar with tokens/s and mean accepted length")


# Settings that never change a written round (they refuse or skip whole prompts, or only
# warn): left out of trace manifests, so stores recorded before they existed resume.
NOT_IN_MANIFEST = {
    "data": ("long_prompts",),
    "model": ("strict_head_positions",),
    "run": ("allow_missing_features",),
}


# Settings added later whose default is the behaviour from before they existed: recorded
# only when set otherwise, so a store recorded before them has the same manifest and resumes.
OMITTED_AT = {"decode": {"draft_temperature": None}, "model": {"drafter_window": None}}


def manifest_view(sections: dict) -> dict:
    """Config sections as trace manifests record them: without NOT_IN_MANIFEST's keys, and
    without OMITTED_AT's keys at their listed values."""
    out = dict(sections)
    for section, keys in NOT_IN_MANIFEST.items():
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k not in keys}
    return without_omitted(out)


def without_omitted(sections: dict) -> dict:
    """Config sections without OMITTED_AT's keys at their listed values: a setting added later,
    at the default that keeps the behaviour from before, reads as absent (manifests, and the
    chunks `decode.pooled` compares)."""
    out = dict(sections)
    for section, defaults in OMITTED_AT.items():
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items()
                            if k not in defaults or v != defaults[k]}  # fmt: skip
    return out


@dataclass
class RunConfig:
    """Online decoding (`decode.run`): the rules that decode, what each target pass scores,
    and what the run compares and measures. On the command line `rule=<...>` and
    `reranker=<...>` are short for `run.rule=<...>` and `run.reranker=<...>`."""

    rule: str = setting(
        "draft",
        "the selection rule that decodes: one with an online route (docs/method.md#rule-values; "
        "`covering` emits the leaf draws as the continuation, one pass per round)",
    )
    rules: list[str] = setting(
        [],
        "several rules in one interleaved run, e.g. `[draft, reranker:<folder>, root_draw]`: each "
        "prompt decoded by each in rotating order, at select.budget and every run.budgets entry, "
        "with ratios of tau and tokens/s to the first rule and paired intervals. `reranker` alone "
        "reads run.reranker; `<rule>@+N` / `<rule>@-N` (not first, no reranker) decodes at each "
        "budget plus / minus N scoring its tree only. Empty: run.rule alone",
    )
    offline: str | None = setting(
        None,
        "per-round values of a rerank.train or rerank.transfer run on a separate recording of "
        "these prompts (its folder, its per_round_values.parquet or an MLflow URI): each rule's "
        "offline prediction is reported beside its realized tau. null: not compared",
    )
    reranker: str | None = setting(
        None,
        "rule=reranker: a folder written by rerank.fit.persist.save_reranker (relative to the "
        "project root) or an MLflow URI such as "
        "`runs:/<run id>/rerankers/rows_lgbm_T0_fold0`; its law must match decode.temperature "
        "(T=0 the classifier, T>0 the regressor)",
    )
    seen_prompts: str = setting(
        "refuse",
        "refuse | skip | allow: what rule=reranker does with prompts the model was trained on "
        "(gains there are in-sample): fail naming them, decode only the others, or decode all",
    )
    predictor: str = setting(
        "auto",
        "auto | library | forest | compiled: how the reranker predicts on the hot path. auto: the "
        "fastest exact route measured (the compiled forest walk on the host, then one copy to the "
        "device); library: the model's own predict; forest: the forest walk (compiled on CPU, "
        "torch ops on CUDA); compiled: the compiled walk on the host",
    )
    score: str = setting(
        "tree",
        "tree | top_m | frontier | record | pool: what each target pass scores beside the "
        "verified tree (docs/method.md#scored-set). tree: nothing else (speed runs); top_m: the "
        "run.score_top_m best-ranked candidates outside it; frontier: every child of a tree node; "
        "record: like decode.record; pool: all. record and pool are needed to record traces and "
        "for offline values. The same policy as rerank.score offline",
    )
    score_top_m: int = setting(
        100,
        "M of run.score=top_m: candidates scored outside the tree; the same M as "
        "rerank.score_top_m offline (formerly run.top_m)",
    )
    allow_missing_features: bool = setting(
        False,
        "decode, with a warning, a reranker whose trees split on features the scored set never "
        "gives (the matched row under score=tree, token-only rows beyond score=record); false "
        "refuses it",
    )
    record_traces: bool = setting(
        False, "write the run's rounds as a trace store (needs run.score=record or pool)"
    )
    traces_out: str = setting(
        "data_out/online_traces/${run.rule}", "trace store of run.record_traces"
    )
    baseline: bool = setting(
        True, "also decode every prompt target-only in the same run, for the speedup"
    )
    budgets: list[int] = setting(
        [],
        "budgets decoded beside select.budget in the same run, each prompt at every one in turn "
        "with one baseline decode; metrics per budget and the elasticity between consecutive "
        "ones. Traces and offline values are select.budget's. Empty: select.budget alone",
    )
    warmup_prompts: int = setting(1, "untimed decodes (both decoders) before measuring")
    torch_threads: int | None = setting(
        1,
        "torch intra-op threads (null: torch's default). 1 because batch-1 decoding of small "
        "models gains little from more, and multi-threaded torch stalls on shared cores",
    )
    bootstrap_resamples: int = setting(
        1000, "paired prompt-bootstrap resamples of the speedup and of realized - expected"
    )
    progress: bool = setting(True, "show a progress bar while decoding")


SECTIONS = {"trace": TraceConfig, "run": RunConfig}  # see specrank.settings.config

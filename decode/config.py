"""Typed settings of the entry points `decode.record` and `decode.run` (`trace:` and `run:`
sections; see `specrank.config`).

On the command line `rule=<...>` and `reranker=<...>` are short for `run.rule=<...>` and
`run.reranker=<...>` (see `decode.run`). Pool, budget, temperature, verifier, output limit
and seed come from the shared `pool`, `select` and `decode` sections (`tree.config`),
exactly as for `decode.record`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING


@dataclass
class TraceConfig:
    out_dir: str = MISSING  # trace store folder (record.yaml derives it from model/data/decode)
    prompts_per_shard: int = 8  # one shard = this many consecutive prompts (resume unit)
    progress: bool = True  # tqdm bar with tokens/s and mean accepted length


# Settings that never change a written round (they refuse or skip whole prompts, or only
# warn): left out of trace manifests, so stores recorded before they existed resume.
NOT_IN_MANIFEST = {
    "data": ("long_prompts",),
    "model": ("strict_head_positions",),
    "run": ("allow_missing_features",),
}


# Settings added later whose default is the behaviour from before they existed: recorded
# only when set otherwise, so a store recorded before them has the same manifest and resumes.
OMITTED_AT = {"decode": {"draft_temperature": None}}


def manifest_view(sections: dict) -> dict:
    """Config sections as trace manifests record them: without NOT_IN_MANIFEST's keys, and
    without OMITTED_AT's keys at their listed values."""
    out = dict(sections)
    for section, keys in NOT_IN_MANIFEST.items():
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k not in keys}
    for section, defaults in OMITTED_AT.items():
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items()
                            if k not in defaults or v != defaults[k]}  # fmt: skip
    return out


# Rules the online decoder runs (docs/method.md#rule-values). `covering` is the comparison decoder of
# the paper's App. D.10 (leaf draws emitted as the continuation; one pass per round).


@dataclass
class RunConfig:
    rule: str = "draft"  # a rule with an online route (selection.rules.online_rules)
    # Several rules in one interleaved run (decode.compare), e.g. [draft, reranker:<folder>,
    # root_draw]: every prompt is decoded by each, in an order rotating with the prompt, at
    # select.budget and each of run.budgets; ratios of tau and tokens/s to the first rule with
    # paired intervals. `reranker` alone reads run.reranker. `<rule>@+N` (not first, no
    # reranker): at each budget + N, scoring its tree only (draft@+<run.top_m>: draft at
    # B + M scored prefixes; its offline prediction is draft_scored). Empty:
    # run.rule alone.
    rules: list[str] = field(default_factory=list)
    # The per-round values of a rerank.train / rerank.transfer run (its folder, the
    # per_round_values.parquet, or an MLflow URI) on a separate recording of the run's
    # prompts: each rule's offline prediction beside its realized tau. None: not compared.
    offline: str | None = None
    # rule=reranker: a folder written by rerank.persist.save_reranker (relative paths:
    # project root) or an MLflow artifact URI, e.g. runs:/<run id>/rerankers/rows_lgbm_T0_fold0.
    # Its law must match decode.temperature (T=0: the classifier; T>0: the regressor).
    reranker: str | None = None
    # rule=reranker and prompts the model was trained on (its saved training prompts are
    # checked against the run's; gains there are in-sample): refuse = fail naming them;
    # skip = decode only the others (e.g. the held-out cross-fitting half); allow = decode all.
    seen_prompts: str = "refuse"
    # Fast phat on the hot path: auto = the fastest exact route measured (the compiled
    # forest walk on the host, rerank/forest/jit.py, for both libraries, then one copy to
    # the device: on CUDA faster than the forest as tensors there, README "On a GPU");
    # library = the model's own predict; forest = the forest walk (compiled on CPU, torch
    # ops on CUDA); compiled = the compiled walk on the host, then one copy to the device.
    predictor: str = "auto"
    # What each target pass scores, beside the verified tree (decode.tree_pass.scored_set):
    # tree = nothing else (speed runs); top_m = the run.top_m best-ranked candidates outside
    # it, in the rule's order (App. D.10); frontier = every child of a tree node (Table 21);
    # record = expanded + the draft top select.top_m, like decode.record; pool = all. record
    # and pool give every pool edge's target probability: needed to record traces and for
    # the offline expected values. (Before, score=pool meant today's record.)
    score: str = "tree"
    top_m: int = 100  # M of score=top_m (App. D.10's M = 100)
    # A reranker whose trees split on features the scored set never gives (the matched row
    # under score=tree, token-only rows beyond score=record) is refused; true decodes it
    # anyway, with a warning.
    allow_missing_features: bool = False
    record_traces: bool = False  # write the run's rounds as traces (needs score=record|pool)
    traces_out: str = "data_out/online_traces/${run.rule}"  # trace store of record_traces
    baseline: bool = True  # target-only decoding of every prompt in the same run (speedup)
    # Budgets decoded beside select.budget in the same run (seed 003's budget elasticity):
    # every prompt at select.budget and each of these, in turn, with one baseline decode;
    # metrics online/B<b>/..., and the elasticity between consecutive budgets under
    # online/elasticity/B<b1>_B<b2>/.... Empty: select.budget alone. Traces and offline
    # values (run.score=record|pool) are of select.budget's decode.
    budgets: list[int] = field(default_factory=list)
    warmup_prompts: int = 1  # untimed decodes (both decoders) before measuring
    # torch intra-op threads. 1 by default: batch-1 decoding of small models gains little
    # from more, and on shared cores multi-threaded torch stalls (a 2-thread run of the
    # pocket pair on a busy 2-core machine measured ~100x slower). None = torch's default.
    torch_threads: int | None = 1
    bootstrap_resamples: int = 1000  # paired prompt bootstrap of speedup and realized - expected
    progress: bool = True


SECTIONS = {"trace": TraceConfig, "run": RunConfig}  # see specrank.config

"""Ray workers of decode.record and decode.run: each holds its own model pair and decodes shards.

The driver (`record_on_ray`, `run_on_ray`) never loads a model: it plans the
shards, checks the store, and `specrank.runtime.parallel.deal` hands one shard at a time
to each actor. A recording worker writes its shards itself, through the store's
claims, so the store ends as a single-process recording would leave it (decoding
is seeded per prompt, so no draw depends on which worker made it); an online-run
worker returns its prompts' timings and the driver summarises them in prompt order.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from decode.config import RunConfig
from decode.metrics import PromptTiming
from decode.recording import RecordReport, ShardRecorder, plan_shards, recording_settings
from decode.session import Arm, decode_all
from decode.stream import DecodeSettings
from pairs.config import ModelConfig
from pairs.models import ModelPair, load_model_pair
from pairs.prompts import Prompt
from rerank.serving import OnlinePredictor, load_online_reranker
from specrank.runtime.parallel import ParallelConfig, deal
from specrank.store.claims import new_owner
from specrank.store.trace_schema import trace_store


def _threads(model: ModelConfig) -> None:
    if model.device == "cpu":
        # As decode.record's main: one intra-op thread per worker (float32 reductions
        # round alike only at equal thread counts, and workers share the cores).
        torch.set_num_threads(1)


class RecordWorker:
    """One recording actor: its model pair, the shards it may be dealt, the store it writes."""

    def __init__(self, model: ModelConfig, settings: DecodeSettings,
                 shards: dict[str, list[Prompt]], manifest_config: dict, out: Path,
                 claim_stale_s: float) -> None:  # fmt: skip
        _threads(model)
        self.pair = load_model_pair(model)
        self.online = recording_settings(settings)
        self.shards, self.manifest_config = shards, manifest_config
        self.store = trace_store(out)
        self.store.claim_stale_s = claim_stale_s
        self.owner = self.store.owner
        self._opened = False

    def info(self) -> dict[str, str]:
        return self.pair.ids

    def __call__(self, shard_id: str) -> RecordReport:
        if not self._opened:  # the driver wrote the manifest; refuse if our models differ
            self.store.open_for_writing(self.manifest_config, self.pair.ids)
            self._opened = True
        report = RecordReport()
        recorder = ShardRecorder(self.pair, self.online, report)
        t0 = time.perf_counter()
        with torch.inference_mode():
            run = self.store.write_pending([shard_id], lambda sid: recorder(self.shards[sid]))
        report.shards_written, report.shards_skipped = run.written, run.skipped
        report.stage_ms["writing"] = 1000.0 * run.write_seconds
        report.seconds = time.perf_counter() - t0
        return report


def record_on_ray(out: Path, model: ModelConfig, prompts: list[Prompt], settings: DecodeSettings,
                  prompts_per_shard: int, manifest_config: dict, parallel: ParallelConfig,
                  progress: bool = True) -> RecordReport:  # fmt: skip
    """Record the pending shards of `out` on `parallel.workers` Ray actors (see the module doc)."""
    shards = plan_shards(prompts, settings, prompts_per_shard)
    store = trace_store(out)
    store.claim_stale_s = parallel.claim_stale_s
    store.check_compatible(manifest_config)  # another config's store: refused before any load
    todo = store.pending(list(shards))
    report = RecordReport(shards_skipped=len(shards) - len(todo))
    if not todo:
        return report
    factory = functools.partial(RecordWorker, model, settings, {s: shards[s] for s in todo},
                                manifest_config, out, parallel.claim_stale_s)  # fmt: skip

    def write_manifest(ids: list[dict[str, str]]) -> None:
        differ = [i for i, x in enumerate(ids) if x != ids[0]]
        if differ:
            raise ValueError(
                f"model: Ray workers {differ} found other checkpoints than worker 0 at the same "
                f"paths ({ids[differ[0]]} vs {ids[0]}); every node must hold the same models"
            )
        store.open_for_writing(manifest_config, ids[0])

    def postfix(_: str, r: RecordReport) -> dict[str, str]:
        report.merge(r)
        elapsed = time.perf_counter() - t0
        return {"tok_s": f"{report.tokens / elapsed:.1f}",
                "accepted": f"{report.accepted / max(report.rounds, 1):.2f}"}  # fmt: skip

    t0 = time.perf_counter()
    dealt = deal(todo, factory, parallel, model.device.startswith("cuda"),
                 sizes={s: len(shards[s]) for s in todo}, on_ready=write_manifest,
                 on_dead=store.break_claims, on_result=postfix, progress=progress,
                 desc="record", unit="prompt")  # fmt: skip
    report.seconds = time.perf_counter() - t0
    report.workers_lost = dealt.lost_workers
    return report


@dataclass(frozen=True)
class PairInfo:
    """What the driver of an online run needs of the workers' model pair (no weights)."""

    eos_ids: frozenset[int]
    ids: dict[str, str]
    device: str
    routes: dict[str, str | None]  # each rule's predictor route (label -> None without one)


def with_predictors(arms: list[Arm], pair: ModelPair, run: RunConfig,
                    tracking_uri: str | None = None) -> list[Arm]:  # fmt: skip
    """The arms with their rerankers' predictors next to `pair` (on its device,
    `run.predictor`), each from the arm's loaded model or else loaded from its source."""
    out = []
    for a in arms:
        if a.reranker is not None:
            fitted = a.fitted or load_online_reranker(
                a.reranker, a.s.base.decode.temperature, tracking_uri
            )
            a = dataclasses.replace(
                a, predictor=OnlinePredictor(fitted, pair.device, run.predictor)
            )
        out.append(a)
    return out


def pair_info(pair: ModelPair, arms: list[Arm]) -> PairInfo:
    routes = {a.label: None if a.predictor is None else a.predictor.route for a in arms}
    return PairInfo(pair.eos_ids, pair.ids, str(pair.device), routes)


class RunWorker:
    """One online-run actor: its model pair (and rerankers), decoding shards of prompts, every
    rule of a prompt here."""

    def __init__(self, model: ModelConfig, arms: list[Arm], run: RunConfig,
                 shards: dict[str, tuple[int, list[Prompt]]],
                 tracking_uri: str | None) -> None:  # fmt: skip
        if run.torch_threads is not None:
            torch.set_num_threads(run.torch_threads)
        self.pair = load_model_pair(model)
        self.arms = with_predictors(arms, self.pair, run, tracking_uri)
        self.shards = shards
        self.run = dataclasses.replace(run, progress=False)
        self.owner = new_owner()

    def info(self) -> PairInfo:
        return pair_info(self.pair, self.arms)

    def __call__(self, shard_id: str) -> dict[str, dict[int, list[PromptTiming]]]:
        start, prompts = self.shards[shard_id]
        with torch.inference_mode():
            out = decode_all(self.pair, prompts, self.arms, self.run, start=start)
        # Warm-up decodes once per worker (its first shard), not before every shard.
        self.run = dataclasses.replace(self.run, warmup_prompts=0)
        return out


def run_on_ray(model: ModelConfig, prompts: list[Prompt], arms: list[Arm], run: RunConfig,
               tracking_uri: str | None, parallel: ParallelConfig, prompts_per_shard: int,
               ) -> tuple[dict[str, dict[int, list[PromptTiming]]], PairInfo]:  # fmt: skip
    """Every rule's timings at every budget of every prompt, decoded on Ray actors shard by
    shard, in prompt order.

    A shard's prompts keep their single-process positions (`decode_all`'s `start`), so the
    baseline-before/after alternation and the rules' order are a single process's.
    """
    shards = {
        f"{j:05d}": (k, prompts[k : k + prompts_per_shard])
        for j, k in enumerate(range(0, len(prompts), prompts_per_shard))
    }
    # each actor loads the rerankers from their sources, as the driver did
    bare = [dataclasses.replace(a, fitted=None, predictor=None) for a in arms]
    factory = functools.partial(RunWorker, model, bare, run, shards, tracking_uri)
    dealt = deal(list(shards), factory, parallel, model.device.startswith("cuda"),
                 sizes={k: len(v[1]) for k, v in shards.items()}, progress=run.progress,
                 desc=f"run {'+'.join(a.label for a in arms)}", unit="prompt")  # fmt: skip
    timings: dict[str, dict[int, list[PromptTiming]]] = {}
    for part in dealt.results.values():  # shard order = prompt order
        for label, by_budget in part.items():
            for budget, ts in by_budget.items():
                timings.setdefault(label, {}).setdefault(budget, []).extend(ts)
    return timings, dealt.infos[0]

"""Recording: decode a shard's prompts with the draft rule and the recording scored set,
one trace row per round (`decode.record` runs it in one process, `decode.shard_workers`
on Ray actors).

One shard = `trace.prompts_per_shard` consecutive prompts (id `t0.0-b59-00003`).
Each prompt's decoding depends only on the models, the settings and its own
seeded generator, so a killed run restarted with the same config skips the
finished shards and writes the rest exactly as an uninterrupted run would
(timing columns aside: they are measurements).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
from tqdm import tqdm

import specrank.settings.config  # noqa: F401  (registers the Hydra schema `config_schema`)
from decode.loop import PromptRun, decode_prompt
from decode.round import STAGES
from decode.settings import OnlineSettings
from decode.stream import DecodeSettings
from pairs.models import ModelPair
from pairs.prompts import Prompt, encode_prompt
from selection.rules import RULES
from specrank.runtime.parallel import ParallelConfig, part_of
from specrank.settings.checks import check_int
from specrank.settings.errors import Refusal
from specrank.store.trace_schema import TRACE_SCHEMA, trace_store
from tree.pool import pool_size

log = logging.getLogger(__name__)


def shard_id(temperature: float, budget: int, index: int) -> str:
    return f"t{float(temperature)}-b{budget}-{index:05d}"


def plan_shards(
    prompts: list[Prompt], settings: DecodeSettings, prompts_per_shard: int
) -> dict[str, list[Prompt]]:
    """Shard id -> its `prompts_per_shard` consecutive prompts, in prompt order."""
    return {
        shard_id(settings.decode.temperature, settings.select.budget, k): prompts[
            i : i + prompts_per_shard
        ]
        for k, i in enumerate(range(0, len(prompts), prompts_per_shard))
    }


@dataclass
class RecordReport:
    prompts_decoded: int = 0
    shards_written: int = 0
    shards_skipped: int = 0
    rounds: int = 0
    tokens: int = 0
    accepted: int = 0
    seconds: float = 0.0  # decoding + writing of the shards written here
    stage_ms: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys((*STAGES, "prefill", "writing"), 0.0)
    )
    workers_lost: int = 0  # launcher=ray: actors that died (their shards were dealt again)

    def add(self, res: PromptRun) -> None:
        self.prompts_decoded += 1
        self.rounds += len(res.rounds)
        self.tokens += len(res.output)
        self.accepted += sum(r.n_accepted for r in res.rounds)
        self.stage_ms["prefill"] += res.prefill_ms
        for r in res.rounds:
            for name, ms in zip(STAGES, r.stage_ms, strict=True):
                self.stage_ms[name] += ms

    def merge(self, other: RecordReport) -> None:
        """Add another worker's counts and stage times (the wall time stays this report's)."""
        for name in ("prompts_decoded", "shards_written", "shards_skipped", "rounds", "tokens",
                     "accepted", "workers_lost"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name, ms in other.stage_ms.items():
            self.stage_ms[name] += ms

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def recording_settings(settings: DecodeSettings, record: bool = True) -> OnlineSettings:
    """Recording = online decoding with the draft rule and the recording scored set (docs/method.md#scored-set)."""
    recordable = [n for n, r in RULES.items() if r.records]  # the paper records draft's trees
    if settings.select.rule not in recordable:
        raise Refusal(
            f"The 'select.rule' for recording must be one of {recordable}. "
            f"Got {settings.select.rule!r} instead."
        )
    return OnlineSettings(base=settings, rule=settings.select.rule, score="record", record=record)


class ShardRecorder:
    """Decodes a shard's prompts into its trace table, adding each prompt to `report`."""

    def __init__(self, pair: ModelPair, online: OnlineSettings, report: RecordReport,
                 on_prompt: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.pair, self.online, self.report, self.on_prompt = pair, online, report, on_prompt

    def __call__(self, prompts: list[Prompt]) -> pa.Table:
        pair, rows = self.pair, []
        for prompt in prompts:
            token_ids = encode_prompt(pair.tokenizer, prompt.text)
            res = decode_prompt(
                pair.target, pair.drafter, token_ids, self.online, pair.eos_ids, prompt.id,
                prompt.task, category=prompt.category,
            )  # fmt: skip
            rows.extend(r.fields for r in res.rounds if r.fields is not None)
            self.report.add(res)
            if self.on_prompt is not None:
                self.on_prompt()
        return pa.Table.from_pylist(rows, schema=TRACE_SCHEMA)


def record_traces(
    out_dir: Path,
    pair: ModelPair,
    prompts: list[Prompt],
    settings: DecodeSettings,
    prompts_per_shard: int,
    manifest_config: dict,
    progress: bool = True,
    write: bool = True,
    parallel: ParallelConfig | None = None,
) -> RecordReport:
    """Decode every prompt of every unfinished shard and write its trace rows.

    `parallel.part` of `parallel.parts` restricts the run to that range of shards
    (one Slurm job's); other writers of the same store are kept apart by claims.
    `write=False` decodes the same shards without recording (no trace rows, no
    retained rows, nothing written): the baseline of the recording-overhead benchmark.
    """
    parallel = parallel or ParallelConfig()
    online = recording_settings(settings, record=write)
    online.check()
    check_int("trace.prompts_per_shard", prompts_per_shard, 1)
    shards = plan_shards(prompts, settings, prompts_per_shard)
    ids = part_of(list(shards), parallel.part, parallel.parts)
    if parallel.parts > 1 and ids:
        log.info("parallel.part %d of %d: shards %s .. %s (%d of %d)", parallel.part,
                 parallel.parts, ids[0], ids[-1], len(ids), len(shards))  # fmt: skip
    store = trace_store(out_dir)
    store.claim_stale_s = parallel.claim_stale_s
    if write:
        store.open_for_writing(config=manifest_config, models=pair.ids)
    todo = store.pending(ids) if write else ids
    report = RecordReport()
    bar = tqdm(
        total=sum(len(shards[k]) for k in todo), unit="prompt", disable=not progress, desc="record"
    )
    t0 = time.perf_counter()

    def prompt_done() -> None:
        bar.update(1)
        elapsed = time.perf_counter() - t0
        bar.set_postfix(
            tok_s=f"{report.tokens / elapsed:.1f}",
            accepted=f"{report.accepted / max(report.rounds, 1):.2f}",
        )

    recorder = ShardRecorder(pair, online, report, prompt_done)
    if write:
        run = store.write_pending(todo, lambda sid: recorder(shards[sid]))
        report.shards_written = run.written
        report.shards_skipped = run.skipped + len(ids) - len(todo)
        report.stage_ms["writing"] = 1000.0 * run.write_seconds
    else:
        for sid in todo:
            recorder(shards[sid])
    report.seconds = time.perf_counter() - t0
    bar.close()
    return report


# Trace bytes per pool candidate per round on disk (zstd Parquet): 6.4 KB per 710-candidate
# round measured on pocket traces, 7 KB on synthetic ones; 10 leaves a margin.
BYTES_PER_CANDIDATE = 10


def record_bytes(out: Path, prompts: list[Prompt], settings: DecodeSettings,
                 prompts_per_shard: int, parallel: ParallelConfig) -> float:  # fmt: skip
    """About what recording the pending shards writes: per prompt, max_new_tokens / 2 rounds
    (a round emits at least one token; the pocket pair emits 4.4 on average) of
    BYTES_PER_CANDIDATE per pool candidate."""
    shards = plan_shards(prompts, settings, prompts_per_shard)
    store = trace_store(out)
    ids = part_of(list(shards), parallel.part, parallel.parts)
    n = sum(len(shards[sid]) for sid in ids if not store.is_done(sid))
    rounds = max(settings.decode.max_new_tokens // 2, 1)
    return n * rounds * pool_size(settings.pool) * BYTES_PER_CANDIDATE

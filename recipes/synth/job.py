"""`python -m decode.synth_traces`: write synthetic traces through the trace store.

One shard = `synth_job.prompts_per_shard` consecutive prompts, all rounds of
each, generated together (vectorised over rounds) from a generator seeded by
(seed, shard index): a shard's content never depends on which other shards
exist, so an interrupted run resumes by skipping finished shards and ends with
the same content fingerprint as an uninterrupted one.

Shard s is decoded at temperature `temperatures[s % len(temperatures)]`, and
prompt i has task `tasks[(i // 2) % len(tasks)]` so both halves of the even/odd
prompt split (docs/method.md#cross-fitting) see every task and temperature, and each task's halves
stay balanced (`rerank.fit.folds` refuses lopsided even/odd halves). The toy
prompts have no finer label: their category is their task.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import hydra
import numpy as np
import pyarrow as pa
from omegaconf import DictConfig, OmegaConf

from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.retained import Retained, retained_features
from recipes.synth.rounds import SynthRounds, synth_rounds
from specrank.settings.cli import exits_on_refusal
from specrank.settings.errors import Refusal
from specrank.settings.paths import CONF_DIR, project_path
from specrank.store.trace_schema import TRACE_SCHEMA, trace_store
from tree.config import PoolConfig, SelectConfig

log = logging.getLogger(__name__)
GENERATOR = "decode.synthetic/2"  # bump when the generator's output changes for a fixed config


def n_shards(job: SynthJobConfig) -> int:
    return -(-job.toy_prompts // job.prompts_per_shard)


def check_job(job: SynthJobConfig, seed: int) -> None:
    for name in ("toy_prompts", "rounds_per_prompt", "prompts_per_shard"):
        value = getattr(job, name)
        if not isinstance(value, int) or value < 1:
            raise Refusal(
                f"The 'synth_job.{name}' parameter must be an int >= 1. Got {value!r} instead."
            )
    if not job.temperatures:
        raise Refusal(
            f"'synth_job.temperatures' must list at least one temperature. Got {job.temperatures!r} instead."
        )
    if not job.tasks:
        raise Refusal(f"'synth_job.tasks' must list at least one task. Got {job.tasks!r} instead.")
    if not isinstance(seed, int) or seed < 0:
        raise Refusal(f"The 'seed' parameter must be an int >= 0. Got {seed!r} instead.")


def synth_chunk(
    shard_index: int,
    job: SynthJobConfig,
    pool: PoolConfig,
    select: SelectConfig,
    synth: SynthConfig,
    seed: int,
) -> pa.Table:
    """One shard's rounds as a trace table (TRACE_SCHEMA), in memory."""
    check_job(job, seed)
    if not 0 <= shard_index < n_shards(job):
        raise ValueError(f"shard_index must be in [0, {n_shards(job)}). Got {shard_index} instead.")
    rng = np.random.default_rng([seed, shard_index])
    first = shard_index * job.prompts_per_shard
    prompt_ids = np.arange(first, min(first + job.prompts_per_shard, job.toy_prompts))
    n_prompts, n_per = len(prompt_ids), job.rounds_per_prompt
    temperature = float(job.temperatures[shard_index % len(job.temperatures)])
    rounds = synth_rounds(rng, n_prompts * n_per, temperature, pool, select, synth)
    retained = retained_features(rng, rounds, n_prompts, synth)
    prompt_length = rng.integers(
        synth.prompt_length_min, synth.prompt_length_max + 1, size=n_prompts
    )
    emitted = (rounds.outcome.path_len + 1).reshape(n_prompts, n_per)
    tokens_before = np.cumsum(emitted, axis=1) - emitted  # exclusive: 0 at round 0
    ident = {
        "prompt_id": np.repeat(
            np.array([f"synth-{i:06d}" for i in prompt_ids], dtype=object), n_per
        ),
        "task": np.repeat(
            np.array([job.tasks[(i // 2) % len(job.tasks)] for i in prompt_ids], dtype=object),
            n_per,
        ),
        "round_index": np.tile(np.arange(n_per), n_prompts),
        "tokens_before": tokens_before.reshape(-1),
        "prompt_length": np.repeat(prompt_length, n_per),
    }
    return rounds_to_table(ident, temperature, select, rounds, retained)


def _list(values: np.ndarray, pa_type: pa.DataType, lengths=None, valid=None) -> pa.ListArray:
    """List column from a dense [R, W] matrix: each row's first `lengths` entries (all by default).

    Built from flat buffers with offsets; `from_pylist` is ~100x slower at this scale.
    """
    n, width = values.shape
    if lengths is None:
        flat, flat_valid = values.reshape(-1), None if valid is None else valid.reshape(-1)
        offsets = np.arange(n + 1, dtype=np.int64) * width
    else:
        keep = np.arange(width)[None, :] < lengths[:, None]
        flat, flat_valid = values[keep], None if valid is None else valid[keep]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise ValueError(
            f"a shard's list column has {offsets[-1]} values (> int32 offsets); use fewer prompts_per_shard"
        )
    arr = pa.array(flat, type=pa_type, mask=None if flat_valid is None else ~flat_valid)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), arr)


def _opt(values: np.ndarray, present: np.ndarray, pa_type: pa.DataType) -> pa.Array:
    return pa.array(values, type=pa_type, mask=~present)


def _ident_columns(
    ident: dict[str, np.ndarray], temperature: float, select: SelectConfig, n: int
) -> dict[str, pa.Array]:
    """Which prompt and round each row is, and the decoding settings it ran under."""
    i32 = pa.int32()
    return {
        "prompt_id": pa.array(ident["prompt_id"], pa.string()),
        "task": pa.array(ident["task"], pa.string()),
        "category": pa.array(ident.get("category", ident["task"]), pa.string()),
        "round_index": pa.array(ident["round_index"], i32),
        "tokens_before": pa.array(ident["tokens_before"], i32),
        "prompt_length": pa.array(ident["prompt_length"], i32),
        "temperature": pa.array(np.full(n, temperature, dtype=np.float32)),
        "rule": pa.array([select.rule] * n, pa.string()),
        "budget": pa.array(np.full(n, select.budget), i32),
    }


def _candidate_columns(rounds: SynthRounds) -> dict[str, pa.ListArray]:
    """The pool's candidates, one list entry per pool position."""
    g, f32, i32 = rounds.pool, pa.float32(), pa.int32()
    return {
        "cand_token": _list(g.token, i32),
        "cand_parent": _list(g.parent, pa.int16()),
        "cand_depth": _list(np.broadcast_to(rounds.depth, g.token.shape), pa.int8()),
        "cand_draft_logprob": _list(g.draft_logprob, f32),
        "cand_expanded": _list(g.expanded, pa.bool_()),
        "cand_target_prob": _list(rounds.target_prob, f32),
        "cand_scored": _list(rounds.scored, pa.bool_()),
        "cand_in_tree": _list(rounds.in_tree, pa.bool_()),
        "cand_target_argmax": _list(rounds.target_argmax, i32),
    }


def _root_and_outcome_columns(
    rounds: SynthRounds, root_p: np.ndarray, entropy: np.ndarray
) -> dict[str, pa.Array]:
    """The root row's summary and the round's verification outcome."""
    out, i32 = rounds.outcome, pa.int32()
    return {
        "root_argmax": pa.array(rounds.root_argmax, i32),
        "root_entropy": pa.array(entropy.astype(np.float32)),
        "root_top1_prob": pa.array(root_p.max(axis=-1)),
        "accepted_path": _list(out.path, pa.int16(), lengths=out.path_len),
        "continuation_token": pa.array(out.continuation, i32),
        "covered": pa.array(out.covered),
    }


def _retained_columns(r: Retained) -> dict[str, pa.Array]:
    """Retained-row features; a kind's columns are null where its row is absent."""
    f32, i32 = pa.float32(), pa.int32()
    cols = {}
    for kind in ("cache", "same", "prev", "matched"):
        cols[f"fl_{kind}_logprob"] = _list(r.fl_logprob[kind], f32, valid=r.fl_valid[kind])
    for name, agg in (("mean", r.fl_token_only_mean), ("max", r.fl_token_only_max)):
        cols[f"fl_token_only_{name}_logprob"] = _list(agg, f32, valid=~np.isnan(agg))
    cols["token_only_argmax"] = _list(r.token_only_argmax, i32, lengths=r.token_only_count)
    cols["cache_age"] = _opt(r.cache_age, r.present["cache"], i32)
    cols["prev_tree_root_count"] = _opt(r.prev_tree_root_count, r.has_prev_round, i32)
    for kind in ("cache", "same", "prev", "matched"):
        cols[f"{kind}_tv"] = _opt(r.tv[kind].astype(np.float32), r.present[kind], f32)
        cols[f"{kind}_argmax_agree"] = _opt(r.argmax_agree[kind], r.present[kind], pa.bool_())
        cols[f"{kind}_entropy"] = _opt(r.row_entropy[kind], r.present[kind], f32)
        cols[f"{kind}_top1_prob"] = _opt(r.row_top1[kind], r.present[kind], f32)
        cols[f"{kind}_argmax"] = _opt(r.row_argmax[kind], r.present[kind], i32)
    cols["token_only_tv"] = _list(
        r.token_only_tv.astype(np.float32), f32, lengths=r.token_only_count
    )
    cols["token_only_argmax_agree"] = _list(
        r.token_only_agree, pa.bool_(), lengths=r.token_only_count
    )
    return cols


def rounds_to_table(
    ident: dict[str, np.ndarray],
    temperature: float,
    select: SelectConfig,
    rounds: SynthRounds,
    retained: Retained,
) -> pa.Table:
    """Synthetic rounds as a trace table (TRACE_SCHEMA); stage timings are zero."""
    n = rounds.pool.token.shape[0]
    root_p = np.exp(rounds.root_logp)  # [R, V]
    with np.errstate(divide="ignore", invalid="ignore"):  # 0 * log 0 = nan -> 0
        entropy = -np.nansum(root_p * rounds.root_logp, axis=-1)
    zeros = np.zeros(n, dtype=np.float32)
    cols = _ident_columns(ident, temperature, select, n)
    cols["root_token"] = pa.array(retained.root_token, pa.int32())
    cols |= _candidate_columns(rounds)
    cols |= _root_and_outcome_columns(rounds, root_p, entropy)
    cols |= _retained_columns(retained)
    for stage in ("draft", "select", "verify", "bookkeeping"):
        cols[f"time_{stage}_ms"] = pa.array(zeros)
    cols["draft_confidence"] = pa.nulls(n, pa.float32())  # no drafter, no confidence head
    return pa.Table.from_pydict(cols, schema=TRACE_SCHEMA)


@dataclass
class SynthReport:
    rounds_written: int
    shards_written: int
    shards_skipped: int
    seconds: float
    fingerprint: str


def write_synthetic_traces(
    out: Path,
    job: SynthJobConfig,
    pool: PoolConfig,
    select: SelectConfig,
    synth: SynthConfig,
    seed: int,
) -> SynthReport:
    """Write (or resume) a synthetic trace store at `out`; finished shards are skipped."""
    check_job(job, seed)
    store = trace_store(out)
    config = {
        "generator": GENERATOR,
        "seed": seed,
        "synth": asdict(synth),
        "synth_job": asdict(job),
        "pool": asdict(pool),
        "select": asdict(select),
    }
    store.open_for_writing(config, models={"target": "synthetic", "drafter": "synthetic"})
    start = time.perf_counter()

    def logged(shard_id: str, table: pa.Table) -> None:
        log.info(
            "shard %s: %d rounds (%.1f s so far)",
            shard_id,
            table.num_rows,
            time.perf_counter() - start,
        )

    run = store.write_pending(
        [f"{s:05d}" for s in range(n_shards(job))],
        lambda shard_id: synth_chunk(int(shard_id), job, pool, select, synth, seed),
        after=logged,
    )
    return SynthReport(
        run.rows, run.written, run.skipped, time.perf_counter() - start, store.fingerprint()
    )


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="synth")
@exits_on_refusal
def main(cfg: DictConfig) -> None:
    out = project_path(cfg.paths.synthetic)
    report = write_synthetic_traces(
        out,
        job=OmegaConf.to_object(cfg.synth_job),
        pool=OmegaConf.to_object(cfg.pool),
        select=OmegaConf.to_object(cfg.select),
        synth=OmegaConf.to_object(cfg.synth),
        seed=cfg.seed,
    )
    log.info(
        "%s: wrote %d rounds in %d shards (%d already done) in %.1f s; fingerprint %s",
        out,
        report.rounds_written,
        report.shards_written,
        report.shards_skipped,
        report.seconds,
        report.fingerprint[:12],
    )

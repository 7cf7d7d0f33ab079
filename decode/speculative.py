"""The speculative tree decoder: one prompt, round by round, optionally recording traces.

    prefill : both models cache the prompt minus its last token; that token is round 0's root
    round   : draft  -> grow the pool below the root (drafter, one forward per depth level)
              select -> verified tree (B nodes) + scored set (tree, expanded, top-M)
              verify -> one target pass over root + scored set; outcome at every row;
                        accepted path; continuation (SPEC §3)
              commit -> caches keep root + accepted path; the continuation is the next root;
                        retained rows are kept for the next round (SPEC §5)

Host syncs per round: two. One after selection, because the scored set's size
fixes the verification batch's shape; one after verification, to learn the
accepted path (everything a trace row needs rides along with it).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from decode import retained as R
from decode.config import DecodeConfig, PoolConfig, SelectConfig
from decode.pool_growth import Pool, grow_pool, level_sizes
from decode.round_record import HostPool, round_trace_fields
from decode.tree_attention import compact_cache, forward_chain, new_cache
from decode.verify import (
    VERIFIERS,
    Selection,
    accepted_mask,
    law_temperature,
    outcome_eagle3,
    outcome_exhaustive,
    outcome_greedy,
    parent_rows,
    row_logprobs,
    select_tree,
    verification_pass,
)

STAGES = ("draft", "select", "verify", "bookkeeping")


@dataclass(frozen=True)
class DecodeSettings:
    """Everything that shapes a decoding run (typed config sections)."""

    pool: PoolConfig = field(default_factory=PoolConfig)
    select: SelectConfig = field(default_factory=SelectConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def check(self) -> None:
        level_sizes(self.pool)  # validates the pool settings
        if self.decode.temperature < 0:
            raise ValueError(
                f"The 'decode.temperature' must be >= 0. Got {self.decode.temperature} instead."
            )
        if self.decode.verifier not in VERIFIERS:
            raise ValueError(
                f"The 'decode.verifier' must be one of {list(VERIFIERS)}. Got {self.decode.verifier!r} instead."
            )
        if self.select.budget < 1:
            raise ValueError(
                f"The 'select.budget' must be an int >= 1. Got {self.select.budget} instead."
            )
        if self.decode.max_new_tokens < 1:
            raise ValueError(
                f"The 'decode.max_new_tokens' must be >= 1. Got {self.decode.max_new_tokens} instead."
            )


@dataclass
class StreamResult:
    output: list[int]  # emitted tokens (may run up to max depth past the limit, as in the paper)
    rounds: list[dict]  # trace rows (TRACE_SCHEMA), empty when not recording
    accepted: list[int]  # accepted draft tokens per round
    stage_ms: dict[str, float]  # total per stage, milliseconds (prefill not included)
    prefill_ms: float


def prompt_seed(seed: int, prompt_id: str) -> int:
    """A stable 63-bit seed per (run seed, prompt): same draws on resume and in any prompt order."""
    digest = hashlib.sha256(f"{seed}\x00{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class StageClock:
    """Per-stage wall time of one round. CUDA: events (no extra syncs); CPU: perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[object] = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def durations_ms(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [1000.0 * (b - a) for a, b in zip(self.marks, self.marks[1:], strict=False)]


@dataclass
class Stream:
    """Decoding state of one prompt (batch size 1)."""

    tokens: list[int]  # prompt + emitted; the last one is the root (not in either cache)
    n_prompt: int
    target_cache: DynamicCache
    drafter_cache: DynamicCache
    drafter_pending: list[int]  # committed tokens the drafter has not cached yet (root excluded)
    generator: torch.Generator | None
    row_cache: R.TokenKeyedCache | None = None
    prev: R.PrevRows | None = None


@torch.inference_mode()
def prefill(
    target: PreTrainedModel, drafter: PreTrainedModel, prompt: list[int], generator, record: bool
) -> Stream:
    """Cache the prompt minus its last token in both models; seed the token-keyed cache."""
    if not prompt:
        raise ValueError("prefill: the prompt has no tokens")
    dev = target.device
    ctx = torch.tensor(prompt[:-1], device=dev)
    tcache, dcache = new_cache(target), new_cache(drafter)
    row_cache = None
    if record:
        vocab = target.get_output_embeddings().out_features
        row_cache = R.TokenKeyedCache(vocab, dev, target.dtype)
    if len(prompt) > 1:
        if record:
            # Rows only at each distinct token's latest occurrence (logits_to_keep as
            # an index tensor): a full prompt's logits would be prompt x vocab.
            toks, pos = R.prompt_cache_rows(prompt[:-1])
            rows = forward_chain(
                target, ctx, tcache, logits_to_keep=torch.as_tensor(pos, device=dev)
            )
            row_cache.store(toks, rows, round_index=-1)
        else:
            forward_chain(target, ctx, tcache, logits_to_keep=1)
        forward_chain(drafter, ctx, dcache, logits_to_keep=1)
    return Stream(list(prompt), len(prompt), tcache, dcache, [], generator, row_cache)


def _outcomes(
    logits: Tensor,
    row_logp: Tensor,
    pool: Pool,
    sel: Selection,
    prow: Tensor,
    s: DecodeSettings,
    gen,
) -> Tensor:
    """The verifier's outcome token at every batch row. [1 + |Q|]."""
    if s.decode.temperature == 0:
        return outcome_greedy(logits)
    if s.decode.verifier == "exhaustive":
        return outcome_exhaustive(row_logp, gen)
    # Exactly min(B, P) tree nodes (top_b's contract), so a static-size nonzero needs no sync.
    n_tree = min(s.select.budget, pool.size)
    tree_idx = torch.nonzero_static(sel.in_tree, size=n_tree)[:, 0]  # [B] pool order
    return outcome_eagle3(row_logp, pool.token[tree_idx], prow[tree_idx], gen)


@dataclass
class RoundOutcome:
    emitted: list[int]  # accepted draft tokens + continuation
    n_accepted: int
    fields: (
        dict | None
    )  # the round's pool, root, outcome and retained columns; None if not recording
    stage_ms: list[float]  # per STAGES


@torch.inference_mode()
def speculative_round(
    stream: Stream,
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    s: DecodeSettings,
    round_index: int,
    record: bool,
) -> RoundOutcome:
    """One draft + verify round on `stream` (advanced in place)."""
    dev = target.device
    temp = s.decode.temperature
    clock = StageClock(dev)
    root = stream.tokens[-1]
    root_pos = len(stream.tokens) - 1  # = tokens already in the target cache

    # -- draft ------------------------------------------------------------------------------
    pending = torch.tensor([*stream.drafter_pending, root], device=dev)
    pool = grow_pool(drafter, stream.drafter_cache, pending, root_pos, s.pool)
    clock.mark()

    # -- select -----------------------------------------------------------------------------
    sel = select_tree(pool, s.select.rule, s.select.budget, s.select.top_m)
    scored_idx = sel.scored.nonzero()[:, 0]  # host sync 1: |Q| sizes the verification batch
    clock.mark()

    # -- verify -----------------------------------------------------------------------------
    root_t = torch.tensor([root], device=dev)
    logits = verification_pass(
        target, stream.target_cache, root_t, root_pos, pool, scored_idx
    )  # [1+|Q|, V]
    row_logp = row_logprobs(logits, temp)  # [1+|Q|, V] float32 at the law temperature
    prow = parent_rows(pool, sel)  # [P]
    outcome = _outcomes(logits, row_logp, pool, sel, prow, s, stream.generator)  # [1+|Q|]
    accepted = accepted_mask(pool, sel.in_tree, prow, outcome)  # [P]
    clock.mark()

    # -- bookkeeping ------------------------------------------------------------------------
    stats = None
    if record:
        first_level = pool.token[: pool.n_first]  # [n1] first-level candidates
        stats = R.retained_stats(
            stream.row_cache,
            stream.prev,
            root,
            logits[0],
            first_level,
            law_temperature(temp),
            round_index,
        )
    # Host sync 2: the outcome; the rest are small copies of finished tensors.
    acc_np = accepted.cpu().numpy()
    outcome_np = outcome.cpu().numpy()
    host = HostPool.from_device(pool, sel)
    path = np.flatnonzero(acc_np)  # pool order = depth order along a path
    last_row = int(host.batch_row[path[-1]]) if path.size else 0
    cont = int(outcome_np[last_row])
    emitted = [*host.token[path].tolist(), cont]

    # Caches keep the root and the accepted path; the continuation becomes the next root.
    compact_cache(
        stream.target_cache, root_pos + 1, [root_pos + int(host.batch_row[a]) for a in path]
    )
    # Accepted nodes the drafter cached (expanded ones: a prefix of the path); the rest are pending.
    in_drafter = path[host.expanded[path]]
    compact_cache(stream.drafter_cache, root_pos + 1, host.drafter_pos[in_drafter].tolist())
    stream.drafter_pending = host.token[path[~host.expanded[path]]].tolist()

    fields = None
    if record:
        fields, stream.prev = round_trace_fields(
            stream.tokens[-1],
            stream.row_cache,
            pool,
            sel,
            host,
            logits,
            row_logp,
            prow,
            path,
            cont,
            stats,
            round_index,
        )
    stream.tokens.extend(emitted)
    clock.mark()
    return RoundOutcome(emitted, int(path.size), fields, clock.durations_ms())


def output_is_done(
    output: list[int], emitted: list[int], eos_ids: frozenset[int], max_new_tokens: int
) -> bool:
    """Stop after the round that emits EOS or brings the output to `max_new_tokens`."""
    return any(t in eos_ids for t in emitted) or len(output) >= max_new_tokens


def check_positions(
    target: PreTrainedModel, drafter: PreTrainedModel, n_prompt: int, s: DecodeSettings
) -> None:
    """Refuse runs whose positions would pass a model's trained range (rotary models go on silently)."""
    depth = len(level_sizes(s.pool))
    need = (
        n_prompt + s.decode.max_new_tokens + depth
    )  # the last round may overshoot by the tree depth
    for name, m in (("target", target), ("drafter", drafter)):
        limit = getattr(m.config, "max_position_embeddings", None)
        if limit is not None and need > limit:
            raise ValueError(
                f"model.{name}: a {n_prompt}-token prompt + decode.max_new_tokens="
                f"{s.decode.max_new_tokens} + depth {depth} needs {need} positions, "
                f"but the model has max_position_embeddings={limit}"
            )


def decode_stream(
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    prompt: list[int],
    s: DecodeSettings,
    eos_ids: frozenset[int],
    prompt_id: str = "0",
    task: str = "",
    record: bool = False,
) -> StreamResult:
    """Decode one prompt speculatively until EOS or the length limit (after that round)."""
    s.check()
    check_positions(target, drafter, len(prompt), s)
    generator = None
    if s.decode.temperature > 0:
        generator = torch.Generator(device=target.device).manual_seed(
            prompt_seed(s.decode.seed, prompt_id)
        )
    t0 = time.perf_counter()
    stream = prefill(target, drafter, prompt, generator, record)
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    prefill_ms = 1000.0 * (time.perf_counter() - t0)

    output: list[int] = []
    rows: list[dict] = []
    accepted: list[int] = []
    totals = dict.fromkeys(STAGES, 0.0)
    round_index = 0
    while True:
        before = len(output)
        r = speculative_round(stream, target, drafter, s, round_index, record)
        output.extend(r.emitted)
        accepted.append(r.n_accepted)
        for name, ms in zip(STAGES, r.stage_ms, strict=True):
            totals[name] += ms
        if record:
            row = {
                "prompt_id": prompt_id,
                "task": task,
                "round_index": round_index,
                "tokens_before": before,
                "prompt_length": len(prompt),
                "temperature": s.decode.temperature,
                "rule": s.select.rule,
                "budget": s.select.budget,
                **r.fields,
            }
            for name, ms in zip(STAGES, r.stage_ms, strict=True):
                row[f"time_{name}_ms"] = ms
            rows.append(row)
        round_index += 1
        if output_is_done(output, r.emitted, eos_ids, s.decode.max_new_tokens):
            break
    return StreamResult(output, rows, accepted, totals, prefill_ms)

"""A prompt's decoding state and what every round shares: settings, prefill, clocks, stopping.

    prefill : both models cache the prompt minus its last token; that token is round 0's root;
              with retained rows, the token-keyed cache is seeded from the prompt (docs/method.md#retained-rows).
              A drafter that drafts from the target's first token (`first_from_target`: the
              block kinds, as DFlash's reference does) instead has the target cache the whole
              prompt and draw its first token from the last row; that token is round 0's root

The round itself is `decode.round`; the loop over rounds is `decode.loop`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from pairs.block.drafter import BlockDrafter, BlockState
from pairs.eagle3.pool import Eagle3State
from pairs.models import STATE_DRAFTERS, Drafter
from pairs.positions import limits_of, needed_positions
from specrank.settings.checks import check_choice, check_int, check_real
from specrank.settings.errors import Refusal
from tree import retained as R
from tree.attention import draft_cache, forward_chain, new_cache
from tree.config import DecodeConfig, PoolConfig, SelectConfig
from tree.pool import DraftDraw, level_sizes, pool_size
from tree.root_pass import draw_root
from tree.verify import VERIFIERS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeSettings:
    """Everything that shapes a decoding run (typed config sections)."""

    pool: PoolConfig = field(default_factory=PoolConfig)
    select: SelectConfig = field(default_factory=SelectConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def check(self) -> None:
        """Every decode setting, before any model loads (specrank.settings.checks messages)."""
        n_pool = pool_size(self.pool)  # validates the pool settings
        check_real("decode.temperature", self.decode.temperature, 0.0)
        check_draft_temperature(self.decode)
        check_choice("decode.verifier", self.decode.verifier, VERIFIERS)
        if self.decode.verifier == "coupling" and self.pool.top_k != 1:
            raise Refusal(
                f"decode.verifier=coupling verifies a chain (one child a node: pool.top_k=1); "
                f"got pool.top_k={self.pool.top_k}. Use exhaustive or eagle3 for trees"
            )
        check_int("select.budget", self.select.budget, 1, n_pool)
        check_int("select.record_top_m", self.select.record_top_m, 0)  # M past the pool: all of it
        check_int("decode.max_new_tokens", self.decode.max_new_tokens, 1)
        check_int("decode.seed", self.decode.seed)


def check_draft_temperature(dec: DecodeConfig) -> None:
    """`decode.draft_temperature`: null, or a temperature; sampled drafts need a sampled law."""
    t_d = dec.draft_temperature
    if t_d is None:
        return
    check_real("decode.draft_temperature", t_d, 0.0)
    if t_d > 0 and dec.temperature == 0:
        raise Refusal(
            f"decode.draft_temperature={t_d:g} with decode.temperature=0: sampled drafting is "
            "the pair 1|1 of a sampled law; under greedy verification use 0 or null (0|0)"
        )


def draft_draw(dec: DecodeConfig, prompt_id: str, device) -> DraftDraw | None:
    """The sampled-drafting generator of a prompt (T_d > 0), seeded apart from the target's
    draws, so that those stay the same stream whatever the drafter draws."""
    if not dec.draft_temperature:
        return None
    seed = prompt_seed(dec.seed, f"{prompt_id}\x00draft")
    gen = torch.Generator(device=device).manual_seed(seed)
    return DraftDraw(dec.draft_temperature, gen, keep_rows=dec.verifier == "coupling")


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
    # the prompt's length: tokens[n_prompt:] is the output, which a first_from_target
    # drafter's prefill starts with the target's first token
    n_prompt: int
    target_cache: DynamicCache
    drafter_cache: DynamicCache
    drafter_pending: list[int]  # committed tokens the drafter has not cached yet (root excluded)
    generator: torch.Generator | None
    row_cache: R.TokenKeyedCache | None = None
    prev: R.PrevRows | None = None
    # model.drafter_kind=eagle3|block: the drafter's state beside the target's cache (an
    # EAGLE-3 head's cache = drafter_cache, and the target's aux states; a block drafter's
    # context and the target's states; pairs.models.STATE_DRAFTERS)
    # states; drafter_pending stays empty (the head's pending pairs follow from `tokens`)
    drafter_state: Eagle3State | BlockState | None = None


@torch.inference_mode()
def prefill(
    target: PreTrainedModel,
    drafter: Drafter,
    prompt: list[int],
    generator,
    record: bool,
    temperature: float = 0.0,
) -> Stream:
    """Cache the prompt minus its last token in both models; seed the token-keyed cache.

    An EAGLE-3 head instead takes the target's aux states of prompt[:-1] from the target's
    prefill and caches every pair but the last (`pairs.eagle3.drafter.Eagle3Drafter.prefill`).
    A drafter with `first_from_target` (the block kinds) drafts its first block from the
    target's first token with the whole prompt as context, as its reference does: the target
    caches the whole prompt and that token, drawn from the last row at `temperature` with
    `generator`, is appended (the stream's first output token, emitted before any round).
    """
    if not prompt:
        raise ValueError("prefill: the prompt has no tokens")
    dev = target.device
    whole = getattr(drafter, "first_from_target", False)
    cached = prompt if whole else prompt[:-1]
    ctx = torch.tensor(cached, device=dev)
    tcache = new_cache(target)
    state = drafter.new_state(tcache) if isinstance(drafter, STATE_DRAFTERS) else None
    dcache = draft_cache(drafter) if state is None else state.cache
    row_cache = None
    if record:
        vocab = target.get_output_embeddings().out_features
        row_cache = R.TokenKeyedCache(vocab, dev, target.dtype)
    last = None  # the target's row after the whole prompt (first_from_target only)
    if cached:
        if record:
            # Rows only at each distinct token's latest occurrence (logits_to_keep as
            # an index tensor): a full prompt's logits would be prompt x vocab.
            toks, pos = R.prompt_cache_rows(cached)
            rows = forward_chain(
                target, ctx, tcache, logits_to_keep=torch.as_tensor(pos, device=dev)
            )
            row_cache.store(toks, rows, round_index=-1)
            if whole:  # the last token's latest occurrence is the last position
                last = rows[int((pos == len(cached) - 1).nonzero()[0][0])][None]
        else:
            last = forward_chain(target, ctx, tcache, logits_to_keep=1)
        if state is None:
            forward_chain(drafter, ctx, dcache, logits_to_keep=1)
    if state is not None:
        drafter.prefill(state, prompt)
    tokens = list(prompt)
    if whole:
        tokens.append(int(draw_root(last, temperature, generator)))
    return Stream(
        tokens, len(prompt), tcache, dcache, [], generator, row_cache, drafter_state=state
    )


def output_is_done(
    output: list[int], emitted: list[int], eos_ids: frozenset[int], max_new_tokens: int
) -> bool:
    """Stop after the round that emits EOS or brings the output to `max_new_tokens`."""
    return any(t in eos_ids for t in emitted) or len(output) >= max_new_tokens


def check_positions(
    target: PreTrainedModel, drafter: Drafter, n_prompt: int, s: DecodeSettings
) -> None:
    """Refuse a prompt whose run would pass a hard position limit (`pairs.positions`), or a
    pool deeper than a block drafter's block; past an EAGLE-3 head's configured length,
    warn once per drafter and decode on. Once per prompt, before its first round."""
    if isinstance(drafter, BlockDrafter):  # its rows cover depths 1 .. a block's reach
        drafter.check_pool(s.pool, "model.drafter")
    head = isinstance(drafter, STATE_DRAFTERS)  # its own position table: a soft limit
    limits = limits_of(target.config, drafter.config, head, head and drafter.strict_positions)
    depth = len(level_sizes(s.pool))
    need = needed_positions(n_prompt, s.decode.max_new_tokens, s.pool)
    warnings = limits.check(n_prompt, need, s.decode.max_new_tokens, depth)
    if warnings and not drafter.positions_warned:
        drafter.positions_warned = True
        for w in warnings:
            log.warning(w)

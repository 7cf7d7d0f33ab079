"""Decode one prompt: prefill, then `decode.round.decode_round` until EOS or the limit.

The one loop behind `decode.record` (rule=draft, run.score=record, record=True)
and `decode.run` (any rule); a recorded round's trace row is assembled here.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from decode.round import STAGES, OnlineStream, RoundRecord, decode_round
from decode.settings import OnlineSettings, levels_of
from decode.stream import check_positions, draft_draw, output_is_done, prefill, prompt_seed
from pairs.models import Drafter
from rerank.serving import OnlinePredictor
from tree.round_record import RoundContext


@dataclass
class PromptRun:
    output: list[int]
    rounds: list[RoundRecord]
    prefill_ms: float
    total_ms: float  # prefill start to the last commit (device work included)


# -- one prompt ------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_prompt(
    target: PreTrainedModel,
    drafter: Drafter,
    prompt: list[int],
    s: OnlineSettings,
    eos_ids: frozenset[int],
    prompt_id: str = "0",
    task: str = "",
    predictor: OnlinePredictor | None = None,
    keep_features: bool = False,
    category: str | None = None,
) -> PromptRun:
    """Decode one prompt until EOS or the length limit (after that round).

    `task` and `category` (default: the task) label the prompt's trace rows.
    """
    s.check()
    if s.entry.predictor and predictor is None:
        raise ValueError("run.rule=reranker needs a loaded reranker (run.reranker)")
    check_positions(target, drafter, len(prompt), s.base)
    dec, dev = s.base.decode, target.device
    generator = None
    if dec.temperature > 0:
        seed = prompt_seed(dec.seed, prompt_id)
        generator = torch.Generator(device=dev).manual_seed(seed)
    rows_needed = s.record or (s.entry.predictor and predictor.uses_rows)
    levels = levels_of(s.base)
    _sync(dev)
    t0 = time.perf_counter()
    stream = prefill(target, drafter, prompt, generator, rows_needed, dec.temperature)
    st = OnlineStream(stream, task, draft_draw=draft_draw(dec, prompt_id, dev))
    _sync(dev)
    prefill_ms = 1000.0 * (time.perf_counter() - t0)
    # a block kind's prefill emits the target's first token (`decode.stream.prefill`)
    output: list[int] = stream.tokens[len(prompt) :]
    rounds: list[RoundRecord] = []
    done = bool(output) and output_is_done(output, output, eos_ids, dec.max_new_tokens)
    for round_index in itertools.count() if not done else ():
        ctx = RoundContext(root=st.stream.tokens[-1], prompt_length=len(prompt),
                           round_index=round_index, tokens_before=len(output),
                           prev_accepted=st.prev_accepted)  # fmt: skip
        r = decode_round(st, target, drafter, s, levels, ctx, predictor, rows_needed, keep_features)
        if r.fields is not None:
            r.fields = _trace_row(r, ctx, prompt_id, task, category or task, s)
        output.extend(r.emitted)
        rounds.append(r)
        if output_is_done(output, r.emitted, eos_ids, dec.max_new_tokens):
            break
    _sync(dev)
    return PromptRun(output, rounds, prefill_ms, 1000.0 * (time.perf_counter() - t0))


def _trace_row(
    r: RoundRecord, ctx: RoundContext, prompt_id: str, task: str, category: str,
    s: OnlineSettings,
) -> dict:  # fmt: skip
    """A full trace row (TRACE_SCHEMA): identity, the round's fields, stage times."""
    ms = dict(zip(STAGES, r.stage_ms, strict=True))
    return {
        "prompt_id": prompt_id,
        "task": task,
        "category": category,
        "round_index": ctx.round_index,
        "tokens_before": ctx.tokens_before,
        "prompt_length": ctx.prompt_length,
        "temperature": s.base.decode.temperature,
        "rule": s.rule,
        "budget": s.base.select.budget,
        **r.fields,
        # The schema's four stages: target passes count as verify, features as select.
        "time_draft_ms": ms["draft"],
        "time_select_ms": ms["features"] + ms["select"],
        "time_verify_ms": ms["root_pass"] + ms["verify"],
        "time_bookkeeping_ms": ms["bookkeeping"],
    }

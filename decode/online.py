"""The online decoder: one prompt, round by round, with the selection rule of `run.rule`.

    draft     -> grow the pool below the root                                  (drafter)
    root pass -> root-pass rules only: the root row from a one-token target pass
    features  -> rule=reranker only: first-level features -> log phat           (host)
    select    -> the verified tree T and the scored set Q (T, or T + expanded + top-M)
    verify    -> one target pass over Q (the root too, unless already cached);
                 outcome at every row; accepted path; continuation (SPEC §3)
    commit    -> caches keep root + accepted path; retained rows; trace fields

It reuses the recorder's pieces (`decode.speculative`, `decode.verify`,
`decode.round_record`), so with rule=draft and run.score=pool a round is
exactly `decode.speculative.speculative_round` (tests hold them equal).
Host syncs per round: one after selection (|Q| sizes the pass; the reranker
adds one for the features), one after verification.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedModel

from decode import retained as R
from decode import root_pass as RP
from decode.online_rerank import (
    OnlinePredictor,
    RoundContext,
    reranker_first_factor,
    update_retained,
)
from decode.pool_growth import Pool, grow_pool, level_sizes
from decode.round_record import HostPool, round_trace_fields
from decode.run_config import RUN_RULES, SCORE_MODES
from decode.select import Levels
from decode.speculative import (
    DecodeSettings,
    StageClock,
    Stream,
    check_positions,
    output_is_done,
    prefill,
    prompt_seed,
)
from decode.tree_attention import compact_cache
from decode.verify import (
    Selection,
    accepted_mask,
    law_temperature,
    outcome_eagle3,
    outcome_exhaustive,
    outcome_greedy,
    parent_rows,
    row_logprobs,
    verification_pass,
)

STAGES = ("draft", "root_pass", "features", "select", "verify", "bookkeeping")


@dataclass(frozen=True)
class OnlineSettings:
    """A decoding run: the shared decode settings plus the rule and what each pass scores."""

    base: DecodeSettings = field(default_factory=DecodeSettings)
    rule: str = "draft"
    score: str = "tree"  # tree | pool (see decode.run_config)
    record: bool = False  # build trace rows (TRACE_SCHEMA) for every round

    def check(self) -> None:
        self.base.check()
        if self.rule not in RUN_RULES:
            raise ValueError(
                f"The 'run.rule' must be one of {list(RUN_RULES)}. Got {self.rule!r} instead."
            )
        if self.score not in SCORE_MODES:
            raise ValueError(
                f"The 'run.score' must be one of {list(SCORE_MODES)}. Got {self.score!r} instead."
            )
        if self.record and self.score != "pool":
            raise ValueError(
                "run.record_traces=true needs run.score=pool: a trace row holds the target "
                "probability of every pool edge, which only a pass over the expanded nodes gives"
            )
        if self.record and self.rule == "covering":
            raise ValueError(
                "run.record_traces=true is not supported for run.rule=covering (its rounds "
                "emit a tree leaf as the continuation, which the trace schema cannot express)"
            )


def levels_of(s: DecodeSettings) -> Levels:
    """Pool-order index ranges of depths 1, 2, ...: fixed by the pool config (no device sync)."""
    bounds = [0, *itertools.accumulate(n for n, _ in level_sizes(s.pool))]
    return list(itertools.pairwise(bounds))


@dataclass
class RoundRecord:
    """What one round did, in host terms."""

    emitted: list[int]  # accepted tokens + continuation
    n_accepted: int  # pool nodes accepted (a draw rule's X1 included)
    value: int  # realized value in the offline sense (draw rules count the draw)
    tree_size: int  # nodes of the verified tree
    passes: int  # target passes this round
    covered: bool  # covering decoder: the next root row came from this pass
    root_entropy: float  # nats, root row at the law temperature (T=1 at T=0)
    stage_ms: list[float]  # per STAGES
    first_logprob: np.ndarray | None = None  # rule=reranker: log phat of the first level
    features: dict | None = None  # rule=reranker with keep_features: the round's features
    fields: dict | None = None  # trace columns when recording


@dataclass
class PromptRun:
    output: list[int]
    rounds: list[RoundRecord]
    prefill_ms: float
    total_ms: float  # prefill start to the last commit (device work included)


@dataclass
class OnlineStream:
    stream: Stream
    task: str
    prev_accepted: int | None = None
    held_row: Tensor | None = None  # covering: the root's row, from the previous pass [V]


# -- stages ---------------------------------------------------------------------------------------


def select(
    rule: str,
    pool: Pool,
    budget: int,
    levels: Levels,
    first_logprob: Tensor | None,
    draw: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(rank, in_tree, draft_rank), each [P]: the rule's ranking and verified tree."""
    draft_rank = RP.rank_of(pool.score)
    if rule in ("reranker", "root"):
        rank = RP.rank_of(RP.factor_scores(pool, first_logprob, levels))
        return rank, rank < budget, draft_rank
    if draw is not None and rule != "root":  # draw rules; covering after a covered round
        draw_rule = "root_draw" if rule == "covering" else rule
        tree = RP.draw_tree(pool, draw_rule, draw, pool.score, draft_rank, budget, levels)
        return draft_rank, tree, draft_rank
    return draft_rank, draft_rank < budget, draft_rank  # draft; covering otherwise


def outcomes(
    logits: Tensor, row_logp: Tensor, pool: Pool, in_tree: Tensor, n_tree: int, prow: Tensor,
    s: DecodeSettings, gen: torch.Generator | None,
) -> Tensor:  # fmt: skip
    """The verifier's outcome token at every batch row. [1 + |Q|] (as decode.speculative)."""
    if s.decode.temperature == 0:
        return outcome_greedy(logits)
    if s.decode.verifier == "exhaustive":
        return outcome_exhaustive(row_logp, gen)
    tree_idx = torch.nonzero_static(in_tree, size=n_tree)[:, 0]  # [n_tree] pool order
    return outcome_eagle3(row_logp, pool.token[tree_idx], prow[tree_idx], gen)


def scored_set(
    s: OnlineSettings, pool: Pool, in_tree: Tensor, draft_rank: Tensor, draw: Tensor | None
) -> Tensor:
    """Q: the prefixes the tree pass scores. [P] bool.

    pool mode: the recorder's set, tree + expanded + the draft top-M (every pool edge's
    target probability). tree mode: the tree alone, and nothing when the draw X1 labels
    no first-level tree node (the tree is then of no use: X1 is the continuation).
    """
    if s.score == "pool":
        return in_tree | pool.expanded | (draft_rank < s.base.select.top_m)
    if draw is None:
        return in_tree
    n1 = pool.n_first
    return in_tree & (in_tree[:n1] & (pool.token[:n1] == draw)).any()


def target_logits(
    target: PreTrainedModel, stream: Stream, pool: Pool, scored: Tensor, n_scored: int,
    root_logits: Tensor | None,
) -> Tensor:  # fmt: skip
    """Rows [1 + |Q|, V]: the root's, then each scored prefix's (pool order).

    The root row comes from the batch (draft/reranker/covering without a held row)
    or is known already (root pass, held row); with nothing scored, no pass runs.
    """
    if n_scored == 0:
        return root_logits
    root_pos = len(stream.tokens) - 1
    scored_idx = torch.nonzero_static(scored, size=n_scored)[:, 0]  # [|Q|]
    if root_logits is None:
        root_t = torch.tensor([stream.tokens[-1]], device=target.device)
        return verification_pass(target, stream.target_cache, root_t, root_pos, pool, scored_idx)
    tree = RP.cached_root_tree_pass(target, stream.target_cache, root_pos, pool, scored_idx)
    return torch.cat([root_logits, tree])


def commit_caches(stream: Stream, host: HostPool, path: np.ndarray, leaf: int | None) -> None:
    """Both caches keep the root and the accepted path (target: and an emitted leaf)."""
    root_pos = len(stream.tokens) - 1
    keep = [root_pos + int(host.batch_row[a]) for a in path]
    if leaf is not None:
        keep.append(root_pos + int(host.batch_row[leaf]))  # its KV: the next root is cached
    compact_cache(stream.target_cache, root_pos + 1, keep)
    # Accepted nodes the drafter cached (expanded ones: a prefix of the path); the rest are pending.
    in_drafter = path[host.expanded[path]]
    compact_cache(stream.drafter_cache, root_pos + 1, host.drafter_pos[in_drafter].tolist())
    stream.drafter_pending = host.token[path[~host.expanded[path]]].tolist()


# -- one round ------------------------------------------------------------------------------------


@torch.inference_mode()
def online_round(
    st: OnlineStream,
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    s: OnlineSettings,
    levels: Levels,
    ctx: RoundContext,
    predictor: OnlinePredictor | None,
    rows_needed: bool,
    keep_features: bool = False,
) -> RoundRecord:
    """One round on `st` (advanced in place)."""
    stream, dec = st.stream, s.base
    dev, temp, budget = target.device, dec.decode.temperature, dec.select.budget
    clock = StageClock(dev)
    root = stream.tokens[-1]
    root_pos = len(stream.tokens) - 1  # = committed tokens before the root

    # -- draft ------------------------------------------------------------------------------
    pending = torch.tensor([*stream.drafter_pending, root], device=dev)
    pool = grow_pool(drafter, stream.drafter_cache, pending, root_pos, dec.pool)
    clock.mark()

    # -- root pass (root-pass rules; covering reuses a held row) -----------------------------
    root_logits = None  # [1, V]: set when the root's row is known before selection
    if s.rule in RP.ROOT_PASS_RULES:
        root_logits = RP.root_pass(target, stream.target_cache, root)
    elif st.held_row is not None:
        root_logits = st.held_row[None]
    passes = int(s.rule in RP.ROOT_PASS_RULES)
    clock.mark()

    # -- features + predict (reranker) ------------------------------------------------------
    first, feats = None, None
    if s.rule == "reranker":
        law_t = law_temperature(temp)
        first, feats = reranker_first_factor(
            stream, st.task, pool, predictor, ctx, law_t, rows_needed
        )
    elif s.rule == "root":
        first = RP.root_first_factor(root_logits, pool.token[: pool.n_first], temp)
    clock.mark()

    # -- select ---------------------------------------------------------------------------------
    draw = None if root_logits is None else RP.draw_root(root_logits, temp, stream.generator)
    rank, in_tree, draft_rank = select(s.rule, pool, budget, levels, first, draw)
    scored = scored_set(s, pool, in_tree, draft_rank, draw)
    batch_row = torch.where(scored, scored.long().cumsum(0), -1)  # root is row 0
    n_scored, n_tree = torch.stack([scored.sum(), in_tree.sum()]).tolist()  # host sync 1
    if n_scored == 0:  # nothing to verify: X1 is the continuation, the round's tree is empty
        in_tree, n_tree = torch.zeros_like(in_tree), 0
    sel = Selection(rank, in_tree, scored, batch_row)
    clock.mark()

    # -- verify ---------------------------------------------------------------------------------
    logits = target_logits(target, stream, pool, scored, n_scored, root_logits)  # [1 + |Q|, V]
    passes += int(n_scored > 0)
    row_logp = row_logprobs(logits, temp)  # [1 + |Q|, V] float32
    prow = parent_rows(pool, sel)  # [P]
    if n_scored == 0:
        outcome, accepted = draw, torch.zeros_like(in_tree)  # [1], [P]
    else:
        outcome = outcomes(logits, row_logp, pool, in_tree, n_tree, prow, dec, stream.generator)
        if draw is not None:
            outcome[0] = draw[0]  # the first draw was made from the root row already
        accepted = accepted_mask(pool, in_tree, prow, outcome)  # [P]
    clock.mark()

    # -- bookkeeping ----------------------------------------------------------------------------
    stats = None
    if s.record:
        stats = R.retained_stats(
            stream.row_cache, stream.prev, root, logits[0], pool.token[: pool.n_first],
            law_temperature(temp), ctx.round_index,
        )  # fmt: skip
    entropy = -(row_logp[0].exp() * row_logp[0]).nan_to_num(0.0, 0.0, 0.0).sum()
    leaves = RP.tree_leaves(pool, in_tree) if s.rule == "covering" else in_tree  # [P]
    small = torch.stack([accepted, leaves]).cpu().numpy()  # host sync 2
    outcome_np = outcome.cpu().numpy()
    host = HostPool.from_device(pool, sel)
    path = np.flatnonzero(small[0])  # pool order = depth order along a path
    last_row = int(host.batch_row[path[-1]]) if path.size else 0
    cont = int(outcome_np[last_row])
    leaf = None
    if s.rule == "covering" and path.size and small[1][path[-1]]:
        leaf, path = int(path[-1]), path[:-1]  # sampled-leaf: the leaf is the continuation
        cont = int(host.token[leaf])
    emitted = [*host.token[path].tolist(), cont]

    commit_caches(stream, host, path, leaf)
    st.held_row = None if leaf is None else logits[int(host.batch_row[leaf])].clone()

    fields = None
    if s.record:
        fields, stream.prev = round_trace_fields(
            root, stream.row_cache, pool, sel, host, logits, row_logp, prow, path, cont, stats,
            ctx.round_index,
        )  # fmt: skip
    elif rows_needed:
        update_retained(stream, host, path, cont, logits, ctx.round_index)
    stream.tokens.extend(emitted)
    st.prev_accepted = int(path.size)
    clock.mark()
    in_first = draw is not None and path.size > 0
    value = int(path.size) + int(s.rule in RP.DRAW_RULES and not in_first)  # the draw counts
    return RoundRecord(
        emitted=emitted,
        n_accepted=int(path.size),
        value=value,
        tree_size=n_tree,
        passes=passes,
        covered=leaf is not None,
        root_entropy=float(entropy),
        stage_ms=clock.durations_ms(),
        first_logprob=None if s.rule != "reranker" else first.float().cpu().numpy(),
        features=feats if keep_features else None,
        fields=fields,
    )


# -- one prompt ------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_prompt(
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    prompt: list[int],
    s: OnlineSettings,
    eos_ids: frozenset[int],
    prompt_id: str = "0",
    task: str = "",
    predictor: OnlinePredictor | None = None,
    keep_features: bool = False,
) -> PromptRun:
    """Decode one prompt until EOS or the length limit (after that round)."""
    s.check()
    if s.rule == "reranker" and predictor is None:
        raise ValueError("run.rule=reranker needs a loaded reranker (run.reranker)")
    check_positions(target, drafter, len(prompt), s.base)
    dec, dev = s.base.decode, target.device
    generator = None
    if dec.temperature > 0:
        seed = prompt_seed(dec.seed, prompt_id)
        generator = torch.Generator(device=dev).manual_seed(seed)
    rows_needed = s.record or (s.rule == "reranker" and predictor.uses_rows)
    levels = levels_of(s.base)
    _sync(dev)
    t0 = time.perf_counter()
    st = OnlineStream(prefill(target, drafter, prompt, generator, rows_needed), task)
    _sync(dev)
    prefill_ms = 1000.0 * (time.perf_counter() - t0)
    output: list[int] = []
    rounds: list[RoundRecord] = []
    for round_index in itertools.count():
        ctx = RoundContext(root=st.stream.tokens[-1], prompt_length=len(prompt),
                           round_index=round_index, tokens_before=len(output),
                           prev_accepted=st.prev_accepted)  # fmt: skip
        r = online_round(st, target, drafter, s, levels, ctx, predictor, rows_needed, keep_features)
        if r.fields is not None:
            r.fields = _trace_row(r, ctx, prompt_id, task, s)
        output.extend(r.emitted)
        rounds.append(r)
        if output_is_done(output, r.emitted, eos_ids, dec.max_new_tokens):
            break
    _sync(dev)
    return PromptRun(output, rounds, prefill_ms, 1000.0 * (time.perf_counter() - t0))


def _trace_row(
    r: RoundRecord, ctx: RoundContext, prompt_id: str, task: str, s: OnlineSettings
) -> dict:
    """A full trace row (TRACE_SCHEMA): identity, the round's fields, stage times."""
    ms = dict(zip(STAGES, r.stage_ms, strict=True))
    return {
        "prompt_id": prompt_id,
        "task": task,
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

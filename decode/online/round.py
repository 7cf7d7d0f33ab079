"""One decoding round, as small steps composed once (gpt-fast's `generate.py` shape).

    draft     -> grow the pool below the root                                  (drafter)
    root pass -> root-pass rules only: the root row from a one-token target pass
    features  -> rule=reranker only: first-level features -> log phat           (host)
    select    -> the verified tree T and the scored set Q (T, or T + expanded + top-M)
    verify    -> one target pass over Q (the root too, unless already known);
                 outcome at every row; accepted path; continuation (SPEC §3)
    commit    -> caches keep root + accepted path; retained rows; trace fields

Recording (`decode.record`) is this round with rule=draft, score=pool and
record=True; online runs (`decode.run`) choose the rule and what a pass scores.
Host syncs per round: one after selection (|Q| sizes the pass; the reranker
adds one for the features), one after verification.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedModel

from decode.online.config import RUN_RULES, SCORE_MODES
from decode.online.reranker import reranker_first_factor
from decode.online.stream import DecodeSettings, StageClock, Stream
from decode.select.ranking import Levels
from decode.tree import retained as R
from decode.tree import root_pass as RP
from decode.tree.attention import compact_cache
from decode.tree.pool import Pool, grow_pool, level_sizes
from decode.tree.round_record import HostPool, retain_rows, round_rows, round_trace_fields
from decode.tree.verify import (
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
from features.online import RoundContext
from rerank.online import OnlinePredictor

STAGES = ("draft", "root_pass", "features", "select", "verify", "bookkeeping")


@dataclass(frozen=True)
class OnlineSettings:
    """A decoding run: the shared decode settings plus the rule and what each pass scores."""

    base: DecodeSettings = field(default_factory=DecodeSettings)
    rule: str = "draft"
    score: str = "tree"  # tree | pool (see decode.online.config)
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
class OnlineStream:
    stream: Stream
    task: str
    prev_accepted: int | None = None
    held_row: Tensor | None = None  # covering: the root's row, from the previous pass [V]


# -- steps ----------------------------------------------------------------------------------------


def root_row(st: OnlineStream, target: PreTrainedModel, rule: str) -> Tensor | None:
    """The root's row [1, V] when known before selection: a root pass, or covering's held row."""
    if rule in RP.ROOT_PASS_RULES:
        return RP.root_pass(target, st.stream.target_cache, st.stream.tokens[-1])
    if st.held_row is not None:
        return st.held_row[None]
    return None


def rank_and_tree(
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


def select_step(
    s: OnlineSettings, pool: Pool, levels: Levels, first: Tensor | None, draw: Tensor | None
) -> tuple[Selection, int, int]:
    """The verified tree and the scored set, with |Q| and |T| on the host (host sync 1)."""
    rank, in_tree, draft_rank = rank_and_tree(
        s.rule, pool, s.base.select.budget, levels, first, draw
    )
    scored = scored_set(s, pool, in_tree, draft_rank, draw)
    batch_row = torch.where(scored, scored.long().cumsum(0), -1)  # root is row 0
    n_scored, n_tree = torch.stack([scored.sum(), in_tree.sum()]).tolist()
    if n_scored == 0:  # nothing to verify: X1 is the continuation, the round's tree is empty
        in_tree, n_tree = torch.zeros_like(in_tree), 0
    return Selection(rank, in_tree, scored, batch_row), n_scored, n_tree


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


def outcomes(
    logits: Tensor, row_logp: Tensor, pool: Pool, in_tree: Tensor, n_tree: int, prow: Tensor,
    s: DecodeSettings, gen: torch.Generator | None,
) -> Tensor:  # fmt: skip
    """The verifier's outcome token at every batch row. [1 + |Q|]."""
    if s.decode.temperature == 0:
        return outcome_greedy(logits)
    if s.decode.verifier == "exhaustive":
        return outcome_exhaustive(row_logp, gen)
    # Exactly n_tree nodes, known on the host, so a static-size nonzero needs no sync.
    tree_idx = torch.nonzero_static(in_tree, size=n_tree)[:, 0]  # [n_tree] pool order
    return outcome_eagle3(row_logp, pool.token[tree_idx], prow[tree_idx], gen)


@dataclass
class Verified:
    """The verification pass and its traversal, on the device."""

    logits: Tensor  # [1 + |Q|, V] model dtype
    row_logp: Tensor  # [1 + |Q|, V] float32 at the law temperature
    prow: Tensor  # [P] batch row of each candidate's parent
    outcome: Tensor  # [1 + |Q|] outcome token per row
    accepted: Tensor  # [P] bool, the accepted path


def verify_step(
    target: PreTrainedModel, stream: Stream, s: DecodeSettings, pool: Pool, sel: Selection,
    n_scored: int, n_tree: int, root_logits: Tensor | None, draw: Tensor | None,
) -> Verified:  # fmt: skip
    """One target pass over Q (none when Q is empty), the outcome at every row, the path."""
    logits = target_logits(target, stream, pool, sel.scored, n_scored, root_logits)
    row_logp = row_logprobs(logits, s.decode.temperature)
    prow = parent_rows(pool, sel)
    if n_scored == 0:
        return Verified(logits, row_logp, prow, draw, torch.zeros_like(sel.in_tree))
    outcome = outcomes(logits, row_logp, pool, sel.in_tree, n_tree, prow, s, stream.generator)
    if draw is not None:
        outcome[0] = draw[0]  # the first draw was made from the root row already
    return Verified(
        logits, row_logp, prow, outcome, accepted_mask(pool, sel.in_tree, prow, outcome)
    )


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


@dataclass
class Committed:
    emitted: list[int]  # accepted tokens + continuation
    path: np.ndarray  # pool indices of the accepted path
    leaf: int | None  # covering: the emitted leaf (the next root's row is in this pass)
    fields: dict | None  # trace columns when recording


def commit_step(
    st: OnlineStream, s: OnlineSettings, pool: Pool, sel: Selection, v: Verified,
    stats: R.RetainedStats | None, round_index: int, rows_needed: bool,
) -> Committed:  # fmt: skip
    """Host sync 2, then caches, retained rows and trace fields; the stream advances."""
    stream, root = st.stream, st.stream.tokens[-1]
    leaves = RP.tree_leaves(pool, sel.in_tree) if s.rule == "covering" else sel.in_tree  # [P]
    small = torch.stack([v.accepted, leaves]).cpu().numpy()
    outcome_np = v.outcome.cpu().numpy()
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
    st.held_row = None if leaf is None else v.logits[int(host.batch_row[leaf])].clone()
    fields = None
    if s.record:
        fields, stream.prev = round_trace_fields(
            root, stream.row_cache, pool, sel, host, v.logits, v.row_logp, v.prow, path, cont,
            stats, round_index,
        )  # fmt: skip
    elif rows_needed:
        rr = round_rows(root, host, path, cont)
        stream.prev = retain_rows(rr, v.logits, stream.row_cache, round_index)
    stream.tokens.extend(emitted)
    st.prev_accepted = int(path.size)
    return Committed(emitted, path, leaf, fields)


# -- one round ------------------------------------------------------------------------------------


@torch.inference_mode()
def decode_round(
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
    """One round on `st` (advanced in place): the steps above, each timed (STAGES)."""
    stream, temp = st.stream, s.base.decode.temperature
    clock = StageClock(target.device)
    root_pos = len(stream.tokens) - 1  # = committed tokens before the root

    pending = torch.tensor([*stream.drafter_pending, stream.tokens[-1]], device=target.device)
    pool = grow_pool(drafter, stream.drafter_cache, pending, root_pos, s.base.pool)
    clock.mark()  # draft

    root_logits = root_row(st, target, s.rule)  # [1, V] or None
    passes = int(s.rule in RP.ROOT_PASS_RULES)
    clock.mark()  # root pass

    first, feats = None, None
    if s.rule == "reranker":
        first, feats = reranker_first_factor(
            stream, st.task, pool, predictor, ctx, law_temperature(temp), rows_needed
        )
    elif s.rule == "root":
        first = RP.root_first_factor(root_logits, pool.token[: pool.n_first], temp)
    clock.mark()  # features

    draw = None if root_logits is None else RP.draw_root(root_logits, temp, stream.generator)
    sel, n_scored, n_tree = select_step(s, pool, levels, first, draw)
    clock.mark()  # select

    v = verify_step(target, stream, s.base, pool, sel, n_scored, n_tree, root_logits, draw)
    passes += int(n_scored > 0)
    clock.mark()  # verify

    stats = None
    if s.record:
        stats = R.retained_stats(
            stream.row_cache, stream.prev, stream.tokens[-1], v.logits[0],
            pool.token[: pool.n_first], law_temperature(temp), ctx.round_index,
        )  # fmt: skip
    entropy = -(v.row_logp[0].exp() * v.row_logp[0]).nan_to_num(0.0, 0.0, 0.0).sum()
    c = commit_step(st, s, pool, sel, v, stats, ctx.round_index, rows_needed)
    clock.mark()  # bookkeeping

    in_first = draw is not None and c.path.size > 0
    value = int(c.path.size) + int(s.rule in RP.DRAW_RULES and not in_first)  # the draw counts
    return RoundRecord(
        emitted=c.emitted,
        n_accepted=int(c.path.size),
        value=value,
        tree_size=n_tree,
        passes=passes,
        covered=c.leaf is not None,
        root_entropy=float(entropy),
        stage_ms=clock.durations_ms(),
        first_logprob=None if s.rule != "reranker" else first.float().cpu().numpy(),
        features=feats if keep_features else None,
        fields=c.fields,
    )

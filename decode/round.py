"""One decoding round, as small steps composed once (gpt-fast's `generate.py` shape).

    draft     -> grow the pool below the root                (drafter, or an EAGLE-3 head)
    root pass -> root-pass rules only: the root row from a one-token target pass
    features  -> first-factor routes only: rule=reranker's first-level features -> log phat
                 (host), else the root row's log p(x1 | c)
    select    -> the verified tree T (the rule's online route, `selection.routes`) and the
                 scored set Q (T, or T + expanded + top-M)
    verify    -> one target pass over Q (the root too, unless already known; a draw
                 rule's X1 alone when X1 is off the pool); outcome at every row;
                 accepted path; continuation (docs/method.md#verification)
    commit    -> caches keep root + accepted path; retained rows; trace fields

Select and verify live in `decode.tree_pass` (with the X1-alone pass).

Recording (`decode.record`) is this round with rule=draft, score=record and
record=True; online runs (`decode.run`) choose the rule and what a pass scores.
Host syncs per round: one after selection (|Q| sizes the pass; the reranker
adds one for the features), one after verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedModel

from decode.reranker import reranker_first_factor
from decode.settings import OnlineSettings
from decode.stream import StageClock, Stream
from decode.tree_pass import Planned, Verified, select_step, verify_step
from pairs.models import Drafter
from rerank.serving import OnlinePredictor
from selection.policies import NO_TOKEN_ONLY
from selection.ranking import Levels
from selection.rules import Rule
from tree import retained as R
from tree import root_pass as RP
from tree.attention import cache_length, compact_cache
from tree.growth import grow_pool
from tree.pool import DraftDraw, Pool
from tree.round_record import HostPool, RoundContext, retain_rows, round_rows, round_trace_fields
from tree.verify import law_temperature

STAGES = ("draft", "root_pass", "features", "select", "verify", "bookkeeping")


@dataclass
class RoundRecord:
    """What one round did, in host terms."""

    emitted: list[int]  # accepted tokens + continuation
    # tokens accepted: pool nodes and a draw rule's X1 (on the pool or alone); the realized
    # value in the offline sense (draw rules count the draw)
    n_accepted: int
    tree_size: int  # nodes of the verified tree (X1 alone: 1)
    scored: int  # prefixes the tree pass scored beside the root (run.score; X1 alone: + 1)
    passes: int  # target passes this round
    covered: bool  # covering decoder: the next root row came from this pass
    root_entropy: float  # nats, root row at the law temperature (T=1 at T=0)
    stage_ms: list[float]  # per STAGES
    first_logprob: np.ndarray | None = None  # rule=reranker: log phat of the first level
    features: dict | None = None  # rule=reranker with keep_features: the round's features
    fields: dict | None = None  # trace columns when recording
    x1_alone: bool = False  # draw rules: X1 was off the pool's first level, verified alone
    # the round held the matched row: the previous pass scored this root's address (a rule
    # that keeps no retained rows, draft, never holds it)
    matched_row: bool = False


@dataclass
class OnlineStream:
    stream: Stream
    task: str
    prev_accepted: int | None = None
    held_row: Tensor | None = None  # covering: the root's row, from the previous pass [V]
    draft_draw: DraftDraw | None = None  # decode.draft_temperature > 0: sampled drafting


# -- steps ----------------------------------------------------------------------------------------


def root_row(st: OnlineStream, target: PreTrainedModel, entry: Rule) -> Tensor | None:
    """The root's row [1, V] when known before selection: a root pass, or covering's held row."""
    if entry.root_pass:
        return RP.root_pass(target, st.stream.target_cache, st.stream.tokens[-1])
    if st.held_row is not None:
        return st.held_row[None]
    return None


def commit_caches(stream: Stream, host: HostPool, path: np.ndarray, rows: list[int],
                  pending: list[int]) -> None:  # fmt: skip
    """Both caches keep the root and the accepted path; the target also `rows` (batch rows).

    rows: an emitted leaf's (covering: the next root is cached) or X1 alone's, after
    the path's, ascending. pending: tokens the drafter has not cached after this round.
    """
    root_pos = len(stream.tokens) - 1
    keep = [root_pos + int(host.batch_row[a]) for a in path] + [root_pos + r for r in rows]
    compact_cache(stream.target_cache, root_pos + 1, keep)
    if stream.drafter_state is not None:  # its target states follow the cache; no draft KV kept
        stream.drafter_state.commit(root_pos + 1, keep, cache_length(stream.target_cache))
        return
    # Accepted nodes the drafter cached (expanded ones: a prefix of the path); the rest are pending.
    in_drafter = path[host.expanded[path]]
    compact_cache(stream.drafter_cache, root_pos + 1, host.drafter_pos[in_drafter].tolist())
    stream.drafter_pending = host.token[path[~host.expanded[path]]].tolist() + pending


@dataclass
class Committed:
    emitted: list[int]  # accepted tokens + continuation
    path: np.ndarray  # pool indices of the accepted path
    x1_alone: list[int]  # draw rules, X1 verified alone: [X1], accepted outside the pool
    covered: bool  # covering: the next root's row is in this pass (a leaf or X1 alone)
    fields: dict | None  # trace columns when recording


def commit_step(
    st: OnlineStream, s: OnlineSettings, pool: Pool, plan: Planned, v: Verified,
    stats: R.RetainedStats | None, round_index: int, rows_needed: bool,
) -> Committed:  # fmt: skip
    """Host sync 2, then caches, retained rows and trace fields; the stream advances.

    X1 alone (`decode.tree_pass`): root-draw / PEARL accept X1 and emit its row's
    outcome as the continuation; covering emits X1 as the continuation (a leaf) and holds
    its row. X1's KV is kept either way; the drafter has not seen X1.
    """
    stream, root, sel = st.stream, st.stream.tokens[-1], plan.sel
    covering = s.entry.online.emits_leaf  # a leaf may be the continuation, its row held
    leaves = RP.tree_leaves(pool, sel.in_tree) if covering else sel.in_tree  # [P]
    small = torch.stack([v.accepted, leaves]).cpu().numpy()
    outcome_np = v.outcome.cpu().numpy()
    host = HostPool.from_device(pool, sel)
    path = np.flatnonzero(small[0])  # pool order = depth order along a path
    last_row = int(host.batch_row[path[-1]]) if path.size else 0
    cont = int(outcome_np[last_row])
    held, rows, x1, pending = None, [], [], []
    if plan.alone:
        rows = [plan.alone_row]
        if covering:  # X1 labels the one-node tree's leaf: it is the continuation
            held = plan.alone_row
        else:  # X1 (row 0's outcome: the draw) accepted; its row's outcome continues
            x1 = pending = [int(outcome_np[0])]
            cont = int(outcome_np[plan.alone_row])
    elif covering and path.size and small[1][path[-1]]:
        leaf, path = int(path[-1]), path[:-1]  # sampled-leaf: the leaf is the continuation
        cont, held = int(host.token[leaf]), int(host.batch_row[leaf])
        rows = [held]
    emitted = [*host.token[path].tolist(), *x1, cont]

    commit_caches(stream, host, path, rows, pending)
    st.held_row = None if held is None else v.logits[held].clone()
    fields = None
    keep_only = s.score not in NO_TOKEN_ONLY  # as the offline masking (for_policy)
    if s.record:
        # In the pool's terms: X1 alone is the traversal's exit at the root (path empty).
        fields, stream.prev = round_trace_fields(
            root, stream.row_cache, pool, sel, host, v.logits, v.row_logp, v.prow, path,
            x1[0] if x1 else cont, stats, round_index, keep_only,
        )  # fmt: skip
    elif rows_needed:
        rr = round_rows(root, host, path, cont)
        stream.prev = retain_rows(rr, v.logits, stream.row_cache, round_index, keep_only)
    if x1 and stream.prev is not None:
        # The next root's address (X1, continuation) lies outside the pool and its retained
        # rows cannot be named in the pool's terms; X1's own row is kept under X1.
        stream.prev = None
        # the root's row wins over a verified prefix's (docs/method.md#retained-rows)
        if x1[0] != root:
            rows_t = v.logits[plan.alone_row : plan.alone_row + 1]
            stream.row_cache.store(np.asarray(x1), rows_t, round_index)
    stream.tokens.extend(emitted)
    st.prev_accepted = int(path.size)  # pool nodes, as the trace's accepted_path
    return Committed(emitted, path, x1, held is not None, fields)


# -- one round ------------------------------------------------------------------------------------


def draft_pool(st: OnlineStream, target: PreTrainedModel, drafter: Drafter, cfg, root_pos: int
               ) -> Pool:  # fmt: skip
    """This round's pool: a state drafter's (EAGLE-3 head, block drafter) or a standalone LM's."""
    stream = st.stream
    if stream.drafter_state is not None:
        return drafter.grow(stream.drafter_state, stream.tokens, root_pos, cfg, st.draft_draw)
    pending = torch.tensor([*stream.drafter_pending, stream.tokens[-1]], device=target.device)
    return grow_pool(drafter, stream.drafter_cache, pending, root_pos, cfg, st.draft_draw)


@torch.inference_mode()
def decode_round(
    st: OnlineStream,
    target: PreTrainedModel,
    drafter: Drafter,
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
    matched_row = stream.prev is not None and stream.prev.matched is not None

    pool = draft_pool(st, target, drafter, s.base.pool, root_pos)
    clock.mark()  # draft

    root_logits = root_row(st, target, s.entry)  # [1, V] or None
    passes = int(s.entry.root_pass)
    clock.mark()  # root pass

    first, feats = None, None
    if s.entry.predictor:
        first, feats = reranker_first_factor(
            stream, st.task, pool, predictor, ctx, law_temperature(temp), rows_needed
        )
    elif s.entry.online.first_factor:  # from the root row (the root pass)
        first = RP.root_first_factor(root_logits, pool.token[: pool.n_first], temp)
    clock.mark()  # features

    draw = None if root_logits is None else RP.draw_root(root_logits, temp, stream.generator)
    plan = select_step(s, pool, levels, first, draw)
    clock.mark()  # select

    v = verify_step(target, stream, s.base, pool, plan, root_logits, draw)
    passes += plan.tree_passes
    clock.mark()  # verify

    stats = None
    if s.record:
        stats = R.retained_stats(
            stream.row_cache, stream.prev, stream.tokens[-1], v.logits[0],
            pool.token[: pool.n_first], law_temperature(temp), ctx.round_index,
        )  # fmt: skip
    entropy = -(v.row_logp[0].exp() * v.row_logp[0]).nan_to_num(0.0, 0.0, 0.0).sum()
    c = commit_step(st, s, pool, plan, v, stats, ctx.round_index, rows_needed)
    clock.mark()  # bookkeeping

    return RoundRecord(
        emitted=c.emitted,
        n_accepted=int(c.path.size) + len(c.x1_alone),
        tree_size=plan.tree_size,
        scored=plan.n_scored + int(plan.alone),
        passes=passes,
        covered=c.covered,
        root_entropy=float(entropy),
        stage_ms=clock.durations_ms(),
        first_logprob=first.float().cpu().numpy() if s.entry.predictor else None,
        features=feats if keep_features else None,
        fields=c.fields,
        x1_alone=plan.alone,
        matched_row=matched_row,
    )

"""Synthetic rounds from a known toy target and drafter (tests and benchmarks).

Toy model. Every address (token prefix) has its own i.i.d. standard-normal
logits z in R^V. The target row is p = softmax(sharpness * z / T) (T = 1 at
T = 0, the schema's convention) and the drafter's row is
q = softmax(sharpness * z / draft_temperature + draft_noise * eps).

Because rows are i.i.d. across addresses, a round needs one row per *row slot*
and all of them can be drawn up front, then the pool grown depth by depth
(docs/method.md#pool), vectorised over rounds:

    slot 0                 the root row p(. | c)
    slots 1 .. n_expanded  the expanded nodes, in pool order (depth, then index)
    slot n_expanded + 1    the "exit row": the row at the non-expanded tree node
                           where a traversal may end (its argmax / draw)

Children of the j-th expanded node of a depth form one contiguous block of
`top_k` entries at the next depth, in the drafter's top-k order, and blocks are
laid out in their parents' pool order. Hence the row slot of every position's
parent is the same in every round (`PoolLayout.parent_slot`); only *which* node
of a depth is expanded (its pool index) varies per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from recipes.synth.config import SynthConfig
from selection.ranking import rank_candidates
from tree.config import PoolConfig, SelectConfig


@dataclass(frozen=True)
class PoolLayout:
    """Static shape of every round's pool: counts per depth and row-slot maps."""

    top_k: int
    n_cand: tuple[int, ...]  # candidates at depth 1..D
    n_expand: tuple[int, ...]  # expanded nodes at depth 1..D (0 at depth D)
    depth: np.ndarray  # [P] int8, 1..D
    parent_slot: np.ndarray  # [P] int64: row slot of each position's parent (0 = root)
    child_rank: np.ndarray  # [P] int64: rank of the edge in its parent's top-k
    child_start: np.ndarray  # [n_slots] int64: pool index of the first child of a slot's node

    @property
    def n_pool(self) -> int:
        return int(sum(self.n_cand))

    @property
    def max_depth(self) -> int:
        return len(self.n_cand)

    @property
    def n_expanded(self) -> int:
        return int(sum(self.n_expand))

    @property
    def n_slots(self) -> int:
        return self.n_expanded + 2  # root + expanded + exit row

    @property
    def exit_slot(self) -> int:
        return self.n_expanded + 1

    def depth_start(self, d: int) -> int:
        """Pool index where depth d (1-based) begins."""
        return int(sum(self.n_cand[: d - 1]))

    def row_start(self, d: int) -> int:
        """Row slot of the first expanded node of depth d (1-based)."""
        return 1 + int(sum(self.n_expand[: d - 1]))


def pool_layout(pool: PoolConfig) -> PoolLayout:
    """Counts per depth of docs/method.md#pool and the fixed row slot of every position's parent."""
    for name, value, low in (
        ("top_k", pool.top_k, 1),
        ("expand_steps", pool.expand_steps, 0),
        ("expand", pool.expand, 1),
    ):
        if not isinstance(value, int) or value < low:
            raise ValueError(
                f"The 'pool.{name}' parameter must be an int >= {low}. Got {value!r} instead."
            )
    n_cand, n_expand = [pool.top_k], []
    for _ in range(pool.expand_steps):
        # each depth but the last expands its `expand` best candidates (all 10 of
        # depth 1 at the defaults), as tree.pool.level_sizes does
        n_expand.append(min(pool.expand, n_cand[-1]))
        n_cand.append(n_expand[-1] * pool.top_k)
    n_expand.append(0)  # the last depth is never expanded
    if sum(n_cand) > np.iinfo(np.int16).max:
        raise ValueError(
            f"pool of {sum(n_cand)} candidates exceeds the schema's int16 parent index"
        )
    depth = np.repeat(np.arange(1, len(n_cand) + 1), n_cand).astype(np.int8)
    parent_slot = [np.zeros(pool.top_k, dtype=np.int64)]
    child_start = np.zeros(sum(n_expand) + 2, dtype=np.int64)
    start, slot = pool.top_k, 1
    for n_exp in n_expand[:-1]:
        slots = np.arange(slot, slot + n_exp)
        parent_slot.append(np.repeat(slots, pool.top_k))
        child_start[slots] = start + np.arange(n_exp) * pool.top_k
        start, slot = start + n_exp * pool.top_k, slot + n_exp
    child_rank = np.tile(np.arange(pool.top_k), sum(n_cand) // pool.top_k)
    return PoolLayout(
        top_k=pool.top_k,
        n_cand=tuple(n_cand),
        n_expand=tuple(n_expand),
        depth=depth,
        parent_slot=np.concatenate(parent_slot),
        child_rank=child_rank,
        child_start=child_start,
    )


@dataclass
class ToyRows:
    """All rows of R rounds. Arrays are [R, S, V] (S = row slots) unless noted."""

    target_logp: np.ndarray  # float32 log p at the round's temperature (T=1 at T=0)
    draft_logq: np.ndarray  # float32 log q
    target_argmax: np.ndarray  # [R, S] int64
    draw: np.ndarray  # [R, S] int64: the token the round's law draws from each row


def toy_rows(
    rng: np.random.Generator, n_rounds: int, n_slots: int, synth: SynthConfig, temperature: float
) -> ToyRows:
    shape = (n_rounds, n_slots, synth.vocab)
    logits = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).mul_(
        synth.target_sharpness
    )
    t_eff = temperature if temperature > 0 else 1.0
    target_logp = torch.log_softmax(logits / t_eff, dim=-1)
    draft = logits.div_(synth.draft_temperature)
    draft += synth.draft_noise * torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))
    draft_logq = torch.log_softmax(draft, dim=-1)
    argmax = target_logp.argmax(dim=-1)
    if temperature > 0:
        # Inverse-CDF draw from every row: each row is visited at most once per
        # traversal, so drawing all of them up front has the traversal's law.
        cdf = torch.cumsum(target_logp.exp(), dim=-1)  # [R, S, V]
        u = torch.from_numpy(rng.random((n_rounds, n_slots, 1), dtype=np.float32)) * cdf[..., -1:]
        # first index whose cdf exceeds u: P(draw = v) = p_v
        draw = torch.searchsorted(cdf, u, right=True)[..., 0].clamp_(max=synth.vocab - 1)
    else:
        draw = argmax  # greedy law: the argmax
    return ToyRows(target_logp.numpy(), draft_logq.numpy(), argmax.numpy(), draw.numpy())


@dataclass
class GrownPool:
    """EAGLE-3 pools of R rounds, [R, P] in pool order."""

    token: np.ndarray  # int64
    parent: np.ndarray  # int64, -1 = root
    draft_logprob: np.ndarray  # float32, per-edge log q
    expanded: np.ndarray  # bool
    node_slot: np.ndarray  # int64: row slot of an expanded node, -1 otherwise
    draft_score: np.ndarray  # float32 cumulative draft log-prob (= select.draft_scores)


def synth_pool(layout: PoolLayout, draft_logq: np.ndarray) -> GrownPool:
    """Grow the pool of docs/method.md#pool from each row slot's draft row ([R, S, V])."""
    n_rounds = draft_logq.shape[0]
    # top-k tokens of every row, most probable first (argpartition + a sort of
    # k entries is ~2x faster than torch.topk on 64-wide rows). Exactly equal
    # float32 draft log-probs are rare and broken arbitrarily but reproducibly
    # here (tree.pool prefers the lower token id); nothing downstream
    # depends on which of two tied tokens was proposed.
    k = layout.top_k
    if k < draft_logq.shape[-1]:
        part = np.argpartition(draft_logq, -k, axis=-1)[..., -k:]
    else:
        part = np.broadcast_to(np.arange(k), (*draft_logq.shape[:-1], k))
    part_lp = np.take_along_axis(draft_logq, part, axis=-1)
    order = np.argsort(-part_lp, axis=-1, kind="stable")
    top_lp = np.take_along_axis(part_lp, order, axis=-1)  # [R, S, k]
    top_tok = np.take_along_axis(part, order, axis=-1)  # [R, S, k]
    token = top_tok[:, layout.parent_slot, layout.child_rank]  # [R, P]
    edge = top_lp[:, layout.parent_slot, layout.child_rank]  # [R, P]
    parent = np.full(token.shape, -1, dtype=np.int64)
    expanded = np.zeros(token.shape, dtype=bool)
    node_slot = np.full(token.shape, -1, dtype=np.int64)
    cum = edge.copy()  # cumulative draft log-prob; float32 as `select.path_sum` adds it
    rows = np.arange(n_rounds)[:, None]
    for d in range(1, layout.max_depth):
        # depth d expands its best candidates: cumulative log-prob desc, then pool
        # index asc (stable sort), kept in pool order so child blocks follow parents
        s, n = layout.depth_start(d), layout.n_cand[d - 1]
        best = np.argsort(-cum[:, s : s + n], axis=1, kind="stable")[:, : layout.n_expand[d - 1]]
        exp_idx = s + np.sort(best, axis=1)  # [R, n_expand]
        expanded[rows, exp_idx] = True
        node_slot[rows, exp_idx] = layout.row_start(d) + np.arange(layout.n_expand[d - 1])
        c, m = layout.depth_start(d + 1), layout.n_cand[d]
        parent[:, c : c + m] = np.repeat(exp_idx, layout.top_k, axis=1)
        cum[:, c : c + m] += np.take_along_axis(cum, parent[:, c : c + m], axis=1)
    return GrownPool(token, parent, edge, expanded, node_slot, cum)


@dataclass
class Traversal:
    """Outcome of verifying the tree under the round's law. [R] unless noted."""

    path: np.ndarray  # [R, D] int64 pool indices in depth order, -1 padded
    path_len: np.ndarray  # int64 accepted tokens
    continuation: np.ndarray  # int64
    covered: np.ndarray  # bool
    exit_node: np.ndarray  # int64 pool index of a non-expanded last node, -1 otherwise


def traverse(
    layout: PoolLayout, pool: GrownPool, in_tree: np.ndarray, scored: np.ndarray, draw: np.ndarray
) -> Traversal:
    """Walk the verified tree from the root with the pre-drawn token of every row (docs/method.md#verification).

    At a reached node the drawn token is accepted when it labels a child in the
    tree; otherwise it is the continuation, and the round is covered when it
    labels a scored child. A non-expanded node has no pool children: the
    continuation is the exit row's draw and the round is not covered.
    """
    n_rounds, k = pool.token.shape[0], layout.top_k
    rows = np.arange(n_rounds)
    path = np.full((n_rounds, layout.max_depth), -1, dtype=np.int64)
    path_len = np.zeros(n_rounds, dtype=np.int64)
    continuation = np.zeros(n_rounds, dtype=np.int64)
    covered = np.zeros(n_rounds, dtype=bool)
    exit_node = np.full(n_rounds, -1, dtype=np.int64)
    cur_node = np.full(n_rounds, -1, dtype=np.int64)  # -1 = root
    cur_slot = np.zeros(n_rounds, dtype=np.int64)  # -1 = non-expanded node
    active = np.ones(n_rounds, dtype=bool)
    for _ in range(layout.max_depth + 1):
        at_leaf = active & (cur_slot < 0)
        continuation[at_leaf] = draw[at_leaf, layout.exit_slot]
        exit_node[at_leaf] = cur_node[at_leaf]
        here = active & (cur_slot >= 0)
        slot = np.maximum(cur_slot, 0)
        x = draw[rows, slot]  # [R]
        kids = layout.child_start[slot][:, None] + np.arange(k)  # [R, k]
        match = np.take_along_axis(pool.token, kids, axis=1) == x[:, None]  # siblings are distinct
        hit = match.any(axis=1)
        child = kids[rows, match.argmax(axis=1)]
        accept = here & hit & in_tree[rows, child]
        stop = here & ~accept
        continuation[stop] = x[stop]
        covered[stop] = hit[stop] & scored[rows, child][stop]
        path[accept, path_len[accept]] = child[accept]
        path_len += accept
        cur_node = np.where(accept, child, cur_node)
        cur_slot = np.where(accept, pool.node_slot[rows, child], cur_slot)
        active = accept
        if not active.any():
            break
    return Traversal(path, path_len, continuation, covered, exit_node)


@dataclass
class SynthRounds:
    """R rounds (no retained rows yet). [R, P] in pool order unless noted."""

    pool: GrownPool
    depth: np.ndarray  # [P] int8
    target_prob: np.ndarray  # float32, per-edge p at T (T=1 at T=0)
    target_argmax: np.ndarray  # int32, -1 where unscored
    scored: np.ndarray  # bool
    in_tree: np.ndarray  # bool
    root_logp: np.ndarray  # [R, V] float32: the root row (log) at T (T=1 at T=0)
    root_argmax: np.ndarray  # [R] int64
    outcome: Traversal


def synth_rounds(
    rng: np.random.Generator,
    n_rounds: int,
    temperature: float,
    pool: PoolConfig,
    select: SelectConfig,
    synth: SynthConfig,
) -> SynthRounds:
    """Pools, verified trees, scored sets and outcomes of `n_rounds` independent rounds."""
    check_synth(synth, select, pool, temperature)
    layout = pool_layout(pool)
    rows = toy_rows(rng, n_rounds, layout.n_slots, synth, temperature)
    grown = synth_pool(layout, rows.draft_logq)
    # target edge probability from the parent's row: p(token_i | prefix of parent_i)
    parent_logp = rows.target_logp[
        np.arange(n_rounds)[:, None], layout.parent_slot[None, :], grown.token
    ]
    target_prob = np.exp(parent_logp)  # [R, P] float32
    # The draft rule's tree and the top-M scored set, ranked by select's tie-break.
    # synth_pool's cumulative sums equal select.draft_scores bit for bit (tested),
    # so one ranking serves both: top_b(score, n) == (rank < n).
    rank = rank_candidates(torch.from_numpy(grown.draft_score)).numpy()  # [R, P]
    in_tree = rank < select.budget
    scored = in_tree | grown.expanded | (rank < select.record_top_m)
    # Argmax at scored prefixes: expanded nodes have their own row. A scored
    # non-expanded prefix gets the argmax of a fresh exchangeable row, i.e. a
    # uniform token; the one where a traversal ends uses the exit row instead.
    target_argmax = rng.integers(0, synth.vocab, size=grown.token.shape)
    has_row = grown.node_slot >= 0
    target_argmax[has_row] = np.take_along_axis(rows.target_argmax, grown.node_slot, axis=1)[
        has_row
    ]
    outcome = traverse(layout, grown, in_tree, scored, rows.draw)
    ends = outcome.exit_node >= 0
    target_argmax[ends, outcome.exit_node[ends]] = rows.target_argmax[ends, layout.exit_slot]
    target_argmax[~scored] = -1
    return SynthRounds(
        pool=grown,
        depth=layout.depth,
        target_prob=target_prob,
        target_argmax=target_argmax.astype(np.int32),
        scored=scored,
        in_tree=in_tree,
        root_logp=rows.target_logp[:, 0, :],
        root_argmax=rows.target_argmax[:, 0],
        outcome=outcome,
    )


def check_synth(
    synth: SynthConfig, select: SelectConfig, pool: PoolConfig, temperature: float
) -> None:
    """Refuse settings the toy model cannot honour, naming the setting."""
    if select.rule != "draft":
        raise ValueError(
            f"Synthetic traces verify the draft rule's tree: 'select.rule' must be 'draft'. Got {select.rule!r} instead."
        )
    if select.budget < 1:
        raise ValueError(
            f"The 'select.budget' parameter must be an int >= 1. Got {select.budget!r} instead."
        )
    if synth.vocab < max(pool.top_k, 2):
        raise ValueError(
            f"The 'synth.vocab' parameter must be >= pool.top_k ({pool.top_k}) and >= 2. Got {synth.vocab} instead."
        )
    if temperature < 0:
        raise ValueError(f"Temperatures must be >= 0 (0 = greedy). Got {temperature} instead.")
    if not 0 <= synth.p_cache <= 1:
        raise ValueError(
            f"The 'synth.p_cache' parameter must be in [0, 1]. Got {synth.p_cache} instead."
        )
    if not 1 <= synth.prompt_length_min <= synth.prompt_length_max:
        raise ValueError(
            "'synth.prompt_length_min' must be in [1, synth.prompt_length_max]. "
            f"Got {synth.prompt_length_min} and {synth.prompt_length_max} instead."
        )

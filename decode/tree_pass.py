"""The select and verify steps of a round (`decode.round`): tree, Q, one target pass, outcomes.

    select -> the rule's verified tree T and the scored set Q; |Q|, |T| and "X1 alone" on the
              host (the round's first host sync). T is built by the tree function of the
              rule's online route (`selection.routes`); the shipped routes' are registered
              here, and the steps branch on the route's flags, never on its name.
    verify -> one target pass over Q (the root too, unless already known), the outcome token
              at every batch row, the accepted path (docs/method.md#verification)

**X1 alone** (paper App. D.3 and D.10). A draw rule -- root-draw, PEARL, and the covering
decoder after a covered round -- draws X1 from the root row before it selects. When X1
labels no first-level pool candidate the rule's tree is X1 alone, a one-node tree that is
not in the pool. It gets a batch row of its own, after the scored pool prefixes (row
1 + |Q|): token X1 at position root_position + 1 (depth 1), seeing the committed context,
the root (always cached here: a draw needs the root row, so it came from a root pass or
from covering's previous pass, both of which cache the root) and itself; no pool prefix
sees it. Its row's outcome is the round's continuation (root-draw / PEARL: the round emits
X1 and that continuation from one tree pass), and covering emits X1 as the continuation
(X1 labels the tree's only leaf) with X1's row held for the next round. Either way commit
keeps X1's KV like an accepted node's (`decode.round.commit_step`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from decode.settings import OnlineSettings
from decode.stream import DecodeSettings, Stream
from selection.ranking import Levels
from selection.routes import COVERING, DRAFT_TREE, DRAW_TREE, FACTOR_TREE, TreeInputs, register_tree
from selection.rules import Rule
from tree import root_pass as RP
from tree.pool import Pool
from tree.verify import (
    Selection,
    accepted_mask,
    outcome_coupling,
    outcome_eagle3,
    outcome_exhaustive,
    outcome_greedy,
    parent_rows,
    row_logprobs,
    verification_pass,
)


def uses_draw_tree(entry: Rule, draw: Tensor | None) -> bool:
    """Whether the round's tree is built below the draw X1 (draw rules; covering with a held row)."""
    return draw is not None and entry.online.draws_x1


def rank_and_tree(
    entry: Rule,
    pool: Pool,
    budget: int,
    levels: Levels,
    first_logprob: Tensor | None,
    draw: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(in_tree, draft_rank, rank), each [P]: the rule's verified tree (pool nodes), from its
    online route's tree function (`selection.routes`); the draft rank, which picks the
    recording set's top M and the retained rows' prefixes whatever the rule, as in the
    recorded traces a reranker is trained on (rule=draft); and the rule's own rank (the draft
    rank for draft and draw rules), which orders the `top_m` scored set."""
    draft_rank = RP.rank_of(pool.score)
    t = TreeInputs(entry, pool, budget, levels, draft_rank, first_logprob, draw)
    in_tree, rank = entry.online.tree(t)
    return in_tree, draft_rank, rank


# -- the shipped online routes' trees (registered for selection.routes' entries) ------------


@register_tree(DRAFT_TREE)
def _draft_tree(t: TreeInputs) -> tuple[Tensor, Tensor]:
    """Draft selection's top-B tree."""
    return t.draft_rank < t.budget, t.draft_rank


@register_tree(FACTOR_TREE)
def _factor_tree(t: TreeInputs) -> tuple[Tensor, Tensor]:
    """Top-B with the first-level factor replaced by the round's (reranker, root row)."""
    rank = RP.rank_of(RP.factor_scores(t.pool, t.first_logprob, t.levels))
    return rank < t.budget, rank


@register_tree(DRAW_TREE)
@register_tree(COVERING)
def _tree_below_draw(t: TreeInputs) -> tuple[Tensor, Tensor]:
    """The entry's draw tree below X1 (draw rules; covering after a covered round), else
    draft selection's (covering otherwise)."""
    if t.draw is None:
        return _draft_tree(t)
    tree = RP.draw_tree(t.pool, t.entry.draw_tree, t.draw, t.pool.score, t.draft_rank,
                        t.budget, t.levels)  # fmt: skip
    return tree, t.draft_rank


def scored_set(
    s: OnlineSettings,
    pool: Pool,
    in_tree: Tensor,
    draft_rank: Tensor,
    draw: Tensor | None,
    rank: Tensor | None = None,
) -> Tensor:
    """Q: the pool prefixes the tree pass scores (`run.score`). [P] bool (X1 alone is
    batched apart). The extra prefixes ride in the same target pass under tree attention,
    so the output law is the tree's whatever the policy.

    tree: the tree alone; under the root rule nothing when X1 labels no first-level tree
        node (X1 is then the continuation and no row of the pass would be read, so the
        pass is skipped).
    top_m: the tree and the `run.score_top_m` highest-ranked candidates outside it, in the
        rule's own order (`rank`; App. D.10).
    frontier: the tree and every candidate whose parent is in it (Table 21).
    record: the recorder's set, tree + expanded + the draft top `select.record_top_m` (every
        pool edge's target probability).
    pool: every candidate.
    """
    if s.score == "record":
        return in_tree | pool.expanded | (draft_rank < s.base.select.record_top_m)
    if s.score == "pool":
        return torch.ones_like(in_tree)
    if s.score == "frontier":
        parent_in = in_tree[pool.parent.clamp(min=0)] & (pool.parent >= 0)
        return in_tree | parent_in | (pool.parent < 0)  # the root is in every tree
    if s.score == "top_m":
        order = torch.argsort(draft_rank if rank is None else rank)
        outside = order[~in_tree[order]][: s.score_top_m]  # best-ranked first
        return in_tree | torch.zeros_like(in_tree).index_fill_(0, outside, True)
    if draw is None or uses_draw_tree(s.entry, draw):
        return in_tree  # a draw tree lacks X1 only when X1 is off the pool: X1 alone
    n1 = pool.n_first
    return in_tree & (in_tree[:n1] & (pool.token[:n1] == draw)).any()


@dataclass
class Planned:
    """The selection with its host-side sizes."""

    sel: Selection
    n_scored: int  # pool prefixes in the tree pass
    n_tree: int  # pool nodes of the verified tree
    alone: bool  # X1 verified alone: one more batch row, `alone_row`, after the pool prefixes

    @property
    def alone_row(self) -> int:
        return 1 + self.n_scored

    @property
    def tree_size(self) -> int:
        """Nodes of the verified tree (X1 alone: 1)."""
        return self.n_tree + int(self.alone)

    @property
    def tree_passes(self) -> int:
        """Target passes the verify step runs: 1, or 0 when no row of it would be read."""
        return int(self.n_scored > 0 or self.alone)


def select_step(
    s: OnlineSettings, pool: Pool, levels: Levels, first: Tensor | None, draw: Tensor | None
) -> Planned:
    """The verified tree and the scored set, with |Q|, |T| and X1-alone on the host (host sync 1)."""
    in_tree, draft_rank, rank = rank_and_tree(
        s.entry, pool, s.base.select.budget, levels, first, draw
    )
    scored = scored_set(s, pool, in_tree, draft_rank, draw, rank)
    batch_row = torch.where(scored, scored.long().cumsum(0), -1)  # root is row 0
    sizes = [scored.sum(), in_tree.sum()]
    if uses_draw_tree(s.entry, draw):
        sizes.append((pool.token[: pool.n_first] != draw).all().long())  # X1 off the pool
    n_scored, n_tree, *off = torch.stack(sizes).tolist()
    if n_scored == 0:  # root rule, X1 off its tree's first level: X1 is the continuation
        in_tree, n_tree = torch.zeros_like(in_tree), 0
    return Planned(
        Selection(draft_rank, in_tree, scored, batch_row), n_scored, n_tree, bool(off and off[0])
    )


def target_logits(
    target: PreTrainedModel, stream: Stream, pool: Pool, plan: Planned,
    root_logits: Tensor | None, draw: Tensor | None,
) -> Tensor:  # fmt: skip
    """Rows [1 + |Q| (+ 1 for X1 alone), V]: the root's, each scored prefix's (pool order), X1's.

    The root row comes from the batch (draft/reranker/covering without a held row)
    or is known already (root pass, held row); with nothing to score, no pass runs.
    """
    if plan.tree_passes == 0:
        return root_logits
    root_pos = len(stream.tokens) - 1
    scored_idx = torch.nonzero_static(plan.sel.scored, size=plan.n_scored)[:, 0]  # [|Q|]
    if root_logits is None:  # no draw without the root row, so never X1 alone here
        root_t = torch.tensor([stream.tokens[-1]], device=target.device)
        return verification_pass(target, stream.target_cache, root_t, root_pos, pool, scored_idx)
    alone = draw if plan.alone else None
    tree = RP.cached_root_tree_pass(target, stream.target_cache, root_pos, pool, scored_idx, alone)
    return torch.cat([root_logits, tree])


def outcomes(
    logits: Tensor, row_logp: Tensor, pool: Pool, in_tree: Tensor, n_tree: int, prow: Tensor,
    s: DecodeSettings, gen: torch.Generator | None,
) -> Tensor:  # fmt: skip
    """The verifier's outcome token at every batch row. [n_rows].

    X1 alone's row has no tree children, so every verifier draws its outcome from the
    full row there (EAGLE-3's residual with nothing removed).
    """
    if s.decode.temperature == 0:
        return outcome_greedy(logits)
    if s.decode.verifier == "exhaustive":
        return outcome_exhaustive(row_logp, gen)
    # Exactly n_tree nodes, known on the host, so a static-size nonzero needs no sync.
    tree_idx = torch.nonzero_static(in_tree, size=n_tree)[:, 0]  # [n_tree] pool order
    if s.decode.verifier == "coupling" and pool.q_rows is not None:
        q = pool.q_rows[pool.q_parent_row[tree_idx]].exp()  # [n_tree, V'] q(. | parent)
        if pool.q_ids is not None:  # a drafter vocabulary (EAGLE-3's d2t): onto the target's
            q = q.new_zeros(len(tree_idx), row_logp.shape[-1]).index_copy_(1, pool.q_ids, q)
        return outcome_coupling(row_logp, pool.token[tree_idx], prow[tree_idx],
                                pool.draft_logprob[tree_idx], q, gen)  # fmt: skip
    # eagle3, and coupling over deterministic drafts (q a point mass: the same rule)
    return outcome_eagle3(row_logp, pool.token[tree_idx], prow[tree_idx], gen)


@dataclass
class Verified:
    """The verification pass and its traversal, on the device."""

    logits: Tensor  # [n_rows, V] model dtype (n_rows = 1 + |Q|, + 1 for X1 alone)
    row_logp: Tensor  # [n_rows, V] float32 at the law temperature
    prow: Tensor  # [P] batch row of each candidate's parent
    outcome: Tensor  # [n_rows] outcome token per row (row 0: the draw X1 when there is one)
    accepted: Tensor  # [P] bool, the accepted path among pool nodes


def verify_step(
    target: PreTrainedModel, stream: Stream, s: DecodeSettings, pool: Pool, plan: Planned,
    root_logits: Tensor | None, draw: Tensor | None,
) -> Verified:  # fmt: skip
    """One target pass over Q and X1 alone (none when neither), the outcome at every row, the path."""
    sel = plan.sel
    logits = target_logits(target, stream, pool, plan, root_logits, draw)
    row_logp = row_logprobs(logits, s.decode.temperature)
    prow = parent_rows(pool, sel)
    if plan.tree_passes == 0:
        return Verified(logits, row_logp, prow, draw, torch.zeros_like(sel.in_tree))
    outcome = outcomes(logits, row_logp, pool, sel.in_tree, plan.n_tree, prow, s, stream.generator)
    if draw is not None:
        outcome[0] = draw[0]  # the first draw was made from the root row already
    return Verified(
        logits, row_logp, prow, outcome, accepted_mask(pool, sel.in_tree, prow, outcome)
    )

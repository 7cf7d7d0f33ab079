"""A scored-set policy offline (`rerank.score`, the words of `run.score`: selection.policies)
and App. D.10's decoder without a root pass under it.

Coverage of a tree T under a policy (paper Eq. 5): the pass scores Q ⊇ T, where Q \\ T is
the policy's set taken in the rule's own order (top_m: the next M after T; frontier: every
candidate whose parent is in T or the root; record: the recording pass's `cand_scored`;
pool: all). The emitted address leaves T through its frontier F, so the round is covered
with probability cov(T) = sum of P(u) over u in Q ∩ F, from the recorded path probabilities
(greedy: 1 on the target's greedy path, so cov is 1 exactly when the greedy exit is scored).
`draft_scored` is draft selection's tree of as many nodes as draft's pass scores prefixes
(B + M under top_m): the decoder that is never covered and scores no more (Theorem 2).
Every pool edge's probability is recorded (`record`/`pool` recordings score every parent),
so any policy's coverage is exact at the recorded contexts.

`root_if_covered` (App. D.10): root selection in rounds that hold the root row, because the
previous round was covered, and draft selection otherwise, including the first round of each
generation. Each round verifies the tree of the rule it uses and scores Q of that tree in
that rule's order. With h_t the probability that round t holds the row (0 at a series' first
round and after a gap in the recorded round indices):

    c_t = h_t cov(T_root,t) + (1 - h_t) cov(T_draft,t)        h_t+1 = c_t
    V_t = h_t V_root,t + (1 - h_t) V_draft,t

At T = 0 each cov is 0 or 1, so h_t is whether the previous round was covered. At T > 0 it
is exact at the recorded contexts by total probability: round t's draws are independent of
whether it holds the row. A pass scores n_T + |Q \\ T| prefixes beside the root (`scored/`).
A learned rule reading the matched row is simulated the same way on its own two rankings,
with the row and without it (`rerank.evaluate.matched`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from features.registry import FEATURES
from rerank.evaluate.pool_chunks import ROUND_KEYS, PoolChunk, series_order
from rerank.evaluate.tree_coverage import compiled_coverage, parents_scored
from selection.context import PoolContext
from selection.policies import SCORE_MODES, SIMULATED
from selection.ranking import compiled_route, rank_order, ranks_of_order
from selection.rules import BASELINE, parse_value_key, value_key
from selection.values import lead_factor_scores, rule_scores, values_at_budgets
from specrank.runtime.jit import njit
from specrank.settings.errors import Refusal
from specrank.statistics.laws import law_name

ROOT_IF_COVERED = "root_if_covered"
DRAFT_SCORED = "draft_scored"
ROOT = "root"  # the rule a round that holds the root row selects with


def own_tree_coverage(ctx: PoolContext, order: Tensor, budget: int, policy: str, top_m: int,
                      scored: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(coverage, tree size, prefixes scored outside the tree) per round of the tree of the
    first `budget` in `order` under `policy` ([R] float64, int64, int64). `scored`: the
    recording's `cand_scored` ([R, P], for `record`)."""
    pool, valid = ctx.pool, ctx.pool.valid
    if policy == "tree":  # Q = T: never covered (Theorem 1); T holds min(B, valid) nodes, as
        # `order` ranks the valid candidates first; nothing to rank or gather
        n_tree = valid.sum(-1).clamp(max=budget)
        return torch.zeros(len(n_tree), dtype=torch.float64), n_tree, torch.zeros_like(n_tree)
    if policy == "record" and scored is None:
        raise ValueError("rerank.score=record needs the recording's cand_scored column")
    if (
        policy in SCORE_MODES
        and order.dim() == 2
        and all(map(compiled_route, (order, ctx.path_prob)))
    ):
        greedy = bool((pool.temperature == 0).all())  # one path: one term a round at most
        return compiled_coverage(order, valid, pool.parent, ctx.path_prob, budget, policy,
                                 top_m, scored, few_terms=greedy)  # fmt: skip
    rank = ranks_of_order(order)
    in_tree = (rank < budget) & valid
    outside = valid & ~in_tree
    parent_in = torch.gather(in_tree, -1, pool.parent.clamp(min=0))
    frontier = outside & ((pool.parent < 0) | parent_in)
    if policy == "top_m":
        q = outside & (rank < budget + top_m)
    elif policy == "frontier":
        q = frontier
    elif policy == "record":
        q = outside & scored
    elif policy == "pool":
        q = outside
    else:
        raise Refusal(f"The 'rerank.score' must be one of {list(SCORE_MODES)}. Got {policy!r}.")
    cov = torch.where(frontier & q, ctx.path_prob, 0.0).sum(-1, dtype=torch.float64)
    return cov, in_tree.sum(-1), q.sum(-1)


@dataclass
class PolicyRounds:
    """Per round and budget: the coverage and scored prefixes of draft's and root's own trees
    under the policy, chunk by chunk (a `ChunkConsumer` of the evaluation pass)."""

    budgets: Sequence[int]
    policy: str
    top_m: int = 100
    store: str = "the trace store"  # named when the store cannot simulate the policy
    parts: list[pd.DataFrame] = field(default_factory=list)
    simulable_share: float = float("nan")  # set by apply
    # The learned rules whose matched row the policy decides (SIMULATED), simulated on their
    # own trees (rerank.evaluate.matched), and their log phat with and without the row:
    # `rerank.evaluate.values.LearnedFactors` of `with/<rule>` and `without/<rule>`.
    simulated: Sequence[str] = ()
    factors: Any = None

    def __post_init__(self) -> None:
        if self.policy not in SCORE_MODES:
            raise Refusal(
                f"The 'rerank.score' must be one of {list(SCORE_MODES)}. Got {self.policy!r}."
            )
        if self.policy == "top_m" and self.top_m < 1:
            raise Refusal(f"The 'rerank.score_top_m' must be >= 1. Got {self.top_m}.")
        if self.simulated and (self.policy not in SIMULATED or self.factors is None):
            raise ValueError(f"rules {list(self.simulated)} are simulated on their own trees "
                             f"under {SIMULATED}, with their predictions with and without the "
                             f"matched row; got rerank.score={self.policy}")  # fmt: skip

    @property
    def columns(self) -> tuple[str, ...]:
        return () if self.policy == "tree" else ("cand_scored",)

    def part(self, chunk: PoolChunk) -> pd.DataFrame:
        ctx = chunk.ctx
        scored = chunk.scored if self.policy == "record" else None
        cols: dict[str, np.ndarray] = {SIMULABLE: simulable_rounds(chunk, self.policy)}
        orders = {BASELINE: chunk.order}
        if self.policy != "tree":  # under tree no tree is covered (Theorem 1): root's order
            orders[ROOT] = rank_order(rule_scores(ctx, ROOT), ctx.restrict)  # is not needed
        for b in self.budgets:
            for name, order in orders.items():
                cov, n_tree, extra = own_tree_coverage(ctx, order, b, self.policy, self.top_m,
                                                       scored)  # fmt: skip
                cols[value_key(f"cov/{name}", b)] = cov.numpy()
                cols[value_key(f"scored/{name}", b)] = (n_tree + extra).double().numpy()
            if ROOT not in orders:  # the same tree size, never covered
                cols[value_key(f"cov/{ROOT}", b)] = np.zeros(len(chunk.table))
                cols[value_key(f"scored/{ROOT}", b)] = cols[value_key(f"scored/{BASELINE}", b)]
        for b in self.budgets:
            # draft's tree as large as its pass's scored prefixes: the first n in draft order,
            # from draft's value curve up to the largest n (a prefix of the whole curve's sums)
            n = torch.from_numpy(cols[value_key(f"scored/{BASELINE}", b)]).long()
            cum = chunk.path_prob_ordered[:, : max(int(n.max()), 1)].cumsum(-1, dtype=torch.float64)
            at = torch.gather(cum, -1, (n - 1).clamp(min=0)[:, None])[:, 0]
            cols[value_key(DRAFT_SCORED, b)] = torch.where(n > 0, at, 0.0).numpy()
        for rule in self.simulated:
            cols.update(self._own_trees(chunk, rule))
        keys = chunk.keys[ROUND_KEYS].reset_index(drop=True)
        return pd.concat([keys, pd.DataFrame(cols)], axis=1)

    def _own_trees(self, chunk: PoolChunk, rule: str) -> dict[str, np.ndarray]:
        """A simulated rule's values, coverage and scored prefixes at every budget, of its
        tree with the matched row and of its tree without (`with/` and `without/`)."""
        ctx, cols = chunk.ctx, {}
        row = self.factors.rows(chunk.keys)
        if (row < 0).any():
            raise ValueError(f"predictions of {rule} lack {int((row < 0).sum())} rounds of "
                             f"the store; every round needs one")  # fmt: skip
        width = ctx.levels[0][1] if ctx.levels else ctx.pool.shape[1]
        for variant in ("with", "without"):
            log_phat = self.factors.matrix(row, f"{variant}/{rule}", width)
            order = rank_order(lead_factor_scores(ctx, log_phat), ctx.restrict)
            values = values_at_budgets(order, ctx.path_prob, self.budgets)
            for j, b in enumerate(self.budgets):
                cov, n_tree, extra = own_tree_coverage(ctx, order, b, self.policy, self.top_m,
                                                       chunk.scored)  # fmt: skip
                cols[value_key(f"{variant}/{rule}", b)] = values[:, j].double().numpy()
                cols[value_key(f"cov/{variant}/{rule}", b)] = cov.numpy()
                cols[value_key(f"scored/{variant}/{rule}", b)] = (n_tree + extra).double().numpy()
        return cols

    def merge(self, part: pd.DataFrame) -> None:
        self.parts.append(part)

    def apply(self, per_round: pd.DataFrame) -> pd.DataFrame:
        """`per_round` (the pass's rounds, in the same chunk order) with `root_if_covered@B`,
        its held probability `held/root_if_covered@B`, `draft_scored@B` and the scored
        prefixes per pass of draft's tree and root_if_covered's (`scored/<rule>@B`); each
        simulated rule's value replaced by its own trees' (`<rule>@B`, `held/<rule>@B`,
        `scored/<rule>@B`: rerank.evaluate.matched)."""
        frame = pd.concat(self.parts, ignore_index=True)
        if not frame[ROUND_KEYS].equals(per_round[ROUND_KEYS].reset_index(drop=True)):
            raise ValueError("the policy's rounds are not the evaluation pass's rounds")
        self.simulable_share = float(frame[SIMULABLE].mean()) if len(frame) else 1.0
        if self.simulable_share < 1.0:
            # every rule is compared on one set of rounds, so a store short of some is refused
            # rather than evaluated on a subset
            raise Refusal(
                f"{self.store} cannot simulate rerank.score={self.policy}: in "
                f"{1 - self.simulable_share:.1%} of its rounds a candidate's parent was not "
                f"scored (cand_scored), so the policy's coverage is unknown there; expected a "
                f"store recorded with run.score=record or pool, which scores every parent"
            )
        order, follows = series_order(frame[ROUND_KEYS])
        out = per_round.copy(deep=False)  # copy-on-write: the new columns only, no data copied

        def held(rule: str, b: int, without: str, with_: str) -> np.ndarray:
            """h_t of `rule` over the rounds (module doc), its trees `without` / `with_` the row."""
            h = np.empty(len(frame))
            h[order] = _held(follows, frame[value_key(f"cov/{without}", b)].to_numpy()[order],
                             frame[value_key(f"cov/{with_}", b)].to_numpy()[order])  # fmt: skip
            out[value_key(f"held/{rule}", b)] = h
            return h

        for b in self.budgets:
            h = held(ROOT_IF_COVERED, b, BASELINE, ROOT)
            draft, root = out[value_key(BASELINE, b)].to_numpy(), out[value_key(ROOT, b)].to_numpy()
            out[value_key(ROOT_IF_COVERED, b)] = h * root + (1.0 - h) * draft
            s_d = frame[value_key(f"scored/{BASELINE}", b)].to_numpy()
            s_r = frame[value_key(f"scored/{ROOT}", b)].to_numpy()
            out[value_key(f"scored/{BASELINE}", b)] = s_d
            out[value_key(DRAFT_SCORED, b)] = frame[value_key(DRAFT_SCORED, b)].to_numpy()
            out[value_key(f"scored/{ROOT_IF_COVERED}", b)] = h * s_r + (1.0 - h) * s_d
            for rule in self.simulated:  # its value and count replace the pass's
                h = held(rule, b, f"without/{rule}", f"with/{rule}")
                v_with, v_without, s_with, s_without = (
                    frame[value_key(f"{what}{v}/{rule}", b)].to_numpy()
                    for what in ("", "scored/") for v in ("with", "without"))  # fmt: skip
                out[value_key(rule, b)] = h * v_with + (1.0 - h) * v_without
                out[value_key(f"scored/{rule}", b)] = h * s_with + (1.0 - h) * s_without
        return out


SIMULABLE = "simulable"  # the round holds every prefix the policy's coverage reads


def simulable_rounds(chunk: PoolChunk, policy: str) -> np.ndarray:
    """[R] bool: the rounds in which `policy` can be simulated. Its coverage reads the path
    probability of every candidate it may score, so each candidate's parent must have been
    scored by the recording pass (`cand_scored`); under `tree` nothing is covered
    (Theorem 1), so every round is."""
    if policy == "tree":
        return np.ones(len(chunk.table), dtype=bool)
    pool = chunk.ctx.pool
    if compiled_route(pool.parent):
        return parents_scored(chunk.scored, pool.parent, pool.valid)
    parent_scored = torch.gather(chunk.scored, -1, pool.parent.clamp(min=0)) | (pool.parent < 0)
    return (parent_scored | ~pool.valid).all(-1).numpy()


@njit()
def _held(follows: np.ndarray, cov_draft: np.ndarray, cov_root: np.ndarray) -> np.ndarray:
    """h_t of the module doc over rounds sorted by series and round index: 0 where a round
    does not follow the previous one, else the previous round's coverage."""
    out = np.zeros(len(follows))
    h = 0.0
    for i in range(len(follows)):
        if not follows[i]:
            h = 0.0
        out[i] = h
        h = h * cov_root[i] + (1.0 - h) * cov_draft[i]
    return out


def scored_means(per_round: pd.DataFrame) -> dict[tuple[str, int, str], float]:
    """(law, budget, rule) -> mean prefixes the rule's pass scores beside the root under the
    policy: root_if_covered's from its own trees, every other rule's from draft's tree
    (exact for tree, top_m and pool, whose count does not depend on the tree; frontier and
    record count draft's tree's)."""
    means = {}
    for temperature, part in per_round.groupby("temperature"):
        law = law_name(float(temperature))
        for c in part.columns:
            if c.startswith("scored/") and (p := parse_value_key(c.removeprefix("scored/"))):
                means[(law, p[1], p[0])] = float(part[c].mean())
    return means


def with_scored_prefixes(table: pd.DataFrame, per_round: pd.DataFrame) -> pd.DataFrame:
    """`table` (rows by law, budget and rule: `rule`, or a comparison's `a` and `b`) with
    each rule's `scored_prefixes` per pass (`scored_prefixes_a` / `_b`), round-weighted at
    every weighting (`scored_means`)."""
    means = scored_means(per_round)

    def count(row: pd.Series, rule_column: str) -> float:
        own = means.get((row["law"], row["budget"], row[rule_column]))
        return own if own is not None else means.get((row["law"], row["budget"], BASELINE), np.nan)

    out = table.copy()
    names = {"rule": "scored_prefixes", "a": "scored_prefixes_a", "b": "scored_prefixes_b"}
    for column, name in names.items():
        if {column, "law", "budget"} <= set(out.columns):
            out[name] = out.apply(count, axis=1, args=(column,)) if len(out) else np.nan
    return out


def policy_text(summary: pd.DataFrame, policy: str, top_m: int, simulable: float,
                simulated: Sequence[str] = (), fit_budget: int | None = None) -> str:  # fmt: skip
    """The scored set the figures are for, the share of rounds it is simulated in, each
    budget's prefixes per pass, and the budget whose trees the `simulated` sets' fits took
    the matched row's availability from (`rerank.evaluate.matched`)."""
    what = f"rerank.score={policy}" + (f", M={top_m}" if policy == "top_m" else "")
    lines = [f"scored set: {what}, simulated in {simulable:.1%} of the rounds; prefixes "
             f"scored per pass beside the root, draft's tree ({ROOT_IF_COVERED}'s own trees):"]  # fmt: skip
    sub = summary[summary["weighting"] == "round"] if "weighting" in summary else summary
    for (law, b), part in sub.groupby(["law", "budget"], sort=False):
        by_rule = part.set_index("rule")["scored_prefixes"]
        own = by_rule.get(ROOT_IF_COVERED, np.nan)
        lines.append(f"  {law} B={b}: {by_rule.get(BASELINE, np.nan):.1f} ({own:.1f}); "
                     f"{DRAFT_SCORED} = draft at that count")  # fmt: skip
    others = sorted({int(b) for b in sub["budget"]} - {fit_budget})
    if simulated and others:
        lines.append(f"  {', '.join(simulated)}: fitted on the matched row as draft's trees at "
                     f"B={fit_budget} hold it; at B={others} that fit is kept (a job with "
                     f"rerank.budgets=[<b> first] fits b's)")  # fmt: skip
    return "\n".join(lines)


# The feature groups whose rows a policy decides: the matched row exists only when the
# previous pass scored the emitted address; the token-only rows are the previous pass's other
# scored prefixes ending in the continuation (features.registry groups).
POLICY_GROUPS = ("matched", "token_only")
# Policies under which those rows are the recording's own (record). Under tree neither is
# there (matched: Theorem 1; token-only: selection.policies.NO_TOKEN_ONLY); under SIMULATED the
# matched row follows the rule's own trees (rerank.evaluate.matched) and no token-only row is kept.
MATCHED_AS_RECORDED = ("record",)
# A feature's value where its row is absent: a count of rows is 0, the rest are missing
ABSENT = {"token_only_count": 0}


def policy_dependent(features: Sequence[str]) -> list[str]:
    """Of `features`, those whose row the policy decides (POLICY_GROUPS in the registry)."""
    groups = {f.name: f.group for f in FEATURES}
    return [f for f in features if groups.get(f) in POLICY_GROUPS]


def for_policy(frame: pd.DataFrame, policy: str, next_root: Any = None,
               variant: str = "fit") -> pd.DataFrame:  # fmt: skip
    """The candidate rows as a decoder under `policy` has them, in fitting and prediction
    alike. Under `record` the matched and token-only rows are the recording's own. Elsewhere
    the decoder keeps no token-only row (`selection.policies.NO_TOKEN_ONLY`), and under `tree`
    never the matched row (Theorem 1: the emitted address is never a verified prefix): their
    features take their values without a row (ABSENT: count 0, the rest missing), as the
    online decoder computes them. Under SIMULATED the matched row's features are those of
    `next_root` (`rerank.evaluate.matched.NextRootRows`) in `variant`: held where draft's trees
    hold the row (`fit`), everywhere (`with`) or nowhere (`without`)."""
    if policy in MATCHED_AS_RECORDED:
        return frame
    cols = policy_dependent(frame.columns)
    if not cols:
        return frame
    # the absent value in the column's own dtype (an int count stays int32, as stored)
    values = {c: np.full(len(frame), ABSENT.get(c, np.nan), frame[c].dtype) if c in ABSENT
              else np.nan for c in cols}  # fmt: skip
    if policy in SIMULATED:
        if next_root is None:
            raise ValueError(f"rerank.score={policy}: the matched row follows the decoder's own "
                             f"trees, so its features need the simulated rows (NextRootRows)")  # fmt: skip
        values.update(next_root.matched(frame, variant))
    return frame.assign(**values)

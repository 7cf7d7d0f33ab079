"""Rule routes (docs/method.md#rule-values): how a rule's value is computed offline and how its
tree is built online, as registered objects that consumers call and branch on by flag.

A `selection.rules.Rule` entry holds one `OfflineRoute` and one `OnlineRoute` (None: that
side does not have the rule). Nothing compares route names: the offline evaluator
(`selection.values`) calls an offline route's `scores` (and `lead`, its one-pass shortcut) or
reads its flags; the online decoder (`decode.round`, `decode.tree_pass`) calls an online
route's `tree` and reads its flags. Every route is registered by name when it is built, so a
pickled or copied entry comes back holding the same route objects.

An online route's tree function is registered apart (`register_tree`), by the module that
defines it: the shipped routes' live in `decode.tree_pass`, a layer above this one, beside
the root-pass helpers they call; a new route's may live beside its entry, written with
`selection.ranking` alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from selection.context import PoolContext
from selection.ranking import Levels, leading_factor_edges, path_sum

# A rule's entry, `selection.rules.Rule`: that module imports this one, so the functions here
# name it `Entry` (what they read of it: name, params, lead_depth, lead_softmax, draw_tree).
Entry = Any

_OFFLINE: dict[str, OfflineRoute] = {}
_ONLINE: dict[str, OnlineRoute] = {}
_TREES: dict[str, TreeFn] = {}

# candidate scores [R, P] of a rule on a batch of pools, non-increasing along paths
ScoreFn = Callable[[PoolContext, Entry], Tensor]
# the compiled one-pass shortcut of a score function: the replaced leading log factors
# (leading pool columns, [R, n]; NaN keeps the draft factor) and the depth they reach
LeadFn = Callable[[PoolContext, Entry], tuple[Tensor, int]]


def _register(table: dict, route: Any) -> None:
    if route.name in table:
        raise ValueError(f"route {route.name!r} is registered already")
    table[route.name] = route


@dataclass(frozen=True, eq=False)  # one object per route: entries compare by it
class OfflineRoute:
    """How `selection.values.evaluate_pools` gets a rule's value on recorded pools.

    A route with `scores` (or a draw flag) is computed from the pool alone (`from_pool`: the
    rule joins `selection.rules.POOL_RULES`); one without is given by its caller (a fitted
    reranker's first factor, a calibrator's scores, the policy's trees: `rerank.evaluate`).
    """

    name: str
    scores: ScoreFn | None = None  # ranked by these candidate scores
    lead: LeadFn | None = None  # ... or, on the compiled route, by these leading factors
    draft_order: bool = False  # its order is draft selection's: its values are draft's
    draw_values: bool = False  # X1 drawn from the root row first (selection.draws.draw_values)
    pearl_curves: bool = False  # draft's tree below the draw (selection.draws.pearl_curves)

    def __post_init__(self) -> None:
        _register(_OFFLINE, self)

    def __reduce__(self) -> tuple:
        return offline_route, (self.name,)

    @property
    def from_pool(self) -> bool:
        return self.scores is not None or self.draws_x1

    @property
    def draws_x1(self) -> bool:
        """Its value is an exact expectation over the first draw X1 (a draw rule)."""
        return self.draw_values or self.pearl_curves


@dataclass(frozen=True)
class TreeInputs:
    """What a round knows when it selects (`decode.tree_pass.rank_and_tree`)."""

    entry: Entry
    pool: Any  # tree.pool.Pool (a layer above): token, parent, depth, score, draft_logprob
    budget: int
    levels: Levels
    draft_rank: Tensor  # [P] draft selection's rank (0 = kept first)
    first_logprob: Tensor | None  # [n_first] with `first_factor`: the first-level log factor
    draw: Tensor | None  # [1] X1, drawn from the root row (root-pass rules, covering's held row)


# (in_tree [P] bool, the rule's own rank [P]: orders the `top_m` scored set)
TreeFn = Callable[[TreeInputs], tuple[Tensor, Tensor]]


@dataclass(frozen=True, eq=False)
class OnlineRoute:
    """How the online decoder builds a rule's verified tree (`decode.tree_pass`)."""

    name: str
    # ranks with a first-level log factor known before verification: a fitted reranker's
    # (a `predictor` rule) or the root row's (decode.round)
    first_factor: bool = False
    # once X1 is drawn from the root row its tree lies below X1 (X1 alone when X1 is off the
    # pool's first level); its rounds read target rows outside the drafted chain
    draws_x1: bool = False
    # a round may emit a tree leaf as its continuation and hold that leaf's row for the next
    # round (App. D.10's covering decoder)
    emits_leaf: bool = False

    def __post_init__(self) -> None:
        _register(_ONLINE, self)

    def __reduce__(self) -> tuple:
        return online_route, (self.name,)

    @property
    def tree(self) -> TreeFn:
        if self.name not in _TREES:
            raise LookupError(f"online route {self.name!r}: no tree function registered "
                              "(the shipped routes' register on importing decode.tree_pass)")  # fmt: skip
        return _TREES[self.name]


def register_tree(route: OnlineRoute) -> Callable[[TreeFn], TreeFn]:
    """Decorator: `fn` builds `route`'s tree. One function per route."""

    def add(fn: TreeFn) -> TreeFn:
        if _TREES.setdefault(route.name, fn) is not fn:
            raise ValueError(f"online route {route.name!r} has a tree function already")
        return fn

    return add


def offline_route(name: str) -> OfflineRoute:
    return _OFFLINE[name]


def online_route(name: str) -> OnlineRoute:
    return _ONLINE[name]


# -- the shipped offline routes --------------------------------------------------------------


def _lead_prob(ctx: PoolContext, entry: Entry) -> Tensor:
    # root_softmax: greedy rounds ranked by the unit-temperature softmax, not the law
    return ctx.pool.target_prob if entry.lead_softmax else ctx.law


def _lead_scores(ctx: PoolContext, entry: Entry) -> Tensor:
    """Path sums with the factors at depths <= lead_depth from the target rows. [R, P]."""
    pool, upto, prob = ctx.pool, entry.lead_depth, _lead_prob(ctx, entry)
    if ctx.levels:  # the replaced depths are the leading columns: log just those
        prob = prob[:, : ctx.levels[min(upto, len(ctx.levels)) - 1][1]]
    edge = leading_factor_edges(pool.draft_logprob, torch.log(prob), pool.depth, upto, ctx.levels)
    return path_sum(edge, pool.parent, ctx.levels)


def _lead_factors(ctx: PoolContext, entry: Entry) -> tuple[Tensor, int]:
    """The replaced leading log factors (leading columns only) and their depth."""
    upto = entry.lead_depth
    end = ctx.levels[min(upto, len(ctx.levels)) - 1][1]
    return torch.log(_lead_prob(ctx, entry)[:, :end]), upto


# The oracle ranks by the path probability P(u) itself: log is monotone, and skipping it
# saves a pass over the pool (log of the many exact zeros of greedy rounds is slow on CPU).
DRAFT = OfflineRoute(name="draft", scores=lambda ctx, _: ctx.draft, draft_order=True)
ORACLE = OfflineRoute(name="oracle", scores=lambda ctx, _: ctx.path_prob)
# leading factors replaced by the exact root row (the entry's lead_depth, lead_softmax)
LEAD = OfflineRoute(name="lead", scores=_lead_scores, lead=_lead_factors)
DRAW = OfflineRoute(name="draw", draw_values=True)  # root-draw / PEARL-commit
PEARL_ROUTE = OfflineRoute(name="pearl", pearl_curves=True)
# given per round by the caller: a first-level log factor (learned, calibrated,
# substituted), whole candidate scores (per-depth calibration)
GIVEN_FIRST_FACTOR = OfflineRoute(name="first_factor")
GIVEN_SCORES = OfflineRoute(name="scores")
# computed from other rules' curves in the summary (matched-size PEARL)
DERIVED = OfflineRoute(name="derived")
# from draft's and root's trees under the scored-set policy (rerank.evaluate.policy:
# App. D.10's decoder, draft at the scored count)
POLICY = OfflineRoute(name="policy")

# -- the shipped online routes (their tree functions: decode.tree_pass) ----------------------

DRAFT_TREE = OnlineRoute(name="draft")  # draft selection's top-B tree
FACTOR_TREE = OnlineRoute(name="first_factor", first_factor=True)  # top-B under that factor
DRAW_TREE = OnlineRoute(name="draw", draws_x1=True)  # the entry's draw_tree below X1
# App. D.10's decoder: draft trees, a draw tree after a covered round
COVERING = OnlineRoute(name="covering", draws_x1=True, emits_leaf=True)

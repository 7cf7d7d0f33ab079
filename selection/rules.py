"""The selection rules (docs/method.md#rule-values), one entry each, and the one place rule and value names are
built and parsed.

Every consumer reads this table instead of comparing names: the offline evaluator
(`selection.values`, `rerank.evaluate`) by an entry's `offline` route, the online decoder
(`decode.round`, `decode.tree_pass`, `tree.root_pass`) by its `online` route and
`root_pass`, the settings checks, the plots (`family`) and the default comparisons
(`compare`). Routes are `selection.routes` objects that hold the functions computing the
rule (offline candidate scores, the online tree) and the flags consumers branch on; no
layer compares route names. A rule that exists on one side only has `None` for the other.

A new rule on a shipped route is one entry here plus its test. A new rule with a new
ranking adds, in this module beside its entry, its score function and `OfflineRoute`, and
for the decoder its `OnlineRoute` and tree function (`register_tree`, written with
`selection.ranking`); with its test that is two files. The derived lists below
(`POOL_RULES`, `FACTOR_RULES`, `online_rules()`) pick it up from the route's flags. A rule
defined elsewhere (a test module) joins by being added to `RULES`.

Parametrized rules are templates: a learned reranker `<feature set>_<model kind>`, a direct
substitution `sub_<row>`, a geometric mixture `mix_<row>` (with the per-weight columns
`mix_<row>_w<w>` it is chosen from). `rule(name)` resolves any name, fixed or templated.

Values travel as `<rule>@B<budget>` column names of the per-round table (one float column
per rule and budget, for the vectorised bootstrap); `value_key` / `parse_value_key` are
the only code that builds or reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from selection.routes import (
    COVERING,
    DERIVED,
    DRAFT,
    DRAFT_TREE,
    DRAW,
    DRAW_TREE,
    FACTOR_TREE,
    GIVEN_FIRST_FACTOR,
    GIVEN_SCORES,
    LEAD,
    ORACLE,
    PEARL_ROUTE,
    POLICY,
    OfflineRoute,
    OnlineRoute,
)

# -- the entries ------------------------------------------------------------------------------

RULE_KINDS = ("factor", "draw", "control", "learned", "derived")
MODEL_KINDS = ("hgb", "lgbm")  # the model kinds a learned rule's name carries


@dataclass(frozen=True, kw_only=True)  # entries name every field they set
class Rule:
    name: str
    family: str  # plot panel (rerank.report.plot_style.FAMILIES)
    kind: str  # factor | draw | control | learned | derived
    offline: OfflineRoute | None  # selection.routes; None: online only
    online: OnlineRoute | None = None  # selection.routes; None: offline only
    root_pass: bool = False  # online: one target pass over the root before selection
    rows: tuple[str, ...] = ()  # target rows it reads before verification
    lead_depth: int = 0  # lead: the factors at depths <= this come from the root row
    lead_softmax: bool = False  # lead: the unit-temperature softmax, not the law
    # draw rules: the tree kept below the first-level candidate g labelled by the draw X1:
    # "descendants" = g and its B-1 best draft-ranked descendants; "draft_tree" = draft
    # selection's B-tree restricted to g's subtree (docs/method.md#rule-values)
    draw_tree: str = ""
    compare: tuple[str, ...] = ()  # rules it is compared with by default (paired, as `a`)
    predictor: bool = False  # online: its first factor comes from a fitted reranker
    records: bool = False  # decode.record may record its trees (the paper records draft's)
    traces: bool = True  # decode.run can write its rounds as trace rows
    params: dict[str, str] = field(default_factory=dict, compare=False)  # a template's values

    @property
    def has_offline_value(self) -> bool:
        """Its expected value on a recorded round can be computed (a fitted reranker's from
        the log phat the round used)."""
        return self.offline is not None or self.predictor

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise ValueError(
                f"rule {self.name}: kind must be one of {RULE_KINDS}, got {self.kind!r}"
            )
        off, on = (
            isinstance(self.offline, OfflineRoute | None),
            isinstance(self.online, OnlineRoute | None),
        )
        if not (off and on):
            raise ValueError(f"rule {self.name}: routes are selection.routes objects, got "
                             f"{self.offline!r} / {self.online!r}")  # fmt: skip


_FIXED = (
    Rule(
        name="draft", family="draft", kind="factor", offline=DRAFT, online=DRAFT_TREE, records=True
    ),
    # the online decoder's fitted reranker; offline each is `<feature set>_<model kind>`
    Rule(
        name="reranker",
        family="learned",
        kind="learned",
        offline=None,
        online=FACTOR_TREE,
        predictor=True,
    ),
    Rule(
        name="root",
        family="exact",
        kind="factor",
        offline=LEAD,
        online=FACTOR_TREE,
        root_pass=True,
        rows=("root",),
        lead_depth=1,
        compare=("draft",),
    ),
    # greedy rounds ranked by the unit-temperature softmax of the root row (docs/method.md#rule-values)
    Rule(
        name="root_softmax",
        family="exact",
        kind="factor",
        offline=LEAD,
        rows=("root",),
        lead_depth=1,
        lead_softmax=True,
    ),
    Rule(
        name="depth_two",
        family="exact",
        kind="factor",
        offline=LEAD,
        rows=("root", "depth 1"),
        lead_depth=2,
    ),
    Rule(name="oracle", family="exact", kind="factor", offline=ORACLE, rows=("every scored row",)),
    Rule(
        name="root_draw",
        family="draw",
        kind="draw",
        offline=DRAW,
        online=DRAW_TREE,
        root_pass=True,
        rows=("root",),
        draw_tree="descendants",
        compare=("pearl", "pearl_matched"),
    ),
    Rule(
        name="pearl",
        family="draw",
        kind="draw",
        offline=PEARL_ROUTE,
        online=DRAW_TREE,
        root_pass=True,
        rows=("root",),
        draw_tree="draft_tree",
        compare=("pearl_commit",),
    ),
    # commits to the drafter's top first token instead of drawing it
    Rule(
        name="pearl_commit",
        family="draw",
        kind="draw",
        offline=DRAW,
        rows=("root",),
        draw_tree="descendants",
    ),
    # PEARL with its pre-draw budget raised until its mean tree size is root-draw's
    Rule(name="pearl_matched", family="draw", kind="derived", offline=DERIVED, rows=("root",)),
    # root selection after a covered round, draft otherwise: a decoder without a root pass,
    # covered as its own trees are under the policy (App. D.10)
    Rule(
        name="root_if_covered",
        family="exact",
        kind="control",
        offline=POLICY,
        rows=("matched",),
        compare=("draft_scored",),
    ),
    # draft selection's tree as large as the prefixes the policy's pass scores: the decoder
    # that is never covered and scores no more prefixes (App. D.10's Theorem 2)
    Rule(
        name="draft_scored", family="exact", kind="control", offline=POLICY
    ),  # plotted beside root_if_covered
    # App. D.10's covering decoder: its rounds emit a tree leaf as the continuation
    Rule(
        name="covering",
        family="draw",
        kind="control",
        offline=None,
        online=COVERING,
        draw_tree="descendants",
        traces=False,
    ),
    Rule(
        name="iso_q1",
        family="calibrators",
        kind="control",
        offline=GIVEN_FIRST_FACTOR,
        compare=("rank_control",),
    ),
    Rule(
        name="per_depth",
        family="calibrators",
        kind="control",
        offline=GIVEN_SCORES,
        compare=("rank_control",),
    ),
    Rule(name="rank_control", family="learned", kind="control", offline=GIVEN_FIRST_FACTOR),
)
RULES: dict[str, Rule] = {r.name: r for r in _FIXED}
BASELINE = "draft"  # every gain is relative to it
# the rules whose advantage over the baseline a share is of (docs/method.md#rule-values): root gain, oracle advantage
SHARE_TOPS = {"share_root": "root", "share_oracle": "oracle"}
# Derived from the routes' flags, so a new entry joins them by its route alone.
PEARL = next(
    r.name for r in _FIXED if r.offline and r.offline.pearl_curves
)  # its curves give the matched size
ROOT_DRAW = next(r.name for r in _FIXED if r.offline and r.offline.draw_values and r.root_pass)
PEARL_MATCHED = next(r.name for r in _FIXED if r.offline is DERIVED)  # PEARL at ROOT_DRAW's size
# The rules selection.values.evaluate_pools computes from the pool alone, in its order.
POOL_RULES = tuple(r.name for r in _FIXED if r.offline and r.offline.from_pool)
# ... ranked by candidate scores (per-edge log factors, docs/method.md#rule-values table), or drawing the first token first
FACTOR_RULES = tuple(n for n in POOL_RULES if RULES[n].offline.scores is not None)
DRAW_RULES = tuple(n for n in POOL_RULES if RULES[n].offline.draws_x1)


def learned(feature_set: str, model_kind: str, compare: tuple[str, ...] = ()) -> Rule:
    """The learned reranker of a feature set and model kind (`rows_lgbm`)."""
    if model_kind not in MODEL_KINDS:
        raise ValueError(f"model kind must be one of {MODEL_KINDS}, got {model_kind!r}")
    return Rule(name=f"{feature_set}_{model_kind}", family="learned", kind="learned",
                offline=GIVEN_FIRST_FACTOR, compare=compare,
                params={"feature_set": feature_set, "model_kind": model_kind})  # fmt: skip


def substitution(row: str) -> Rule:
    """Direct substitution of a retained row's first factor (`sub_cache`)."""
    return Rule(name=f"sub_{row}", family="substitutions", kind="control",
                offline=GIVEN_FIRST_FACTOR, rows=(row,), params={"row": row})  # fmt: skip


def mixture(row: str, weight: float | None = None) -> Rule:
    """Geometric mixture with draft (`mix_cache`; `mix_cache_w0.5` at one weight)."""
    name = f"mix_{row}" if weight is None else f"mix_{row}_w{weight:g}"
    params = {"row": row} | ({} if weight is None else {"weight": f"{weight:g}"})
    return Rule(
        name=name,
        family="mixtures",
        kind="control",
        offline=GIVEN_FIRST_FACTOR,
        rows=(row,),
        params=params,
    )


_LEARNED = re.compile(
    rf"^(?P<feature_set>[a-z][a-z0-9_]*)_(?P<model_kind>{'|'.join(MODEL_KINDS)})$"
)
_MIX = re.compile(r"^mix_(?P<row>[a-z]+)(?:_w(?P<weight>[0-9.]+))?$")


def rule(name: str) -> Rule:
    """The entry of any rule name, fixed or templated; an unknown name is refused by name."""
    if name in RULES:
        return RULES[name]
    if m := _MIX.match(name):
        return mixture(m["row"], None if m["weight"] is None else float(m["weight"]))
    if name.startswith("sub_") and len(name) > 4:
        return substitution(name[4:])
    if m := _LEARNED.match(name):
        return learned(m["feature_set"], m["model_kind"])
    raise ValueError(
        f"unknown rule {name!r}: expected one of {sorted(RULES)}, a learned reranker "
        f"'<feature set>_<{'|'.join(MODEL_KINDS)}>', 'sub_<row>' or 'mix_<row>'"
    )


def with_compare(r: Rule, compare: tuple[str, ...]) -> Rule:
    return replace(r, compare=compare)


def online_rules() -> tuple[str, ...]:
    """`run.rule` values: the rules with an online tree route (a rule added to RULES too)."""
    return tuple(n for n, r in RULES.items() if r.online is not None)


def root_pass_rules() -> tuple[str, ...]:
    return tuple(n for n, r in RULES.items() if r.root_pass)


# -- value names: `<rule>@B<budget>` ---------------------------------------------------------

_VALUE = re.compile(r"^(?P<rule>[^@]+)@B(?P<budget>\d+)$")


def value_key(name: str, budget: int) -> str:
    """The per-round column of a rule's value at a budget (`rows_lgbm@B8`)."""
    return f"{name}@B{int(budget)}"


def parse_value_key(key: str) -> tuple[str, int] | None:
    """(rule, budget) of a `value_key`; None for any other column."""
    m = _VALUE.match(key)
    return None if m is None else (m["rule"], int(m["budget"]))


def budgets_of(keys) -> list[int]:
    """The budgets among value keys, ascending."""
    return sorted({p[1] for k in keys if (p := parse_value_key(k)) is not None})

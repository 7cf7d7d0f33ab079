"""The first-level candidate features (docs/method.md#features), one entry each, and the feature sets.

Each entry holds a feature's name, the dtype `first_level_features` returns it in,
its group, the feature set it first belongs to, its nullability and type in the
candidate table, and its kernel slot: the output block row the compiled kernels write
it to (`features.kernels.fill` for the step `draft`, `row`, `shape`, `only`,
`context`, `flags`; `features.subtree.subtree_stats` for `subtree`). Generated from
this table: the kernels' output layout (`features.first_level.OUT_ROWS`), the
features' dtypes and order (`FEATURE_DTYPES`), the candidate schema
(`features.schema.CANDIDATE_SCHEMA`), the online features (the same functions) and
the feature sets (`FEATURE_SETS`, each with its parent; the rerankers'
`rerank.fit.models.FEATURE_SETS` add the token prior, computed per fold).

The order of the entries is the order of the features in the table and in every design
matrix: a new feature goes at the end of its group's block, and a new stored column
bumps `features.schema.CANDIDATE_VERSION`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

# the kernel steps, in the order of `features.kernels.fill`'s `out` (OUT_ROWS); `subtree`
# is written by `features.subtree.subtree_stats`. A step of `row` / `shape` writes one
# tuple of rows per row kind (cache, same, prev, matched: tree.retained.ROW_KINDS).
FILL_STEPS = ("draft", "drafti", "row", "shape", "only", "context", "contexti", "flags")
PER_KIND_STEPS = ("row", "shape")
SUBTREE_STEPS = ("subtree", "subtreei")
_KIND = {"cache": 0, "same": 1, "prev": 2, "matched": 3}


@dataclass(frozen=True)
class Feature:
    name: str
    dtype: type  # what first_level_features returns (float: NaN = missing)
    group: str  # draft | root | subtree | context | rows | rows_extra | matched | token_only
    first_set: str  # the feature set it first joins (FEATURE_SET_TREE)
    slot: tuple[str, int] | tuple[str, int, int]  # (step, row) or (step, kind, row)
    nullable: bool = False  # may be null in the candidate table
    stored: pa.DataType | None = None  # the table's type, where not dtype's (integer floats)

    @property
    def arrow_type(self) -> pa.DataType:
        return self.stored or pa.from_numpy_dtype(np.dtype(self.dtype))


def _f(name, group, first_set, *slot, nullable=False, stored=None) -> Feature:
    return Feature(name, np.float32, group, first_set, slot, nullable, stored)


def _i(name, group, first_set, *slot) -> Feature:
    return Feature(name, np.int32, group, first_set, slot)


def _b(name, group, first_set, *slot) -> Feature:
    return Feature(name, np.bool_, group, first_set, slot)


def _extra_rows(kind: str) -> tuple[Feature, ...]:
    """Beyond the paper, per retained row: the candidate's rank under it, the row's shape
    (entropy, top-1 mass) and whether its argmax is the drafter's top first token."""
    k, first_set = _KIND[kind], "rows_matched" if kind == "matched" else "rows_extra"
    group = "matched" if kind == "matched" else "rows_extra"
    return (
        _f(f"{kind}_rank", group, first_set, "row", k, 2, nullable=True),
        _f(f"{kind}_entropy", group, first_set, "shape", k, 0, nullable=True),
        _f(f"{kind}_top1", group, first_set, "shape", k, 1, nullable=True),
        _f(f"{kind}_top_is_draft_top", group, first_set, "shape", k, 2, nullable=True),
    )


_i32 = pa.int32()
FEATURES: tuple[Feature, ...] = (
    # the candidate's draft probability among its siblings
    _f("draft_logprob", "draft", "base", "draft", 0),  # log q(x1)
    _f("draft_prob", "draft", "base", "draft", 1),  # q(x1)
    _i("draft_rank", "draft", "base", "drafti", 0),  # 0 = the drafter's top (ties: pool index)
    _f("draft_prob_share", "draft", "base", "draft", 2),  # q(x1) / sum of q over the first level
    # largest q among the other first-level candidates; NaN if none
    _f("top_sibling_prob", "draft", "base", "draft", 3, nullable=True),
    # log q(x1) - log top_sibling_prob; NaN if no sibling
    _f("margin_top_sibling", "draft", "base", "draft", 4, nullable=True),
    # log q of the next-higher-ranked sibling - log q(x1); NaN at rank 0
    _f("gap_above", "draft", "base", "draft", 5, nullable=True),
    # log q(x1) - log q of the next-lower-ranked sibling; NaN at the last
    _f("gap_below", "draft", "base", "draft", 6, nullable=True),
    _f("sibling_mass", "draft", "base", "draft", 7),  # sum of q over the other first level
    # the draft distribution at the root (round-level)
    _i("n_first_level", "root", "base", "drafti", 1),
    _f("fl_draft_mass", "root", "base", "draft", 8),  # sum of q over the first level
    _f("root_draft_entropy", "root", "base", "draft", 9),  # nats, over the renormalised q
    _f("root_draft_top1", "root", "base", "draft", 10),  # max q
    # the pool subtree below the candidate (features.subtree.subtree_stats says what each is)
    _b("expanded", "subtree", "base", "flags", 0),
    _i("subtree_size", "subtree", "base", "subtreei", 0),
    _i("subtree_depth", "subtree", "base", "subtreei", 1),
    _f("subtree_best_d2", "subtree", "base", "subtree", 0, nullable=True),
    _f("subtree_best_deepest", "subtree", "base", "subtree", 1, nullable=True),
    _f("subtree_draft_mass", "subtree", "base", "subtree", 2),
    _f("subtree_draft_mass_rel", "subtree", "base", "subtree", 3, nullable=True),
    # context
    _i("prompt_length", "context", "base", "contexti", 0),
    _i("round_index", "context", "base", "contexti", 1),  # also a key column of the table
    _i("tokens_before", "context", "base", "contexti", 2),
    # NaN at round 0 (integer-valued)
    _f("prev_accepted", "context", "base", "context", 0, nullable=True, stored=_i32),
    _b("repeats_root", "context", "base", "flags", 1),  # token == root token
    # retained rows (the paper's "Rows"): log p under the row, minus the row's best first-level
    # log p; null where the row is absent
    _f("cache_logprob", "rows", "rows", "row", 0, 0, nullable=True),
    _f("cache_gap", "rows", "rows", "row", 0, 1, nullable=True),
    _f("same_logprob", "rows", "rows", "row", 1, 0, nullable=True),
    _f("same_gap", "rows", "rows", "row", 1, 1, nullable=True),
    # NaN for the candidate repeating the root token, always
    _f("prev_logprob", "rows", "rows", "row", 2, 0, nullable=True),
    _f("prev_gap", "rows", "rows", "row", 2, 1, nullable=True),
    # NaN without a cache row (integer-valued)
    _f("cache_age", "rows", "rows", "context", 1, nullable=True, stored=_i32),
    # NaN where the trace has none (integer-valued)
    _f("prev_tree_root_count", "rows", "rows", "context", 2, nullable=True, stored=_i32),
    *_extra_rows("cache"),
    *_extra_rows("same"),
    *_extra_rows("prev"),
    # the matched row (after a covered round: the next root row up to rounding; null
    # otherwise) ...
    _f("matched_logprob", "matched", "rows_matched", "row", 3, 0, nullable=True),
    _f("matched_gap", "matched", "rows_matched", "row", 3, 1, nullable=True),
    *_extra_rows("matched"),
    # ... and the token-only rows, aggregated
    _i("token_only_count", "token_only", "rows_matched", "contexti", 3),
    _f("token_only_mean_logprob", "token_only", "rows_matched", "only", 0, nullable=True),
    _f("token_only_max_logprob", "token_only", "rows_matched", "only", 1, nullable=True),
    # share whose argmax is the drafter's top; NaN if none
    _f("token_only_top_agree", "token_only", "rows_matched", "only", 2, nullable=True),
)
BY_NAME = {f.name: f for f in FEATURES}


@dataclass(frozen=True)
class FeatureSet:
    name: str
    parent: str | None  # the set it adds to
    paper: bool  # one of the paper's rerankers (docs/method.md#cross-fitting: Base, Rows)
    # rules it is compared with by default (as rule_a; a set names the run's reranker of it)
    compare: tuple[str, ...] = ()


FEATURE_SET_TREE = (
    FeatureSet("base", None, True, ("draft", "rank_control")),
    FeatureSet("rows", "base", True, ("base", "draft", "rank_control")),
    # beyond the paper: rank under each row, row shapes, argmax vs the drafter's top
    FeatureSet("rows_extra", "rows", False, ("rows", "rank_control")),
    # ... plus the matched row and the token-only rows ("Rows+matched")
    FeatureSet("rows_matched", "rows_extra", False, ("rows", "rows_extra", "rank_control")),
)
SETS = {s.name: s for s in FEATURE_SET_TREE}
# table columns that are also features of every set, ahead of the rest (task: categorical)
KEY_FEATURES = ("task", "round_index")


def lineage(name: str) -> list[str]:
    """The set and its ancestors, the root (base) first."""
    chain = []
    while name is not None:
        chain.append(name)
        name = SETS[name].parent
    return chain[::-1]


def first_in(name: str) -> list[str]:
    """The features a set adds to its parent, in table order."""
    return [f.name for f in FEATURES if f.first_set == name]


def set_features(name: str) -> list[str]:
    """A set's first-level features in design order: KEY_FEATURES, then its own and its
    ancestors' features in table order."""
    sets = set(lineage(name))
    rest = [f.name for f in FEATURES if f.first_set in sets and f.name not in KEY_FEATURES]
    return [*KEY_FEATURES, *rest]


def check_registry() -> None:
    """Every set's parent exists, every feature's set exists, and no two features share a
    name or a kernel slot (run at import, so a bad entry fails every user at once)."""
    problems = []
    for s in FEATURE_SET_TREE:
        if s.parent is not None and s.parent not in SETS:
            problems.append(f"set {s.name}: parent {s.parent!r} is not a set")
    slots: dict[tuple, str] = {}
    for f in FEATURES:
        if f.first_set not in SETS:
            problems.append(f"{f.name}: first_set {f.first_set!r} is not a set")
        if f.slot[0] not in (*FILL_STEPS, *SUBTREE_STEPS):
            problems.append(f"{f.name}: slot step {f.slot[0]!r} is not a kernel step")
        if f.slot in slots:
            problems.append(f"{f.name}: slot {f.slot} is {slots[f.slot]}'s too")
        slots[f.slot] = f.name
    if len(BY_NAME) != len(FEATURES):
        problems.append("two features share a name")
    if problems:
        raise ValueError("features.registry: " + "; ".join(problems))


check_registry()

"""The registries and their users agree (README "How to add"), and each name has one definition.

A rule, a feature or a drafter kind is one registry entry; these tests fail when an entry
and a module that reads it disagree (a rule no evaluator computes, a feature the kernels
do not write, a drafter kind the loader does not know), or when a list is defined twice.
"""

from __future__ import annotations

import ast
import dataclasses
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from features import first_level as FL
from features.registry import (
    FEATURE_SET_TREE,
    FEATURES,
    FILL_STEPS,
    KEY_FEATURES,
    SETS,
    SUBTREE_STEPS,
    lineage,
    set_features,
)
from features.schema import CANDIDATE_SCHEMA, KEY_COLUMNS, LABEL_COLUMNS
from pairs.config import ModelConfig
from pairs.models import DRAFTERS, drafter_kind
from rerank.config import RerankConfig
from rerank.fit.design import TOKEN_PRIOR
from rerank.fit.models import FEATURE_SETS
from rerank.report.comparisons import DEFAULT_COMPARISONS, parse_comparisons
from rerank.report.plot_style import FAMILIES
from rerank.serving import ROW_READING
from rerank.settings import run_rules
from selection.rules import (
    DRAW_RULES,
    FACTOR_RULES,
    MODEL_KINDS,
    POOL_RULES,
    RULES,
    learned,
    online_rules,
    parse_value_key,
    rule,
    value_key,
)
from selection.values import evaluate_pools
from tests.random_pools import random_pool_batch

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specrank", "selection", "tree", "pairs", "features", "rerank", "decode", "recipes",
            "calibrate")  # fmt: skip
# names every entry point or module has its own of, by convention (not lists of one idea):
# a module's logger, an entry point's main / run / run_record, a stage's SECTIONS, a card
PER_MODULE = {"log", "main", "run", "run_record", "SECTIONS", "write_card"}


def _definitions() -> dict[str, list[str]]:
    defs: dict[str, list[str]] = defaultdict(list)
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.Assign):
                    names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names = [node.target.id] if node.value is not None else []
                elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    names = [node.name]
                else:
                    names = []
                for name in names:
                    if not name.startswith("_") and name not in PER_MODULE:
                        defs[name].append(str(path.relative_to(ROOT)))
    return defs


def test_every_public_name_has_one_definition() -> None:
    twice = {n: paths for n, paths in _definitions().items() if len(paths) > 1}
    assert not twice, f"defined in more than one module: {twice}"


# -- rules ---------------------------------------------------------------------------------------


def test_every_rule_is_read_by_its_users() -> None:
    families = {f.key for f in FAMILIES}
    sets = {s.name for s in FEATURE_SET_TREE}
    for name, entry in RULES.items():
        # draft is the baseline: the zero line of every panel, not a panel
        assert entry.family in families | {"draft"}, f"{name}: family {entry.family!r}: no panel"
        for other in entry.compare:
            assert other in RULES or other in sets, f"{name}: compared with unknown {other!r}"
        assert entry.offline is not None or entry.online is not None, f"{name}: on no side"
    # offline: the job evaluates every rule with an offline route (calibrators when asked)
    job = run_rules(RerankConfig(calibrators=["iso_q1", "per_depth", "rank_control"]))
    offline = {n for n, r in RULES.items() if r.offline is not None}
    assert offline <= job, f"rules the job does not evaluate: {sorted(offline - job)}"
    assert set(FACTOR_RULES) | set(DRAW_RULES) == set(POOL_RULES)
    # online: `run.rule` accepts exactly the rules with an online route
    # (tests/test_online_decode.py decodes each of online_rules())
    assert set(online_rules()) == {n for n, r in RULES.items() if r.online is not None}


def test_every_pool_rule_gets_a_value_from_the_evaluator() -> None:
    pool = random_pool_batch(np.random.default_rng(3), 6, [3, 5, 4, 2])
    values = evaluate_pools(pool, [2, 8], rules=POOL_RULES)  # {rule: [R, n_budgets]}
    for name in POOL_RULES:
        got = values[name].numpy()
        assert got.shape == (6, 2) and np.isfinite(got).all() and (got >= 0).all(), name
        assert (got[:, 1] >= got[:, 0] - 1e-6).all(), name  # a larger budget keeps more


def test_rule_names_and_value_names_parse_back() -> None:
    for s in SETS:
        for kind in MODEL_KINDS:
            entry = learned(s, kind)
            assert rule(entry.name) == entry and entry.family == "learned"
    assert parse_value_key(value_key("rows_lgbm", 59)) == ("rows_lgbm", 59)
    assert parse_value_key("size/pearl@B8") is None or parse_value_key("pearl@B8") == ("pearl", 8)
    with pytest.raises(ValueError, match="unknown rule 'rows_xgb'"):
        rule("rows_xgb")


def test_default_comparisons_come_from_the_registries() -> None:
    pairs = parse_comparisons(DEFAULT_COMPARISONS, "lgbm")
    assert ("rows_lgbm", "base_lgbm") in pairs and ("root", "draft") in pairs  # the paper's
    for s in FEATURE_SET_TREE:  # every richer set against its parent
        if s.parent is not None:
            assert (f"{s.name}_lgbm", f"{s.parent}_lgbm") in pairs, s.name
    assert len(set(pairs)) == len(pairs)


# -- features ------------------------------------------------------------------------------------


def test_every_feature_is_written_stored_and_in_its_sets() -> None:
    names = [f.name for f in FEATURES]
    assert list(FL.FEATURE_DTYPES) == names  # first_level_features returns them in this order
    stored = [n for n in CANDIDATE_SCHEMA.names if n not in KEY_COLUMNS + LABEL_COLUMNS]
    assert stored == [n for n in names if n not in KEY_COLUMNS]
    for f in FEATURES:
        field = CANDIDATE_SCHEMA.field(f.name)
        assert (field.type, field.nullable) == (f.arrow_type, f.nullable), f.name
    # the kernels write every row of every output block exactly once: each step writes one
    # block (its features' dtype), and the steps of a block cover its rows
    step_dtypes: dict[str, set] = defaultdict(set)
    for f in FEATURES:
        step_dtypes[f.slot[0]].add(f.dtype)
    assert all(len(d) == 1 for d in step_dtypes.values()), step_dtypes
    steps = (*FILL_STEPS, *SUBTREE_STEPS)
    rows_of = dict(zip(steps, (*FL.OUT_ROWS, FL._SUB32, FL._SUBI32), strict=True))
    for dtype, block in ((np.float32, FL.F32), (np.int32, FL.I32), (np.bool_, FL.B8)):
        rows = [r for step in steps if step_dtypes.get(step) == {dtype}
                for part in rows_of[step] for r in (part if isinstance(part, tuple) else (part,))]  # fmt: skip
        assert sorted(rows) == list(range(len(block))), dtype
    # every set is its parent's features plus its own; the rerankers add the token prior
    for s in FEATURE_SET_TREE:
        assert lineage(s.name)[0] == "base"
        assert FEATURE_SETS[s.name] == [*set_features(s.name), TOKEN_PRIOR]
        assert set_features(s.name)[: len(KEY_FEATURES)] == list(KEY_FEATURES)
    beyond = {n for s in FEATURE_SET_TREE if s.parent for n in set(set_features(s.name))}
    assert beyond - set(set_features("base")) == ROW_READING


# -- drafter kinds -------------------------------------------------------------------------------


def test_every_drafter_kind_is_known_to_its_users() -> None:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert ModelConfig().drafter_kind in DRAFTERS
    for kind in DRAFTERS.values():
        assert set(kind.settings) <= fields, kind.name
        assert {"target", "drafter"} <= set(kind.manifest_fields), kind.name
        assert set(kind.verifiers) <= {"greedy", "sampling"}, kind.name
    # a setting of one kind given with another is refused before anything is read
    with pytest.raises(
        ValueError, match=r"model\.aux_layers' applies to model\.drafter_kind=eagle3"
    ):
        drafter_kind(ModelConfig(drafter_kind="standalone", aux_layers=[1, 2]))
    with pytest.raises(ValueError, match=r"model\.drafter_kind"):
        drafter_kind(ModelConfig(drafter_kind="medusa"))
    # the loaded pairs' manifest fields: tests/test_models.py, tests/test_eagle3_load.py


def test_no_name_is_imported_from_a_module_that_only_imports_it() -> None:
    """No re-export shims: `from a import x` names the module that defines x."""
    modules: dict[str, set[str]] = {}
    paths = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    for path in paths:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        defined = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined.add(node.target.id)
        modules[name] = defined
    through = []
    users = [
        *paths,
        *sorted((ROOT / "tests").rglob("*.py")),
        *sorted((ROOT / "bench").rglob("*.py")),
    ]
    for path in users:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}" in modules
                    if alias.name not in modules[node.module] and not submodule:
                        through.append(f"{path.relative_to(ROOT)}: {node.module}.{alias.name}")
    assert not through, f"names imported through a module that does not define them: {through}"

"""A fitted reranker's tree ensemble as one flat node table (`Forest`), read from either library.

The online decoder predicts phat for ~10 first-level candidates per round. The
libraries' own predictors are exact but CPU-only, and scikit-learn's spends ~2
ms of Python per call on 400 trees. A `Forest` holds every tree of a LightGBM
Booster or a HistGradientBoosting model as rows of one table (all trees
concatenated, leaves pointing to themselves) with each library's rules for
missing values and categories, so `rerank.forest.walk` can evaluate it with a
few array ops per tree level, on the CPU (numpy) or on a CUDA device (torch).

Exactness. Inputs are the float32 design matrix (`rerank.design.design_matrix`).
Both libraries compare the float64 image of a float32 input with a float64
threshold, so `x <= thr` is stored as `x <= t32`, t32 = the largest float32
<= thr: equal for every float32 x. Only the summation order of the leaf values
differs from the libraries (float64, ~1e-15); `tests/test_online_forest.py`
states and checks the tolerance.

Missing values and categories:
- scikit-learn HGB: categorical columns are first re-encoded by the model's
  OrdinalEncoder (a value unseen in training becomes NaN) and moved in front;
  NaN goes the node's `missing_go_to_left` way; at categorical nodes a negative
  or unknown code goes that way too.
- LightGBM: |x| <= 1e-35 is read as 0 (its dense-row reader drops such values);
  at numerical nodes NaN is read as 0 unless the missing type is NaN, and with
  missing type Zero (NaN) a 0 (NaN) goes the default way; at categorical nodes
  NaN, negative (after truncation) and unlisted categories go right.
Category codes are held in 64-bit masks: a model with a category code above 62
is refused with `ForestError`, and the caller uses the library's predictor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_CATEGORY = 62  # category codes 0..62 fit one int64 bit mask


class ForestError(ValueError):
    """A model this module cannot represent exactly (the caller falls back to the library)."""


@dataclass(frozen=True)
class Forest:
    """All trees' nodes in one table (numpy, M nodes); leaves point to themselves."""

    feature: np.ndarray  # [M] int64 input column tested (0 at leaves)
    threshold: np.ndarray  # [M] float32: x <= threshold goes left
    left: np.ndarray  # [M] int64 global node index
    right: np.ndarray  # [M] int64
    missing_left: np.ndarray  # [M] bool: the way a missing value goes
    nan_as_zero: np.ndarray  # [M] bool: NaN is read as 0 first (LightGBM None/Zero)
    zero_missing: np.ndarray  # [M] bool: 0 counts as missing (LightGBM Zero)
    categorical: np.ndarray  # [M] bool
    cat_left: np.ndarray  # [M] int64, bit c: category c goes left
    cat_known: np.ndarray  # [M] int64, bit c: category c is known (else: missing)
    value: np.ndarray  # [M] float64, leaf value (0 at internal nodes)
    roots: np.ndarray  # [T] int64
    depth: int  # longest root-to-leaf path (edges)
    base: float  # added to the sum of leaf values
    link: str  # "identity" | "logistic"
    sigmoid: float  # logistic slope (LightGBM's `sigmoid:` objective parameter)
    lightgbm: bool  # LightGBM's input rules (tiny values -> 0, truncating category codes)
    n_features: int  # input columns the model reads
    # HGB re-encodes categorical inputs first: (column, its training values); the code of
    # a value is its index there, a value not listed becomes NaN (missing).
    encode: tuple[tuple[int, np.ndarray], ...] = ()

    @property
    def n_trees(self) -> int:
        return int(self.roots.shape[0])


def float32_at_most(thr: np.ndarray) -> np.ndarray:
    """Largest float32 <= each float64 threshold: `x <= t32` iff `x <= thr` for float32 x."""
    thr = np.asarray(thr, dtype=np.float64)
    with np.errstate(over="ignore"):
        t32 = thr.astype(np.float32)  # round to nearest (overflow -> inf)
    up = t32.astype(np.float64) > thr
    t32[up] = np.nextafter(t32[up], np.float32(-np.inf))
    return t32


def _mask(codes: list[int], where: str) -> int:
    if any(c < 0 or c > MAX_CATEGORY for c in codes):
        raise ForestError(
            f"{where}: category codes {codes} exceed the fast path's range 0..{MAX_CATEGORY}"
        )
    out = 0
    for c in codes:
        out |= 1 << c
    return out


def _bits_to_codes(words: np.ndarray) -> list[int]:
    """Category codes set in a little-endian array of uint32 bitset words."""
    return [
        w * 32 + b for w, word in enumerate(np.asarray(words)) for b in range(32) if word >> b & 1
    ]


class _Builder:
    """Collects nodes tree by tree (load-time Python; never on the decoding path)."""

    def __init__(self) -> None:
        self.cols: dict[str, list] = {
            k: []
            for k in (
                "feature", "threshold", "left", "right", "missing_left", "nan_as_zero",
                "zero_missing", "categorical", "cat_left", "cat_known", "value",
            )
        }  # fmt: skip
        self.roots: list[int] = []
        self.depth = 0

    def add(self, **node: Any) -> int:
        idx = len(self.cols["feature"])
        for k, col in self.cols.items():
            col.append(node.get(k, _LEAF_DEFAULTS[k]))
        return idx

    def finish(
        self,
        base: float,
        link: str,
        sigmoid: float,
        lightgbm: bool,
        n_features: int,
        encode: tuple = (),
    ) -> Forest:
        c = self.cols
        n = len(c["feature"])
        idx = np.arange(n)
        left = np.asarray(c["left"], dtype=np.int64)
        right = np.asarray(c["right"], dtype=np.int64)
        is_leaf = left < 0
        return Forest(
            feature=np.asarray(c["feature"], dtype=np.int64),
            threshold=float32_at_most(np.asarray(c["threshold"], dtype=np.float64)),
            left=np.where(is_leaf, idx, left),
            right=np.where(is_leaf, idx, right),
            missing_left=np.asarray(c["missing_left"], dtype=bool),
            nan_as_zero=np.asarray(c["nan_as_zero"], dtype=bool),
            zero_missing=np.asarray(c["zero_missing"], dtype=bool),
            categorical=np.asarray(c["categorical"], dtype=bool),
            cat_left=np.asarray(c["cat_left"], dtype=np.int64),
            cat_known=np.asarray(c["cat_known"], dtype=np.int64),
            value=np.asarray(c["value"], dtype=np.float64),
            roots=np.asarray(self.roots, dtype=np.int64),
            depth=self.depth,
            base=float(base),
            link=link,
            sigmoid=float(sigmoid),
            lightgbm=lightgbm,
            n_features=n_features,
            encode=encode,
        )


_LEAF_DEFAULTS = {
    "feature": 0, "threshold": 0.0, "left": -1, "right": -1, "missing_left": False,
    "nan_as_zero": False, "zero_missing": False, "categorical": False, "cat_left": 0,
    "cat_known": 0, "value": 0.0,
}  # fmt: skip


def forest_of(estimator: Any, kind: str) -> Forest:
    """The node table of a fitted estimator of `kind` ("lgbm" or "hgb")."""
    return forest_from_lightgbm(estimator) if kind == "lgbm" else forest_from_hgb(estimator)


# -- LightGBM -----------------------------------------------------------------------------------


def _lgb_objective(objective: str) -> tuple[str, float]:
    name, *params = objective.split()
    if name == "regression":
        return "identity", 1.0
    if name == "binary":
        slope = [float(p.split(":")[1]) for p in params if p.startswith("sigmoid:")]
        return "logistic", slope[0] if slope else 1.0
    raise ForestError(f"LightGBM objective {objective!r}: expected 'regression' or 'binary'")


def forest_from_lightgbm(booster: Any) -> Forest:
    """The node table of a LightGBM Booster (regression or binary objective)."""
    d = booster.dump_model()
    if d.get("num_tree_per_iteration", 1) != 1 or d.get("average_output", False):
        raise ForestError("LightGBM: only one tree per iteration and summed outputs are supported")
    link, slope = _lgb_objective(str(d["objective"]))
    b = _Builder()
    for info in d["tree_info"]:
        b.roots.append(_lgb_tree(b, info["tree_structure"], 0))
    return b.finish(0.0, link, slope, lightgbm=True, n_features=int(d["max_feature_idx"]) + 1)


def _lgb_tree(b: _Builder, node: dict, depth: int) -> int:
    """Add one (sub)tree in pre-order; returns its root's index (depth <= 62: recursion is fine)."""
    b.depth = max(b.depth, depth)
    if "split_feature" not in node:
        return b.add(value=float(node["leaf_value"]))
    idx = b.add(**_lgb_split(node))
    b.cols["left"][idx] = _lgb_tree(b, node["left_child"], depth + 1)
    b.cols["right"][idx] = _lgb_tree(b, node["right_child"], depth + 1)
    return idx


def _lgb_split(node: dict) -> dict:
    missing = node.get("missing_type", "None")
    if missing not in ("None", "Zero", "NaN"):
        raise ForestError(f"LightGBM: unknown missing_type {missing!r}")
    if node["decision_type"] == "==":  # categorical: threshold "a||b||c" lists the left categories
        codes = [int(c) for c in str(node["threshold"]).split("||")]
        return dict(
            feature=int(node["split_feature"]),
            categorical=True,
            cat_left=_mask(codes, "LightGBM categorical split"),
            cat_known=-1,  # every other category goes right, like a missing one
            missing_left=False,
        )
    if node["decision_type"] != "<=":
        raise ForestError(f"LightGBM: unknown decision_type {node['decision_type']!r}")
    return dict(
        feature=int(node["split_feature"]),
        threshold=float(node["threshold"]),
        missing_left=bool(node["default_left"]),
        nan_as_zero=missing != "NaN",
        zero_missing=missing == "Zero",
    )


# -- scikit-learn HistGradientBoosting ------------------------------------------------------------


def forest_from_hgb(estimator: Any) -> Forest:
    """The node table of a fitted binary HistGradientBoostingClassifier or a squared-error regressor."""
    loss = type(estimator._loss).__name__
    links = {"HalfBinomialLoss": "logistic", "HalfSquaredError": "identity"}
    if loss not in links:
        raise ForestError(f"HGB loss {loss}: expected one of {sorted(links)}")
    if any(len(it) != 1 for it in estimator._predictors):
        raise ForestError("HGB: only one tree per iteration (binary or regression) is supported")
    known, f_idx_map = estimator._bin_mapper.make_known_categories_bitsets()
    column, encode = _hgb_inputs(estimator)
    b = _Builder()
    for (pred,) in estimator._predictors:
        nodes = pred.nodes
        offset = len(b.cols["feature"])
        b.roots.append(offset)
        b.depth = max(b.depth, int(nodes["depth"].max()))
        for i in range(nodes.shape[0]):
            nd = nodes[i]
            if nd["is_leaf"]:
                b.add(value=float(nd["value"]))
                continue
            split = dict(
                feature=int(column[nd["feature_idx"]]),
                threshold=float(nd["num_threshold"]),
                left=offset + int(nd["left"]),
                right=offset + int(nd["right"]),
                missing_left=bool(nd["missing_go_to_left"]),
            )
            if nd["is_categorical"]:
                where = f"HGB categorical split on feature {int(nd['feature_idx'])}"
                left_codes = _bits_to_codes(pred.raw_left_cat_bitsets[nd["bitset_idx"]])
                known_codes = _bits_to_codes(known[f_idx_map[nd["feature_idx"]]])
                split.update(
                    categorical=True,
                    cat_left=_mask(left_codes, where),
                    cat_known=_mask(known_codes, where),
                )
            b.add(**split)
    base = float(np.asarray(estimator._baseline_prediction).reshape(-1)[0])
    n_features = int(estimator.n_features_in_)
    return b.finish(base, links[loss], 1.0, lightgbm=False, n_features=n_features, encode=encode)


def _hgb_inputs(estimator: Any) -> tuple[np.ndarray, tuple[tuple[int, np.ndarray], ...]]:
    """Original column of each tree feature index, and the categorical re-encoding.

    With categorical features, HGB's preprocessor (a ColumnTransformer) puts the
    ordinally encoded categorical columns first, then the numerical ones; the
    trees index that output.
    """
    n = int(estimator.n_features_in_)
    if estimator._preprocessor is None:
        return np.arange(n), ()
    is_cat = np.asarray(estimator.is_categorical_, dtype=bool)
    column = np.concatenate([np.flatnonzero(is_cat), np.flatnonzero(~is_cat)])
    cats = estimator._preprocessor.named_transformers_["encoder"].categories_
    encode = tuple(
        (int(c), np.asarray(v, dtype=np.float64))
        for c, v in zip(np.flatnonzero(is_cat), cats, strict=True)
    )
    return column, encode

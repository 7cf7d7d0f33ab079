"""Evaluate a `rerank.forest.table.Forest`: categorical splits become virtual columns, then tree walks.

prepare (numpy, per call): X [N, F] float32 -> Xv [N, 2W], W = F + K
    HGB: categorical columns re-encoded; LightGBM: |x| <= 1e-35 read as 0
    one virtual column per categorical node k: 0.0 if the row goes left at k, else 1.0
    (threshold 0.5), so every node is numerical; then a second copy of all W
    columns with NaN replaced by -inf, read by the nodes that send NaN left.
    Every node is then one test:  go left  <=>  x <= t
    (NaN <= t is False: right; -inf <= t is True: left)
walk, CPU (numpy): node [N, T] starts at the roots, `depth` steps of
    node = child[node, go_left(Xv[n, feature[node]])]      (leaves are fixed points)
walk, any torch device: decisions at all M nodes at once, then pointer jumping:
    child [N, M] = next node; child = child[child] ceil(log2 depth) times
    (a fixed ~10 kernels whatever the depth: what a GPU wants; on a CPU the
    numpy walk touches only the ~depth x T nodes on the paths and is faster)
sum: raw [N] = base + sum over trees of value[leaf] (float64); link: identity | logistic

Two layouts evaluate a forest: this one (`CompiledForest`: the numpy reference walk, and
`TorchForest` on a device) and the compiled walk's (`rerank.forest.jit.JitForest`: the
online walk of one round's rows, and the offline batch walk, rows in parallel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rerank.forest.table import MAX_CATEGORY, Forest, ForestError

LGB_ZERO = np.float32(1e-35)  # LightGBM's kZeroThreshold (a float literal)
_EXIT_CHECK = 4  # the numpy walk checks every few steps whether all paths reached a leaf


@dataclass(frozen=True)
class CompiledForest:
    """A Forest with categorical nodes turned into tests on virtual columns. M nodes, K categorical."""

    forest: Forest
    feature: np.ndarray  # [M] int64 column of Xv (the -inf copy for nodes sending NaN left)
    threshold: np.ndarray  # [M] float32 (0.5 on virtual columns)
    child: np.ndarray  # [M, 2] int64: [right, left]
    is_leaf: np.ndarray  # [M] bool
    cat_column: np.ndarray  # [K] int64 input column of each categorical node
    cat_left: np.ndarray  # [K] int64 masks
    cat_known: np.ndarray  # [K] int64 masks
    cat_missing_left: np.ndarray  # [K] bool
    cat_floor: np.float32  # smallest value read as a category code


def compile_forest(f: Forest) -> CompiledForest:
    """Fold missing-value rules and categorical nodes into plain `x <= t` tests."""
    if f.zero_missing.any():
        raise ForestError("LightGBM zero_as_missing splits are not supported by the fast path")
    cats = np.flatnonzero(f.categorical)
    feature = f.feature.copy()
    feature[cats] = f.n_features + np.arange(cats.size)
    threshold = f.threshold.copy()
    threshold[cats] = np.float32(0.5)
    # LightGBM reads NaN as 0 at non-NaN missing types: then 0 <= t decides.
    nan_left = np.where(f.nan_as_zero, np.float32(0) <= f.threshold, f.missing_left)
    nan_left[cats] = False  # virtual columns are never NaN
    feature = feature + nan_left * (f.n_features + cats.size)  # the -inf copy
    # LightGBM truncates the code (int cast): x > -1 is a code >= 0; HGB refuses x < 0.
    floor = np.nextafter(np.float32(-1), np.float32(0)) if f.lightgbm else np.float32(0)
    return CompiledForest(
        forest=f,
        feature=feature,
        threshold=threshold,
        child=np.stack([f.right, f.left], axis=1),
        is_leaf=f.left == np.arange(f.left.size),
        cat_column=f.feature[cats],
        cat_left=f.cat_left[cats],
        cat_known=f.cat_known[cats],
        cat_missing_left=f.missing_left[cats],
        cat_floor=floor,
    )


def prepare(c: CompiledForest, X: np.ndarray) -> np.ndarray:
    """The walk's input Xv [N, 2 (F + K)] float32 from the design matrix X [N, F]."""
    f = c.forest
    if X.ndim != 2 or X.shape[1] != f.n_features:
        raise ValueError(f"forest input: expected [N, {f.n_features}] float32, got {X.shape}")
    X = np.array(X, dtype=np.float32, copy=True)
    for col, values in f.encode:  # HGB's OrdinalEncoder: code = index of the exact value
        match = X[:, col, None].astype(np.float64) == values[None, :]  # [N, n_values]
        X[:, col] = np.where(match.any(axis=1), match.argmax(axis=1), np.nan)
    if f.lightgbm:
        X[np.abs(X) <= LGB_ZERO] = 0.0  # NaN compares False and stays NaN
    if c.cat_column.size:
        X = np.concatenate([X, _virtual_columns(c, X)], axis=1)  # [N, W]
    return np.concatenate([X, np.where(np.isnan(X), np.float32(-np.inf), X)], axis=1)


def _virtual_columns(c: CompiledForest, X: np.ndarray) -> np.ndarray:
    """0.0 where a row goes left at categorical node k, else 1.0. [N, K] float32."""
    x = X[:, c.cat_column]  # [N, K]
    in_range = (x >= c.cat_floor) & (x < MAX_CATEGORY + 1)  # False for NaN
    bit = np.left_shift(np.int64(1), np.where(in_range, x, 0).astype(np.int64))  # truncates
    in_left = in_range & ((c.cat_left & bit) != 0)
    known = in_range & ((c.cat_known & bit) != 0)
    go_left = np.where(~in_left & ~known, c.cat_missing_left, in_left)  # unknown: missing way
    return (~go_left).astype(np.float32)


def link(c: CompiledForest, raw: np.ndarray | Tensor) -> np.ndarray | Tensor:
    """The model's prediction from raw scores (logistic: LightGBM's 1 / (1 + exp(-s raw)))."""
    if c.forest.link != "logistic":
        return raw
    z = -c.forest.sigmoid * raw
    return 1.0 / (1.0 + (z.exp() if isinstance(z, Tensor) else np.exp(z)))


def walk_numpy(c: CompiledForest, Xv: np.ndarray) -> np.ndarray:
    """Raw scores by walking every tree for every row (numpy). [N] float64."""
    f = c.forest
    n, width = Xv.shape
    flat = Xv.ravel()
    row_base = (np.arange(n) * width)[:, None]  # [N, 1]
    child = c.child.ravel()  # node * 2 + go_left
    node = np.broadcast_to(f.roots, (n, f.n_trees)).copy()  # [N, T]
    for step in range(f.depth):
        go = flat[row_base + c.feature[node]] <= c.threshold[node]  # [N, T]
        node = child[(node << 1) | go]
        if step % _EXIT_CHECK == _EXIT_CHECK - 1 and c.is_leaf[node].all():
            break
    return f.value[node].sum(axis=1) + f.base


class TorchForest:
    """A compiled forest resident on one torch device; `raw(Xv)` by pointer jumping."""

    def __init__(self, c: CompiledForest, device: torch.device | str) -> None:
        dev = torch.device(device)
        self.compiled, self.device = c, dev
        f = c.forest

        def t(x: np.ndarray) -> Tensor:
            return torch.as_tensor(np.ascontiguousarray(x), device=dev)

        self.feature, self.threshold = t(c.feature), t(c.threshold)
        self.left, self.right = t(f.left), t(f.right)
        self.value, self.roots = t(f.value), t(f.roots)
        # 2^jumps >= depth: enough squarings to reach a leaf from every root
        self.jumps = math.ceil(math.log2(f.depth)) if f.depth > 1 else 0

    @torch.inference_mode()
    def raw(self, Xv: Tensor) -> Tensor:
        """[N] float64 raw scores for the prepared input Xv [N, 2W] float32 (on this device)."""
        go = Xv[:, self.feature] <= self.threshold  # [N, M]
        child = torch.where(go, self.left, self.right)  # [N, M]
        for _ in range(self.jumps):  # after k squarings a node points 2^k levels down
            child = child.gather(1, child)
        return self.value[child[:, self.roots]].sum(dim=1) + self.compiled.forest.base

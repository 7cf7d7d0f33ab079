"""The compiled (numba) walk of a `rerank.forest.walk.CompiledForest`: the host layout.

The online decoder predicts phat for one round's ~10 first-level candidates. The
numpy walk (`forest.walk.walk_numpy`) pays a few array ops per tree level over all
trees at once (~0.4 ms for 400 trees of depth ~30 and 10 rows on this project's
2-core machine); LightGBM's own predictor ~0.2 ms a call, mostly in its Python and
ctypes layers. This walk visits only the nodes on each row's paths, in eight
lanes (independent chains of loads the CPU overlaps): lane j walks trees j, j + 8,
..., starting its next tree as soon as it reaches a leaf, so no lane waits for a
deeper tree of another.

Between two rounds the models' forward passes evict the node table from the
caches, and a walk that misses on every step costs several times a warm one. So
the table is small and read ahead: each tree renumbered in preorder (the left
child is the next node), a node in 8 bytes (threshold; Xv column, 1 bit "left =
next", 15 bits right-child offset; a leaf holds the index of its value instead
of a threshold, values of a tree's leaves side by side), and the walk first
streams through the table and the values (sequential loads the hardware
prefetches) before it walks.

Semantics are `forest.walk`'s, unchanged: the input is `forest.walk.prepare`'s Xv
(categorical nodes as virtual columns, NaN-left nodes reading the -inf copy) and
every node is `go left <=> Xv[row, column] <= threshold`, so every row reaches the
leaves the libraries reach. Only the summation order of the leaf values differs
(each lane's trees in order, then the eight lane sums, float64): predictions equal
the libraries' to ~1e-15 (`tests/test_online_speed.py` holds 1e-12).

The offline batch walk (`batch_phat`) reads the same layout with another schedule: rows
in parallel, each row's trees one after the other, summed in the libraries' own order, so
its predictions are the libraries' bit for bit (`tests/test_fast_paths.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch
from numba import prange
from scipy.special import expit

from calibrate.isotonic import PROB_FLOOR
from rerank.forest.table import MAX_CATEGORY, ForestError
from rerank.forest.walk import LGB_ZERO, CompiledForest, prepare
from specrank.runtime.jit import njit

MAX_COLUMN = 2**16 - 1  # Xv columns a node can name (16 bits)
MAX_OFFSET = 2**15 - 1  # preorder distance to a right child (15 bits): trees < 32k nodes
LANES = 8  # trees walked side by side per row


@dataclass(frozen=True)
class JitForest:
    """A compiled forest in the walk's layout (M nodes, L leaves, T trees)."""

    compiled: CompiledForest
    node: np.ndarray  # [M, 2] int32: threshold bits | leaf's value index; column | bits
    node_threshold: np.ndarray  # [M, 2] float32 view of `node` (column 0: thresholds)
    value: np.ndarray  # [L] float64 leaf values, each tree's in preorder
    roots: np.ndarray  # [T] int64 node index of each root (preorder, tree after tree)
    base: float
    logistic: bool
    sigmoid: float
    # `forest.walk.prepare`'s input rules, as arrays for `_design_xv` (E encoded columns,
    # K categorical nodes)
    enc_column: np.ndarray  # [E] int64 input column HGB re-encodes
    enc_values: np.ndarray  # [E, V] float64 its training values (NaN padding)
    cat_column: np.ndarray  # [K] int64
    cat_left: np.ndarray  # [K] int64 masks
    cat_known: np.ndarray  # [K] int64 masks
    cat_missing_left: np.ndarray  # [K] bool
    cat_floor: float
    lightgbm: bool


def jit_forest(c: CompiledForest) -> JitForest:
    """`c` renumbered and packed for `phat`; ForestError if a tree does not fit the layout."""
    f = c.forest
    left, right, feature = c.child[:, 1], c.child[:, 0], c.feature
    is_leaf = c.is_leaf
    if int(feature[~is_leaf].max(initial=0)) > MAX_COLUMN:
        raise ForestError(f"forest_jit: a node reads Xv column > {MAX_COLUMN}")
    order: list[int] = []  # old node index, in preorder tree after tree
    roots: list[int] = []
    for r in f.roots.tolist():
        roots.append(len(order))
        stack = [r]
        while stack:
            k = stack.pop()
            order.append(k)
            if not is_leaf[k]:
                stack.append(int(right[k]))
                stack.append(int(left[k]))  # popped first: the left child comes next
    old = np.asarray(order, dtype=np.int64)
    new_of = np.empty(f.left.size, dtype=np.int64)
    new_of[old] = np.arange(old.size)
    leaf = is_leaf[old]  # [M] in the new order
    internal = ~leaf
    offset = new_of[right[old]] - np.arange(old.size)  # right child's distance
    if int(offset[internal].max(initial=0)) > MAX_OFFSET:
        raise ForestError(f"forest_jit: a tree has more than {MAX_OFFSET} nodes")
    if not (new_of[left[old]][internal] == np.flatnonzero(internal) + 1).all():
        raise ForestError("forest_jit: preorder renumbering failed (not a forest of trees)")
    node = np.zeros((old.size, 2), dtype=np.int32)
    thr = np.ascontiguousarray(c.threshold[old], dtype=np.float32).view(np.int32)
    node[:, 0] = np.where(internal, thr, np.cumsum(leaf) - 1)  # leaves: their value's index
    node[:, 1] = np.where(internal, feature[old] | (1 << 16) | (offset << 17), 0)
    enc = f.encode
    width = max((len(v) for _, v in enc), default=0)
    enc_values = np.full((len(enc), width), np.nan, dtype=np.float64)
    for e, (_, v) in enumerate(enc):
        enc_values[e, : len(v)] = v
    return JitForest(
        compiled=c,
        node=node,
        node_threshold=node.view(np.float32),
        value=np.ascontiguousarray(f.value[old[leaf]], dtype=np.float64),
        roots=np.asarray(roots, dtype=np.int64),
        base=float(f.base),
        logistic=f.link == "logistic",
        sigmoid=float(f.sigmoid),
        enc_column=np.asarray([col for col, _ in enc], dtype=np.int64),
        enc_values=enc_values,
        cat_column=np.ascontiguousarray(c.cat_column, dtype=np.int64),
        cat_left=np.ascontiguousarray(c.cat_left, dtype=np.int64),
        cat_known=np.ascontiguousarray(c.cat_known, dtype=np.int64),
        cat_missing_left=np.ascontiguousarray(c.cat_missing_left, dtype=np.bool_),
        cat_floor=float(c.cat_floor),
        lightgbm=bool(f.lightgbm),
    )


def phat(j: JitForest, X: np.ndarray) -> np.ndarray:
    """The model's prediction [N] float64 for the design matrix X [N, F] (unclipped)."""
    Xv = prepare(j.compiled, X)
    return _predict(Xv, j.node, j.node_threshold, j.value, j.roots, j.base, j.logistic, j.sigmoid)


def log_phat(j: JitForest, X: np.ndarray) -> np.ndarray:
    """log phat [N] float32, phat clipped to [PROB_FLOOR, 1] as `predict_matrix` clips it.

    One compiled call (`_design_log_phat`): `prepare`, the walk and the log, on X's
    [F, N] rows. `OnlinePredictor.design` returns the transpose of a C-ordered [F, N]
    block, so the decoder's call copies nothing; one call per round instead of a dozen
    array ops is what a round pays once the models' passes have evicted the caches.
    The log is libm's (numpy's vectorised log may differ in the last bit).
    """
    n_features = j.compiled.forest.n_features
    if X.ndim != 2 or X.shape[1] != n_features:
        raise ValueError(f"forest input: expected [N, {n_features}] float32, got {X.shape}")
    return _design_log_phat(
        np.ascontiguousarray(X.T, dtype=np.float32), j.node, j.node_threshold, j.value,
        j.roots, j.base, j.logistic, j.sigmoid, j.enc_column, j.enc_values, j.cat_column,
        j.cat_left, j.cat_known, j.cat_missing_left, np.float32(j.cat_floor), j.lightgbm,
    )  # fmt: skip


@njit(nogil=True, inline="always")
def _clip_log_one(p):
    return np.float32(math.log(min(max(p, PROB_FLOOR), 1.0)))


@njit(nogil=True, inline="always")
def _lane(k, t, s, x, node, thr, value, roots):
    """One step of a lane walking trees t, t + 8, ...: down a level, or at a leaf, take its
    value and start the lane's next tree (k = -1: the lane is done)."""
    w = node[k, 1]
    if w == 0:  # a leaf
        s += value[node[k, 0]]
        t += LANES
        k = roots[t] if t < roots.size else -1
    else:  # left is the next node; right is w >> 17 nodes on
        k += ((w >> 16) & 1) if x[w & 0xFFFF] <= thr[k, 0] else w >> 17
    return k, t, s


@njit(nogil=True, inline="always")
def _walk(x, node, thr, value, roots):
    """Sum of the leaf values row x reaches, eight lanes (lane j walks trees j, j + 8, ...)."""
    T = roots.size
    k0 = roots[0] if T > 0 else -1
    k1 = roots[1] if T > 1 else -1
    k2 = roots[2] if T > 2 else -1
    k3 = roots[3] if T > 3 else -1
    k4 = roots[4] if T > 4 else -1
    k5 = roots[5] if T > 5 else -1
    k6 = roots[6] if T > 6 else -1
    k7 = roots[7] if T > 7 else -1
    t0, t1, t2, t3, t4, t5, t6, t7 = 0, 1, 2, 3, 4, 5, 6, 7
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    while max(k0, k1, k2, k3, k4, k5, k6, k7) >= 0:
        if k0 >= 0:
            k0, t0, s0 = _lane(k0, t0, s0, x, node, thr, value, roots)
        if k1 >= 0:
            k1, t1, s1 = _lane(k1, t1, s1, x, node, thr, value, roots)
        if k2 >= 0:
            k2, t2, s2 = _lane(k2, t2, s2, x, node, thr, value, roots)
        if k3 >= 0:
            k3, t3, s3 = _lane(k3, t3, s3, x, node, thr, value, roots)
        if k4 >= 0:
            k4, t4, s4 = _lane(k4, t4, s4, x, node, thr, value, roots)
        if k5 >= 0:
            k5, t5, s5 = _lane(k5, t5, s5, x, node, thr, value, roots)
        if k6 >= 0:
            k6, t6, s6 = _lane(k6, t6, s6, x, node, thr, value, roots)
        if k7 >= 0:
            k7, t7, s7 = _lane(k7, t7, s7, x, node, thr, value, roots)
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@njit(nogil=True, inline="always")
def _read_ahead(node, value):
    """One load per cache line of the nodes and the values (streamed by the hardware), so
    that the walk finds them cached; returns 0.0 built from the loads so they are kept."""
    ahead = 0
    for k in range(0, node.shape[0], 8):
        ahead += node[k, 1]
    for k in range(0, value.size, 8):
        ahead += np.int32(value[k] > 0)
    return 0.0 * ahead  # 0 * a finite int is 0


@njit(nogil=True, inline="always")
def _link(s, logistic, sigmoid):
    return 1.0 / (1.0 + math.exp(-sigmoid * s)) if logistic else s


@njit(nogil=True, error_model="numpy")
def _predict(Xv, node, thr, value, roots, base, logistic, sigmoid):
    n = Xv.shape[0]
    out = np.zeros(n)
    out[0:1] += _read_ahead(node, value)
    for i in range(n):
        s = _walk(Xv[i], node, thr, value, roots) + out[i] + base
        out[i] = _link(s, logistic, sigmoid)
    return out


@njit(nogil=True, error_model="numpy")
def _design_log_phat(XT, node, thr, value, roots, base, logistic, sigmoid, enc_column,
                     enc_values, cat_column, cat_left, cat_known, cat_missing_left, cat_floor,
                     lightgbm):  # fmt: skip
    """The clipped log of `_predict(prepare(XT.T))` for a design matrix given as its [F, N] rows.

    Each row's Xv is built as `forest.walk.prepare` builds it (re-encoded columns,
    LightGBM's zero rule, virtual categorical columns, the -inf copy), then walked.
    """
    n_features, n = XT.shape
    x = np.empty(2 * (n_features + cat_column.size), dtype=np.float32)
    out = np.empty(n, dtype=np.float32)
    ahead = _read_ahead(node, value)
    for i in range(n):
        _prepare_row(XT[:, i], x, enc_column, enc_values, cat_column, cat_left, cat_known,
                     cat_missing_left, cat_floor, lightgbm)  # fmt: skip
        s = _walk(x, node, thr, value, roots) + (ahead if i == 0 else 0.0) + base
        out[i] = _clip_log_one(_link(s, logistic, sigmoid))
    return out


@njit(nogil=True, inline="always")
def _prepare_row(row, x, enc_column, enc_values, cat_column, cat_left, cat_known,
                 cat_missing_left, cat_floor, lightgbm):  # fmt: skip
    """Row `row` [F] of the design matrix as `forest.walk.prepare` builds it, into x [2W]:
    re-encoded columns, LightGBM's zero rule, virtual categorical columns, the -inf copy."""
    n_features, n_cat = row.shape[0], cat_column.size
    width = n_features + n_cat
    for f in range(n_features):
        x[f] = row[f]
    for e in range(enc_column.size):  # HGB: the index of the exact training value
        col = enc_column[e]
        v = np.float64(x[col])
        code = np.float32(np.nan)
        for c in range(enc_values.shape[1]):
            if v == enc_values[e, c]:
                code = np.float32(c)
                break
        x[col] = code
    if lightgbm:
        for f in range(n_features):
            if abs(x[f]) <= LGB_ZERO:  # NaN compares False and stays NaN
                x[f] = 0.0
    for k in range(n_cat):
        v = x[cat_column[k]]
        in_range = v >= cat_floor and v < MAX_CATEGORY + 1  # False for NaN
        bit = np.int64(1) << (np.int64(v) if in_range else np.int64(0))  # truncates
        in_left = in_range and (cat_left[k] & bit) != 0
        known = in_range and (cat_known[k] & bit) != 0
        go_left = cat_missing_left[k] if not in_left and not known else in_left
        x[n_features + k] = 0.0 if go_left else 1.0
    for f in range(width):
        x[width + f] = -np.inf if np.isnan(x[f]) else x[f]


# -- batch prediction (offline: every held-out candidate) -----------------------------------------

_BATCH_ROWS = 256  # rows per task of the batch walk (one prepared-row buffer each)


def batch_raw(j: JitForest, X: np.ndarray, n_threads: int | None = None) -> np.ndarray:
    """Raw scores [N] float64 of the design matrix X [N, F], summed tree by tree in the
    libraries' own order (HGB: baseline, then tree 1, 2, ...; LightGBM: its base 0, then
    the trees): the libraries' raw scores bit for bit (`tests/test_fast_paths.py`).

    The same layout as the online walk, a different schedule: rows in parallel on
    `n_threads` numba threads (None: numba's pool), each row's trees one after the other
    (the online walk's eight lanes serve one round's few rows; here rows are many).
    """
    n_features = j.compiled.forest.n_features
    if X.ndim != 2 or X.shape[1] != n_features:
        raise ValueError(f"forest input: expected [N, {n_features}] float32, got {X.shape}")
    torch_threads = torch.get_num_threads()
    numba.set_num_threads(min(n_threads or numba.config.NUMBA_NUM_THREADS,
                              numba.config.NUMBA_NUM_THREADS))  # fmt: skip
    try:
        return _batch_raw(
            np.ascontiguousarray(X, dtype=np.float32), j.node, j.node_threshold, j.value,
            j.roots, j.base, j.enc_column, j.enc_values, j.cat_column, j.cat_left,
            j.cat_known, j.cat_missing_left, np.float32(j.cat_floor), j.lightgbm,
        )  # fmt: skip
    finally:
        # numba's OpenMP layer shares libgomp with torch's intra-op pool; restore torch's
        # count (see selection.ranking.compiled_route)
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)


def batch_phat(j: JitForest, X: np.ndarray, n_threads: int | None = None) -> np.ndarray:
    """The model's prediction [N] float64, with each library's own link function."""
    raw = batch_raw(j, X, n_threads)
    if not j.logistic:
        return raw
    if j.lightgbm:  # LightGBM's sigmoid: 1 / (1 + exp(-s raw)) in C++ doubles
        return _lgb_sigmoid(raw, j.sigmoid)
    return expit(raw)  # scikit-learn's HalfBinomialLoss.predict_proba


@njit(parallel=True, nogil=True)
def _lgb_sigmoid(raw: np.ndarray, slope: float) -> np.ndarray:
    out = np.empty_like(raw)
    for i in prange(raw.shape[0]):
        out[i] = 1.0 / (1.0 + math.exp(-slope * raw[i]))
    return out


@njit(parallel=True, nogil=True, error_model="numpy")
def _batch_raw(X, node, thr, value, roots, base, enc_column, enc_values, cat_column, cat_left,
               cat_known, cat_missing_left, cat_floor, lightgbm):  # fmt: skip
    n, n_features = X.shape
    out = np.empty(n, dtype=np.float64)
    for task in prange((n + _BATCH_ROWS - 1) // _BATCH_ROWS):
        x = np.empty(2 * (n_features + cat_column.size), dtype=np.float32)
        for i in range(task * _BATCH_ROWS, min(n, (task + 1) * _BATCH_ROWS)):
            _prepare_row(X[i], x, enc_column, enc_values, cat_column, cat_left, cat_known,
                         cat_missing_left, cat_floor, lightgbm)  # fmt: skip
            acc = base
            for t in range(roots.size):
                k = roots[t]
                w = node[k, 1]
                while w != 0:  # left is the next node; right is w >> 17 nodes on
                    k += ((w >> 16) & 1) if x[w & 0xFFFF] <= thr[k, 0] else w >> 17
                    w = node[k, 1]
                acc += value[node[k, 0]]
            out[i] = acc
    return out

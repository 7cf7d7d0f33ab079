"""Calibration controls (docs/method.md#rule-values, #cross-fitting; paper Table 19): isotonic maps of draft probability.

- `EqualCountIsotonic`: the first draft factor. x = draft probability of a
  first-level candidate, y = its label (target probability under sampling,
  argmax flag under greedy). The selector ranks by ``log iso(q(x1)) + ...``.
- `PerDepthIsotonic`: every factor, one map per depth. x = the edge's draft
  probability, y = its target probability under the law (greedy: 1 if the
  edge token is the target's argmax at the parent, else 0). Fitted on pool
  edges, all of which have scored parents (docs/method.md#scored-set), so every y is known.

A map sorts the rows by x, cuts them into ``n_bins`` equal-count bins (sizes
differ by at most one; fewer bins when there are fewer rows), and fits an
increasing isotonic regression of the bins' mean y on their mean x, weighted
by bin size. Binning first (the paper's recipe) makes the fit O(n log n) for
millions of edges and smooths the step function.

Outputs are clipped to [PROB_FLOOR, 1]: the selector takes their log (must be
finite; an isotonic fit of a 0/1 label can return exactly 0), and factors
<= 1 keep path scores non-increasing so the top-B set stays ancestor-closed.
Cross-fitting them over prompt halves is `rerank.fit.folds.crossfit_calibrate`.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from sklearn.base import BaseEstimator
from sklearn.isotonic import IsotonicRegression
from sklearn.utils.validation import check_is_fitted

# Floor of every probability the selector takes the log of (calibrated maps and the
# rerankers' phat alike). It must be finite (a -inf first factor would tie the
# candidate's whole subtree at -inf, and -inf - -inf is NaN in score differences),
# and values <= 1 keep log <= 0 = the root's score, so scores stay non-increasing
# along paths and top-B stays ancestor-closed. A regressor can predict <= 0 or > 1;
# the floor is far below any probability the models resolve (held-out error >> 1e-6).
PROB_FLOOR = 1e-6
DEFAULT_BINS = 200  # equal-count bins of every isotonic map (docs/method.md#cross-fitting)


def _as_1d(name: str, a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64).ravel()
    if not np.isfinite(a).all():
        raise ValueError(f"{name}: {int((~np.isfinite(a)).sum())} non-finite value(s)")
    return a


def _depths(depth: np.ndarray) -> np.ndarray:
    """Depths as int64; refuse non-integers or values < 1 (e.g. probabilities passed as depth)."""
    d = np.asarray(depth).ravel()
    if np.issubdtype(d.dtype, np.integer):  # pool depths: one pass instead of a float round trip
        bad = d[d < 1] if d.size and d.min() < 1 else d[:0]
        if not bad.size:
            return d.astype(np.int64, copy=False)
    d = d.astype(np.float64)
    bad = d[~np.isfinite(d) | (d < 1) | (d != np.round(d))]
    if bad.size:
        raise ValueError(
            f"depth must hold integers >= 1 (pool depth of each edge); found {bad.size} other "
            f"value(s), e.g. {bad[:3].tolist()}. Call order is fit(x, y, depth)."
        )
    return d.astype(np.int64)


_KEY_SHIFT = 44  # a float's bits >> 44: its octave and 8 mantissa bits, 256 buckets per octave
_MAX_BUCKETS = 1 << 16  # coarser buckets where the knots span many octaves


@njit(cache=True, nogil=True)
def _interp_clipped(
    x: np.ndarray, lo: float, hi: float, xp: np.ndarray, fp: np.ndarray, floor: float, shift: int
) -> np.ndarray:
    """np.clip(np.interp(np.clip(x, lo, hi), xp, fp), floor, 1) in one pass, by numpy's
    arithmetic (numpy/_core/src/multiarray/compiled_base.c, `arr_interp`): the slope of
    segment j is (fp[j+1] - fp[j]) / (xp[j+1] - xp[j]), the value slope * (x - xp[j]) + fp[j],
    and x equal to a knot takes that knot's fp. Needs 0 <= lo, len(xp) >= 2, xp strictly
    increasing (a fitted IsotonicRegression's thresholds).

    Why not sklearn's predict: its validation, scipy's interp1d wrapper and numpy's binary
    search (whose branches the pool's unordered values mispredict) took 13% of the pool pass.
    Here the segment comes from a table indexed by the value's bits (for x >= 0 they order as
    the values do), then a short forward scan.
    """
    n = xp.size
    slopes = (fp[1:] - fp[:-1]) / (xp[1:] - xp[:-1])
    keys = xp.view(np.int64) >> shift
    k_lo = np.int64(np.array([lo]).view(np.int64)[0] >> shift)
    k_hi = np.int64(np.array([hi]).view(np.int64)[0] >> shift)
    # start[k]: the last knot in a bucket below k_lo + k (-1: none), so xp[start] < any v there
    start = np.full(k_hi - k_lo + 1, -1, dtype=np.int64)
    j = -1
    for k in range(k_hi - k_lo + 1):
        while j + 1 < n and keys[j + 1] < k_lo + k:
            j += 1
        start[k] = j
    bits = x.view(np.int64)
    out = np.empty(x.size)
    for i in range(x.size):
        v = min(max(x[i], lo), hi)
        if v > xp[n - 1]:
            r = fp[n - 1]
        elif v < xp[0]:
            r = fp[0]
        else:
            a = start[min(max(bits[i] >> shift, k_lo), k_hi) - k_lo]
            a = max(a, 0)
            while a + 1 < n and xp[a + 1] <= v:  # the largest a with xp[a] <= v
                a += 1
            if a == n - 1 or xp[a] == v:
                r = fp[a]
            else:
                r = slopes[a] * (v - xp[a]) + fp[a]
                if np.isnan(r):  # as numpy: try the other end of the segment
                    r = slopes[a] * (v - xp[a + 1]) + fp[a + 1]
                    if np.isnan(r) and fp[a] == fp[a + 1]:
                        r = fp[a]
        out[i] = min(max(r, floor), 1.0)
    return out


class EqualCountIsotonic(BaseEstimator):
    """Increasing isotonic map of y on x over equal-count bins of x."""

    def __init__(self, n_bins: int = DEFAULT_BINS) -> None:
        self.n_bins = n_bins

    def fit(self, x: np.ndarray, y: np.ndarray) -> EqualCountIsotonic:
        x, y = _as_1d("x", x), _as_1d("y", y)
        if x.shape != y.shape:
            raise ValueError(f"x shape {x.shape} != y shape {y.shape}")
        if x.size == 0:
            raise ValueError("EqualCountIsotonic.fit: no rows")
        if int(self.n_bins) < 1:
            raise ValueError(f"n_bins must be >= 1; got {self.n_bins!r}")
        order = np.argsort(x, kind="stable")
        n_bins = min(int(self.n_bins), x.size)
        # Bin b holds sorted rows [edges[b], edges[b+1]): equal counts up to one row.
        edges = (np.arange(n_bins + 1) * x.size) // n_bins
        counts = np.diff(edges)
        xs, ys = x[order], y[order]
        self.bin_counts_ = counts
        self.bin_x_ = np.add.reduceat(xs, edges[:-1]) / counts
        self.bin_y_ = np.add.reduceat(ys, edges[:-1]) / counts
        self.n_bins_ = n_bins
        self.iso_ = IsotonicRegression(increasing=True, out_of_bounds="clip").fit(
            self.bin_x_, self.bin_y_, sample_weight=counts.astype(np.float64)
        )
        return self

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Calibrated probability (float64, clipped to [PROB_FLOOR, 1])."""
        check_is_fitted(self, "iso_")
        x, iso = _as_1d("x", x), self.iso_
        xp, fp = iso.X_thresholds_, iso.y_thresholds_
        if xp.size < 2:  # sklearn's constant map
            return np.clip(np.full(x.size, fp[0], dtype=np.float64), PROB_FLOOR, 1.0)
        if iso.X_min_ < 0:  # not a probability: the bit order of the values breaks below 0
            return np.clip(iso.predict(x), PROB_FLOOR, 1.0)
        ends = np.array([iso.X_min_, iso.X_max_], dtype=np.float64).view(np.int64)
        span, shift = int(ends[1] - ends[0]), _KEY_SHIFT
        while span >> shift > _MAX_BUCKETS:
            shift += 1
        return _interp_clipped(x, iso.X_min_, iso.X_max_, xp, fp, PROB_FLOOR, shift)


class PerDepthIsotonic(BaseEstimator):
    """One `EqualCountIsotonic` per depth; ``fit(x, y, depth)``, ``predict(x, depth)``."""

    def __init__(self, n_bins: int = DEFAULT_BINS) -> None:
        self.n_bins = n_bins

    def fit(self, x: np.ndarray, y: np.ndarray, depth: np.ndarray) -> PerDepthIsotonic:
        x, y = _as_1d("x", x), _as_1d("y", y)
        depth = _depths(depth)
        if not (x.shape == y.shape == depth.shape):
            raise ValueError(f"x {x.shape}, y {y.shape} and depth {depth.shape} differ in shape")
        self.maps_ = {
            int(d): EqualCountIsotonic(self.n_bins).fit(x[depth == d], y[depth == d])
            for d in np.unique(depth)
        }
        return self

    def predict(self, x: np.ndarray, depth: np.ndarray) -> np.ndarray:
        check_is_fitted(self, "maps_")
        x = _as_1d("x", x)
        depth = _depths(depth)
        if x.shape != depth.shape:
            raise ValueError(f"x shape {x.shape} != depth shape {depth.shape}")
        present = np.flatnonzero(np.bincount(depth))  # depths are small ints >= 1: no sort
        unseen = sorted(set(present.tolist()) - set(self.maps_))
        if unseen:
            # A silent fallback would apply another depth's calibration; make the caller choose.
            raise ValueError(
                f"no map for depth(s) {unseen}: the training half had edges at depths "
                f"{sorted(self.maps_)} only"
            )
        out = np.empty_like(x)
        for d, m in self.maps_.items():
            sel = depth == d
            if sel.any():
                out[sel] = m.predict(x[sel])
        return out

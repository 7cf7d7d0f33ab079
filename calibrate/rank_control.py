"""The draft-rank control: what a first-level reranker gains from the draft ranking alone.

`DraftRankMeans` predicts a first-level candidate's label (target probability
under sampling, argmax flag under greedy) as the mean label of the training
candidates at the same draft rank among their siblings, optionally within
equal-count bins of the draft probability at that rank. It reads no target
row, so a learned reranker's gain over it is what the rows (and the richer
draft features) add beyond re-calibrating the drafter's order; a gain that
this control matches came from the ranking, not from the retained rows.

Ranks beyond the deepest rank seen in training share that rank's means. With
`q_bins` > 1, each rank's draft probabilities are cut into `q_bins`
equal-count bins on the training rows (fewer when a rank has fewer distinct
values); a prediction takes its rank's bin by searchsorted on those edges.
Outputs are clipped to [PROB_FLOOR, 1] like every factor the selector logs.
Cross-fitting it over prompt halves is `rerank.fit.folds.crossfit_rank_control`.
"""

from __future__ import annotations

import numpy as np

from calibrate.isotonic import PROB_FLOOR


class DraftRankMeans:
    """Mean label per (draft rank, draft-probability bin within the rank)."""

    def __init__(self, q_bins: int = 1) -> None:
        if not isinstance(q_bins, int) or q_bins < 1:
            raise ValueError(f"q_bins must be an integer >= 1; got {q_bins!r}")
        self.q_bins = q_bins

    def fit(self, rank: np.ndarray, q: np.ndarray, y: np.ndarray) -> DraftRankMeans:
        rank, q, y = _inputs(rank, q, y)
        if rank.size == 0:
            raise ValueError("DraftRankMeans.fit: no training rows")
        self.max_rank_ = int(rank.max())
        self.edges_: list[np.ndarray] = []
        self.means_: list[np.ndarray] = []
        pooled = float(y.mean())
        for r in range(self.max_rank_ + 1):
            at = rank == r
            if not at.any():  # a gap in the ranks seen: the pooled mean stands in
                self.edges_.append(np.empty(0))
                self.means_.append(np.array([pooled]))
                continue
            qr, yr = q[at], y[at]
            # inner edges of equal-count bins (quantiles); duplicates collapse bins
            inner = np.unique(np.quantile(qr, np.linspace(0, 1, self.q_bins + 1)[1:-1]))
            b = np.searchsorted(inner, qr, side="right")
            sums = np.bincount(b, weights=yr, minlength=inner.size + 1)
            counts = np.bincount(b, minlength=inner.size + 1)
            means = np.divide(sums, counts, out=np.full(sums.shape, yr.mean()), where=counts > 0)
            self.edges_.append(inner)
            self.means_.append(means)
        return self

    def predict(self, rank: np.ndarray, q: np.ndarray) -> np.ndarray:
        if not hasattr(self, "means_"):
            raise ValueError("DraftRankMeans: call fit before predict")
        rank, q, _ = _inputs(rank, q, None)
        rank = np.minimum(rank, self.max_rank_)
        out = np.empty(rank.size, dtype=np.float64)
        for r in np.unique(rank):
            at = rank == r
            b = np.searchsorted(self.edges_[r], q[at], side="right")
            out[at] = self.means_[r][b]
        return np.clip(out, PROB_FLOOR, 1.0)


def _inputs(rank, q, y) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    rank = np.asarray(rank).ravel()
    q = np.asarray(q, dtype=np.float64).ravel()
    if rank.shape != q.shape or (y is not None and np.shape(y) != rank.shape):
        raise ValueError(
            f"rank {rank.shape}, q {q.shape} and y {None if y is None else np.shape(y)} "
            f"must have one entry per candidate"
        )
    if rank.size and (rank.min() < 0 or not np.issubdtype(rank.dtype, np.integer)):
        raise ValueError("rank must hold integer draft ranks >= 0 (0 = the drafter's top)")
    if not np.isfinite(q).all():
        raise ValueError(f"q: {int((~np.isfinite(q)).sum())} non-finite draft probabilities")
    if y is not None:
        y = np.asarray(y, dtype=np.float64).ravel()
        if not np.isfinite(y).all():
            raise ValueError(f"y: {int((~np.isfinite(y)).sum())} non-finite labels")
    return rank.astype(np.int64), q, y

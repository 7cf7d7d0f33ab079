"""The draft-rank control (calibrate.rank_control, rerank.fit.folds.crossfit_rank_control)."""

from __future__ import annotations

import numpy as np
import pytest

from calibrate.isotonic import PROB_FLOOR
from calibrate.rank_control import DraftRankMeans
from rerank.fit.folds import crossfit_rank_control


def test_means_by_rank_and_by_q_bin_by_hand():
    rank = np.array([0, 0, 0, 0, 1, 1, 2])
    q = np.array([0.9, 0.8, 0.5, 0.4, 0.3, 0.1, 0.05])
    y = np.array([1.0, 1.0, 0.0, 0.5, 0.25, 0.75, 0.0])
    m = DraftRankMeans().fit(rank, q, y)
    np.testing.assert_allclose(m.predict(np.array([0, 1, 2, 7]), np.zeros(4)),
                               [0.625, 0.5, PROB_FLOOR, PROB_FLOOR])  # fmt: skip
    # two equal-count bins within each rank: rank 0 splits at its median q (0.65)
    m2 = DraftRankMeans(q_bins=2).fit(rank, q, y)
    np.testing.assert_allclose(m2.predict(np.array([0, 0, 1, 1]), np.array([0.95, 0.45, 0.3, 0.1])),
                               [1.0, 0.25, 0.25, 0.75])  # fmt: skip


def test_refuses_bad_inputs_by_name():
    with pytest.raises(ValueError, match="q_bins must be an integer >= 1"):
        DraftRankMeans(0)
    with pytest.raises(ValueError, match="integer draft ranks >= 0"):
        DraftRankMeans().fit(np.array([-1]), np.array([0.5]), np.array([1.0]))
    with pytest.raises(ValueError, match="non-finite draft probabilities"):
        DraftRankMeans().fit(np.array([0]), np.array([np.nan]), np.array([1.0]))
    with pytest.raises(ValueError, match="call fit before predict"):
        DraftRankMeans().predict(np.array([0]), np.array([0.5]))


@pytest.mark.parametrize("q_bins", [1, 3])
def test_a_half_is_predicted_from_the_other_half_only(q_bins):
    """Changing one half's labels leaves that half's predictions unchanged, and moves the other's."""
    rng = np.random.default_rng(0)
    n = 400
    folds = (np.arange(n) // 20) % 2  # prompt blocks of 20 rows
    rank = rng.integers(0, 5, n)
    q = rng.uniform(0, 1, n)
    y = rng.uniform(0, 1, n)
    before, _ = crossfit_rank_control(rank, q, y, folds, q_bins)
    y2 = y.copy()
    y2[folds == 0] = rng.uniform(0, 1, int((folds == 0).sum()))  # redraw half 0's labels
    after, _ = crossfit_rank_control(rank, q, y2, folds, q_bins)
    np.testing.assert_array_equal(before[folds == 0], after[folds == 0])
    assert not np.allclose(before[folds == 1], after[folds == 1])
    # and the values are the other half's means at each rank (q_bins=1)
    if q_bins == 1:
        for r in range(5):
            at = (rank == r) & (folds == 0)
            want = y[(rank == r) & (folds == 1)].mean()
            np.testing.assert_allclose(before[at], want)

"""Calibration controls: equal-count bins, monotone maps, per-depth maps, out-of-fold."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calibrate.isotonic import (
    PROB_FLOOR,
    EqualCountIsotonic,
    PerDepthIsotonic,
)
from rerank.fit.folds import crossfit_calibrate
from rerank.fit.halves import prompt_halves


def _draws(n: int, seed: int = 0, power: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    """x ~ U(0, 1), y ~ Bernoulli(x ** power): the true map is x ** power."""
    rng = np.random.default_rng(seed)
    x = rng.random(n)
    return x, (rng.random(n) < x**power).astype(np.float64)


def test_two_hundred_equal_count_bins() -> None:
    x, y = _draws(1003)
    iso = EqualCountIsotonic().fit(x, y)
    assert iso.n_bins_ == 200 and iso.bin_counts_.sum() == 1003
    assert set(iso.bin_counts_.tolist()) == {5, 6}  # equal counts up to one row
    # Bin means by hand: the k-th bin holds the next bin_counts_[k] rows in x order.
    order = np.argsort(x, kind="stable")
    starts = np.concatenate([[0], np.cumsum(iso.bin_counts_)[:-1]])
    for k in (0, 57, 199):
        rows = order[starts[k] : starts[k] + iso.bin_counts_[k]]
        assert iso.bin_x_[k] == pytest.approx(x[rows].mean())
        assert iso.bin_y_[k] == pytest.approx(y[rows].mean())
    assert np.all(np.diff(iso.bin_x_) > 0)


def test_fewer_rows_than_bins_gives_one_row_per_bin() -> None:
    iso = EqualCountIsotonic().fit([0.3, 0.1, 0.2], [1.0, 0.0, 0.0])
    assert iso.n_bins_ == 3 and iso.bin_counts_.tolist() == [1, 1, 1]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), n_bins=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_maps_are_monotone_and_in_range(n, n_bins, seed) -> None:
    rng = np.random.default_rng(seed)
    x = rng.random(n)
    y = rng.random(n) * (rng.random() < 0.5)  # sometimes all zero
    iso = EqualCountIsotonic(n_bins).fit(x, y)
    assert iso.n_bins_ == min(n, n_bins)
    grid = np.concatenate([[-1.0], np.sort(rng.random(200)), [2.0]])  # outside the range: clip
    out = iso.predict(grid)
    assert np.all(np.diff(out) >= 0)
    assert np.all((out >= PROB_FLOOR) & (out <= 1.0))


def test_map_recovers_a_known_calibration_curve() -> None:
    x, y = _draws(40_000, power=2.0)
    grid = np.linspace(0.1, 0.9, 9)
    np.testing.assert_allclose(EqualCountIsotonic().fit(x, y).predict(grid), grid**2, atol=0.04)


def test_all_zero_labels_give_the_floor_not_zero() -> None:
    out = EqualCountIsotonic().fit(np.linspace(0, 1, 500), np.zeros(500)).predict([0.2, 0.9])
    np.testing.assert_array_equal(out, [PROB_FLOOR, PROB_FLOOR])
    assert np.isfinite(np.log(out)).all()


def test_per_depth_maps_are_separate() -> None:
    x2, y2 = _draws(5000, seed=1, power=2.0)
    x4, y4 = _draws(5000, seed=2, power=4.0)
    x = np.concatenate([x2, x4])
    y = np.concatenate([y2, y4])
    depth = np.repeat([2, 4], 5000)
    iso = PerDepthIsotonic().fit(x, y, depth)
    assert sorted(iso.maps_) == [2, 4]
    assert all(m.n_bins_ == 200 for m in iso.maps_.values())
    grid = np.full(3, 0.7)
    got = iso.predict(grid, np.array([2, 4, 2]))
    assert got[0] == pytest.approx(0.49, abs=0.06) and got[1] == pytest.approx(0.24, abs=0.06)
    assert got[2] == got[0]
    np.testing.assert_array_equal(
        iso.predict(x2[:50], np.full(50, 2)), EqualCountIsotonic().fit(x2, y2).predict(x2[:50])
    )
    with pytest.raises(ValueError, match=r"no map for depth\(s\) \[3\].*\[2, 4\]"):
        iso.predict(grid, np.array([2, 3, 4]))
    with pytest.raises(ValueError, match=r"integers >= 1.*fit\(x, y, depth\)"):
        PerDepthIsotonic().fit(x, depth, y)  # arguments swapped: refused, not silently wrong


@pytest.mark.parametrize("per_depth", [False, True])
def test_crossfit_calibration_is_out_of_fold(per_depth) -> None:
    rng = np.random.default_rng(3)
    prompts = np.array([f"p-{i}" for i in rng.integers(0, 50, 8000)])
    folds = prompt_halves(prompts)
    x, y = _draws(8000, seed=4)
    depth = rng.integers(1, 4, 8000) if per_depth else None
    res = crossfit_calibrate(x, y, folds, depth=depth)
    np.testing.assert_array_equal(res.folds, folds)
    # maps[f] is exactly a map fitted on fold 1-f alone.
    for f in (0, 1):
        tr, te = folds == 1 - f, folds == f
        if per_depth:
            ref = PerDepthIsotonic().fit(x[tr], y[tr], depth[tr]).predict(x[te], depth[te])
        else:
            ref = EqualCountIsotonic().fit(x[tr], y[tr]).predict(x[te])
        np.testing.assert_array_equal(res.prob[te], ref)
    # New labels for fold-0 rows never change fold-0 calibrated values, but change fold 1's.
    y2 = y.copy()
    y2[folds == 0] = 1.0 - y2[folds == 0]
    res2 = crossfit_calibrate(x, y2, folds, depth=depth)
    np.testing.assert_array_equal(res2.prob[folds == 0], res.prob[folds == 0])
    assert not np.array_equal(res2.prob[folds == 1], res.prob[folds == 1])


@pytest.mark.parametrize("n, n_bins, labels", [(5000, 200, "prob"), (3000, 50, "binary"),
                                               (40, 200, "prob"), (300, 1, "prob"),
                                               (2000, 200, "zero"), (2000, 200, "negative"),
                                               (3000, 200, "wide")])  # fmt: skip
def test_predict_equals_sklearns_isotonic_bit_for_bit(n, n_bins, labels) -> None:
    # The compiled interpolation replaces IsotonicRegression.predict: the same floats at
    # knots, between them, beyond both ends and at ties.
    rng = np.random.default_rng(n + n_bins)
    x = np.exp(rng.normal(-3.0, 2.0, n).astype(np.float32).astype(np.float64)).clip(max=1.0)
    x[: n // 10] = x[n // 10 : 2 * (n // 10)]  # tied x values
    if labels == "negative":  # not probabilities: the sklearn route
        x = x - 0.5
    if labels == "wide":  # knots over ~1000 octaves: coarser buckets (_MAX_BUCKETS)
        x = 10.0 ** -rng.uniform(0, 300, n)
    y = {"prob": np.clip(x + rng.normal(0, 0.1, n), 0, 1),
         "binary": (rng.random(n) < x).astype(np.float64), "zero": np.zeros(n),
         "negative": np.clip(x + 0.5, 0, 1), "wide": (rng.random(n) < 0.5) * 1.0}[labels]  # fmt: skip
    m = EqualCountIsotonic(n_bins=n_bins).fit(x, y)
    knots = m.iso_.X_thresholds_
    mids = (knots[1:] + knots[:-1]) / 2 if knots.size > 1 else knots
    probe = np.concatenate([x, knots, mids, np.nextafter(knots, 0), np.nextafter(knots, 2),
                            [0.0, -0.0, -0.5, 1.0, 2.0, m.iso_.X_min_, m.iso_.X_max_, 1e-30,
                             5e-324], rng.random(1000)])  # fmt: skip
    want = np.clip(m.iso_.predict(probe), PROB_FLOOR, 1.0)  # sklearn's own predict
    got = m.predict(probe)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got.view(np.int64), want.view(np.int64))

"""The curve's two numeric kernels against the libraries whose results they reproduce:
a load bin's rate against ``scipy.stats.trim_mean`` and the monotone fit against
scikit-learn's ``IsotonicRegression``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats
from sklearn.isotonic import IsotonicRegression

from kvscope.advisor.frames import isotonic_increasing, level_rate


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 13, 60])
def test_level_rate_is_the_interquartile_mean(n: int) -> None:
    rng = np.random.default_rng(n)
    for _ in range(50):
        x = rng.choice([222.0, 632.0, 1111.0, 443.0], n) + rng.normal(0, 30, n)
        assert level_rate(x) == pytest.approx(stats.trim_mean(x, 0.25), rel=1e-12)


def test_level_rate_skips_missing_seconds() -> None:
    assert level_rate(np.array([math.nan, 1.0, 2.0, 3.0, 100.0])) == pytest.approx(2.5)
    assert math.isnan(level_rate(np.array([math.nan])))
    assert math.isnan(level_rate(np.array([])))


@pytest.mark.parametrize("n", [2, 3, 5, 12, 40])
def test_the_monotone_fit_is_scikit_learns(n: int) -> None:
    rng = np.random.default_rng(100 + n)
    x = np.arange(n, dtype=float)
    for _ in range(100):
        # A plateau curve with noise, dips and ties: violators to pool.
        y = np.minimum(np.arange(1, n + 1), n // 2 + 1) * 100.0 + rng.normal(0, 60, n)
        y[rng.integers(0, n)] = y.min() - 5.0
        w = rng.integers(1, 30, n).astype(float)
        want = IsotonicRegression(increasing=True).fit(x, y, sample_weight=w).predict(x)
        got = isotonic_increasing(y, w)
        assert np.all(np.diff(got) >= -1e-9)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)


def test_the_monotone_fit_keeps_an_increasing_series() -> None:
    y = np.array([1.0, 2.0, 2.0, 5.0])
    np.testing.assert_array_equal(isotonic_increasing(y, np.ones(4)), y)
    np.testing.assert_array_equal(isotonic_increasing(np.array([3.0]), np.ones(1)), [3.0])

"""The statistics the real-engine tests judge by (``bench/noise.py``): Student's t
quantiles against the published table, Welch's interval worked by hand, the verdicts,
and the interval's coverage on simulated noisy runs."""

from __future__ import annotations

import math
import random

import pytest

from bench.noise import (
    FAILS,
    HOLDS,
    WITHIN_NOISE,
    Ratio,
    ratio,
    ratio_to,
    relative_error,
    t_quantile,
)


@pytest.mark.parametrize(
    ("df", "expected"),
    # Two-sided 95% (0.975 quantile) and 99% (0.995) critical values from the t table.
    [(1, 12.706), (2, 4.303), (4, 2.776), (8, 2.306), (10, 2.228), (30, 2.042), (1e6, 1.960)],
)
def test_t_quantile_matches_the_table(df: float, expected: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3)


def test_t_quantile_other_levels_and_bad_input() -> None:
    assert t_quantile(0.995, 5) == pytest.approx(4.032, abs=1e-3)
    assert t_quantile(0.5, 3) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="t quantile"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="t quantile"):
        t_quantile(0.9, 0)


def test_welch_interval_worked_by_hand() -> None:
    # logs of a: 0.1, -0.1, 0 (mean 0, variance 0.01); b: all 0 (no variance), so the
    # Welch degrees of freedom are a's alone (2) and the half-width 4.303 * sqrt(0.01 / 3).
    a = [math.exp(0.1), math.exp(-0.1), 1.0]
    r = ratio([100 * x for x in a], [100.0, 100.0, 100.0])
    half = 4.3027 * math.sqrt(0.01 / 3)
    assert r.estimate == pytest.approx(1.0)
    assert r.low == pytest.approx(math.exp(-half), rel=1e-4)
    assert r.high == pytest.approx(math.exp(half), rel=1e-4)
    assert (r.n_a, r.n_b) == (3, 3)


def test_one_run_borrows_the_other_sides_variance_and_two_single_runs_say_nothing() -> None:
    r = ratio([90.0], [100.0, 110.0, 90.0])
    assert r.estimate == pytest.approx(90 / (100 * 110 * 90) ** (1 / 3))
    assert 0 < r.low < r.estimate < r.high < math.inf
    blind = ratio([90.0], [100.0])
    assert blind.low == 0 and blind.high == math.inf
    assert blind.at_least(0.5) == WITHIN_NOISE


def test_ratio_to_a_prediction() -> None:
    r = ratio_to([100.0, 110.0, 90.0, 105.0], 100.0)
    assert r.low < r.estimate < r.high
    assert r.within(0.8, 1.25) == HOLDS
    assert r.within(1.5, 2.0) == FAILS
    with pytest.raises(ValueError, match="positive"):
        ratio_to([1.0], 0.0)
    with pytest.raises(ValueError, match="positive"):
        ratio([1.0, -1.0], [1.0])


def test_verdicts_on_each_side_of_a_bound() -> None:
    r = Ratio(estimate=0.9, low=0.86, high=0.94, n_a=5, n_b=5)
    assert r.at_least(0.85) == HOLDS
    assert r.at_least(0.90) == WITHIN_NOISE
    assert r.at_least(0.95) == FAILS
    assert r.at_most(0.95) == HOLDS
    assert r.at_most(0.88) == WITHIN_NOISE
    assert r.at_most(0.80) == FAILS
    assert r.within(0.8, 1.0) == HOLDS and r.within(0.88, 1.0) == WITHIN_NOISE
    assert r.within(0.95, 1.2) == FAILS and r.within(0.5, 0.8) == FAILS
    assert "0.9" in r.describe() and "95% CI" in r.describe()


def test_relative_error_falls_as_runs_are_added() -> None:
    assert relative_error([100.0]) == math.inf
    three = relative_error([90.0, 100.0, 110.0])
    six = relative_error([90.0, 100.0, 110.0, 90.0, 100.0, 110.0])
    assert 0 < six < three
    # Unlike (max - min) / median, which stays at 20% for both.


def test_interval_covers_the_true_ratio_about_95_percent_of_the_time() -> None:
    """Simulated runs with 10% multiplicative noise (a noisy host) and a true ratio of 0.9:
    the interval holds the truth in about 95% of repetitions, and the verdict on a bound
    of 0.85 is almost never "fails"."""
    rng = random.Random(7)
    trials, covered, failed = 4000, 0, 0
    for _ in range(trials):
        a = [900 * math.exp(rng.gauss(0, 0.1)) for _ in range(5)]
        b = [1000 * math.exp(rng.gauss(0, 0.1)) for _ in range(5)]
        r = ratio(a, b)
        covered += r.low <= 0.9 <= r.high
        failed += r.at_least(0.85) == FAILS
    assert 0.93 <= covered / trials <= 0.97
    assert failed / trials < 0.01

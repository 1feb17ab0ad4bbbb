"""Judging a property of repeated, noisy runs: a ratio, its confidence interval, a verdict.

A real-engine test that compares two settings (the cap and the uncapped overload, say)
does not compare two runs: each setting is run several times and the ratio of the two
is estimated with a confidence interval that comes from the runs' own spread. A bound on
that ratio ("the cap keeps at least 85% of the throughput") then gets one of three
verdicts:

- ``holds``: the whole interval lies on the right side of the bound;
- ``fails``: the whole interval lies on the wrong side: the runs show, at the stated
  confidence, that the property does not hold;
- ``within noise``: the interval straddles the bound; on this machine, at this many
  runs, the runs cannot tell. A test fails only on ``fails``; a test's output and the
  summary say which of the other two it was.

The estimate is the ratio of geometric means and the interval is Welch's t interval on
the logarithms (throughputs and latencies are positive, and their run-to-run noise is
multiplicative). :func:`relative_error` is the standard error of one setting's log-mean,
the figure a setting's runs are repeated until they reach.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats

CONFIDENCE = 0.95
"""Two-sided confidence of the intervals: a verdict of ``fails`` has at most a 2.5% chance
of coming from noise alone when the property holds exactly at its bound."""
HOLDS, FAILS, WITHIN_NOISE = "holds", "fails", "within noise"


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile (``0.5 <= p < 1``) of Student's t with ``df`` (> 0, not necessarily
    whole) degrees of freedom (SciPy's ``stats.t.ppf``)."""
    if not 0.5 <= p < 1.0 or not df > 0:
        raise ValueError(f"t quantile needs 0.5 <= p < 1 and df > 0, got p={p}, df={df}")
    return float(stats.t.ppf(p, df))


def _logs(xs: Sequence[float], what: str) -> list[float]:
    if not xs:
        raise ValueError(f"no runs of {what}")
    bad = [x for x in xs if not (x > 0 and math.isfinite(x))]
    if bad:
        raise ValueError(f"{what}: runs must be positive and finite, got {bad}")
    return [math.log(x) for x in xs]


def relative_error(xs: Sequence[float]) -> float:
    """Standard error of the log-mean of ``xs`` (about the relative standard error of their
    geometric mean); infinite for fewer than two runs."""
    logs = _logs(xs, "a setting")
    if len(logs) < 2:
        return math.inf
    return statistics.stdev(logs) / math.sqrt(len(logs))


@dataclass(frozen=True)
class Ratio:
    """``a / b`` estimated from runs of each, with its confidence interval."""

    estimate: float
    low: float
    high: float
    n_a: int
    n_b: int
    confidence: float = CONFIDENCE

    def at_least(self, bound: float) -> str:
        """Verdict on ``a / b >= bound``."""
        if self.low >= bound:
            return HOLDS
        if self.high < bound:
            return FAILS
        return WITHIN_NOISE

    def at_most(self, bound: float) -> str:
        """Verdict on ``a / b <= bound``."""
        if self.high <= bound:
            return HOLDS
        if self.low > bound:
            return FAILS
        return WITHIN_NOISE

    def within(self, low: float, high: float) -> str:
        """Verdict on ``low <= a / b <= high``."""
        if self.low >= low and self.high <= high:
            return HOLDS
        if self.high < low or self.low > high:
            return FAILS
        return WITHIN_NOISE

    def describe(self) -> str:
        return (
            f"{self.estimate:.3g} ({self.confidence:.0%} CI {self.low:.3g}-{self.high:.3g}; "
            f"{self.n_a} vs {self.n_b} runs)"
        )


def ratio(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> Ratio:
    """The ratio of the geometric means of ``a`` and ``b`` with Welch's t interval.

    A side with one run borrows the other side's variance (the same measurement on the
    same machine); with one run on each side the interval is unbounded.
    """
    la, lb = _logs(a, "the first setting"), _logs(b, "the second setting")
    diff = statistics.fmean(la) - statistics.fmean(lb)
    va = statistics.variance(la) if len(la) > 1 else None
    vb = statistics.variance(lb) if len(lb) > 1 else None
    if va is None and vb is None:
        return Ratio(math.exp(diff), 0.0, math.inf, len(la), len(lb), confidence)
    va = vb if va is None else va
    vb = va if vb is None else vb
    assert va is not None and vb is not None
    sa, sb = va / len(la), vb / len(lb)
    se = math.sqrt(sa + sb)
    if se == 0:
        return Ratio(math.exp(diff), math.exp(diff), math.exp(diff), len(la), len(lb), confidence)
    # Welch-Satterthwaite degrees of freedom; a side with one run contributes none.
    den = (sa**2 / (len(la) - 1) if len(la) > 1 else 0.0) + (
        sb**2 / (len(lb) - 1) if len(lb) > 1 else 0.0
    )
    df = (sa + sb) ** 2 / den
    t = t_quantile(0.5 + confidence / 2, df)
    return Ratio(
        math.exp(diff),
        math.exp(diff - t * se),
        math.exp(diff + t * se),
        len(la),
        len(lb),
        confidence,
    )


def ratio_to(a: Sequence[float], value: float, confidence: float = CONFIDENCE) -> Ratio:
    """The ratio of the geometric mean of ``a`` to a fixed ``value`` (a prediction), with
    the one-sample t interval; unbounded for one run."""
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"the value compared with must be positive and finite, got {value}")
    la = _logs(a, "the runs")
    diff = statistics.fmean(la) - math.log(value)
    if len(la) < 2:
        return Ratio(math.exp(diff), 0.0, math.inf, len(la), 0, confidence)
    se = statistics.stdev(la) / math.sqrt(len(la))
    t = t_quantile(0.5 + confidence / 2, len(la) - 1)
    return Ratio(
        math.exp(diff), math.exp(diff - t * se), math.exp(diff + t * se), len(la), 0, confidence
    )

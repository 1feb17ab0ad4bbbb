"""The concurrency cap when throughput falls past its peak (preemption thrash)."""

from __future__ import annotations

import numpy as np
import pytest

from kvscope.advisor import FrameSource, analyze
from kvscope.advisor.datasets import REGIMES, _throughput, make_engine

LEVELS = (1, 2, 4, 8, 12, 16, 24, 32)


@pytest.mark.parametrize("seed", (0, 1, 2))
def test_cap_keeps_the_fraction_of_the_peak_when_throughput_falls(seed: int) -> None:
    s = make_engine("preemption_thrash", seed=seed, levels=LEVELS)
    v = analyze(FrameSource(s.engines, s.windows, s.requests)).engines[0]
    assert v.preemption_thrash
    cap = v.recommended_concurrency_cap
    assert cap is not None
    p = REGIMES["preemption_thrash"]
    grid = np.linspace(1, max(LEVELS), 500)
    peak = float(_throughput(grid, p).max())
    at_cap = float(_throughput(np.array([float(cap)]), p)[0])
    # The cap holds the engine near its peak, not near the thrashing levels' average...
    assert at_cap >= 0.88 * peak, (cap, at_cap, peak)
    # ...and it is no larger than needed: one request less must fall below the fraction
    # (or be the peak's own neighbourhood), and it lies before the collapse.
    true_knee = float(grid[np.argmax(_throughput(grid, p) >= 0.9 * peak)])
    assert cap <= np.ceil(true_knee) + 2, (cap, true_knee)
    assert v.predicted_throughput_fraction_at_cap is not None
    assert v.predicted_throughput_fraction_at_cap >= 0.9

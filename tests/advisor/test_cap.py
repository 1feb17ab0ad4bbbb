"""The concurrency cap when throughput falls past its peak (preemption thrash)."""

from __future__ import annotations

import pytest

from kvscope.advisor import FrameSource, analyze
from kvscope.advisor.datasets import make_engine, true_curve

LEVELS = (1, 2, 4, 8, 12, 16, 24, 32)


@pytest.mark.parametrize("seed", (0, 1, 2))
def test_cap_keeps_the_fraction_of_the_peak_when_throughput_falls(seed: int) -> None:
    s = make_engine("preemption_thrash", seed=seed, levels=LEVELS)
    assert s.truth["thrash"], s.truth  # the simulated engine does fall past its peak
    v = analyze(FrameSource(s.engines, s.windows, s.requests)).engines[0]
    assert v.preemption_thrash
    cap = v.recommended_concurrency_cap
    assert cap is not None
    # The engine's own curve, measured at every whole load without jitter.
    curve = true_curve("preemption_thrash", LEVELS)
    peak = max(curve.values())
    # The cap holds the engine near its peak, not near the thrashing levels' average...
    assert curve[cap] >= 0.88 * peak, (cap, curve)
    # ...and it lies before the collapse: no further than one client past the peak.
    peak_load = max(curve, key=lambda k: curve[k])
    assert cap <= peak_load + 1, (cap, curve)
    assert v.predicted_throughput_fraction_at_cap is not None
    assert v.predicted_throughput_fraction_at_cap >= 0.9

"""The plateau of a collector's own 1-second windows of recorded engine steps: the expected
answer of the tests that scrape the same steps as a Prometheus server would."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvscope.advisor import ThroughputCurve
from kvscope.advisor.frames import prepare_windows
from kvscope.collector._windows import aggregate

_ZERO_WHEN_ABSENT = ("deferred", "kv_blocks_used", "prefix_queries", "prefix_hits")


def collector_curve(cols: dict[str, np.ndarray]) -> ThroughputCurve:
    """``cols``: the steps' columns as the collector stores them (``ts_unix_s``, counts and
    gauges); the columns a recording lacks count zero, its iteration times unknown."""
    n = len(cols["ts_unix_s"])
    full = dict(cols)
    for c in _ZERO_WHEN_ABSENT:
        full.setdefault(c, np.zeros(n))
    full.setdefault("iteration_s", np.full(n, math.nan))
    _, w = aggregate(np.zeros(n, dtype=np.int64), full)
    frame = pd.DataFrame(w).assign(engine_id="e")
    return ThroughputCurve().fit(prepare_windows(frame))


def collector_plateau(cols: dict[str, np.ndarray]) -> float:
    """The plateau of :func:`collector_curve`."""
    return collector_curve(cols).plateau_tokens_per_s_

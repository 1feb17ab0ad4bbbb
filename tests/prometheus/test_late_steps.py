"""A collector's series, scraped at any timing, give the plateau the plugin's windows give.

No server here: the bundled real recording's batches reach a collector at their pace, one
after another, a lag after their last step; three times (``OUTAGES``, as the replayed
fleet of ``conftest.py``) the batches of 3 s arrive together at the end, ``spacing`` apart.
A scrape every second, at a ``phase`` of the second, reads what ``/metrics`` exports at
that moment: the counters summed over the batches that arrived, and the latest step's
time. From those samples the windows are built as :class:`PrometheusSource` builds them
(reset-aware increases, late steps spread back, the two-interval average,
:func:`kvscope_windows`). The expected answer is the plateau of the collector's own
1-second windows of the same steps (by step time): 1,276 tok/s; these timings read
0.96-0.98 of it. Spread back by the step counter alone (an interval after ones without a
step and about ``m + 1`` times its peers), 17% of them read more than 5% off, up to +21%
(the replay test against real Prometheus read +8% and +13% in two of about twenty runs that
way): a scrape that falls among the late batches leaves an interval that looks like its
peers, and the rest in the next one."""

from __future__ import annotations

import numpy as np
import pytest
from _promfleet import OUTAGES
from _steps import collector_plateau

from kvscope.advisor import ThroughputCurve
from kvscope.advisor.frames import prepare_windows
from kvscope.lab.recording import BUNDLED_RECORDING, load_recording
from kvscope.sources.prometheus.frames import (
    increases,
    kvscope_windows,
    late_groups,
)
from kvscope.sources.prometheus.read import KVSCOPE_SMOOTH_STEPS, LATE_MAX_GAP_S, Reader

SUMS = {
    "n_steps": None,
    "generation_tokens": "generation_tokens",
    "prompt_tokens": "prompt_tokens",
    "preemptions": "preemptions",
    "batch:sum": "batch_size",
    "batch:count": None,
    "kv:sum": "kv_usage_ratio",
    "kv:count": None,
    "waiting:sum": "waiting",
    "deferred:sum": "deferred",
}


@pytest.fixture(scope="module")
def steps() -> list[dict[str, np.ndarray]]:
    rec = load_recording(BUNDLED_RECORDING)
    first, _ = rec.span_unix_s
    out = []
    for b in rec.batches:
        if b.get("steps") and b["steps"]["ts_unix_s"]:
            cols = {k: np.asarray(v, float) for k, v in b["steps"].items() if v is not None}
            cols["ts_unix_s"] = cols["ts_unix_s"] - first
            out.append(cols)
    return sorted(out, key=lambda s: float(s["ts_unix_s"].max()))


@pytest.fixture(scope="module")
def expected(steps: list[dict[str, np.ndarray]]) -> float:
    """The plateau of the collector's own windows (steps by their time)."""
    return collector_plateau({k: np.concatenate([s[k] for s in steps]) for k in steps[0]})


def scraped_plateau(
    steps: list[dict[str, np.ndarray]], phase: float, spacing: float, lag: float
) -> float:
    arrivals, late = [], {}
    for s in steps:
        due = float(s["ts_unix_s"].max())
        out = next(((a, a + d) for a, d in OUTAGES if a <= due < a + d), None)
        if out is not None:
            late[out] = late.get(out, -1) + 1
            at = out[1] + lag + late[out] * spacing
        else:
            at = due + lag
        arrivals.append(max(at, arrivals[-1] + 1e-3) if arrivals else at)  # one sender
    arrived = np.asarray(arrivals)
    per_batch = {
        k: np.array([len(s["ts_unix_s"]) if c is None else s[c].sum() for s in steps])
        for k, c in SUMS.items()
    }
    per_batch["kv:count"] = per_batch["batch:count"] = per_batch["n_steps"]
    last_step = np.array([s["ts_unix_s"].max() for s in steps])
    points = np.arange(phase - 3.0, arrived.max() + 3.0, 1.0)
    seen = arrived[None, :] <= points[:, None]  # scrape x batch
    counters = {k: seen @ v for k, v in per_batch.items()}
    marks = np.where(seen.any(axis=1), np.where(seen, last_step, -np.inf).max(axis=1), np.nan)
    groups = late_groups(increases(counters["n_steps"]), marks, points, int(LATE_MAX_GAP_S))
    lead = KVSCOPE_SMOOTH_STEPS
    c = {k: Reader.smoothed(v, lead, groups) for k, v in counters.items()}
    grid = points[lead:]
    w = kvscope_windows(c, grid, 1.0).assign(engine_id="e")
    w = w[np.isfinite(w["batch_mean"].to_numpy(float))]
    return ThroughputCurve().fit(prepare_windows(w)).plateau_tokens_per_s_


@pytest.mark.parametrize("spacing", [0.0, 0.05, 0.3])
@pytest.mark.parametrize("lag", [0.3, 1.0, 2.5])
def test_late_steps_give_the_plateau_at_every_scrape_timing(
    steps: list[dict[str, np.ndarray]], expected: float, spacing: float, lag: float
) -> None:
    got = {
        round(phase, 2): scraped_plateau(steps, phase, spacing, lag)
        for phase in np.arange(0.0, 1.0, 0.05)
    }
    ratios = {p: v / expected for p, v in got.items()}
    assert all(0.95 <= r <= 1.05 for r in ratios.values()), (expected, ratios)

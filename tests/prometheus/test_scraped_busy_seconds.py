"""vLLM's series of a slow KV-starved engine, scraped at any timing, give the plateau the
collector's windows give.

No server here: the steps of a real run (CPU vLLM, 48 blocks of 32 tokens, swept 1 to 32
clients; ``fixtures/cpu_kv_starved_steps.csv.gz``, the collector's ``steps`` of CI run
63) are exported as vLLM's ``/metrics`` would: the running and waiting gauges hold the
latest step's values while the engine steps (0 once it went idle), the counters sum the
steps so far. A scrape every second at a ``phase`` of the second reads them; the
windows are built by :meth:`Reader.vllm_windows` at the scrape interval. The expected
answer is the plateau of the collector's own 1-second windows of the same steps (267
tok/s). At 32 clients this engine recomputes preempted requests: some seconds hold 10
steps instead of 25, busy all through. Read as idle by the step-count estimate of the
busy share, they were dropped and the plateau read 1.05-1.19x (VictoriaMetrics
scraping at .65 s read 321 against 267 in CI)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from _steps import collector_curve, collector_plateau

from kvscope.advisor import ThroughputCurve
from kvscope.advisor.frames import prepare_windows
from kvscope.lab.recording import BUNDLED_RECORDING, load_recording
from kvscope.sources.prometheus.frames import increases
from kvscope.sources.prometheus.read import Fetch, Reader

STEPS = Path(__file__).resolve().parents[1] / "fixtures" / "cpu_kv_starved_steps.csv.gz"
IDLE_AFTER_S = 0.5
"""A scrape this long after the latest step, with no step since, reads the engine idle."""


@pytest.fixture(scope="module")
def steps() -> pd.DataFrame:
    return pd.read_csv(STEPS)


@pytest.fixture(scope="module")
def expected(steps: pd.DataFrame) -> float:
    cols = {c: steps[c].to_numpy(float) for c in steps if c != "t_s"}
    return collector_plateau({**cols, "ts_unix_s": steps["t_s"].to_numpy(float)})


def scraped_curve(steps: pd.DataFrame, phase: float) -> ThroughputCurve:
    t = steps["t_s"].to_numpy(float)
    scrapes = np.arange(math.floor(t[0]) - 2 + phase, t[-1] + 3, 1.0)
    k = np.searchsorted(t, scrapes, side="right") - 1  # the latest step at each scrape
    nxt = np.append(t, math.inf)[k + 1]
    stepping = (k >= 0) & (nxt - scrapes < IDLE_AFTER_S)

    def gauge(col: str) -> np.ndarray:
        return np.where(stepping, steps[col].to_numpy(float)[np.maximum(k, 0)], 0.0)

    def counter(v: np.ndarray) -> np.ndarray:
        return increases(np.concatenate([[0.0], np.cumsum(v)])[k + 1])

    running = gauge("batch_size")[1:]
    c = {
        "snapshot": running,
        "batch_max": running,
        "waiting_mean": gauge("waiting")[1:],
        "kv_usage_sampled": gauge("kv_usage_ratio")[1:],
        "n_steps": counter(np.ones(len(t))),
        **{
            col: counter(steps[col].to_numpy(float))
            for col in ("generation_tokens", "prompt_tokens", "preemptions")
        },
    }
    grid = np.ceil(scrapes[1:])  # window k: (grid[k] - 1, grid[k]], its scrape inside
    f = Fetch(since=grid[0] - 1, until=grid[-1], names=set(), step_s=1)
    w = Reader.vllm_windows(c, grid, f, {}, pd.DataFrame()).assign(engine_id="e")
    return ThroughputCurve().fit(prepare_windows(w))


def scraped_plateau(steps: pd.DataFrame, phase: float) -> float:
    return scraped_curve(steps, phase).plateau_tokens_per_s_


PHASES = [round(0.05 * i, 2) for i in range(20)]


def test_slow_busy_seconds_stay_in_the_plateau_at_every_scrape_timing(
    steps: pd.DataFrame, expected: float
) -> None:
    """Every timing within the integration test's 15%, and no bias over them (the spread
    left is the load read as one snapshot per scrape, binned: 0.985-1.123, mean 1.04;
    1.05-1.19, mean 1.12 with those seconds dropped)."""
    assert expected == pytest.approx(267.3, abs=0.5)
    ratio = {p: scraped_plateau(steps, p) / expected for p in PHASES}
    assert max(abs(r - 1.0) for r in ratio.values()) <= 0.15, ratio
    assert float(np.mean(list(ratio.values()))) == pytest.approx(1.0, abs=0.06), ratio


def _recording_steps() -> pd.DataFrame:
    """The steps of the bundled recording: the run the Prometheus fleet replays."""
    cols: dict[str, list[float]] = {}
    for b in load_recording(BUNDLED_RECORDING).batches:
        for k, v in b["steps"].items():
            cols.setdefault(k, []).extend(v)
    return pd.DataFrame(cols).rename(columns={"ts_unix_s": "t_s"}).sort_values("t_s")


@pytest.mark.parametrize("run", ["cpu_fixture", "bundled_recording"])
def test_the_knee_stays_below_the_batch_the_full_cache_held_at_every_scrape_timing(
    steps: pd.DataFrame, run: str
) -> None:
    """Past the batch the engine held while its cache was full and requests waited, more
    load only queues: throughput stops growing there at the latest. That batch is read
    from the engine's steps (KV usage >= 0.9 with a request waiting: 11.4-11.5 on both
    runs). A plateau lifted a few percent by one scrape timing pulled the 8-client level
    under 90% of it, and the fraction rule put the knee at the first KV-full load: 14.7
    in flight in CI against the store's 7.1, up to 17.2 on the CPU run's steps."""
    st = steps if run == "cpu_fixture" else _recording_steps()
    cols = {c: st[c].to_numpy(float) for c in st if c != "t_s"}
    expected = collector_curve({**cols, "ts_unix_s": st["t_s"].to_numpy(float)})
    full = st[(st["waiting"] >= 1) & (st["kv_usage_ratio"] >= 0.9)]
    held = float(full["batch_size"].mean())
    assert 11 <= held <= 12
    knees = {p: scraped_curve(st, p).knee_load_ for p in PHASES}
    assert max(knees.values()) <= 1.15 * held, knees
    assert min(knees.values()) >= expected.knee_load_ / 2, knees

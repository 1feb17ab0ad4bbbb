"""Windows for the analyses from the collector's 1-minute tier.

The collector keeps 1-second windows for its window retention and the 1-minute windows it
rolled them up into for much longer (:mod:`kvscope.collector._rollup`). An engine whose
range holds minutes but no seconds is analysed from its minutes, as the Prometheus source
does with windows at a coarse step:

* :func:`windows_from_minutes`: each minute one window of the shape the analyses read,
  its counts per second the engine stepped in, its step-weighted means as they are, batch
  percentiles from the mean and maximum, step times unknown (the busy share is estimated
  from the step count), ``resolution_s`` 60;
* :func:`append_minute_windows`, :func:`read_from_minutes`, :func:`sample_with_minutes`:
  which engines read which tier;
* :func:`steady` and :func:`knee_gap`: a minute straddling a change of load is a point
  between two loads and moves the knee up, so a knee from minutes is trusted only between
  steady minutes; otherwise no cap is recommended from it.

The steadiness rule and its measurements on real engines: see
docs/advise.md#knees-from-the-1-minute-tier.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from kvscope.advisor.sources import SourceError, WindowSample

MINUTE_S = 60
"""A row of the tier covers this many seconds."""

_PER_SECOND = (
    "n_steps",
    "batch_sum",
    "kv_usage_sum",
    "waiting_sum",
    "deferred_sum",
    "preemptions",
    "prompt_tokens",
    "generation_tokens",
    "prefix_queries",
    "prefix_hits",
    "iteration_n",
    "iteration_s_sum",
)
"""Minute sums read as rates per second the engine stepped in."""

_KEPT = (
    "engine_id",
    "ts_s",
    "pool",
    "model",
    "batch_mean",
    "batch_min",
    "batch_max",
    "kv_usage_mean",
    "kv_usage_max",
    "kv_blocks_max",
    "waiting_mean",
    "waiting_max",
    "deferred_mean",
    "deferred_max",
    "iteration_s_max",
    "load_p50",
    "load_p90",
)
"""Minute columns read as they are (means over the minute's steps, extremes, labels)."""


def windows_from_minutes(minutes: pd.DataFrame) -> pd.DataFrame:
    """One analysis window per 1-minute row (see the module docstring); an empty frame
    for no rows. Minutes without a stepped second (``n_seconds`` 0 or missing) are left
    out."""
    if minutes is None or not len(minutes):
        return pd.DataFrame()
    m = minutes.reset_index(drop=True)
    seconds = pd.to_numeric(m.get("n_seconds"), errors="coerce")
    if not isinstance(seconds, pd.Series):
        return pd.DataFrame()
    ok = seconds.gt(0)
    m, seconds = m[ok].reset_index(drop=True), seconds[ok].reset_index(drop=True)
    out = pd.DataFrame({c: m[c] for c in _KEPT if c in m})
    for c in _PER_SECOND:
        if c in m:
            out[c] = pd.to_numeric(m[c], errors="coerce") / seconds
    batch_mean = pd.to_numeric(out.get("batch_mean"), errors="coerce")
    out["batch_p50"] = batch_mean
    out["batch_p90"] = batch_mean
    out["batch_p99"] = pd.to_numeric(out.get("batch_max"), errors="coerce")
    if "iteration_s_sum" in out and "iteration_n" in out:
        n = out["iteration_n"].where(out["iteration_n"] > 0)
        out["iteration_s_mean"] = (out["iteration_s_sum"] / n).astype(float)
    out["first_step_unix_s"] = math.nan
    out["last_step_unix_s"] = math.nan
    out["n_parts"] = seconds.to_numpy(dtype=float)
    out["resolution_s"] = float(MINUTE_S)
    return out


def append_minute_windows(
    source: object,
    engines: pd.DataFrame,
    windows: pd.DataFrame,
    since: float | None,
    until: float | None,
    pool: str | None,
    seconds_held: pd.Series | None = None,
    first_held: float | None = None,
) -> pd.DataFrame:
    """``windows`` with the engines whose range the 1-minute tier covers better read
    from it (:func:`windows_from_minutes`).

    Only for a range that starts before the oldest 1-second window ``source`` holds
    (``seconds_aged_out``; a source without it, or without ``minute_windows``, is left
    alone): an engine whose 1-second windows in the range are fewer than half the
    seconds its minutes say it stepped in (``n_seconds``) is read from its minutes,
    its seconds dropped (one resolution per engine: a fit over both would weigh each
    second like a minute). ``seconds_held`` and ``first_held``: the engines' true
    counts of 1-second windows in the range and the first of them, where ``windows`` is
    a sample of them. A range whose first second kept lies at its start reads nothing
    more (the source's oldest second is no later)."""
    read = getattr(source, "minute_windows", None)
    aged_out = getattr(source, "seconds_aged_out", None)
    if read is None or aged_out is None or since is None:
        return windows
    if _first_second(windows, seconds_held, first_held) <= since + MINUTE_S:
        return windows  # a second kept at the range's start: none before it aged out
    try:
        oldest = aged_out(since, until)
        if oldest is None or since >= oldest - MINUTE_S:
            return windows
        minutes = read(since, until, pool=pool)
    except SourceError as exc:
        if exc.status == 404:  # a collector from before the minute tier
            return windows
        raise
    if not len(minutes) or "engine_id" not in minutes or "engine_id" not in engines:
        return windows
    known = engines if pool is None or "pool" not in engines else engines[engines["pool"] == pool]
    ids = minutes["engine_id"].astype(str)
    minutes = minutes[ids.isin({str(e) for e in known["engine_id"]})]
    stepped = (
        pd.to_numeric(minutes["n_seconds"], errors="coerce")
        .groupby(minutes["engine_id"].astype(str))
        .sum()
    )
    if seconds_held is None:
        has = "engine_id" in windows and len(windows)
        seconds_held = windows.groupby(windows["engine_id"].astype(str)).size() if has else None
    held = (
        seconds_held.reindex(stepped.index).fillna(0.0)
        if seconds_held is not None
        else pd.Series(0.0, index=stepped.index)
    )
    use = set(stepped.index[held.to_numpy(float) < 0.5 * stepped.to_numpy(float)])
    if not use:
        return windows
    return read_from_minutes(windows, minutes, use)


def read_from_minutes(windows: pd.DataFrame, minutes: pd.DataFrame, use: set[str]) -> pd.DataFrame:
    """``windows`` with the engines in ``use`` read from their ``minutes``
    (:func:`windows_from_minutes`) and their 1-second windows dropped: one resolution per
    engine."""
    if not use or minutes is None or not len(minutes) or "engine_id" not in minutes:
        return windows
    extra = windows_from_minutes(minutes[minutes["engine_id"].astype(str).isin(use)])
    if "engine_id" in windows and len(windows):
        windows = windows[~windows["engine_id"].astype(str).isin(use)]
    if not len(windows):
        return extra
    if not len(extra):
        return windows
    return pd.concat([windows, extra], ignore_index=True)


def _first_second(windows: pd.DataFrame, held: pd.Series | None, first_held: float | None) -> float:
    """The first 1-second window of the range (``first_held`` for a sample; inf: none)."""
    if held is not None:
        return first_held if first_held is not None else math.inf
    if "ts_s" not in windows or not len(windows):
        return math.inf
    first = float(pd.to_numeric(windows["ts_s"], errors="coerce").min())
    return first if math.isfinite(first) else math.inf


def sample_with_minutes(
    source: Any,
    engines: pd.DataFrame,
    sample: WindowSample,
    since: float | None,
    until: float | None,
    pool: str | None,
) -> WindowSample:
    """A window sample (whole time blocks of 1-second windows and their requests) with the
    engines the 1-minute tier covers better read from it (:func:`append_minute_windows`),
    and those engines' requests of the whole range (the sample's blocks are of seconds:
    it holds none of their requests)."""
    first = (
        float(pd.to_numeric(sample.counts["first_ts_s"], errors="coerce").min())
        if len(sample.counts) and "first_ts_s" in sample.counts
        else math.nan
    )
    windows = append_minute_windows(
        source,
        engines,
        sample.windows,
        since,
        until,
        pool,
        seconds_held(sample),
        first if math.isfinite(first) else None,
    )
    if windows is sample.windows:
        return sample
    ids = {str(e) for e in windows.loc[from_minutes(windows), "engine_id"]}
    requests = source.requests(since, until, pool=pool)
    if len(requests) and "engine_id" in requests:
        requests = requests[requests["engine_id"].astype(str).isin(ids)]
    kept = sample.requests
    if len(kept) and "engine_id" in kept:
        kept = kept[~kept["engine_id"].astype(str).isin(ids)]
    parts = [p for p in (kept, requests) if len(p)]
    both = pd.concat(parts, ignore_index=True) if len(parts) > 1 else (parts or [kept])[0]
    return replace(sample, windows=windows, requests=both)


def seconds_held(sample: WindowSample) -> pd.Series | None:
    """Per engine, the 1-second windows of the range a window sample stands for (its
    true counts), None when it has none."""
    c = sample.counts
    if not len(c) or "engine_id" not in c or "n_windows" not in c:
        return None
    return pd.to_numeric(c["n_windows"], errors="coerce").groupby(c["engine_id"].astype(str)).sum()


MAX_KNEE_GAP = 2.0
"""A knee read from minutes is resolved only where steady minutes were seen at loads within
this factor of each other on both sides of it (the lab's sweeps step load by at most 2x)."""
MIN_STEADY_BELOW = 3
"""...and at least this many steady minutes below it (the rising part of the curve)."""
STEADY_SPREAD = 1.5
"""A minute is steady when the load of its P90 second is at most this times its median
second's, plus one request (a minute of Poisson arrivals at 12 in flight: about 1.4x)."""


def steady(windows: pd.DataFrame) -> np.ndarray:
    """Per window read from minutes: whether its load held within the minute (see
    :data:`STEADY_SPREAD`); True where the spread is unknown."""
    if "load_p50" not in windows or "load_p90" not in windows:
        return np.ones(len(windows), dtype=bool)
    p50 = pd.to_numeric(windows["load_p50"], errors="coerce").to_numpy(float)
    p90 = pd.to_numeric(windows["load_p90"], errors="coerce").to_numpy(float)
    with np.errstate(invalid="ignore"):
        return ~(p90 > STEADY_SPREAD * p50 + 1.0)


def knee_gap(windows: pd.DataFrame, knee: float) -> tuple[float, float] | None:
    """Where a knee read from minutes is not resolved, the loads of the steady minutes
    nearest it on each side (below it, at or above it; 1 in flight where none lies below,
    the highest load seen where none lies above); None where it is: steady minutes within
    :data:`MAX_KNEE_GAP` of each other on both sides and :data:`MIN_STEADY_BELOW` below
    it.

    A minute that straddles a change of load (clients arriving within it) is a point
    between two loads, under the curve where it bends; a lab sweep whose levels last 30-90
    s leaves one or two such minutes below the knee, and the minutes' knee came out at
    2.1-3.8x the seconds' on six of them (bench/minute_tier_knees.py, docs/advise.md)."""
    load = pd.to_numeric(windows["load"], errors="coerce").to_numpy(float)
    x = load[steady(windows) & np.isfinite(load) & (load > 0)]
    # Strictly below: a knee at a merged bin's median load sits on a window's load.
    edge = knee * (1.0 - 1e-9)
    below, above = x[x < edge], x[x >= edge]
    lo = float(below.max()) if len(below) else 1.0
    hi = float(above.min()) if len(above) else float(np.nanmax(load, initial=knee))
    unresolved = not len(above) or hi > MAX_KNEE_GAP * lo or len(below) < MIN_STEADY_BELOW
    return (lo, hi) if unresolved else None


def from_minutes(windows: pd.DataFrame) -> np.ndarray:
    """Per row of ``windows``: whether it was read from the 1-minute tier."""
    if "resolution_s" not in windows:
        return np.zeros(len(windows), dtype=bool)
    return pd.to_numeric(windows["resolution_s"], errors="coerce").fillna(1.0).gt(1.0).to_numpy()

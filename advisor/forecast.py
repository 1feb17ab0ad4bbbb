"""Capacity forecast: when a pool's daily peak load would reach its capacity.

Per pool and UTC day the daily peak is the sum of its engines' highest load of the day (an
upper bound of the pool's simultaneous peak); the capacity is the sum of its engines' knees,
or of their batch limits where an engine did not saturate. A least-squares line through the
daily peaks gives the trend, and :class:`PoolForecast` says ``not_enough_days``,
``no_capacity``, ``past``, ``not_rising``, ``crosses`` (with the date) or ``not_within``
the horizon.

* :func:`capacity_forecast`: the forecast of every pool of a report; ``history`` (daily
  peaks from the collector's 1-minute windows) extends the line over the weeks before;
* :func:`engine_capacity`: an engine's knee or batch limit, and which it was;
* :func:`trend_crossing`: the line and where it meets the capacity.

See docs/report.md#capacity-forecast.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvscope.advisor.findings import Finding, Report, _clean
from kvscope.advisor.usage import DAY_S, Usage

WEEK_S = 7 * DAY_S


@dataclass
class Trend:
    """The line through the daily peaks and where it meets the capacity."""

    status: str
    slope_per_day: float | None = None
    level_at_end: float | None = None
    """The line's value at the middle of the last day."""
    crossing_unix_s: float | None = None


@dataclass
class PoolForecast:
    """One pool's daily peaks, capacity, trend and verdict (see the module docstring)."""

    pool: str | None
    status: str
    capacity: float | None
    capacity_from: list[str]
    day_start_unix_s: list[float]
    daily_peak: list[float]
    slope_per_day: float | None = None
    level_at_end: float | None = None
    crossing_unix_s: float | None = None
    weeks_to_crossing: float | None = None
    horizon_weeks: float = 8.0
    min_days: int = 4
    unit: str = "requests in flight"
    history_days: int = 0
    """How many of the days (the first ones) lie before the week (from ``history``)."""

    def to_dict(self) -> dict[str, Any]:
        return _clean(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolForecast:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def trend_crossing(
    days_unix_s: list[float],
    peaks: list[float],
    capacity: float | None,
    *,
    until_unix_s: float,
    min_days: int = 4,
    horizon_weeks: float = 8.0,
) -> Trend:
    """The least-squares line through ``(day middle, peak)`` and when it reaches
    ``capacity`` (see the module docstring for the statuses)."""
    if len(peaks) < min_days:
        return Trend("not_enough_days")
    x = (np.asarray(days_unix_s, dtype=float) + DAY_S / 2) / DAY_S
    slope, intercept = np.polyfit(x, np.asarray(peaks, dtype=float), 1)
    last = float(x.max())
    level = float(intercept + slope * last)
    out = Trend("", float(slope), level)
    if capacity is None:
        out.status = "no_capacity"
    elif level >= capacity:
        out.status = "past"
    elif slope <= 0:
        out.status = "not_rising"
    else:
        out.crossing_unix_s = float((capacity - intercept) / slope * DAY_S)
        horizon = until_unix_s + horizon_weeks * WEEK_S
        out.status = "crosses" if out.crossing_unix_s <= horizon else "not_within"
    return out


def _evidence(findings: list[Finding], kind: str, engine_id: str, key: str) -> float | None:
    for f in findings:
        if f.kind == kind and f.scope.engine_id == engine_id:
            v = f.evidence.get(key)
            if v is None:
                return None
            try:
                x = float(v)
            except (TypeError, ValueError):
                return None
            return x if math.isfinite(x) else None
    return None


def engine_capacity(report: Report, engine_id: str) -> tuple[float | None, str]:
    """An engine's capacity in requests in flight and where it comes from: its knee, else
    its batch limit ``min(KV room, max_num_seqs)``, else ``(None, "unknown")``."""
    v = report.engine(engine_id)
    if v.saturated and v.knee_concurrency is not None:
        return float(v.knee_concurrency), "knee"
    room = _evidence(report.findings, "kv_capacity", engine_id, "kv_batch")
    seqs = _evidence(report.findings, "bottleneck", engine_id, "max_num_seqs")
    limits = [x for x in (room, seqs) if x is not None]
    if not limits:
        return None, "unknown"
    return min(limits), "batch limit"


def _engine_day_peaks(rows: Any, pool: str | None, into: dict[tuple[str, float], float]) -> None:
    """Each (engine, day)'s highest load of ``pool`` from a frame-like of columns
    engine_id, pool, day_start_unix_s, load_max, into ``into`` (keeping the higher)."""
    n = len(rows.get("engine_id", [])) if rows is not None else 0
    if not n or "load_max" not in rows:
        return
    for i in range(n):
        load = rows["load_max"][i]
        if rows["pool"][i] != pool or load is None:
            continue
        x = float(load)
        if not math.isfinite(x):
            continue
        key = (str(rows["engine_id"][i]), float(rows["day_start_unix_s"][i]))
        into[key] = max(x, into.get(key, x))


def _columns(frame: Any) -> dict[str, list[Any]]:
    """A DataFrame or a dict of columns as a dict of lists."""
    if frame is None:
        return {}
    if hasattr(frame, "to_dict") and hasattr(frame, "columns"):
        return {str(c): frame[c].tolist() for c in frame.columns}
    return dict(frame)


def capacity_forecast(
    usage: Usage,
    report: Report,
    *,
    min_days: int = 4,
    horizon_weeks: float = 8.0,
    history: Any = None,
) -> list[PoolForecast]:
    """One :class:`PoolForecast` per pool of ``report`` (see the module docstring);
    ``history``: the per engine-day peaks of the days before the week."""
    hist = _columns(history)
    out = []
    for p in report.pools:
        before: dict[tuple[str, float], float] = {}
        _engine_day_peaks(hist, p.pool, before)
        week: dict[tuple[str, float], float] = {}
        _engine_day_peaks(usage.days, p.pool, week)
        week_days = {day for _, day in week}
        merged = {**before}
        for k, v in week.items():
            merged[k] = max(v, merged.get(k, v))
        peaks: dict[float, float] = {}
        for (_, day), load in merged.items():
            peaks[day] = peaks.get(day, 0.0) + load
        caps = [engine_capacity(report, e) for e in p.engine_ids]
        capacity = None if any(c is None for c, _ in caps) else sum(c or 0.0 for c, _ in caps)
        days = sorted(peaks)
        t = trend_crossing(
            days,
            [peaks[x] for x in days],
            capacity,
            until_unix_s=usage.until_unix_s,
            min_days=min_days,
            horizon_weeks=horizon_weeks,
        )
        out.append(
            PoolForecast(
                pool=p.pool,
                status=t.status,
                capacity=capacity,
                capacity_from=sorted({src for _, src in caps}),
                day_start_unix_s=days,
                daily_peak=[peaks[x] for x in days],
                slope_per_day=t.slope_per_day,
                level_at_end=t.level_at_end,
                crossing_unix_s=t.crossing_unix_s,
                weeks_to_crossing=(
                    (t.crossing_unix_s - usage.until_unix_s) / WEEK_S
                    if t.crossing_unix_s is not None
                    else None
                ),
                horizon_weeks=horizon_weeks,
                min_days=min_days,
                history_days=sum(1 for x in days if x not in week_days),
            )
        )
    return out

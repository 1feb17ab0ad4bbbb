"""What one refresh of the dashboard reads from its source, and nothing else.

:func:`load_snapshot` reads engines, windows and finished requests through the source
the settings name: :class:`advisor.CollectorSource` (the collector's ``/v1`` read API,
1-second windows) or :class:`kvscope.sources.prometheus.source.PrometheusSource` (vLLM's own series in
a Prometheus-compatible server, windows one scrape interval long, requests estimated
from histograms). It runs :func:`kvscope.advisor.analyze` once on those same frames (annotated
with the scrape resolution for Prometheus, as ``kvscope advise --prometheus`` does) and
keeps all of it in a :class:`Snapshot`: the pages present the report's verdicts,
findings and recommendations and plot the raw frames; they never recompute a finding.
:func:`read_steps` reads the per-step rows of one engine in a time range
(``/v1/steps``); only a collector has them (:attr:`Snapshot.has_steps`).

No Streamlit here: the app caches these calls; the tests call them directly.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from kvscope.advisor import CollectorSource, Report, SourceError, analyze
from kvscope.advisor.minute_windows import read_from_minutes
from kvscope.advisor.render import source_error_message
from kvscope.advisor.request_latency import (
    RequestLatency,
    SloTargets,
    latency_over_time,
    length_histogram,
    request_latency,
)
from kvscope.advisor.sources import Source
from kvscope.dashboard._messages import no_data_message, window_text
from kvscope.dashboard._status import DOWN_S, EngineState, engine_state
from kvscope.dashboard.settings import DashboardSettings


class _KeepingSource:
    """A source that hands the advisor the source's frames and keeps them."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.frames: dict[str, pd.DataFrame] = {}

    def engines(self) -> pd.DataFrame:
        self.frames["engines"] = self.source.engines()
        return self.frames["engines"]

    def windows(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame:
        self.frames["windows"] = self.source.windows(since, until, engine, pool)
        return self.frames["windows"]

    def requests(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame:
        self.frames["requests"] = self.source.requests(since, until, engine, pool)
        return self.frames["requests"]

    def kv_events(
        self, since: float | None = None, until: float | None = None, pool: str | None = None
    ) -> pd.DataFrame:
        self.frames["kv_events"] = self.source.kv_events(since, until, pool)
        return self.frames["kv_events"]

    def minute_windows(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame:
        read = getattr(self.source, "minute_windows", None)
        self.frames["minute_windows"] = (
            read(since, until, engine, pool) if read is not None else pd.DataFrame()
        )
        return self.frames["minute_windows"]

    def analysed_windows(self, report: Report) -> pd.DataFrame:
        """The windows the report was made from: the 1-second ones read, with the engines
        it read from the 1-minute tier (``coverage.engines_from_minutes``) in their minutes
        only (:func:`~kvscope.advisor.minute_windows.read_from_minutes`, the advisor's
        rule: one resolution per engine)."""
        w = self.frames.get("windows", pd.DataFrame())
        ids = {str(e) for e in report.coverage.get("engines_from_minutes") or []}
        return read_from_minutes(w, self.frames.get("minute_windows", pd.DataFrame()), ids)

    def seconds_aged_out(self, since: float | None, until: float | None) -> float | None:
        aged_out = getattr(self.source, "seconds_aged_out", None)
        return aged_out(since, until) if aged_out is not None else None


@dataclass
class Snapshot:
    """One read of the collector: the advisor's report and the frames it was made from.

    ``settings`` are those of the read (the pages read raw steps with them);
    ``error`` is set (and ``report`` is None) when the collector could not be read;
    ``error_status`` is its HTTP status (None when unreachable). ``fetched_unix_s``
    is when the read started; ``since_unix_s`` / ``until_unix_s`` the window;
    ``since_text`` the sidebar's window (``30m``) or the range's start, ``until_text``
    the range's end (None for a window ending now).
    """

    settings: DashboardSettings
    since_text: str
    since_unix_s: float | None
    until_unix_s: float | None
    fetched_unix_s: float
    report: Report | None = None
    engines: pd.DataFrame = field(default_factory=pd.DataFrame)
    windows: pd.DataFrame = field(default_factory=pd.DataFrame)
    requests: pd.DataFrame = field(default_factory=pd.DataFrame)
    error: str | None = None
    error_status: int | None = None
    read_s: float = 0.0
    prom_no_data: str | None = None
    until_text: str | None = None

    @property
    def collector_url(self) -> str:
        """The base URL read (the collector's, or Prometheus')."""
        return self.settings.source_url

    @property
    def from_prometheus(self) -> bool:
        return self.settings.prometheus is not None

    @property
    def has_steps(self) -> bool:
        """Whether per-step rows can be read (a collector keeps them; Prometheus has one
        sample per scrape)."""
        return not self.from_prometheus

    @property
    def long_range(self) -> bool:
        """Whether the window is long enough (``LONG_RANGE_S``) for the time series to read
        the collector's 1-minute windows."""
        if self.from_prometheus:
            return False
        if self.since_unix_s is None:
            return True
        end = self.until_unix_s if self.until_unix_s is not None else self.fetched_unix_s
        return end - self.since_unix_s >= LONG_RANGE_S

    @property
    def window_s(self) -> float:
        """Length of one window in seconds (1 from a collector; the resolution read from
        Prometheus)."""
        res = self.report.coverage.get("resolution_s") if self.report is not None else None
        return float(res) if self.from_prometheus and res else 1.0

    @property
    def window(self) -> str:
        """``2026-... UTC to now (window 30m)``."""
        return window_text(self.since_unix_s, self.until_unix_s, self.since_text, self.until_text)

    @property
    def has_data(self) -> bool:
        return self.report is not None and self.report.has_data

    @property
    def no_data_text(self) -> str:
        """Why there is nothing to show and what to do (empty when there is data)."""
        if self.report is None or self.report.has_data:
            return ""
        if self.prom_no_data is not None:
            return self.prom_no_data
        return no_data_message(
            self.report,
            self.collector_url,
            self.window,
            now_unix_s=self.fetched_unix_s,
            ranged=self.until_text is not None,
            current=self.since_text,
        )

    @property
    def known_engine_ids(self) -> list[str]:
        """Every engine the source knows (``/v1/engines``), with data in the window or not."""
        if "engine_id" not in self.engines:
            return []
        return sorted(str(e) for e in self.engines["engine_id"].dropna().unique())

    def engine_state(self, engine_id: str) -> EngineState:
        """Live, idle or DOWN (with when it was last seen), from the engine's row."""
        cfg = self.engine_config(engine_id)
        return engine_state(
            cfg.get("last_step_unix_s"),
            cfg.get("last_seen_unix_s"),
            self.fetched_unix_s,
            # Prometheus has no heartbeat: the newest sample stands for it.
            max(DOWN_S, 4 * self.window_s),
        )

    def engine_config(self, engine_id: str) -> dict[str, Any]:
        """The engine's latest configuration (its row of ``/v1/engines``)."""
        if "engine_id" not in self.engines:
            return {}
        rows = self.engines[self.engines["engine_id"] == engine_id]
        if not len(rows):
            return {}
        return {
            k: (None if (isinstance(v, float) and v != v) or v is pd.NA else v)
            for k, v in rows.iloc[0].to_dict().items()
        }

    def engine_windows(self, engine_id: str) -> pd.DataFrame:
        """The engine's 1-second windows, oldest first."""
        return _part(self.windows, engine_id, self._parts, "windows")

    def engine_requests(self, engine_id: str) -> pd.DataFrame:
        """The engine's finished requests, oldest first."""
        return _part(self.requests, engine_id, self._parts, "requests")

    @property
    def slo_targets(self) -> SloTargets:
        """The targets the advisor ran with (the settings' ``--slo-*``)."""
        return slo_targets(self.settings)

    def latency(self, engine_ids: list[str], targets: SloTargets) -> RequestLatency | None:
        """The latency block of these engines' finished requests judged against
        ``targets`` (:func:`kvscope.advisor.request_latency.request_latency` on the
        requests read); None without requests."""
        parts = [self.engine_requests(e) for e in engine_ids]
        parts = [p for p in parts if len(p)]
        if not parts:
            return None
        return request_latency(pd.concat(parts, ignore_index=True), targets)

    def latency_over_time(self, engine_id: str) -> pd.DataFrame:
        """TTFT, ITL and e2e percentiles of the engine's requests per bin of finish time
        (:func:`kvscope.advisor.request_latency.latency_over_time`)."""
        return latency_over_time(self.engine_requests(engine_id))

    def length_histogram(self, engine_id: str, column: str) -> pd.DataFrame:
        """Requests per length bin of ``column`` (``prompt_tokens``, ``generation_tokens``)."""
        return length_histogram(self.engine_requests(engine_id), column)

    @functools.cached_property
    def _parts(self) -> dict[str, dict[str, pd.DataFrame]]:
        return {}


def slo_targets(settings: DashboardSettings) -> SloTargets:
    """The latency targets of the settings."""
    return SloTargets(
        ttft_s=settings.slo_ttft_s, itl_s=settings.slo_itl_s, e2e_s=settings.slo_e2e_s
    )


def _slo_kw(settings: DashboardSettings) -> dict[str, Any]:
    return {
        "slo_ttft_s": settings.slo_ttft_s,
        "slo_itl_s": settings.slo_itl_s,
        "slo_e2e_s": settings.slo_e2e_s,
    }


def _part(
    df: pd.DataFrame, engine_id: str, cache: dict[str, dict[str, pd.DataFrame]], name: str
) -> pd.DataFrame:
    """One engine's rows, the frame split by engine once (fleets have many engines)."""
    if "engine_id" not in df:
        return df.iloc[0:0]
    if name not in cache:
        cache[name] = {str(k): g.reset_index(drop=True) for k, g in df.groupby("engine_id")}
    return cache[name].get(engine_id, df.iloc[0:0])


def resolve_since(since_text: str, now_unix_s: float) -> float | None:
    """Unix seconds of a ``--since`` value (``0`` and ``all`` mean the beginning)."""
    from kvscope.args import parse_time

    if since_text.strip().lower() in ("", "0", "all"):
        return None
    return parse_time("since", since_text, now_unix_s)


def load_snapshot(
    settings: DashboardSettings,
    since_text: str | None = None,
    pool: str | None = None,
    *,
    until_text: str | None = None,
    now_unix_s: float | None = None,
) -> Snapshot:
    """Read the collector once and run the advisor on what was read: the window
    ``since_text`` ending now, or the range ``since_text`` to ``until_text``."""
    from kvscope.args import parse_time

    now = time.time() if now_unix_s is None else now_unix_s
    since_text = since_text or settings.since
    pool = pool if pool is not None else settings.pool
    since = resolve_since(since_text, now)
    until = parse_time("until", until_text, now) if until_text else None
    snap = Snapshot(
        settings=settings,
        since_text=since_text,
        since_unix_s=since,
        until_unix_s=until,
        fetched_unix_s=now,
        until_text=until_text or None,
    )
    if settings.prometheus is not None:
        return _load_prometheus(snap, settings, since, until, pool, now)
    source = _KeepingSource(
        CollectorSource(settings.collector_url, token=settings.token, timeout_s=settings.timeout_s)
    )
    t0 = time.monotonic()
    try:
        snap.report = analyze(source, since, until, pool, **_slo_kw(settings))
    except SourceError as exc:
        snap.error = source_error_message(exc, settings.collector_url)
        snap.error_status = exc.status
        return snap
    finally:
        snap.read_s = time.monotonic() - t0
    snap.engines = source.frames.get("engines", pd.DataFrame())
    snap.windows = source.analysed_windows(snap.report)
    snap.requests = source.frames.get("requests", pd.DataFrame())
    return snap


def _load_prometheus(
    snap: Snapshot,
    settings: DashboardSettings,
    since: float | None,
    until: float | None,
    pool: str | None,
    now: float,
) -> Snapshot:
    """:func:`load_snapshot` over Prometheus: one range read, analysed and annotated."""
    from kvscope.dashboard._messages import prometheus_no_data_message
    from kvscope.sources.prometheus.source import annotate_report, source_error_text
    from kvscope.sources.prometheus.target import PromArgError

    assert settings.prometheus is not None
    t0 = time.monotonic()
    try:
        prom = settings.prometheus.source(
            timeout_s=settings.timeout_s,
            clock=lambda: now,
            lookback_s=max(7 * 86400.0, now - (since if since is not None else now)),
        )
        f = prom.prefetch(since, until)
        source = _KeepingSource(prom)
        snap.report = annotate_report(
            analyze(source, f.since, f.until, pool, **_slo_kw(settings)), prom
        )
        if not snap.report.has_data:
            snap.prom_no_data = prometheus_no_data_message(prom, snap.report, prom.url, snap.window)
    except PromArgError as exc:
        snap.error, snap.error_status = str(exc), 400
        return snap
    except SourceError as exc:
        snap.error = source_error_text(exc, settings.prometheus.url)
        snap.error_status = exc.status
        return snap
    finally:
        snap.read_s = time.monotonic() - t0
    snap.since_unix_s = f.since
    snap.until_unix_s = f.until if until is not None else None
    snap.engines = source.frames.get("engines", pd.DataFrame())
    snap.windows = source.frames.get("windows", pd.DataFrame())
    snap.requests = source.frames.get("requests", pd.DataFrame())
    return snap


LONG_RANGE_S = 6 * 3600.0
"""From this span on, the engine page's time series read the collector's 1-minute windows
(the 1-second ones bucketed to minutes at least anyway; past the collector's window
retention only the minutes are left)."""


def read_minute_windows(
    settings: DashboardSettings,
    engine_id: str,
    since_unix_s: float | None,
    until_unix_s: float | None,
) -> pd.DataFrame:
    """The engine's 1-minute windows in ``[since, until)`` (``/v1/windows_1m``, paged), oldest
    first; empty from a collector without them. Raises :class:`advisor.SourceError` on a
    failed read."""
    source = CollectorSource(
        settings.collector_url, token=settings.token, timeout_s=settings.timeout_s
    )
    try:
        return source.minute_windows(since_unix_s, until_unix_s, engine_id)
    except SourceError as exc:
        if exc.status == 404:  # a collector from before the tier
            return pd.DataFrame()
        raise


def read_steps(
    settings: DashboardSettings,
    engine_id: str,
    since_unix_s: float,
    until_unix_s: float,
    page_rows: int = 50_000,
    every: int = 1,
) -> pd.DataFrame:
    """The engine's raw steps in ``[since, until)`` (``/v1/steps``, paged), oldest first;
    ``every`` > 1: every ``every``-th, sampled by the collector.

    Empty when the collector no longer holds them (raw steps are kept for its raw
    retention, a day by default). Raises :class:`advisor.SourceError` on a failed read.
    """
    source = CollectorSource(
        settings.collector_url,
        token=settings.token,
        timeout_s=settings.timeout_s,
        page_rows=page_rows,
    )
    return source.steps(since_unix_s, until_unix_s, engine_id, every=every)

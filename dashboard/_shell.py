"""The Streamlit frame around every page: settings, sidebar, cached reads, refresh, errors.

A page is a function ``render(snapshot)``; :func:`run_page` gives it the current
:class:`~kvscope.dashboard.data.Snapshot` inside a fragment that reruns every ``refresh_s``
seconds, or shows what went wrong (collector unreachable, 401, no data) and what to
do about it. Reads are cached per refresh tick and shared by pages and sessions.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

import streamlit as st

from kvscope.dashboard._status import utc_text
from kvscope.dashboard._window import TimeRange, selected, time_controls
from kvscope.dashboard.data import Snapshot, load_snapshot
from kvscope.dashboard.settings import DashboardSettings, SettingsError, parse_settings

_SETTINGS = "kvscope_settings"
_AUTO = "kvscope_auto_refresh"


def settings() -> DashboardSettings:
    """The settings from the app's arguments (after ``--``), parsed once per session."""
    if _SETTINGS not in st.session_state:
        try:
            st.session_state[_SETTINGS] = parse_settings(sys.argv[1:])
        except SettingsError as exc:
            st.error(f"kvscope dashboard: {exc}")
            st.stop()
    s: DashboardSettings = st.session_state[_SETTINGS]
    return s


@st.cache_data(ttl=3600, max_entries=16, show_spinner="Reading the data...")
def _cached_snapshot(
    _settings: DashboardSettings,
    key: str,
    since: str,
    until: str | None,
    pool: str | None,
    tick: int,
) -> Snapshot:
    # ``key`` stands for the settings (secrets digested); ``tick`` changes
    # every refresh period: a new key, a new read.
    del key, tick
    return load_snapshot(_settings, since, pool, until_text=until)


def window() -> TimeRange:
    """The window (or range) the sidebar selected (``--since`` until changed)."""
    return selected(settings(), time.time())


def refresh_s() -> float | None:
    """Seconds between automatic refreshes, None when off."""
    s = settings()
    if s.refresh_s <= 0 or not st.session_state.get(_AUTO, True):
        return None
    return s.refresh_s


def read_period_s() -> float:
    """Seconds one read of the collector is shown for: the refresh interval, but at
    least 1/360 of the window (a 7-day window is read again every 28 min, not every
    10 s), and an hour when automatic refresh is off."""
    refresh = refresh_s()
    if refresh is None:
        return 3600.0
    from kvscope.args import ParamError, parse_time

    now, w = time.time(), window()
    try:
        since = parse_time("since", w.since_text, now) if w.since_text not in ("0", "all") else None
        until = parse_time("until", w.until_text, now) if w.until_text else now
    except ParamError:
        since, until = None, now
    span = until - since if since is not None else 7 * 86400.0
    return stretched_period(max(refresh, span / 360.0), _LAST_READ_S[0])


def stretched_period(period_s: float, last_read_s: float) -> float:
    """``period_s``, doubled until it is at least 4 times ``last_read_s``.

    A read (the advisor's run included) that takes a good part of the period would keep the
    page running from one read to the next; doubling rather than scaling keeps the period,
    and the cache key, still while the reads take about as long."""
    slow = 4.0 * last_read_s / period_s
    return period_s * 2.0 ** math.ceil(math.log2(slow)) if slow > 1.0 else period_s


_LAST_READ_S = [0.0]
"""Seconds the newest read of the collector took (shared by the sessions)."""


def snapshot() -> Snapshot:
    """The current read of the collector (one per read period, shared by all pages and
    sessions)."""
    s, w = settings(), window()
    tick = int(time.time() // read_period_s())
    snap = _cached_snapshot(s, s.cache_key(), w.since_text, w.until_text, s.pool, tick)
    _LAST_READ_S[0] = snap.read_s
    return snap


def sidebar() -> None:
    """Collector, window and refresh controls."""
    s = settings()
    with st.sidebar:
        kind = "Prometheus" if s.prometheus is not None else "Collector"
        st.markdown(f"**{kind}** `{s.source_url}`" + (f"  \npool `{s.pool}`" if s.pool else ""))
        time_controls(s, time.time())
        if s.refresh_s > 0:
            st.toggle(f"Refresh every {s.refresh_s:g} s", value=True, key=_AUTO)
        if st.button("Refresh now", icon=":material/refresh:"):
            _cached_snapshot.clear()
        st.caption(
            "Verdicts, findings and recommendations are the advisor's "
            "(`kvscope advise`); charts plot the "
            + (
                "windows read from Prometheus (one per scrape interval)."
                if s.prometheus is not None
                else "collector's rows."
            )
        )


def show_problem(snap: Snapshot) -> bool:
    """Show why there is nothing to render, with what to do; True when there was."""
    if snap.error is not None and snap.from_prometheus:
        _prometheus_problem(snap)
        return True
    if snap.error is not None:
        if snap.error_status is None:
            st.error(f"**Collector unreachable.** {snap.error}.")
            st.info(
                "Start one with `kvscope collector --store kvscope.duckdb`, point "
                "`kvscope dashboard --collector URL` at it, or look at the recorded "
                "demo data with `kvscope dashboard --demo`."
            )
        elif snap.error_status == 401:
            st.error(f"**Not authorized (401).** {snap.error}.")
            st.info(
                "Restart the dashboard with `kvscope dashboard --collector URL "
                "--token T` (or set `KVSCOPE_TOKEN`), T being the collector's `--token`."
            )
        else:
            st.error(f"**The collector answered {snap.error_status}.** {snap.error}.")
        return True
    if not snap.has_data:
        st.warning(f"**No data.** {snap.no_data_text}.")
        return True
    return False


def _prometheus_problem(snap: Snapshot) -> None:
    if snap.error_status is None:
        st.error(f"**Prometheus unreachable.** {snap.error}.")
    elif snap.error_status in (401, 403):
        st.error(f"**Prometheus refused the credentials ({snap.error_status}).** {snap.error}.")
        st.info(
            "Restart the dashboard with `--prometheus-bearer-token-file FILE`, or "
            "`--prometheus-user U --prometheus-password-file FILE` (or the "
            "`KVSCOPE_PROMETHEUS_*` variables)."
        )
    else:
        st.error(f"**Prometheus answered {snap.error_status}.** {snap.error}.")


def engines_text(snap: Snapshot) -> str:
    """``3 engine(s) known (1 DOWN), 2 with data in the window``."""
    cov = snap.report.coverage if snap.report is not None else {}
    known = snap.known_engine_ids
    down = sum(snap.engine_state(e).state == "DOWN" for e in known)
    return (
        f"{len(known)} engine(s) known"
        + (f" ({down} DOWN)" if down else "")
        + f", {cov.get('n_engines_analyzed', 0)} with data in the window"
        + (
            f" ({len(m)} of them read from {cov.get('n_minute_windows', 0):,} one-minute "
            "windows: their 1-second windows in it were deleted after the collector's "
            "window retention)"
            if (m := cov.get("engines_from_minutes"))
            else ""
        )
        + (
            f" ({n} more with request latency only: no 1-second windows in it)"
            if (n := cov.get("n_engines_latency_only"))
            else ""
        )
    )


def run_page(render: Callable[[Snapshot], None], title: str, *, without_data: bool = False) -> None:
    """Render a page from the current snapshot, refreshed every ``refresh_s`` seconds.
    With ``without_data`` the page is rendered under the "no data" warning too, when
    the source knows engines (the overview lists them, silent or not)."""
    st.title(title)

    @st.fragment(run_every=refresh_s())
    def body() -> None:
        snap = snapshot()
        cov = snap.report.coverage if snap.report is not None else {}
        period = read_period_s()
        again = (
            f"; read again every {period:.0f} s"
            if refresh_s() is not None
            else "; automatic refresh off"
        )
        kind = (
            f"{snap.window_s:g}-second windows (Prometheus, confidences scaled by "
            f"{cov.get('confidence_factor') or 1:.2f})"
            if snap.from_prometheus
            else "one-second windows"
        )
        st.caption(
            f"read {utc_text(snap.fetched_unix_s)} from {snap.collector_url} in "
            f"{snap.read_s:.1f} s{again}; {snap.window}"
            + (
                f"; {engines_text(snap)}; "
                f"{cov.get('n_windows', 0):,} {kind}, "
                f"{cov.get('n_requests', 0):,} finished requests"
                + (" (estimated from histograms)" if snap.from_prometheus else "")
                if cov
                else ""
            )
        )
        if show_problem(snap) and not (
            without_data and snap.error is None and snap.known_engine_ids
        ):
            return
        render(snap)

    body()

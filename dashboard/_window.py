"""The sidebar's time controls, kept in the page's URL.

Either a *window* ending now (``?window=1h``; the dashboard's ``--since`` when the URL
names none) or a *range* between two times (``?time=range&from=...&to=...``, UTC, in
the time syntax of every kvscope command: ``2026-11-30T08:00Z``, ``2026-11-30 08:00``,
``-2h``, unix seconds; an empty end means now). The widgets are bound to the URL's
query parameters, so a copied link opens the same view, and they live in the app's
entry point, so the parameters survive a change of page.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import streamlit as st

from kvscope.dashboard._charts import ZOOM
from kvscope.dashboard.settings import WINDOW_CHOICES, DashboardSettings

TIME_KEY, WINDOW_KEY, FROM_KEY, TO_KEY = "time", "window", "from", "to"
"""Session-state keys, and the URL's query parameters."""
ZOOM_KEY = "kvscope_zoom_to"
"""A zoom dragged on a chart, applied to the range before the sidebar's widgets exist."""
MIN_ZOOM_S = 2.0
"""A shorter drag is a click, not a zoom."""
MODES = ("window", "range")


@dataclass(frozen=True)
class TimeRange:
    """What the sidebar selected: ``since_text`` (a window such as ``30m``, or the
    range's start) and ``until_text`` (the range's end; None for a window ending now)."""

    since_text: str
    until_text: str | None = None

    @property
    def ranged(self) -> bool:
        return self.until_text is not None


def window_choices(settings: DashboardSettings) -> list[str]:
    """The sidebar's windows, the dashboard's ``--since`` first when not among them."""
    choices = list(WINDOW_CHOICES)
    if settings.since not in choices:
        choices.insert(0, settings.since)
    return choices


def range_error(since_text: str, until_text: str, now_unix_s: float) -> str | None:
    """Why the range cannot be read (None when it can)."""
    from kvscope.args import ParamError, parse_time

    if not since_text.strip():
        return "set the range's start (From)"
    try:
        since = parse_time("From", since_text, now_unix_s)
        until = parse_time("To", until_text or "now", now_unix_s)
    except ParamError as exc:
        return str(exc)
    if until <= since:
        return "the range's end (To) must come after its start (From)"
    return None


def selected(settings: DashboardSettings, now_unix_s: float) -> TimeRange:
    """The time the sidebar selected; the window when its range is not readable."""
    window = str(st.session_state.get(WINDOW_KEY) or settings.since)
    if st.session_state.get(TIME_KEY) != "range":
        return TimeRange(window)
    since = str(st.session_state.get(FROM_KEY) or "").strip()
    until = str(st.session_state.get(TO_KEY) or "").strip() or "now"
    if range_error(since, until, now_unix_s) is not None:
        return TimeRange(window)
    return TimeRange(since, until)


def _unix_s(v: Any) -> float | None:
    """A selection bound: epoch milliseconds (Vega's number) or an ISO time (a Date)."""
    if isinstance(v, int | float) and math.isfinite(v):
        return float(v) / 1000.0
    if isinstance(v, str):
        try:
            when = datetime.fromisoformat(v.replace("Z", "+00:00"))
        except ValueError:
            return None
        return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()
    return None


def zoom_range(
    selection: Mapping[str, Any] | None, param: str = ZOOM
) -> tuple[float, float] | None:
    """(since, until) unix seconds of an interval dragged across a time chart's axis
    (the chart's ``on_select`` event's ``selection``), or None (nothing dragged, or a
    drag shorter than :data:`MIN_ZOOM_S`)."""
    brush = (selection or {}).get(param) or {}
    bounds = brush.get("time") if isinstance(brush, Mapping) else None
    if not isinstance(bounds, list | tuple) or len(bounds) != 2:
        return None
    a, b = (_unix_s(x) for x in bounds)
    if a is None or b is None:
        return None
    a, b = min(a, b), max(a, b)
    return (a, b) if b - a >= MIN_ZOOM_S else None


def utc_iso(unix_s: float) -> str:
    """``2026-11-30T08:00:05Z``: the range's times as the sidebar shows them."""
    return datetime.fromtimestamp(unix_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def zoom_to(since_unix_s: float, until_unix_s: float) -> None:
    """Show every chart over ``[since, until]``: the sidebar's range, in the URL (set
    on the rerun this starts, before the sidebar's widgets are made)."""
    st.session_state[ZOOM_KEY] = (since_unix_s, until_unix_s)
    st.rerun()


def _apply_zoom() -> None:
    pending = st.session_state.pop(ZOOM_KEY, None)
    if pending is None:
        return
    since, until = pending
    st.session_state[TIME_KEY] = "range"
    st.session_state[FROM_KEY] = utc_iso(math.floor(since))
    st.session_state[TO_KEY] = utc_iso(math.ceil(until))


def time_controls(settings: DashboardSettings, now_unix_s: float) -> None:
    """The sidebar's window selector, or the range's two times."""
    _apply_zoom()
    mode = st.radio(
        "Time",
        MODES,
        key=TIME_KEY,
        bind="query-params",
        horizontal=True,
        help="a window ending now, or a range between two times (UTC)",
    )
    ranged = mode == "range"
    if not ranged:
        choices = window_choices(settings)
        st.selectbox(
            "Window (data since)",
            choices,
            index=choices.index(settings.since),
            key=WINDOW_KEY,
            bind="query-params",
            help="how far back the advisor and the charts read",
        )
    # The range's two times exist in both modes (greyed out for a window), so a zoom that
    # sets them from a chart reaches the widgets, and the URL, on the next run.
    st.text_input(
        "From (UTC)",
        key=FROM_KEY,
        bind="query-params",
        disabled=not ranged,
        placeholder="2026-11-30 08:00, or -2h",
        help="UTC unless a zone is named: 2026-11-30T08:00Z, 2026-11-30 08:00, -2h, "
        "or unix seconds",
    )
    st.text_input(
        "To (UTC)", key=TO_KEY, bind="query-params", disabled=not ranged, placeholder="now"
    )
    if not ranged:
        return
    since = str(st.session_state.get(FROM_KEY) or "")
    until = str(st.session_state.get(TO_KEY) or "") or "now"
    err = range_error(since, until, now_unix_s)
    if err is not None:
        window = str(st.session_state.get(WINDOW_KEY) or settings.since)
        st.warning(f"{err}; showing the window {window} until then.")

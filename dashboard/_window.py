"""The sidebar's time controls, kept in the page's URL.

Either a *window* ending now (``?window=1h``; the dashboard's ``--since`` when the URL
names none) or a *range* between two times (``?time=range&from=...&to=...``, UTC, in
the time syntax of every kvscope command: ``2026-11-30T08:00Z``, ``2026-11-30 08:00``,
``-2h``, unix seconds; an empty end means now). The widgets are bound to the URL's
query parameters, so a copied link opens the same view, and they live in the app's
entry point, so the parameters survive a change of page.
"""

from __future__ import annotations

from dataclasses import dataclass

import streamlit as st

from kvscope.dashboard.settings import WINDOW_CHOICES, DashboardSettings

TIME_KEY, WINDOW_KEY, FROM_KEY, TO_KEY = "time", "window", "from", "to"
"""Session-state keys, and the URL's query parameters."""
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


def time_controls(settings: DashboardSettings, now_unix_s: float) -> None:
    """The sidebar's window selector, or the range's two times."""
    mode = st.radio(
        "Time",
        MODES,
        key=TIME_KEY,
        bind="query-params",
        horizontal=True,
        help="a window ending now, or a range between two times (UTC)",
    )
    if mode != "range":
        choices = window_choices(settings)
        st.selectbox(
            "Window (data since)",
            choices,
            index=choices.index(settings.since),
            key=WINDOW_KEY,
            bind="query-params",
            help="how far back the advisor and the charts read",
        )
        return
    st.text_input(
        "From (UTC)",
        key=FROM_KEY,
        bind="query-params",
        placeholder="2026-11-30 08:00, or -2h",
        help="UTC unless a zone is named: 2026-11-30T08:00Z, 2026-11-30 08:00, -2h, "
        "or unix seconds",
    )
    st.text_input("To (UTC)", key=TO_KEY, bind="query-params", placeholder="now")
    since = str(st.session_state.get(FROM_KEY) or "")
    until = str(st.session_state.get(TO_KEY) or "") or "now"
    err = range_error(since, until, now_unix_s)
    if err is not None:
        window = str(st.session_state.get(WINDOW_KEY) or settings.since)
        st.warning(f"{err}; showing the window {window} until then.")

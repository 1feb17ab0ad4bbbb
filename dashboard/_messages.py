"""What the dashboard says about its time range, in the page's own terms.

The terminal view (:mod:`kvscope.advisor.render`) names command-line flags (``--since``,
``--until``); a web page has a sidebar instead: its *window* selector (a window ending
now: ``30m``, ``1h``, ...) and its *range* (two times). These functions word the range
and the "no data" hints for the page, naming the sidebar's controls and, where one
fits, the window to pick.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from kvscope.advisor import Report
from kvscope.dashboard._status import ago_text, utc_text
from kvscope.dashboard.settings import WINDOW_CHOICES


def window_seconds(choice: str) -> float | None:
    """``30m`` -> 1800.0; None for a choice that is not a duration (``all``)."""
    from kvscope.args import ParamError, parse_time

    try:
        return -parse_time("window", choice, 0.0)
    except ParamError:
        return None


def window_text(
    since: float | None, until: float | None, since_text: str, until_text: str | None = None
) -> str:
    """``2026-11-29 16:20:00 UTC to now (window 30m)`` or, for a range,
    ``2026-11-29 16:20:00 UTC to 2026-11-29 17:20:00 UTC (range)``."""
    start = utc_text(since, math.inf) if since is not None else "the beginning"
    end = utc_text(until, math.inf) if until is not None else "now"
    how = f"window {since_text}" if until_text is None else "range"
    return f"{start} to {end} ({how})"


def window_to_pick(
    age_s: float, choices: Sequence[str] = WINDOW_CHOICES, current: str | None = None
) -> str | None:
    """The shortest of the sidebar's windows reaching ``age_s`` seconds back (with 10%
    margin), None when none does."""
    for c in choices:
        span = window_seconds(c)
        if span is not None and span >= age_s * 1.1 and c != current:
            return c
    return None


def no_data_message(
    report: Report,
    source: str,
    window: str,
    *,
    now_unix_s: float | None = None,
    ranged: bool = False,
    current: str | None = None,
) -> str:
    """Why the report is empty and what to do on this page. ``window`` is
    :func:`window_text`'s; ``ranged`` says whether the sidebar holds a range (two times)
    rather than a window ending now; ``current`` is the window selected."""
    cov = report.coverage
    pool = report.parameters.get("pool")
    pools = cov.get("pools") or []
    if not cov.get("n_engines_known"):
        if pool is not None and pools:
            return f"no engines in pool {pool!r} at {source}; pools known: {', '.join(pools)}"
        return (
            f"the collector at {source} knows no engines yet; point the engines' "
            "KVSCOPE_COLLECTOR_URL at it, or replay a recording (kvscope demo)"
        )
    head = f"no data in {window} at {source}"
    latest = cov.get("latest_step_unix_s")
    if latest is None:
        return f"{head}; no engine has sent a step yet"
    now = time.time() if now_unix_s is None else now_unix_s
    newest = f"the newest step is from {utc_text(latest, now)} ({ago_text(now - latest)} ago)"
    until, since = report.until_unix_s, report.since_unix_s
    oldest = cov.get("oldest_window_unix_s")
    if oldest is not None and (until if until is not None else now) <= oldest:
        return (
            f"{head}; the collector holds 1-second windows from {utc_text(oldest, now)} on "
            "(older ones are deleted after its window retention, 15 days by default, and "
            "kept as 1-minute windows, which the analyses read, for the collector's rollup "
            "retention; the range holds none of these engines' minutes): set a range after "
            f"{utc_text(oldest, now)} in the sidebar"
        )
    if ranged and until is not None and latest >= until:
        return f"{head}; {newest}, after the range: move its end later in the sidebar"
    if ranged:
        return f"{head}; {newest}: set the range in the sidebar to include it"
    if since is not None and latest < since:
        pick = window_to_pick(now - latest, current=current)
        if pick is not None:
            return f"{head}; {newest}: pick the {pick} window (or longer) in the sidebar"
        return f"{head}; {newest}: set a range around it in the sidebar (Time: range)"
    return f"{head}; {newest}: pick a longer window in the sidebar"


def prometheus_no_data_message(prom: Any, report: Report, url: str, window: str) -> str:
    """:func:`kvscope.sources.prometheus.source.no_data_message` in the page's terms: the
    window is the sidebar's; the selector is the one the dashboard was started with."""
    from kvscope.sources.prometheus.source import no_data_message

    f = prom.last_fetch
    if f is None or not (f.vllm or f.kvscope):
        sel = f" matching {prom.selector}" if prom.selector else ""
        tried = " or ".join(prom.names_tried())
        return (
            f"no vLLM series{sel} at {url} in {window}: tried {tried} (and every older "
            "name of them); pick a longer window in the sidebar, and check the selector "
            "the dashboard was started with and that Prometheus scrapes vLLM's /metrics"
        )
    return str(no_data_message(prom, report, url, window))

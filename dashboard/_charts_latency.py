"""Altair charts of the Latency page: percentiles over time, where a request's life goes,
finish reasons and lengths.

Each function takes what :mod:`kvscope.advisor.request_latency` produced (a frame of
:func:`~kvscope.advisor.request_latency.latency_over_time`, a
:class:`~kvscope.advisor.request_latency.RequestLatency`, a length histogram) and returns a
chart; none computes a number. Conventions of :mod:`kvscope.dashboard._charts`: a plot
area ``HEIGHT`` pixels tall, times in UTC on a 24-hour clock, a legend where series
share a chart.
"""

from __future__ import annotations

import altair as alt
import pandas as pd

from kvscope.advisor.request_latency import RequestLatency
from kvscope.dashboard._charts import (
    COUNT_FORMAT,
    HEIGHT,
    RATE_FORMAT,
    Chart,
    finish,
    fitting,
    rules,
    time_x,
    with_time_text,
    y_axis,
)

PERCENTILES = {"p50": "P50", "p90": "P90", "p99": "P99"}
PARTS = {
    "queue": "queue",
    "prefill": "prefill",
    "decode": "decode",
    "other": "other (API server)",
}


def percentile_frame(series: pd.DataFrame, measure: str) -> pd.DataFrame:
    """One measure of :func:`~kvscope.advisor.request_latency.latency_over_time` in long
    format: ``time`` (the bin's start, UTC), ``percentile``, ``seconds``, ``n``."""
    s = series[series["measure"] == measure]
    if not len(s):
        return pd.DataFrame(columns=["time", "percentile", "seconds", "n"])
    long = s.melt(
        id_vars=["bin_start_unix_s", "n"],
        value_vars=list(PERCENTILES),
        var_name="percentile",
        value_name="seconds",
    )
    long["percentile"] = long["percentile"].map(PERCENTILES)
    long["time"] = pd.to_datetime(long["bin_start_unix_s"], unit="s", utc=True)
    return long[["time", "percentile", "seconds", "n"]]


def percentile_chart(
    series: pd.DataFrame,
    measure: str,
    title: str,
    target_s: float | None = None,
    *,
    height: int = HEIGHT,
) -> Chart:
    """P50, P90 and P99 of ``measure`` per bin, with the target as a dashed rule."""
    long = with_time_text(percentile_frame(series, measure))
    bin_s = int(series["bin_s"].iloc[0]) if len(series) else 60
    lines = (
        alt.Chart(long)
        .mark_line(point=True, interpolate="step-after")
        .encode(
            x=time_x(long["time"]),
            y=alt.Y("seconds:Q", title="seconds", axis=y_axis(RATE_FORMAT)),
            color=alt.Color(
                "percentile:N",
                title=None,
                sort=list(PERCENTILES.values()),
                legend=alt.Legend(orient="top"),
            ),
            tooltip=[
                alt.Tooltip("when:N", title="bin start"),
                "percentile:N",
                alt.Tooltip("seconds:Q", format=".3f"),
                alt.Tooltip("n:Q", title="requests"),
            ],
        )
    )
    data_max = float(pd.to_numeric(long["seconds"], errors="coerce").max() or 0.0)
    keep, above = fitting([(target_s, f"target {target_s:g} s" if target_s else "")], data_max)
    per = f"per {bin_s // 60} min" if bin_s < 3600 else f"per {bin_s // 3600} h"
    note = "; ".join([per, *above])
    return finish(alt.layer(lines, *rules(keep)), title, subtitle=note, height=height)


def breakdown_frame(blocks: dict[str, RequestLatency]) -> pd.DataFrame:
    """``engine``, ``part``, ``seconds``: the mean life of each engine's requests split
    into queue, prefill, decode and the rest (the advisor's ``breakdown_mean_s``)."""
    rows = [
        {"engine": eid, "part": PARTS[k], "order": i, "seconds": lat.breakdown_mean_s.get(k)}
        for eid, lat in blocks.items()
        for i, k in enumerate(PARTS)
        if lat.breakdown_mean_s.get(k) is not None
    ]
    return pd.DataFrame(rows, columns=["engine", "part", "order", "seconds"])


def breakdown_chart(blocks: dict[str, RequestLatency], *, height: int = HEIGHT) -> Chart:
    """A stacked bar per engine: mean seconds in the queue, prefill, decode and the rest."""
    df = breakdown_frame(blocks)
    chart = (
        alt.Chart(df)
        .mark_bar()
        .encode(
            y=alt.Y("engine:N", title=None),
            x=alt.X("seconds:Q", title="mean seconds per request", stack="zero"),
            color=alt.Color(
                "part:N",
                title=None,
                sort=list(PARTS.values()),
                legend=alt.Legend(orient="top"),
            ),
            order=alt.Order("order:Q"),
            tooltip=["engine:N", "part:N", alt.Tooltip("seconds:Q", format=".3f")],
        )
    )
    return finish(chart, "Mean time per request, by phase", height=height)


def reasons_chart(reasons: dict[str, int], *, height: int = HEIGHT) -> Chart:
    """Requests per finish reason."""
    df = pd.DataFrame({"reason": list(reasons), "requests": list(reasons.values())})
    chart = (
        alt.Chart(df)
        .mark_bar()
        .encode(
            x=alt.X("reason:N", title="finish reason", sort="-y", axis=alt.Axis(labelAngle=0)),
            y=alt.Y("requests:Q", title="requests", axis=y_axis(COUNT_FORMAT)),
            tooltip=["reason:N", alt.Tooltip("requests:Q", format=",d")],
        )
    )
    labels = chart.mark_text(dy=-4, baseline="bottom").encode(
        text=alt.Text("requests:Q", format=",d")
    )
    return finish(alt.layer(chart, labels), "Finish reasons", height=height)


def histogram_chart(hist: pd.DataFrame, title: str, *, height: int = HEIGHT) -> Chart:
    """Requests per length bin (``lo`` to ``hi`` tokens)."""
    chart = (
        alt.Chart(hist)
        .mark_bar()
        .encode(
            x=alt.X("lo:Q", title="tokens", bin="binned", axis=alt.Axis(format=",d")),
            x2="hi:Q",
            y=alt.Y("n:Q", title="requests", axis=y_axis(COUNT_FORMAT)),
            tooltip=[
                alt.Tooltip("lo:Q", title="from", format=",d"),
                alt.Tooltip("hi:Q", title="to (excl.)", format=",d"),
                alt.Tooltip("n:Q", title="requests", format=",d"),
            ],
        )
    )
    return finish(chart, title, height=height)

"""Altair charts of the dashboard over time: one engine's series, latency percentiles,
its raw steps (the charts over load are in :mod:`kvscope.dashboard._charts_load`).

Each function takes frames (the collector's raw rows, or a finding's ``frame``) and
returns a chart; none computes a verdict. Long windows are bucketed so a chart holds
at most about ``MAX_POINTS`` points per series.

Every chart follows the same conventions (:func:`finish`, :func:`time_x`): a plot area
``HEIGHT`` pixels tall (the title, legend and axes come on top of it), times on a
24-hour clock in UTC (the axis says so, the day added when the span exceeds one),
integer ticks on axes that count (requests, blocks), a legend wherever two series
share a chart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import altair as alt
import numpy as np
import pandas as pd

Chart = alt.Chart | alt.LayerChart | alt.FacetChart
"""What the chart functions return (``properties`` of a layer may give a facet)."""

MAX_POINTS = 900
HEIGHT = 260
"""Pixels of plot area (without title, legend and axes) of every chart."""
COUNT_FORMAT = ",d"
"""Tick labels of axes that count (requests, KV blocks): integers, one apart at least."""
RATE_FORMAT = ",~f"
"""Tick labels of rates and seconds: as many decimals as the tick needs (10, 2.5)."""
DAY_S = 86400.0

_GAUGES = ("batch_mean", "kv_usage_mean", "waiting_mean")
_MAXES = ("batch_max", "kv_blocks_max", "waiting_max")
_SUMS = ("preemptions", "generation_tokens", "prompt_tokens", "prefix_queries", "prefix_hits")


def bucket_seconds(span_s: float, max_points: int = MAX_POINTS) -> int:
    """1, 5, 10, 30, 60, 300, 600 or 3600 seconds: the finest that fits ``max_points``."""
    for b in (1, 5, 10, 30, 60, 300, 600, 3600):
        if span_s / b <= max_points:
            return b
    return 3600


def engine_series(
    windows: pd.DataFrame,
    num_gpu_blocks: float | None,
    window_s: float = 1.0,
    *,
    counts: bool | None = None,
) -> pd.DataFrame:
    """Per-second (or bucketed) series of one engine's windows, each ``window_s`` seconds
    long (1 from a collector, 60 from its 1-minute windows; from Prometheus the
    resolution). ``counts``: whether the windows' tokens and preemptions are counts over
    the window (a collector's) rather than per-second rates (Prometheus'); by default,
    counts for 1-second windows only. Buckets are whole multiples of ``window_s``.

    Columns: ``time`` (UTC datetime), gauge means, maxima, and rates per second
    (``preemptions_per_s``, ``gen_tokens_per_s``, ``prompt_tokens_per_s``,
    ``prefix_hits_per_s``, ``prefix_queries_per_s``), ``prefix_hit_rate``,
    ``kv_blocks_mean`` (KV usage x ``num_gpu_blocks``) and ``bucket_s``.
    """
    if not len(windows):
        return pd.DataFrame()
    w = windows.copy()
    for c in (*_GAUGES, *_MAXES, *_SUMS, "ts_s"):
        w[c] = pd.to_numeric(w[c], errors="coerce") if c in w else np.nan
    step = max(1, round(window_s))
    if counts is None:
        counts = step == 1
    if not counts:  # per-second rates over the window: back to counts
        for c in _SUMS:
            w[c] = w[c] * step
    span = float(w["ts_s"].max() - w["ts_s"].min() + step)
    b = -(-bucket_seconds(span) // step) * step
    w["bucket"] = (w["ts_s"] // b) * b
    g = w.groupby("bucket")
    out = pd.DataFrame({c: g[c].mean() for c in _GAUGES})
    for c in _MAXES:
        out[c] = g[c].max()
    for c in _SUMS:
        out[c] = g[c].sum()
    out = out.reset_index()
    # Rates over the bucket's seconds; the last bucket may be shorter.
    end = float(w["ts_s"].max()) + step
    secs = np.minimum(float(b), end - out["bucket"])
    out["preemptions_per_s"] = out["preemptions"] / secs
    out["gen_tokens_per_s"] = out["generation_tokens"] / secs
    out["prompt_tokens_per_s"] = out["prompt_tokens"] / secs
    out["prefix_hits_per_s"] = out["prefix_hits"] / secs
    out["prefix_queries_per_s"] = out["prefix_queries"] / secs
    out["prefix_hit_rate"] = out["prefix_hits"] / out["prefix_queries"].where(
        out["prefix_queries"] > 0
    )
    blocks = float(num_gpu_blocks) if num_gpu_blocks else math.nan
    out["kv_blocks_mean"] = out["kv_usage_mean"] * blocks
    out["time"] = pd.to_datetime(out["bucket"], unit="s", utc=True)
    out["bucket_s"] = b
    return out


def latency_series(requests: pd.DataFrame, max_points: int = 200) -> pd.DataFrame:
    """TTFT and end-to-end latency percentiles (P50, P90, P99) of finished requests,
    per bucket of finish time (at least 5 s, so a percentile has requests behind it).
    Long format: ``time``, ``metric`` (``TTFT P99``...), ``seconds``, ``n``."""
    if not len(requests) or "finished_unix_s" not in requests:
        return pd.DataFrame(columns=["time", "metric", "seconds", "n"])
    r = requests.copy()
    t = pd.to_numeric(r["finished_unix_s"], errors="coerce")
    b = max(5, bucket_seconds(float(t.max() - t.min() + 1), max_points))
    r["bucket"] = (t // b) * b
    rows = []
    for bucket, grp in r.groupby("bucket"):
        for col, name in (("ttft_s", "TTFT"), ("e2e_s", "e2e")):
            vals = pd.to_numeric(grp[col], errors="coerce").dropna()
            if not len(vals):
                continue
            for q in (50, 90, 99):
                rows.append(
                    {
                        "bucket": bucket,
                        "metric": f"{name} P{q}",
                        "seconds": float(np.percentile(vals, q)),
                        "n": len(vals),
                    }
                )
    out = pd.DataFrame(rows, columns=["bucket", "metric", "seconds", "n"])
    out["time"] = pd.to_datetime(out["bucket"], unit="s", utc=True)
    return out


ZOOM = "zoom"
"""The time charts' interval selection: dragged across the time axis, the page zooms
every chart to it (:func:`kvscope.dashboard._window.zoom_range`)."""


def finish(
    chart: Chart, title: str, *, subtitle: str = "", height: int = HEIGHT, title_offset: int = 0
) -> Chart:
    """``chart`` with its title and a plot area ``height`` pixels tall: the width fits
    the page, the height is the plot's (Streamlit's default, ``fit``, would squeeze the
    title, legend and axes into ``height``). ``title_offset`` pixels are left between
    the title and what is under it."""
    kw: dict[str, Any] = {"subtitle": subtitle} if subtitle else {}
    if title_offset:
        kw["offset"] = title_offset
    return chart.properties(
        title=alt.TitleParams(title, **kw) if kw else title,
        height=height,
        autosize=alt.AutoSizeParams(type="fit-x", contains="padding"),
    )


def time_format(span_s: float) -> str:
    """``%H:%M:%S`` (24-hour clock), with the day (``%d %b %H:%M``) past a day."""
    return "%d %b %H:%M" if span_s > DAY_S else "%H:%M:%S"


def time_x(times: pd.Series) -> alt.X:
    """The time axis: UTC, 24-hour clock, named so."""
    t = pd.to_datetime(times, utc=True)
    span = (t.max() - t.min()).total_seconds() if len(t) else 0.0
    return alt.X(
        "time:T",
        title="time (UTC)",
        scale=alt.Scale(type="utc"),
        axis=alt.Axis(format=time_format(span), labelAngle=0, labelOverlap=True),
    )


def with_time_text(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with ``when``: its ``time`` as text for tooltips (``19:02:11 UTC``; with
    the date past a day), the axis' clock and zone."""
    out = df.copy()
    t = pd.to_datetime(out["time"], utc=True)
    span = (t.max() - t.min()).total_seconds() if len(t) else 0.0
    fmt = "%Y-%m-%d %H:%M:%S UTC" if span > DAY_S else "%H:%M:%S UTC"
    out["when"] = t.dt.strftime(fmt)
    return out


def y_axis(y_format: str) -> alt.Axis:
    """A value axis; a counting one (``COUNT_FORMAT``) has ticks one apart at least."""
    if y_format == COUNT_FORMAT:
        return alt.Axis(format=y_format, tickMinStep=1)
    return alt.Axis(format=y_format)


def rules(values: Sequence[tuple[float | None, str]]) -> list[alt.Chart]:
    """Dashed horizontal rules at each value, its label above the line at the left."""
    out: list[alt.Chart] = []
    for v, label in values:
        if v is None or not math.isfinite(float(v)):
            continue
        df = pd.DataFrame({"v": [float(v)], "label": [label]})
        rule = alt.Chart(df).mark_rule(strokeDash=[6, 4], color="#d62728").encode(y="v:Q")
        text = (
            alt.Chart(df)
            .mark_text(align="left", dx=4, dy=-4, color="#d62728", baseline="bottom")
            .encode(y="v:Q", x=alt.value(4), text="label:N")
        )
        out += [rule, text]
    return out


def fitting(
    values: Sequence[tuple[float | None, str]], data_max: float
) -> tuple[list[tuple[float | None, str]], list[str]]:
    """Rules within 3x the data's maximum, and the labels of those far above it
    (drawn, they would flatten the data into the bottom of the chart)."""
    keep: list[tuple[float | None, str]] = []
    above: list[str] = []
    for v, label in values:
        if v is None or not math.isfinite(float(v)):
            continue
        if data_max > 0 and float(v) > 3 * data_max:
            above.append(f"{label}, far above")
        else:
            keep.append((v, label))
    return keep, above


def _top_legend(entries: int) -> alt.Legend:
    """A legend above the plot, in rows of at most three entries so that it fits a chart
    half the page wide."""
    return alt.Legend(orient="top", columns=3) if entries > 3 else alt.Legend(orient="top")


def time_chart(
    series: pd.DataFrame,
    columns: dict[str, str],
    title: str,
    y_title: str,
    limits: Sequence[tuple[float | None, str]] = (),
    *,
    y_format: str = RATE_FORMAT,
    subtitle: str = "",
    height: int = HEIGHT,
    zoom: bool = False,
) -> Chart:
    """Lines of ``columns`` (column -> legend label) over ``time``, with dashed
    horizontal ``limits`` (value, label) such as a configured limit; ``zoom``: an interval
    across the time axis (:data:`ZOOM`) the page reads to zoom every chart to it."""
    cols = [c for c in columns if c in series]
    long = with_time_text(
        series.melt(id_vars=["time"], value_vars=cols, var_name="series", value_name="y")
    )
    long["series"] = long["series"].map(columns)
    keep, above = fitting(limits, float(np.nan_to_num(long["y"].max())))
    lines = (
        alt.Chart(long)
        .mark_line(interpolate="step-after")
        .encode(
            x=time_x(long["time"]),
            y=alt.Y("y:Q", title=y_title, axis=y_axis(y_format)),
            color=alt.Color("series:N", title=None, legend=_top_legend(len(cols))),
            tooltip=[
                alt.Tooltip("when:N", title="time"),
                "series:N",
                alt.Tooltip("y:Q", format=",.2~f", title=y_title),
            ],
        )
    )
    if zoom:
        lines = lines.add_params(alt.selection_interval(name=ZOOM, encodings=["x"]))
    note = "; ".join([*([subtitle] if subtitle else []), *above])
    return finish(alt.layer(lines, *rules(keep)), title, subtitle=note, height=height)


def latency_chart(lat: pd.DataFrame, *, height: int = HEIGHT) -> Chart:
    """TTFT and e2e percentiles over time (from :func:`latency_series`)."""
    lat = with_time_text(lat)
    chart = (
        alt.Chart(lat)
        .mark_line(point=True)
        .encode(
            x=time_x(lat["time"]),
            y=alt.Y("seconds:Q", title="seconds", axis=y_axis(RATE_FORMAT)),
            color=alt.Color(
                "metric:N", title=None, legend=_top_legend(int(lat["metric"].nunique()))
            ),
            tooltip=[
                alt.Tooltip("when:N", title="time"),
                "metric:N",
                alt.Tooltip("seconds:Q", format=".3f"),
                "n:Q",
            ],
        )
    )
    return finish(chart, "Latency percentiles of finished requests", height=height)


def step_frame(steps: pd.DataFrame) -> pd.DataFrame:
    """Raw steps with ``time`` (UTC datetime) and ``kv_usage_pct``."""
    s = steps.copy()
    s["time"] = pd.to_datetime(pd.to_numeric(s["ts_unix_s"]), unit="s", utc=True)
    if "kv_usage_ratio" in s:
        s["kv_usage_pct"] = pd.to_numeric(s["kv_usage_ratio"], errors="coerce") * 100.0
    return s


def step_chart(
    steps: pd.DataFrame, max_num_seqs: float | None, *, subtitle: str = "", height: int = HEIGHT
) -> Chart:
    """Batch size and waiting queue per engine step (raw steps, possibly every k-th)."""
    s = step_frame(steps)
    cols = {"batch_size": "batch (running)", "waiting": "waiting"}
    long = with_time_text(
        s.melt(
            id_vars=["time"],
            value_vars=[c for c in cols if c in s],
            var_name="series",
            value_name="y",
        )
    )
    long["series"] = long["series"].map(cols)
    lines = (
        alt.Chart(long)
        .mark_line(interpolate="step-after")
        .encode(
            x=time_x(long["time"]),
            y=alt.Y("y:Q", title="requests", axis=y_axis(COUNT_FORMAT)),
            color=alt.Color("series:N", title=None, legend=alt.Legend(orient="top")),
            tooltip=[alt.Tooltip("when:N", title="time"), "series:N", "y:Q"],
        )
    )
    keep, above = fitting(
        [(max_num_seqs, f"max_num_seqs {max_num_seqs:.0f}" if max_num_seqs else "")],
        float(np.nan_to_num(long["y"].max())),
    )
    note = "; ".join([*([subtitle] if subtitle else []), *above])
    return finish(
        alt.layer(lines, *rules(keep)), "Per engine step: requests", subtitle=note, height=height
    )


def step_kv_chart(steps: pd.DataFrame, *, subtitle: str = "", height: int = HEIGHT) -> Chart:
    """KV-cache usage per engine step, 0 to 100% of the blocks."""
    s = with_time_text(step_frame(steps))
    line = (
        alt.Chart(s)
        .mark_line(interpolate="step-after", color="#9467bd")
        .encode(
            x=time_x(s["time"]),
            y=alt.Y(
                "kv_usage_pct:Q",
                title="KV blocks in use (%)",
                scale=alt.Scale(domain=[0, 100]),
                axis=alt.Axis(format=",d"),
            ),
            tooltip=[
                alt.Tooltip("when:N", title="time"),
                alt.Tooltip("kv_usage_pct:Q", format=".1f", title="KV used (%)"),
                *(
                    [alt.Tooltip("kv_blocks_used:Q", title="blocks")]
                    if "kv_blocks_used" in s
                    else []
                ),
            ],
        )
    )
    return finish(line, "Per engine step: KV-cache usage", subtitle=subtitle, height=height)

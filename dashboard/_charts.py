"""Altair charts of the dashboard: time series of one engine, the plateau, latency vs load.

Each function takes frames (the collector's raw rows, or a finding's ``frame``) and
returns a chart; none computes a verdict. Long windows are bucketed so a chart holds
at most about ``MAX_POINTS`` points per series.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import altair as alt
import numpy as np
import pandas as pd

Chart = alt.Chart | alt.LayerChart | alt.FacetChart
"""What the chart functions return (``properties`` of a layer may give a facet)."""

MAX_POINTS = 900
HEIGHT = 220

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
    windows: pd.DataFrame, num_gpu_blocks: float | None, window_s: float = 1.0
) -> pd.DataFrame:
    """Per-second (or bucketed) series of one engine's windows, each ``window_s`` seconds
    long (1 from a collector; from Prometheus the resolution, its counts per-second
    rates). Buckets are whole multiples of ``window_s``.

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
    if step > 1:  # per-second rates over the window: back to counts
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


def _rules(values: Sequence[tuple[float | None, str]], axis: str) -> list[alt.Chart]:
    """Dashed rules at each value with its label; labels of vertical rules are
    staggered so that two close rules (a knee of 6.6 and a cap of 7) stay readable."""
    out: list[alt.Chart] = []
    for i, (v, label) in enumerate(
        (v, lb) for v, lb in values if v is not None and math.isfinite(float(v))
    ):
        df = pd.DataFrame({"v": [float(v)], "label": [label]})
        enc = {axis: alt.X("v:Q") if axis == "x" else alt.Y("v:Q")}
        rule = alt.Chart(df).mark_rule(strokeDash=[6, 4], color="#d62728").encode(**enc)
        text = (
            alt.Chart(df)
            .mark_text(
                align="left",
                dx=4,
                dy=-4 if axis == "y" else 0,
                color="#d62728",
                baseline="bottom" if axis == "y" else "top",
            )
            .encode(
                **enc,
                text="label:N",
                **({"y": alt.value(4 + 16 * i)} if axis == "x" else {"x": alt.value(4)}),
            )
        )
        out += [rule, text]
    return out


def _fitting(
    rules: Sequence[tuple[float | None, str]], data_max: float
) -> tuple[list[tuple[float | None, str]], list[str]]:
    """Rules within 3x the data's maximum, and the labels of those far above it
    (drawn, they would flatten the data into the bottom of the chart)."""
    keep: list[tuple[float | None, str]] = []
    above: list[str] = []
    for v, label in rules:
        if v is None or not math.isfinite(float(v)):
            continue
        if data_max > 0 and float(v) > 3 * data_max:
            above.append(f"{label}, far above")
        else:
            keep.append((v, label))
    return keep, above


def time_chart(
    series: pd.DataFrame,
    columns: dict[str, str],
    title: str,
    y_title: str,
    rules: Sequence[tuple[float | None, str]] = (),
    *,
    y_format: str = ",.1f",
    height: int = HEIGHT,
) -> Chart:
    """Lines of ``columns`` (column -> legend label) over ``time``, with dashed
    horizontal ``rules`` (value, label) such as a configured limit."""
    cols = [c for c in columns if c in series]
    long = series.melt(id_vars=["time"], value_vars=cols, var_name="series", value_name="y")
    long["series"] = long["series"].map(columns)
    keep, above = _fitting(rules, float(np.nan_to_num(long["y"].max())))
    lines = (
        alt.Chart(long)
        .mark_line(interpolate="step-after")
        .encode(
            x=alt.X("time:T", title=None),
            y=alt.Y("y:Q", title=y_title, axis=alt.Axis(format=y_format)),
            color=alt.Color("series:N", title=None, legend=alt.Legend(orient="top")),
            tooltip=[
                alt.Tooltip("time:T", format="%H:%M:%S"),
                "series:N",
                alt.Tooltip("y:Q", format=y_format),
            ],
        )
    )
    return alt.layer(lines, *_rules(keep, "y")).properties(
        title=alt.TitleParams(title, subtitle="; ".join(above)) if above else title, height=height
    )


def latency_chart(lat: pd.DataFrame, *, height: int = HEIGHT) -> Chart:
    """TTFT and e2e percentiles over time (from :func:`latency_series`)."""
    return (
        alt.Chart(lat)
        .mark_line(point=True)
        .encode(
            x=alt.X("time:T", title=None),
            y=alt.Y("seconds:Q", title="seconds"),
            color=alt.Color("metric:N", title=None, legend=alt.Legend(orient="top")),
            tooltip=[
                alt.Tooltip("time:T", format="%H:%M:%S"),
                "metric:N",
                alt.Tooltip("seconds:Q", format=".3f"),
                "n:Q",
            ],
        )
        .properties(title="Latency percentiles of finished requests", height=height)
    )


def _load_domain(*loads: Sequence[float]) -> list[float]:
    vals = [float(v) for seq in loads for v in seq if v is not None and float(v) > 0]
    if not vals:
        return [0.5, 64.0]
    return [min(vals) / 1.3, max(vals) * 1.3]


def plateau_chart(
    curve: dict[str, list],
    *,
    knee: float | None,
    plateau: float | None,
    cap: float | None,
    domain: list[float],
    height: int = 300,
) -> Chart:
    """Generated tokens/s against requests in flight (log axis): the measured bins, the
    fitted curve, the plateau, the knee and the recommended cap."""
    df = pd.DataFrame(
        {
            "load": curve.get("load", []),
            "measured": curve.get("gen_tokens_per_s", []),
            "fit": curve.get("gen_fit") or [None] * len(curve.get("load", [])),
            "windows": curve.get("n_windows") or [None] * len(curve.get("load", [])),
        }
    )
    x = alt.X(
        "load:Q",
        title="requests in flight (log)",
        scale=alt.Scale(type="log", domain=domain, nice=False),
    )
    pts = (
        alt.Chart(df)
        .mark_circle(size=70, color="#1f77b4")
        .encode(
            x=x,
            y=alt.Y("measured:Q", title="generated tok/s"),
            tooltip=[
                alt.Tooltip("load:Q", format=".1f"),
                alt.Tooltip("measured:Q", format=",.0f"),
                "windows:Q",
            ],
        )
    )
    fit = alt.Chart(df.dropna(subset=["fit"])).mark_line(color="#ff7f0e").encode(x=x, y="fit:Q")
    layers: list[alt.Chart] = [pts, fit]
    layers += _rules([(plateau, f"plateau {plateau:,.0f} tok/s" if plateau else "")], "y")
    layers += _rules(
        [(knee, f"knee {knee:.1f}" if knee else ""), (cap, f"cap {cap:.0f}" if cap else "")], "x"
    )
    return alt.layer(*layers).properties(title="Throughput against load", height=height)


def p99_chart(
    lat: dict[str, list],
    *,
    knee: float | None,
    cap: float | None,
    domain: list[float],
    height: int = 220,
) -> Chart:
    """P99 end-to-end latency and TTFT against requests in flight, on the plateau
    chart's load axis."""
    df = pd.DataFrame(
        {
            "load": lat.get("load", []),
            "e2e P99": lat.get("e2e_s_p99", []),
            "TTFT P99": lat.get("ttft_s_p99", []),
            "n": lat.get("n_requests") or [None] * len(lat.get("load", [])),
        }
    )
    long = df.melt(id_vars=["load", "n"], var_name="metric", value_name="seconds")
    x = alt.X(
        "load:Q",
        title="requests in flight (log)",
        scale=alt.Scale(type="log", domain=domain, nice=False),
    )
    lines = (
        alt.Chart(long)
        .mark_line(point=True)
        .encode(
            x=x,
            y=alt.Y("seconds:Q", title="seconds"),
            color=alt.Color("metric:N", title=None, legend=alt.Legend(orient="top")),
            tooltip=[
                alt.Tooltip("load:Q", format=".1f"),
                "metric:N",
                alt.Tooltip("seconds:Q", format=".2f"),
                "n:Q",
            ],
        )
    )
    rules = _rules([(knee, "knee"), (cap, "cap")], "x")
    return alt.layer(lines, *rules).properties(title="P99 latency against load", height=height)


def load_domain(
    curve: dict[str, list] | None, lat: dict[str, list] | None, extra: Sequence[float | None] = ()
) -> list[float]:
    """One log-axis domain for the plateau and P99 charts of an engine."""
    return _load_domain(
        (curve or {}).get("load", []),
        (lat or {}).get("load", []),
        [v for v in extra if v is not None],
    )


def hit_rate_chart(frame: dict[str, list], *, height: int = 180) -> Chart:
    """Prefix-cache hit rate per replica (a ``prefix_cache`` finding's frame)."""
    df = pd.DataFrame(
        {
            "engine": frame.get("engine_id", []),
            "hit rate": frame.get("hit_rate", []),
            "looked up": frame.get("prefix_queries", []),
        }
    )
    return (
        alt.Chart(df)
        .mark_bar()
        .encode(
            y=alt.Y("engine:N", title=None, sort=None),
            x=alt.X("hit rate:Q", axis=alt.Axis(format="%"), scale=alt.Scale(domain=[0, 1])),
            tooltip=[
                "engine:N",
                alt.Tooltip("hit rate:Q", format=".0%"),
                alt.Tooltip("looked up:Q", format=",.0f"),
            ],
        )
        .properties(title="Prefix-cache hit rate per replica", height=height)
    )


def step_chart(steps: pd.DataFrame, max_num_seqs: float | None, *, height: int = HEIGHT) -> Chart:
    """Batch size and waiting queue per engine step (the recent raw steps)."""
    s = steps.copy()
    s["time"] = pd.to_datetime(pd.to_numeric(s["ts_unix_s"]), unit="s", utc=True)
    cols = {"batch_size": "batch (running)", "waiting": "waiting"}
    long = s.melt(
        id_vars=["time"], value_vars=[c for c in cols if c in s], var_name="series", value_name="y"
    )
    long["series"] = long["series"].map(cols)
    lines = (
        alt.Chart(long)
        .mark_line(interpolate="step-after")
        .encode(
            x=alt.X("time:T", title=None, axis=alt.Axis(format="%H:%M:%S")),
            y=alt.Y("y:Q", title="requests"),
            color=alt.Color("series:N", title=None, legend=alt.Legend(orient="top")),
        )
    )
    keep, above = _fitting(
        [(max_num_seqs, f"max_num_seqs {max_num_seqs:.0f}" if max_num_seqs else "")],
        float(np.nan_to_num(long["y"].max())),
    )
    title = f"Per engine step: the last {len(s):,} steps"
    return alt.layer(lines, *_rules(keep, "y")).properties(
        title=alt.TitleParams(title, subtitle="; ".join(above)) if above else title, height=height
    )

"""Altair charts over load and per replica: the plateau (throughput and P99 latency
against requests in flight, one chart) and the prefix-cache hit rate per replica.

They draw a finding's ``frame`` as it is; none computes a verdict. The conventions are
those of :mod:`kvscope.dashboard._charts` (plot height, legends).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import altair as alt
import pandas as pd

from kvscope.dashboard._charts import HEIGHT, Chart, finish, rules

SERIES = ("measured", "fit", "e2e P99", "TTFT P99")
"""The plateau chart's legend, in order."""
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")
_RED = "#d62728"


def _load_domain(*loads: Sequence[float]) -> list[float]:
    vals = [float(v) for seq in loads for v in seq if v is not None and float(v) > 0]
    if not vals:
        return [0.5, 64.0]
    return [min(vals) / 1.3, max(vals) * 1.3]


def load_domain(
    curve: dict[str, list] | None, lat: dict[str, list] | None, extra: Sequence[float | None] = ()
) -> list[float]:
    """The log-axis domain of an engine's plateau chart: its loads, knee and cap."""
    return _load_domain(
        (curve or {}).get("load", []),
        (lat or {}).get("load", []),
        [v for v in extra if v is not None],
    )


def load_rules(values: Sequence[tuple[float | None, str]]) -> list[alt.Chart]:
    """Dashed vertical rules at each load with its label *above* the plot area, where no
    point can be: of two rules (a knee of 7 and a cap of 8) the lower one's label ends at
    its rule, the higher one's starts at it; a third goes a line higher."""
    shown = sorted(
        ((float(v), label) for v, label in values if v is not None and math.isfinite(float(v))),
        key=lambda x: x[0],
    )
    out: list[alt.Chart] = []
    for i, (v, label) in enumerate(shown):
        df = pd.DataFrame({"v": [v], "label": [label]})
        rule = alt.Chart(df).mark_rule(strokeDash=[6, 4], color=_RED).encode(x="v:Q")
        text = (
            alt.Chart(df)
            .mark_text(
                align="right" if i == 0 and len(shown) > 1 else "left",
                dx=-3 if i == 0 and len(shown) > 1 else 3,
                baseline="bottom",
                color=_RED,
            )
            .encode(x="v:Q", y=alt.value(-4 - 14 * (i // 2)), text="label:N")
        )
        out += [rule, text]
    return out


def plateau_chart(
    curve: dict[str, list],
    lat: dict[str, list] | None,
    *,
    knee: float | None,
    plateau: float | None,
    cap: float | None,
    domain: list[float],
    height: int = HEIGHT + 60,
) -> Chart:
    """Generated tokens/s against requests in flight (log axis: the measured bins and
    the fitted curve, left axis) and the P99 end-to-end latency and TTFT of the same
    load bins (right axis), with the plateau, the knee and the recommended cap."""
    n = len(curve.get("load", []))
    df = pd.DataFrame(
        {
            "load": curve.get("load", []),
            "measured": curve.get("gen_tokens_per_s", []),
            "fit": curve.get("gen_fit") or [None] * n,
            "windows": curve.get("n_windows") or [None] * n,
        }
    )
    x = alt.X(
        "load:Q",
        title="requests in flight (log)",
        scale=alt.Scale(type="log", domain=domain, nice=False),
    )
    color = alt.Color(
        "series:N",
        title=None,
        scale=alt.Scale(domain=list(SERIES), range=list(_COLORS)),
        legend=alt.Legend(orient="top"),
    )
    tok_y = alt.Y("tokens_per_s:Q", title="generated tok/s", axis=alt.Axis(format=",~f"))
    measured = df.assign(series="measured", tokens_per_s=df["measured"])
    pts = (
        alt.Chart(measured)
        .mark_circle(size=70, opacity=1)
        .encode(
            x=x,
            y=tok_y,
            color=color,
            tooltip=[
                alt.Tooltip("load:Q", format=".1f", title="in flight"),
                alt.Tooltip("measured:Q", format=",.0f", title="generated tok/s"),
                "windows:Q",
            ],
        )
    )
    fitted = df.dropna(subset=["fit"]).assign(series="fit")
    fitted["tokens_per_s"] = fitted["fit"]
    fit = alt.Chart(fitted).mark_line().encode(x=x, y=tok_y, color=color)
    left = [pts, fit, *rules([(plateau, f"plateau {plateau:,.0f} tok/s" if plateau else "")])]
    layers: list[Chart] = [alt.layer(*left)]
    if lat is not None and lat.get("load"):
        p99 = pd.DataFrame(
            {
                "load": lat.get("load", []),
                "e2e P99": lat.get("e2e_s_p99", []),
                "TTFT P99": lat.get("ttft_s_p99", []),
                "n": lat.get("n_requests") or [None] * len(lat.get("load", [])),
            }
        ).melt(id_vars=["load", "n"], var_name="series", value_name="seconds")
        layers.append(
            alt.Chart(p99)
            .mark_line(point=True, strokeDash=[4, 2])
            .encode(
                x=x,
                y=alt.Y(
                    "seconds:Q",
                    title="P99 latency (s)",
                    axis=alt.Axis(format=",~f", orient="right"),
                ),
                color=color,
                tooltip=[
                    alt.Tooltip("load:Q", format=".1f", title="in flight"),
                    "series:N",
                    alt.Tooltip("seconds:Q", format=".2f"),
                    alt.Tooltip("n:Q", title="requests"),
                ],
            )
        )
    marks = load_rules(
        [(knee, f"knee {knee:.1f}" if knee else ""), (cap, f"cap {cap:.0f}" if cap else "")]
    )
    chart = alt.layer(*layers, *marks).resolve_scale(y="independent")
    return finish(
        chart,
        "Throughput and P99 latency against load",
        height=height,
        title_offset=12 + 14 * ((len(marks) // 2 - 1) // 2),  # room for the rule labels
    )


def hit_rate_chart(frame: dict[str, list], *, height: int | None = None) -> Chart:
    """Prefix-cache hit rate per replica (a ``prefix_cache`` finding's frame), each bar
    labelled with its rate, so a 0% replica shows "0%" rather than nothing."""
    df = pd.DataFrame(
        {
            "engine": frame.get("engine_id", []),
            "hit rate": frame.get("hit_rate", []),
            "looked up": frame.get("prefix_queries", []),
        }
    )
    rate = pd.to_numeric(df["hit rate"], errors="coerce")
    df["label"] = [
        "no lookups" if not math.isfinite(r) else f"{r:.0%}" for r in rate.fillna(math.nan)
    ]
    y = alt.Y("engine:N", title=None, sort=None)
    x = alt.X(
        "hit rate:Q",
        axis=alt.Axis(format="%"),
        scale=alt.Scale(domain=[0, 1]),
        title="hit rate (share of looked-up prompt tokens found)",
    )
    tooltip = [
        "engine:N",
        alt.Tooltip("hit rate:Q", format=".0%"),
        alt.Tooltip("looked up:Q", format=",.0f", title="tokens looked up"),
    ]
    bars = alt.Chart(df).mark_bar().encode(y=y, x=x, tooltip=tooltip)
    zero = alt.Chart(df).mark_tick(thickness=3, color="#1f77b4").encode(y=y, x=x)
    labels = (
        alt.Chart(df.assign(**{"hit rate": rate.fillna(0.0)}))
        .mark_text(align="left", dx=6)
        .encode(y=y, x=x, text="label:N")
    )
    return finish(
        alt.layer(bars, zero, labels),
        "Prefix-cache hit rate per replica",
        height=height if height is not None else max(HEIGHT, 40 * len(df)),
    )

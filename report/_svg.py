"""Inline SVG charts for the HTML report, written by hand (no plotting library, no
script, nothing fetched): throughput against load for two weeks, and stacked bars per
day. Pure: frames in, an ``<svg>`` string out."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape
from typing import Any

CURRENT, PREVIOUS, KNEE, CAP = "#2563eb", "#94a3b8", "#d97706", "#dc2626"
PALETTE = ("#2563eb", "#0d9488", "#9333ea", "#ea580c", "#db2777", "#65a30d", "#0891b2", "#a16207")
_FONT = 'font-family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif"'


def _nice_top(v: float, ticks: int = 4) -> tuple[float, float]:
    """A round upper bound above ``v`` and its tick step."""
    if v <= 0 or not math.isfinite(v):
        return 1.0, 0.25
    raw = v / ticks
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return step * math.ceil(v / step - 1e-9), step


def short_number(v: float) -> str:
    """``1.2M``, ``35k``, ``820``, ``2.5``."""
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.1f}".rstrip("0").rstrip(".") + "M"
    if a >= 1e4:
        return f"{v / 1e3:.0f}k"
    if a >= 1e3:
        return f"{v / 1e3:.1f}".rstrip("0").rstrip(".") + "k"
    if a >= 10 or v == int(v):
        return f"{v:.0f}"
    return f"{v:.1f}"


def duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.5 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _points(frame: dict[str, list[Any]] | None, ycol: str) -> list[tuple[float, float]]:
    if not frame:
        return []
    xs, ys = frame.get("load") or [], frame.get(ycol) or []
    return [
        (float(x), float(y))
        for x, y in zip(xs, ys, strict=False)
        if x is not None and y is not None and x > 0 and math.isfinite(float(y))
    ]


def _text(
    x: float,
    y: float,
    s: str,
    *,
    size: int = 11,
    anchor: str = "start",
    fill: str = "#334155",
    weight: str = "normal",
) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
        f'fill="{fill}" font-weight="{weight}">{escape(s)}</text>'
    )


def curve_svg(
    current: dict[str, list[Any]] | None,
    previous: dict[str, list[Any]] | None,
    *,
    knee: float | None = None,
    cap: float | None = None,
    previous_knee: float | None = None,
    label: str = "",
    width: int = 560,
    height: int = 300,
) -> str:
    """Generated tok/s against requests in flight (log axis): this week's load-bin
    medians and monotone fit, last week's in grey, the knee and the cap as lines."""
    cur, cur_fit = _points(current, "gen_tokens_per_s"), _points(current, "gen_fit")
    prev, prev_fit = _points(previous, "gen_tokens_per_s"), _points(previous, "gen_fit")
    everything = cur + cur_fit + prev + prev_fit
    if not everything:
        return ""
    left, right, top, bottom = 58, 18, 30, 44
    pw, ph = width - left - right, height - top - bottom
    marks = [v for v in (knee, cap, previous_knee) if v is not None and v > 0]
    lo = min([p[0] for p in everything] + marks) / 1.2
    hi = max([p[0] for p in everything] + marks) * 1.2
    ytop, ystep = _nice_top(max(p[1] for p in everything) * 1.05)
    llo, lhi = math.log(lo), math.log(hi)

    def sx(x: float) -> float:
        return left + (math.log(x) - llo) / (lhi - llo) * pw

    def sy(y: float) -> float:
        return top + ph - y / ytop * ph

    out = [
        f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(label or "throughput against load")}" {_FONT}>',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#f8fafc" stroke="#e2e8f0"/>',
    ]
    y = 0.0
    while y <= ytop + 1e-9:
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" '
            'stroke="#e2e8f0"/>'
        )
        out.append(_text(left - 6, sy(y) + 4, short_number(y), anchor="end"))
        y += ystep
    x = 2.0 ** math.floor(math.log2(lo))
    while x <= hi:
        if x >= lo:
            out.append(
                f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{top}" y2="{top + ph}" '
                'stroke="#eef2f7"/>'
            )
            out.append(_text(sx(x), top + ph + 16, short_number(x), anchor="middle"))
        x *= 2
    out.append(_text(left + pw / 2, height - 8, "requests in flight (log scale)", anchor="middle"))
    out.append(
        f'<text transform="translate(14 {top + ph / 2:.0f}) rotate(-90)" '
        'font-size="11" text-anchor="middle" fill="#334155">generated tok/s</text>'
    )
    for value, color, name, dash in (
        (previous_knee, PREVIOUS, "knee last week", "4 3"),
        (knee, KNEE, "knee", "6 3"),
        (cap, CAP, "cap", ""),
    ):
        if value is None or value <= 0:
            continue
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<line x1="{sx(value):.1f}" x2="{sx(value):.1f}" y1="{top}" '
            f'y2="{top + ph}" stroke="{color}" stroke-width="1.5"{dash_attr}>'
            f"<title>{escape(name)} {value:.1f}</title></line>"
        )
    for fit, color, dash in (
        (prev_fit, PREVIOUS, ' stroke-dasharray="5 4"'),
        (cur_fit, CURRENT, ""),
    ):
        if len(fit) > 1:
            line = " ".join(f"{sx(a):.1f},{sy(b):.1f}" for a, b in fit)
            out.append(
                f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"{dash}/>'
            )
    for pts, color, filled in ((prev, PREVIOUS, False), (cur, CURRENT, True)):
        for a, b in pts:
            fill = color if filled else "#ffffff"
            out.append(
                f'<circle cx="{sx(a):.1f}" cy="{sy(b):.1f}" r="3.5" fill="{fill}" '
                f'stroke="{color}" stroke-width="1.5"><title>{a:.1f} in flight: '
                f"{b:,.0f} tok/s</title></circle>"
            )
    legend = [("this week", CURRENT, "line"), ("last week", PREVIOUS, "dash")]
    if knee is not None:
        legend.append((f"knee {knee:.1f}", KNEE, "vdash"))
    if cap is not None:
        legend.append((f"cap {cap:.0f}", CAP, "vline"))
    if previous_knee is not None:
        legend.append((f"last week's knee {previous_knee:.1f}", PREVIOUS, "vdash"))
    lx = float(left)
    for name, color, style in legend:
        if style in ("line", "dash"):
            dash = ' stroke-dasharray="5 4"' if style == "dash" else ""
            out.append(
                f'<line x1="{lx:.0f}" x2="{lx + 18:.0f}" y1="14" y2="14" stroke="{color}" '
                f'stroke-width="2"{dash}/>'
            )
        else:
            dash = ' stroke-dasharray="3 2"' if style == "vdash" else ""
            out.append(
                f'<line x1="{lx + 9:.0f}" x2="{lx + 9:.0f}" y1="6" y2="22" stroke="{color}" '
                f'stroke-width="1.5"{dash}/>'
            )
        out.append(_text(lx + 23, 18, name))
        lx += 30 + 6.2 * len(name)
    out.append("</svg>")
    return "\n".join(out)


def stacked_bars_svg(
    categories: Sequence[str],
    series: Sequence[tuple[str, Sequence[float]]],
    *,
    value_text: Callable[[float], str] = short_number,
    label: str = "",
    title: str = "",
    width: int = 540,
    height: int = 230,
) -> str:
    """One stacked bar per category (a day), one colour per series (an engine)."""
    if not categories or not series:
        return ""
    totals = [sum(float(s[1][i] or 0.0) for s in series) for i in range(len(categories))]
    left, right, bottom = 46, 10, 34
    legend: list[tuple[float, float, int, str]] = []  # x, y, series index, name
    if len(series) > 1:
        lx, ly = float(left), 34.0
        for j, (name, _) in enumerate(series):
            w = 24 + 6.0 * len(name)
            if lx + w > width - right and lx > left:
                lx, ly = float(left), ly + 15
            legend.append((lx, ly, j, name))
            lx += w
    top = (legend[-1][1] + 12) if legend else 30.0
    height += int(top - 30)
    pw, ph = width - left - right, height - top - bottom
    ytop, ystep = _nice_top(max(totals) * 1.1 if max(totals) > 0 else 1.0)
    slot = pw / len(categories)
    bw = min(46.0, slot * 0.62)

    def sy(y: float) -> float:
        return top + ph - y / ytop * ph

    out = [
        f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(label or title)}" {_FONT}>'
    ]
    if title:
        out.append(_text(left, 16, title, size=12, weight="600", fill="#0f172a"))
    y = 0.0
    while y <= ytop + 1e-9:
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" '
            'stroke="#e2e8f0"/>'
        )
        out.append(_text(left - 6, sy(y) + 4, value_text(y), anchor="end"))
        y += ystep
    for i, cat in enumerate(categories):
        cx = left + slot * (i + 0.5)
        base = 0.0
        for j, (name, values) in enumerate(series):
            v = float(values[i] or 0.0)
            if v <= 0:
                continue
            y0, y1 = sy(base), sy(base + v)
            out.append(
                f'<rect x="{cx - bw / 2:.1f}" y="{y1:.1f}" width="{bw:.1f}" '
                f'height="{max(0.5, y0 - y1):.1f}" fill="{PALETTE[j % len(PALETTE)]}">'
                f"<title>{escape(name)}, {escape(cat)}: {escape(value_text(v))}</title>"
                "</rect>"
            )
            base += v
        if totals[i] > 0:
            out.append(
                _text(
                    cx,
                    sy(totals[i]) - 4,
                    value_text(totals[i]),
                    size=10,
                    anchor="middle",
                    fill="#475569",
                )
            )
        out.append(_text(cx, top + ph + 15, cat, size=10, anchor="middle"))
    for lx, ly, j, name in legend:
        out.append(
            f'<rect x="{lx:.0f}" y="{ly - 9:.0f}" width="10" height="10" '
            f'fill="{PALETTE[j % len(PALETTE)]}"/>'
        )
        out.append(_text(lx + 14, ly, name, size=10))
    out.append("</svg>")
    return "\n".join(out)

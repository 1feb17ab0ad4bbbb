"""A small text plot of throughput against load, with the knee and the cap marked.

Load runs along a log axis (a sweep doubles it per level), throughput up from zero,
so the plateau's height reads as a share of the whole. Each load bin's median is a
``●``; the monotone fit between them is drawn with ``·``; the knee is a ``┊`` column
and the cap a ``│`` column (``┃`` where they fall together). Pure: strings out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

POINT, FIT, KNEE, CAP, BOTH = "●", "·", "┊", "│", "┃"


def _fmt_num(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 else f"{v:.1f}".rstrip("0").rstrip(".")


def throughput_plot(
    load: Sequence[float],
    tokens_per_s: Sequence[float],
    fit: Sequence[float] | None = None,
    *,
    knee: float | None = None,
    cap: float | None = None,
    width: int = 48,
    height: int = 8,
) -> list[str]:
    """Lines of the plot (no trailing newlines); empty without two usable points."""
    pts = [
        (float(x), float(y))
        for x, y in zip(load, tokens_per_s, strict=True)
        if x is not None and y is not None and x > 0 and math.isfinite(y)
    ]
    if len(pts) < 2:
        return []
    xs = np.array([p[0] for p in pts])
    ys = np.array([p[1] for p in pts])
    fits = (
        np.array([float(v) for v in fit], float)
        if fit is not None and len(fit) == len(load)
        else None
    )
    lo, hi = math.log(xs.min()), math.log(xs.max())
    if hi - lo < 1e-9:
        return []
    top = float(max(ys.max(), fits.max() if fits is not None else 0.0)) * 1.05 or 1.0

    def col(x: float) -> int:
        return round((math.log(x) - lo) / (hi - lo) * (width - 1))

    def row(y: float) -> int:
        return height - 1 - min(height - 1, max(0, round(y / top * (height - 1))))

    grid = [[" "] * width for _ in range(height)]
    marks = {}
    for value, ch in ((knee, KNEE), (cap, CAP)):
        if value is not None and value > 0 and math.isfinite(value):
            c = min(width - 1, max(0, col(value)))
            marks[c] = BOTH if c in marks else ch
    for c, ch in marks.items():
        for r in range(height):
            grid[r][c] = ch
    if fits is not None:
        for c in range(width):
            x = math.exp(lo + (hi - lo) * c / (width - 1))
            y = float(np.interp(x, xs, fits))
            if grid[row(y)][c] == " ":
                grid[row(y)][c] = FIT
    for x, y in pts:
        grid[row(y)][col(x)] = POINT

    labels = {0: _fmt_num(top / 1.05), height - 1: "0"}
    labels[height // 2] = _fmt_num(top * (height - 1 - height // 2) / (height - 1))
    lw = max(len(v) for v in labels.values())
    lines = [
        f"{labels.get(r, ''):>{lw}} ┤{''.join(grid[r])}"
        if r in labels
        else f"{'':>{lw}} │{''.join(grid[r])}"
        for r in range(height)
    ]
    axis = [" "] * width
    ticks: list[tuple[int, str]] = []
    x = 2.0 ** math.floor(math.log2(xs.min()))
    while x <= xs.max() * 1.1:
        if x >= xs.min() / 1.1:
            ticks.append((min(width - 1, max(0, col(x))), _fmt_num(x)))
        x *= 2
    tick_line = [" "] * (width + 6)
    for c, text in ticks:
        axis[c] = "┬"
        if all(ch == " " for ch in tick_line[max(0, c - 1) : c + len(text) + 1]):
            tick_line[c : c + len(text)] = list(text)
    lines.append(f"{'':>{lw}} └{''.join(axis)}")
    lines.append(f"{'':>{lw}}  {''.join(tick_line).rstrip()}")
    legend = ["in flight (log)", f"{POINT} measured", f"{FIT} fit"]
    if knee is not None:
        legend.append(f"{KNEE} knee {knee:.1f}")
    if cap is not None:
        legend.append(f"{CAP} cap {cap:.0f}")
    lines.append(f"{'':>{lw}}  " + "   ".join(legend))
    return lines

"""Number formatting for the dashboard, units read from the key's suffix.

Follows the terminal view (:mod:`kvscope.advisor.render`) so that a number reads the same in
``kvscope advise`` and in the dashboard: percentages without decimals, token rates
with thousands separators, seconds with two decimals, the knee with one.
"""

from __future__ import annotations

import math
import re
from typing import Any

from kvscope.advisor import render

EFFECT_LABELS = {
    **render.EFFECT_LABELS,
    "throughput_fraction": "throughput (share of peak)",
    "step_ms": "step time",
}
"""The terminal view's labels of expected effects, two of them spelled out."""


NONE = "–"
"""Shown for a missing number (a bare ``-`` would render as a Markdown list item)."""


def finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def num(v: Any, spec: str = ",.1f") -> str:
    return format(v, spec) if finite(v) else NONE


def pct(v: Any) -> str:
    return f"{v:.0%}" if finite(v) else NONE


def tok(v: Any) -> str:
    return f"{v:,.0f} tok/s" if finite(v) else NONE


def sec(v: Any) -> str:
    return f"{v:.2f} s" if finite(v) else NONE


def knee(v: Any) -> str:
    """The knee in requests in flight, as ``kvscope advise`` prints it."""
    return f"{v:.1f}" if finite(v) else NONE


def value(key: str, v: Any) -> str:
    """One evidence or effect value, its unit taken from the key's suffix."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if finite(v):
        if key.endswith("tokens_per_s"):
            return tok(v)
        if re.search(r"_per_s(_|$)", key):
            return f"{num(v, ',.1f')}/s"
        if key.endswith("_ms"):
            return f"{v:.1f} ms"
        if key.endswith("change_s"):
            return f"{v * 1e3:+,.0f} ms"
        if key.endswith("_s") or "_s_" in key:
            return sec(v)
        if key.endswith(
            (
                "_ratio",
                "fraction",
                "_share",
                "hit_rate",
                "hit_rate_max",
                "_loss",
                "available",
                "captured",
                "usage_median",
                "usage_max",
            )
        ):
            return pct(v)
        if key.endswith("_r2"):
            return num(v, ".2f")
        return num(v, ",.0f") if float(v).is_integer() else num(v, ",.1f")
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return NONE
    return str(v)


def facts(d: dict[str, Any], labels: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """``(label, formatted value)`` for the scalar entries of ``d``."""
    out = []
    for k, v in d.items():
        if v is None or isinstance(v, (dict, list)):
            continue
        out.append(((labels or {}).get(k, k.replace("_", " ")), value(k, v)))
    return out

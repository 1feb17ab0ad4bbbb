"""The value syntax every part of kvscope shares: times and durations, HTTP headers, and the
argument types of the ``kvscope`` command and of the dashboard's own arguments.

One parser per kind of value, so ``--since 1h`` means the same to ``advise``, ``report``,
``lint``, the dashboard and the collector's query API (``?since=1h``), and a header is
written ``Name: value`` wherever one is given (``--otlp-header``, ``--prometheus-header``,
``$KVSCOPE_PROMETHEUS_HEADERS``). The argument types raise
:class:`argparse.ArgumentTypeError` saying what was expected and what was given.

Standard library only, and nothing else of kvscope: every subpackage may import it.
"""

from __future__ import annotations

import argparse
import math
import re

__all__ = [
    "ParamError",
    "at_least_two",
    "count",
    "duration",
    "fraction",
    "header",
    "non_negative",
    "parse_duration",
    "parse_header",
    "parse_time",
    "positive",
    "ratio",
]

_UNITS_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_DURATION_HINT = "a duration such as 90s, 30m, 2h, 7d, 1w"


class ParamError(ValueError):
    """A time, duration or header that does not parse; the message names the parameter."""


def _seconds(text: str) -> float | None:
    """A finite number of 0 or more, else None."""
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) and v >= 0 else None


def parse_duration(name: str, text: str) -> float:
    """Seconds from ``90s``, ``30m``, ``2h``, ``7d``, ``1w`` or a plain number of seconds."""
    t = text.strip().lower()
    m = _DURATION.match(t)
    if m:
        return float(m.group(1)) * _UNITS_S[m.group(2)]
    v = _seconds(t)
    if v is None:
        raise ParamError(f"{name}: expected {_DURATION_HINT} (or seconds); got {text!r}")
    return v


def parse_time(name: str, text: str, now_unix_s: float) -> float:
    """Unix seconds (``1764430000``), ``now``, or a duration ago (``90s``, ``30m``, ``7d``)."""
    t = text.strip().lower()
    if t == "now":
        return now_unix_s
    m = _DURATION.match(t)
    if m:
        return now_unix_s - float(m.group(1)) * _UNITS_S[m.group(2)]
    v = _seconds(t)
    if v is None:
        raise ParamError(
            f"{name}: expected unix seconds, 'now' or {_DURATION_HINT} ago; got {text!r}"
        )
    return v


def parse_header(name: str, text: str) -> tuple[str, str]:
    """``Name: value`` (as curl's ``-H``) -> (name, value), both stripped.

    The message never repeats the value: headers carry credentials."""
    key, sep, value = text.partition(":")
    key = key.strip()
    if not sep or not key or any(c.isspace() or c == "=" for c in key):
        shown = f" (starting {key[:20]!r})" if key and sep else ""
        raise ParamError(
            f"{name}: expected 'Name: value', e.g. 'Authorization: Bearer T'; "
            f"got a value without a header name{shown}"
        )
    return key, value.strip()


def _number(text: str, expected: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return v


def _whole(text: str) -> int:
    try:
        return int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive(text: str) -> float:
    """A number above 0 (seconds, a rate, ...)."""
    v = _number(text, "a number > 0")
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return v


def non_negative(text: str) -> float:
    """A number of 0 or more."""
    v = _number(text, "a number >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return v


def fraction(text: str) -> float:
    """A share in (0, 1]."""
    v = _number(text, "a number in (0, 1]")
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return v


def ratio(text: str) -> float:
    """A ratio of 1 or more."""
    v = _number(text, "a number >= 1")
    if not v >= 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return v


def count(text: str) -> int:
    """A whole number of 0 or more."""
    n = _whole(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return n


def at_least_two(text: str) -> int:
    """A whole number of 2 or more."""
    n = _whole(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2, got {text!r}")
    return n


def duration(text: str) -> float:
    """Seconds, from a duration (``90s``, ``30m``, ``1h``) or a plain number of seconds."""
    try:
        return parse_duration("duration", text)
    except ParamError:
        raise argparse.ArgumentTypeError(
            f"expected {_DURATION_HINT} or seconds, got {text!r}"
        ) from None


def header(text: str) -> tuple[str, str]:
    """An HTTP header, ``Name: value``."""
    try:
        return parse_header("header", text)
    except ParamError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("header: ")) from None

"""The value syntax every part of kvscope shares: times and durations, HTTP headers, and the
argument types of the ``kvscope`` command and of the dashboard's own arguments.

One parser per kind of value, so ``--since 1h`` means the same to ``advise``, ``report``,
``lint``, ``twin``, the dashboard and the collector's query API (``?since=1h``), and a header
is written ``Name: value`` wherever one is given (``--otlp-header``, ``--prometheus-header``,
``$KVSCOPE_PROMETHEUS_HEADERS``). The argument types raise
:class:`argparse.ArgumentTypeError` saying what was expected and what was given.

A duration is one or more numbers with a unit, ``s``, ``m``, ``h``, ``d`` or ``w``
(``90s``, ``30m``, ``1h30m``, ``2.5h``, ``7d``, ``1w``), or a plain number of seconds.
A time (:func:`parse_time`, :data:`TIME_SYNTAX`) is ``now``; a duration ago (``1h``), also
written with its sign (``-1h``) or as Grafana does (``now-1h``), all three the same instant;
an ISO 8601 date or time (``2026-11-30``, ``2026-11-30T08:00Z``,
``2026-11-30T09:00+01:00``), UTC unless it names a zone; or unix seconds (``1764490000``;
``0`` is the beginning). Nothing reaches into the future: ``+1h`` is refused.

Standard library only, and nothing else of kvscope: every subpackage may import it.
"""

from __future__ import annotations

import argparse
import math
import re
from datetime import datetime, timezone

__all__ = [
    "TIME_SYNTAX",
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
    "positive_duration",
    "ratio",
]

_UNITS_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_DURATION = re.compile(r"^(?:\d+(?:\.\d+)?[smhdw])+$")
_AGO = re.compile(r"^(?:now\s*)?-\s*")
_DURATION_HINT = "a duration such as 90s, 30m, 1h30m, 7d, 1w"
_TIME_HINT = (
    f"unix seconds, 'now', {_DURATION_HINT} ago (also written -1h or now-1h) "
    "or an ISO 8601 time such as 2026-11-30T08:00Z"
)
TIME_SYNTAX = """\
times (--since, --until): a duration ago, 90s, 30m, 1h30m, 7d, 1w (-1h and now-1h say
  the same as 1h); 'now'; an ISO 8601 time, 2026-11-30T08:00Z or 2026-11-30 (UTC unless
  it names a zone); or unix seconds (0: the beginning)."""
"""The time syntax, as the commands' help shows it."""


class ParamError(ValueError):
    """A time, duration or header that does not parse; the message names the parameter."""


def _seconds(text: str) -> float | None:
    """A finite number of 0 or more, else None."""
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) and v >= 0 else None


def _duration_s(t: str) -> float | None:
    """Seconds of ``90s``, ``1h30m``, ``2.5h`` (lower case, stripped), else None."""
    if not _DURATION.match(t):
        return None
    return sum(float(n) * _UNITS_S[u] for n, u in _PART.findall(t))


def _iso_time(text: str) -> float | None:
    """Unix seconds of an ISO 8601 date or time (UTC unless it names a zone), else None."""
    t = text.strip()
    if not re.match(r"^\d{4}-\d{2}-\d{2}", t):
        return None
    t = t[:-1] + "+00:00" if t[-1:] in ("Z", "z") else t
    try:
        when = datetime.fromisoformat(t)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def parse_duration(name: str, text: str) -> float:
    """Seconds from ``90s``, ``30m``, ``1h30m``, ``7d``, ``1w`` or a plain number of seconds."""
    t = text.strip().lower()
    v = _duration_s(t)
    if v is None:
        v = _seconds(t)
    if v is None:
        raise ParamError(f"{name}: expected {_DURATION_HINT} (or seconds); got {text!r}")
    return v


def parse_time(name: str, text: str, now_unix_s: float) -> float:
    """Unix seconds of a time: ``now``; a duration ago (``30m``, ``1h30m``; ``-30m`` and
    ``now-30m`` are the same); an ISO 8601 time (``2026-11-30T08:00Z``, UTC unless it
    names a zone); or unix seconds (``1764430000``)."""
    t = text.strip().lower()
    if t == "now":
        return now_unix_s
    ago = _duration_s(_AGO.sub("", t, count=1))
    if ago is not None:
        return now_unix_s - ago
    v = _seconds(t)
    if v is None:
        v = _iso_time(text)
    if v is None:
        raise ParamError(f"{name}: expected {_TIME_HINT}; got {text!r}")
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


def positive_duration(text: str) -> float:
    """A :func:`duration` above 0."""
    v = duration(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be longer than 0, got {text!r}")
    return v


def header(text: str) -> tuple[str, str]:
    """An HTTP header, ``Name: value``."""
    try:
        return parse_header("header", text)
    except ParamError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("header: ")) from None


SLO_TARGETS = (
    ("ttft", "time to first token"),
    ("itl", "inter-token latency (requests with 2 output tokens or more)"),
    ("e2e", "end-to-end latency"),
)
"""The latency targets of ``--slo-ttft``, ``--slo-itl`` and ``--slo-e2e``."""


def add_slo_targets(
    p: argparse.ArgumentParser,
    effect: str = (
        "the latency block says which share of requests met it, per engine and pool "
        "(SLO attainment; the cap is unchanged)"
    ),
) -> None:
    """``--slo-ttft``, ``--slo-itl`` and ``--slo-e2e`` (seconds, None by default) on ``p``;
    ``effect`` says what a target does in that command."""
    for name, what in SLO_TARGETS:
        p.add_argument(
            f"--slo-{name}",
            type=positive,
            default=None,
            metavar="S",
            help=f"{what} target in seconds: {effect}",
        )

"""The argument types every ``kvscope`` subcommand shares: one validator per kind of value,
each raising :class:`argparse.ArgumentTypeError` with what was expected and what was given.

Times and durations (``--since 30m``, ``--until now``) are parsed by
:func:`kvscope.collector.params.parse_time`, the syntax of the collector's query API, so a
window reads the same on the command line, in the dashboard and in a URL.
"""

from __future__ import annotations

import argparse

__all__ = ["at_least_two", "count", "fraction", "header", "otlp_url", "positive", "ratio"]


def positive(text: str) -> float:
    """A number of seconds (or any quantity) above 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return v


def fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return v


def ratio(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}") from None
    if not v >= 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return v


def at_least_two(text: str) -> int:
    try:
        v = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2, got {text!r}")
    return v


def count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def header(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key or any(c in key for c in " :\r\n"):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. Authorization=Bearer T), "
                                         f"got {text!r}")
    return key, value.strip()


def otlp_url(text: str) -> str:
    scheme, sep, rest = text.partition("://")
    if scheme not in ("http", "https") or not sep or not rest.strip("/"):
        raise argparse.ArgumentTypeError(
            f"expected an http(s) URL such as http://otel-collector:4318/v1/metrics, got {text!r}")
    return text

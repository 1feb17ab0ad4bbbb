"""Query-string parsing for the read API; errors name the parameter.

Times (``since``, ``until``) use the syntax of :mod:`kvscope.args`, as the command line does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvscope.args import ParamError, parse_duration, parse_time
from kvscope.engine_plugins.schema import MAX_UNIX_S

__all__ = ["FORMATS", "ParamError", "Query", "parse_query", "parse_time"]

FORMATS = ("records", "columns")
MAX_EVERY = 2**31
"""Largest ``every`` (a sample of the raw steps): one step in two billion."""


@dataclass(frozen=True)
class Query:
    """Parsed read-API parameters."""

    engine_id: str | None = None
    pool: str | None = None
    since_unix_s: float | None = None
    until_unix_s: float | None = None
    limit: int | None = None
    format: str = "records"
    group_by: str = "engine"
    source: str = "windows"
    fields: tuple[str, ...] | None = None
    """Columns to return (all when None)."""
    step_s: int = 60
    """Seconds summed per row of the request tier (a multiple of 60)."""
    deleted_only: bool = False
    """Of the request tier, only the minutes whose request rows the retention deleted."""
    every: int = 1
    """Of the raw steps, every ``every``-th only (a sample for a chart)."""


def _integer(params: Mapping[str, str], name: str, default: int) -> int:
    """``params[name]`` as an integer (``default`` when absent); the caller checks its range."""
    if name not in params:
        return default
    try:
        return int(params[name])
    except ValueError:
        raise ParamError(f"{name}: expected a positive integer, got {params[name]!r}") from None


def _time(name: str, text: str, now: float) -> float:
    try:
        return parse_time(name, text, now)
    except (OverflowError, ValueError) as exc:
        if isinstance(exc, ParamError):
            raise
        raise ParamError(f"{name}: out of range, got {text[:40]!r}") from None


def parse_query(
    params: Mapping[str, str],
    allowed: Iterable[str],
    *,
    default_since: str | None,
    max_limit: int,
    now_unix_s: float | None = None,
) -> Query:
    """Check the parameter names against ``allowed`` and parse their values."""
    allowed = tuple(allowed)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ParamError(
            f"unknown parameter(s) {', '.join(map(repr, unknown))}; "
            f"this endpoint takes {', '.join(allowed) or 'none'}"
        )
    for key, value in params.items():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ParamError(f"{key}: not valid Unicode text") from None
    now = time.time() if now_unix_s is None else now_unix_s
    since_text = params.get("since", default_since)
    since = _time("since", since_text, now) if since_text else None
    until = _time("until", params["until"], now) if params.get("until") else None
    for key, t in (("since", since), ("until", until)):
        if t is not None and not (math.isfinite(t) and abs(t) <= MAX_UNIX_S):
            raise ParamError(f"{key}: out of range (a time between 1970 and 2242), got {t!r}")
    if since is not None and until is not None and until < since:
        raise ParamError(f"until ({until}) is before since ({since})")
    limit = _integer(params, "limit", max_limit)
    if not 0 < limit <= max_limit:
        raise ParamError(f"limit: must be in 1..{max_limit}, got {limit}")
    fmt = params.get("format", "records")
    if fmt not in FORMATS:
        raise ParamError(f"format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    group_by = params.get("group_by", "engine")
    if group_by not in ("engine", "pool", "all"):
        raise ParamError(f"group_by: expected engine, pool or all, got {group_by!r}")
    source = params.get("source", "windows")
    if source not in ("windows", "steps"):
        raise ParamError(f"source: expected windows or steps, got {source!r}")
    for key in ("engine", "pool"):
        if key in params and not params[key]:
            raise ParamError(f"{key}: must not be empty")
    fields = None
    if "fields" in params:
        fields = tuple(f.strip() for f in params["fields"].split(",") if f.strip())
        if not fields:
            raise ParamError("fields: expected a comma-separated list of column names")
        if len(set(fields)) != len(fields):
            raise ParamError("fields: a column is named twice")
    step_s = 60
    if "step" in params:
        try:
            step = parse_duration("step", params["step"])
        except OverflowError:
            raise ParamError(f"step: out of range, got {params['step'][:40]!r}") from None
        if not 60 <= step <= MAX_UNIX_S or step % 60:
            raise ParamError(f"step: must be a whole number of minutes, got {params['step']!r}")
        step_s = int(step)
    deleted_only = params.get("deleted_only", "false").lower()
    if deleted_only not in ("true", "false", "1", "0"):
        raise ParamError(f"deleted_only: expected true or false, got {params['deleted_only']!r}")
    every = _integer(params, "every", 1)
    if not 1 <= every <= MAX_EVERY:
        raise ParamError(f"every: must be in 1..{MAX_EVERY}, got {every}")
    return Query(
        engine_id=params.get("engine"),
        pool=params.get("pool"),
        since_unix_s=since,
        until_unix_s=until,
        limit=limit,
        format=fmt,
        group_by=group_by,
        source=source,
        fields=fields,
        step_s=step_s,
        deleted_only=deleted_only in ("true", "1"),
        every=every,
    )

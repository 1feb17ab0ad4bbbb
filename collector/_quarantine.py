"""Rows outside what an engine can produce, moved aside when the store opens.

The wire schema bounds every value at the door (see :mod:`kvscope.engine_plugins.schema`).
A store written before those bounds (or by hand) may still hold a row past them: a window
dated before 1970 or after the schema's last time, a sum that wrapped negative or exceeds
what its steps can hold, an identity dated after the schema's last time. Such a row could
stop a rollup, a read or the start itself. At open, :func:`quarantine` copies each to
``quarantined_rows`` (table, engine, reason, the row as JSON) and deletes it, or, for an
engine's identity, forgets only the bad part. The service says so in its log and on
``/metrics`` (``kvscope_collector_quarantined_rows``). Times merely ahead of the clock are
left alone here (test fixtures and generated fleets date data in the future); where they
would hold off genuine data (an identity, the gauges) the comparison itself ignores them
(see :mod:`kvscope.collector._ingest_sql` and :mod:`kvscope.collector.metrics`).
"""

from __future__ import annotations

import logging
from typing import Any

from kvscope.collector import _windows
from kvscope.engine_plugins.schema import (
    FLOAT,
    INT,
    MAX_UNIX_S,
    REQUEST_FIELDS,
    STEP_FIELDS,
    Field,
)

log = logging.getLogger(__name__)

_MAX_OF = {f.name: f.maximum for f in STEP_FIELDS}


def _field_bad(fields: tuple[Field, ...], skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(reason, SQL condition) per numeric field: NaN/inf, or outside the field's bounds."""
    out = []
    for f in fields:
        if f.kind not in (INT, FLOAT) or f.name in skip:
            continue
        c = f.name
        parts = []
        if f.kind == FLOAT:
            parts.append(f"NOT isfinite({c})")
        if f.minimum is not None:
            parts.append(f"{c} < {f.minimum!r}")
        if f.maximum is not None:
            parts.append(f"{c} > {f.maximum!r}")
        if parts:
            out.append((f"{c} out of range", f"({' OR '.join(parts)})"))
    return out


def _rules() -> dict[str, list[tuple[str, str]]]:
    latest = float(MAX_UNIX_S)
    window_sums = [
        (
            f"{name} past its steps' bound",
            f"(CAST({name} AS DOUBLE) < 0 OR CAST({name} AS "
            f"DOUBLE) > CAST(n_steps AS DOUBLE) * {float(_MAX_OF[col] or 1.0)!r})",
        )
        for name, col in _windows._SUMS
    ]
    minute_sums = [
        (f"{name} negative", f"{name} < 0")
        for name, _ in _windows._SUMS
        if name not in ("kv_usage_sum",)
    ]
    return {
        "steps": [
            (
                "time out of range",
                f"(NOT isfinite(ts_unix_s) OR ts_unix_s < 0 OR ts_unix_s > {latest!r})",
            ),
            *_field_bad(STEP_FIELDS, skip=("ts_unix_s",)),
        ],
        "windows_1s": [
            ("time out of range", f"(ts_s < 0 OR ts_s > {latest!r})"),
            ("no steps", "(n_steps IS NULL OR n_steps <= 0)"),
            *window_sums,
        ],
        "windows_1m": [("time out of range", f"(ts_s < 0 OR ts_s > {latest!r})"), *minute_sums],
        "requests": [
            (
                "time out of range",
                f"(NOT isfinite(finished_unix_s) OR finished_unix_s < 0 "
                f"OR finished_unix_s > {latest!r})",
            ),
            *_field_bad(REQUEST_FIELDS, skip=("finished_unix_s",)),
        ],
        "requests_1m": [("time out of range", f"(ts_s < 0 OR ts_s > {latest!r})")],
        "kv_event_windows": [("time out of range", f"(ts_s < 0 OR ts_s > {latest!r})")],
        "engine_configs": [
            (
                "hello dated past the bounds",
                f"(NOT isfinite(started_unix_s) OR started_unix_s > {latest!r})",
            )
        ],
    }


def quarantine(con: Any, now_unix_s: float) -> dict[str, int]:
    """Move the rows past the bounds to ``quarantined_rows``; return the rows per table
    (in one transaction; the caller holds the write lock)."""
    moved: dict[str, int] = {}
    latest = float(MAX_UNIX_S)
    con.execute("BEGIN TRANSACTION")
    try:
        for table, rules in _rules().items():
            # One scan a table: the first rule a row breaks is its reason.
            bad = " OR ".join(cond for _, cond in rules)
            reason = "CASE " + " ".join(f"WHEN {c} THEN ?" for _, c in rules) + " END"
            row = con.execute(
                f"INSERT INTO quarantined_rows SELECT ?, t.engine_id, {reason}, "
                f"CAST(to_json(t) AS VARCHAR), ? FROM {table} t WHERE {bad}",
                [table, *(r for r, _ in rules), now_unix_s],
            ).fetchone()
            n = int(row[0]) if row else 0
            if n:
                con.execute(f"DELETE FROM {table} WHERE {bad}")
                moved[table] = n
        # An engine's identity dated past any time would hold off every genuine hello:
        # forget that part (the next hello sets it), keep the engine.
        future = (
            f"(NOT isfinite(coalesce(started_unix_s, 0)) OR started_unix_s > {latest!r} "
            f"OR NOT isfinite(coalesce(last_step_unix_s, 0)) OR last_step_unix_s > {latest!r})"
        )
        row = con.execute(
            "INSERT INTO quarantined_rows SELECT 'engines', t.engine_id, "
            "'identity dated past the bounds', CAST(to_json(t) AS VARCHAR), ? "
            f"FROM engines t WHERE {future}",
            [now_unix_s],
        ).fetchone()
        n = int(row[0]) if row else 0
        if n:
            con.execute(
                f"UPDATE engines SET has_hello = CASE WHEN started_unix_s > {latest!r} "
                "OR NOT isfinite(coalesce(started_unix_s, 0)) THEN false ELSE has_hello END, "
                f"started_unix_s = CASE WHEN started_unix_s > {latest!r} "
                "OR NOT isfinite(coalesce(started_unix_s, 0)) THEN NULL ELSE started_unix_s END, "
                f"last_step_unix_s = CASE WHEN last_step_unix_s > {latest!r} "
                "OR NOT isfinite(coalesce(last_step_unix_s, 0)) THEN NULL "
                "ELSE last_step_unix_s END "
                f"WHERE {future}"
            )
            moved["engines"] = n
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    for table, n in sorted(moved.items()):
        log.warning(
            "store: %d row(s) of %s lie outside what an engine can produce (a store "
            "written before the collector's bounds); moved to quarantined_rows",
            n,
            table,
        )
    return moved


def counts(cur: Any) -> dict[str, int]:
    """Rows in ``quarantined_rows`` per source table."""
    rows = cur.execute(
        "SELECT table_name, count(*) FROM quarantined_rows GROUP BY table_name"
    ).fetchall()
    return {str(t): int(n) for t, n in rows}

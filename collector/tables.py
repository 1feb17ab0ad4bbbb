"""The store's tables, derived from the wire schema, and their idempotent creation.

Columns that mirror wire fields are generated from :mod:`kvscope.engine_plugins.schema`, so a
field added there appears here too; :func:`ensure_schema` creates missing tables and
adds such columns to an existing store file (``ALTER TABLE ... ADD COLUMN IF NOT
EXISTS``) and records the store layout version in ``meta``. Added columns are
nullable, so a store written before them opens and reads them as null.
"""

from __future__ import annotations

from typing import Any

from kvscope.collector._request_rollup import REQUEST_MINUTE_FIELDS
from kvscope.collector._rollup import MINUTE_FIELDS
from kvscope.engine_plugins.schema import (
    BOOL,
    EXPORTER_FIELDS,
    FLOAT,
    HELLO_FIELDS,
    INT,
    REQUEST_FIELDS,
    STEP_FIELDS,
    STR,
    Field,
)

STORE_SCHEMA_VERSION = 1
"""Bump on a change an older collector would misread; add the migration step."""

_SQL_TYPE = {INT: "BIGINT", FLOAT: "DOUBLE", STR: "VARCHAR", BOOL: "BOOLEAN"}


class StoreVersionError(RuntimeError):
    """The store file was written by a newer kvscope."""


def _cols(fields: tuple[Field, ...], skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    return [(f.name, _SQL_TYPE[f.kind]) for f in fields if f.name not in skip]


#: Hello fields kept per engine / per boot (engine_id and boot_id are key columns).
HELLO_DATA_COLUMNS: tuple[str, ...] = tuple(
    f.name for f in HELLO_FIELDS if f.name not in ("engine_id", "boot_id")
)

#: Window columns per (engine_id, ts_s), computed in ``kvscope.collector._windows``. Sums,
#: minima and maxima merge exactly when a second arrives in parts; ``n_parts`` counts
#: the separately aggregated parts merged into the window (1 = percentiles exact).
WINDOW_FIELDS: tuple[tuple[str, str], ...] = (
    ("n_steps", "BIGINT"),
    ("n_parts", "BIGINT"),
    ("first_step_unix_s", "DOUBLE"),
    ("last_step_unix_s", "DOUBLE"),
    ("batch_sum", "BIGINT"),
    ("batch_mean", "DOUBLE"),
    ("batch_min", "BIGINT"),
    ("batch_max", "BIGINT"),
    ("batch_p50", "DOUBLE"),
    ("batch_p90", "DOUBLE"),
    ("batch_p99", "DOUBLE"),
    ("kv_usage_sum", "DOUBLE"),
    ("kv_usage_mean", "DOUBLE"),
    ("kv_usage_max", "DOUBLE"),
    ("kv_blocks_max", "BIGINT"),
    ("waiting_sum", "BIGINT"),
    ("waiting_mean", "DOUBLE"),
    ("waiting_max", "BIGINT"),
    ("deferred_sum", "BIGINT"),
    ("deferred_mean", "DOUBLE"),
    ("deferred_max", "BIGINT"),
    ("preemptions", "BIGINT"),
    ("prompt_tokens", "BIGINT"),
    ("generation_tokens", "BIGINT"),
    ("prefix_queries", "BIGINT"),
    ("prefix_hits", "BIGINT"),
    ("iteration_n", "BIGINT"),
    ("iteration_s_sum", "DOUBLE"),
    ("iteration_s_mean", "DOUBLE"),
    ("iteration_s_max", "DOUBLE"),
)
WINDOW_COLUMNS: tuple[str, ...] = ("engine_id", "ts_s", *(c for c, _ in WINDOW_FIELDS))

#: Per (engine_id, ts_s) counters of the engine's KV-cache events (see
#: :mod:`kvscope.collector.kv_events`). All but the ``HELD_LAST`` columns add up when a second
#: arrives in parts; those take the latest part's value.
KV_EVENT_FIELDS: tuple[tuple[str, str], ...] = (
    ("n_batches", "BIGINT"),
    ("stored_blocks", "BIGINT"),
    ("dup_blocks", "BIGINT"),
    ("reseen_blocks", "BIGINT"),
    ("orphan_blocks", "BIGINT"),
    ("removed_blocks", "BIGINT"),
    ("cleared_events", "BIGINT"),
    ("missed_batches", "BIGINT"),
    ("held_blocks", "BIGINT"),
    ("held_shared_blocks", "BIGINT"),
    ("block_size", "BIGINT"),
)
KV_EVENT_COLUMNS: tuple[str, ...] = ("engine_id", "ts_s", *(c for c, _ in KV_EVENT_FIELDS))
KV_EVENT_LAST: tuple[str, ...] = ("held_blocks", "held_shared_blocks", "block_size")

ENGINE_EXTRA: list[tuple[str, str]] = [
    ("boot_id", "VARCHAR"),  # boot of the hello applied (the latest process start)
    *_cols(HELLO_FIELDS, skip=("engine_id", "boot_id")),
    ("has_hello", "BOOLEAN"),
    ("hello_unix_s", "DOUBLE"),
    ("first_seen_unix_s", "DOUBLE"),
    ("last_seen_unix_s", "DOUBLE"),
    ("last_step_unix_s", "DOUBLE"),
    ("last_boot_id", "VARCHAR"),  # boot of the latest batch stored
]
ENGINE_COLUMNS: tuple[str, ...] = ("engine_id", *(c for c, _ in ENGINE_EXTRA))

TABLES: dict[str, dict[str, Any]] = {
    "meta": {"cols": [("key", "VARCHAR"), ("value", "VARCHAR")], "pk": ("key",)},
    "engines": {"cols": [("engine_id", "VARCHAR"), *ENGINE_EXTRA], "pk": ("engine_id",)},
    "engine_configs": {
        "cols": [
            ("engine_id", "VARCHAR"),
            ("boot_id", "VARCHAR"),
            ("received_unix_s", "DOUBLE"),
            *_cols(HELLO_FIELDS, skip=("engine_id", "boot_id")),
        ],
        "pk": ("engine_id", "boot_id"),
    },
    "steps": {"cols": [("engine_id", "VARCHAR"), ("boot_id", "VARCHAR"), *_cols(STEP_FIELDS)]},
    "windows_1s": {
        "cols": [("engine_id", "VARCHAR"), ("ts_s", "BIGINT"), *WINDOW_FIELDS],
        "pk": ("engine_id", "ts_s"),
    },
    "windows_1m": {
        "cols": [("engine_id", "VARCHAR"), ("ts_s", "BIGINT"), *MINUTE_FIELDS],
        "pk": ("engine_id", "ts_s"),
    },
    "requests": {
        "cols": [("engine_id", "VARCHAR"), ("boot_id", "VARCHAR"), *_cols(REQUEST_FIELDS)],
    },
    "requests_1m": {
        "cols": [("engine_id", "VARCHAR"), ("ts_s", "BIGINT"), *REQUEST_MINUTE_FIELDS],
        "pk": ("engine_id", "ts_s"),
    },
    "kv_event_windows": {
        "cols": [("engine_id", "VARCHAR"), ("ts_s", "BIGINT"), *KV_EVENT_FIELDS],
        "pk": ("engine_id", "ts_s"),
    },
    "ingested_batches": {
        "cols": [
            ("engine_id", "VARCHAR"),
            ("boot_id", "VARCHAR"),
            ("seq", "BIGINT"),
            ("received_unix_s", "DOUBLE"),
            ("sent_unix_s", "DOUBLE"),
            ("n_steps", "BIGINT"),
            ("n_requests", "BIGINT"),
            ("has_hello", "BOOLEAN"),
        ],
        "pk": ("engine_id", "boot_id", "seq"),
    },
    "exporter_stats": {
        "cols": [
            ("engine_id", "VARCHAR"),
            ("boot_id", "VARCHAR"),
            *_cols(EXPORTER_FIELDS),
            ("updated_unix_s", "DOUBLE"),
        ],
        "pk": ("engine_id", "boot_id"),
    },
    "quarantined_rows": {
        "cols": [
            ("table_name", "VARCHAR"),
            ("engine_id", "VARCHAR"),
            ("reason", "VARCHAR"),
            ("row_json", "VARCHAR"),
            ("quarantined_unix_s", "DOUBLE"),
        ],
    },
    "saved_state": {
        "cols": [("key", "VARCHAR"), ("value", "VARCHAR"), ("saved_unix_s", "DOUBLE")],
        "pk": ("key",),
    },
}


def create_statement(name: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` for one of :data:`TABLES`."""
    spec = TABLES[name]
    parts = [f"{c} {t}" for c, t in spec["cols"]]
    if spec.get("pk"):
        parts.append(f"PRIMARY KEY ({', '.join(spec['pk'])})")
    return f"CREATE TABLE IF NOT EXISTS {name} ({', '.join(parts)})"


def ensure_schema(con: Any) -> None:
    """Create missing tables and columns; check and record the layout version."""
    con.execute("BEGIN")
    try:
        con.execute(create_statement("meta"))
        row = con.execute("SELECT value FROM meta WHERE key = 'store_schema_version'").fetchone()
        if row is not None and int(row[0]) > STORE_SCHEMA_VERSION:
            raise StoreVersionError(
                f"store layout version {row[0]} is newer than this kvscope supports "
                f"({STORE_SCHEMA_VERSION}); upgrade kvscope"
            )
        for name in TABLES:
            con.execute(create_statement(name))
            have = {
                r[0]
                for r in con.execute(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_name = ? AND table_schema = current_schema()",
                    [name],
                ).fetchall()
            }
            for col, typ in TABLES[name]["cols"]:
                if col not in have:
                    con.execute(f"ALTER TABLE {name} ADD COLUMN IF NOT EXISTS {col} {typ}")
        con.execute(
            "INSERT INTO meta VALUES ('store_schema_version', ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            [str(STORE_SCHEMA_VERSION)],
        )
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise

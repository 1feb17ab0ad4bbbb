"""SQL statements of the ingest transaction (see :mod:`kvscope.collector._ingest`).

Each reads a ``_kv_*`` relation that the calling function binds as a local variable
(a DuckDB replacement scan of a dict of numpy arrays or a DataFrame).
"""

from __future__ import annotations

from kvscope.collector._sql import saturated_add
from kvscope.collector.tables import (
    ENGINE_COLUMNS,
    HELLO_DATA_COLUMNS,
    WINDOW_COLUMNS,
    WINDOW_FIELDS,
)
from kvscope.engine_plugins.schema import EXPORTER_KEYS, REQUEST_COLUMNS, STEP_COLUMNS

_ADD = (
    "n_steps",
    "n_parts",
    "batch_sum",
    "kv_usage_sum",
    "waiting_sum",
    "deferred_sum",
    "preemptions",
    "prompt_tokens",
    "generation_tokens",
    "prefix_queries",
    "prefix_hits",
    "iteration_n",
    "iteration_s_sum",
)
_FLOAT_SUMS = frozenset({"kv_usage_sum", "iteration_s_sum"})
_MEAN_OF = {
    "batch_mean": "batch_sum",
    "kv_usage_mean": "kv_usage_sum",
    "waiting_mean": "waiting_sum",
    "deferred_mean": "deferred_sum",
}


def _window_merge(col: str) -> str:
    w, e = f"windows_1s.{col}", f"excluded.{col}"
    n_w, n_e = "windows_1s.n_steps", "excluded.n_steps"
    if col in _ADD:
        return f"{w} + {e}" if col in _FLOAT_SUMS else saturated_add(w, e)
    if col.endswith(("_min", "first_step_unix_s")):
        return f"least({w}, {e})"
    if col.endswith(("_max", "last_step_unix_s")):
        return f"greatest({w}, {e})"
    if col in _MEAN_OF:
        s = _MEAN_OF[col]
        return f"(windows_1s.{s} + excluded.{s}) / ({n_w} + {n_e})"
    if col == "iteration_s_mean":
        return (
            "CASE WHEN windows_1s.iteration_n + excluded.iteration_n > 0 THEN "
            "(windows_1s.iteration_s_sum + excluded.iteration_s_sum) / "
            "(windows_1s.iteration_n + excluded.iteration_n) END"
        )
    if col.startswith("batch_p"):
        return f"({w} * {n_w} + {e} * {n_e}) / ({n_w} + {n_e})"
    raise AssertionError(f"no merge rule for window column {col}")  # pragma: no cover


_WCOLS = ", ".join(WINDOW_COLUMNS)
WINDOW_INSERT = f"INSERT INTO windows_1s ({_WCOLS}) SELECT {_WCOLS} FROM _kv_windows"
WINDOW_MERGE = (
    f"INSERT INTO windows_1s ({_WCOLS}) SELECT {_WCOLS} FROM _kv_merge "
    "ON CONFLICT (engine_id, ts_s) DO UPDATE SET "
    + ", ".join(f"{c} = {_window_merge(c)}" for c, _ in WINDOW_FIELDS)
)

_ENGINE_HELLO_COLS = ("boot_id", *HELLO_DATA_COLUMNS, "hello_unix_s")
FUTURE_IDENTITY_S = 300.0
"""A stored identity whose ``started_unix_s`` lies more than this after the collector's
clock when another hello arrives is taken as wrong (a sender's clock far ahead, a store
from before the door's bounds) and replaced, so it cannot hold off genuine hellos."""
_NEWER_HELLO = (
    "(excluded.has_hello AND (NOT coalesce(engines.has_hello, false) "
    "OR excluded.started_unix_s >= engines.started_unix_s "
    f"OR engines.started_unix_s > excluded.hello_unix_s + {FUTURE_IDENTITY_S!r}))"
)
ENGINE_UPSERT = (
    f"INSERT INTO engines ({', '.join(ENGINE_COLUMNS)}) "
    f"SELECT {', '.join(ENGINE_COLUMNS)} FROM _kv_engines "
    "ON CONFLICT (engine_id) DO UPDATE SET "
    + ", ".join(
        f"{c} = CASE WHEN {_NEWER_HELLO} THEN excluded.{c} ELSE engines.{c} END"
        for c in _ENGINE_HELLO_COLS
    )
    + ", has_hello = coalesce(engines.has_hello, false) OR excluded.has_hello"
    ", first_seen_unix_s = least(engines.first_seen_unix_s, excluded.first_seen_unix_s)"
    ", last_seen_unix_s = greatest(engines.last_seen_unix_s, excluded.last_seen_unix_s)"
    ", last_step_unix_s = greatest(engines.last_step_unix_s, excluded.last_step_unix_s)"
    ", last_boot_id = excluded.last_boot_id"
)
ENGINE_TOUCH = (
    "UPDATE engines SET "
    "last_seen_unix_s = greatest(engines.last_seen_unix_s, u.last_seen_unix_s), "
    "last_step_unix_s = greatest(engines.last_step_unix_s, u.last_step_unix_s), "
    "last_boot_id = u.last_boot_id FROM _kv_touch u WHERE engines.engine_id = u.engine_id"
)
CONFIG_COLS = ("engine_id", "boot_id", "received_unix_s", *HELLO_DATA_COLUMNS)
CONFIG_INSERT = (
    f"INSERT INTO engine_configs ({', '.join(CONFIG_COLS)}) "
    f"SELECT {', '.join(CONFIG_COLS)} FROM _kv_configs ON CONFLICT DO NOTHING"
)
_EXPORTER_COLS = ("engine_id", "boot_id", *EXPORTER_KEYS, "updated_unix_s")
EXPORTER_UPSERT = (
    f"INSERT INTO exporter_stats ({', '.join(_EXPORTER_COLS)}) "
    f"SELECT {', '.join(_EXPORTER_COLS)} FROM _kv_exporter "
    "ON CONFLICT (engine_id, boot_id) DO UPDATE SET "
    + ", ".join(
        f"{c} = greatest(exporter_stats.{c}, excluded.{c})"
        for c in (*EXPORTER_KEYS, "updated_unix_s")
    )
)
_LEDGER_COLS = (
    "engine_id",
    "boot_id",
    "seq",
    "received_unix_s",
    "sent_unix_s",
    "n_steps",
    "n_requests",
    "has_hello",
)
LEDGER_INSERT = (
    f"INSERT INTO ingested_batches ({', '.join(_LEDGER_COLS)}) "
    f"SELECT {', '.join(_LEDGER_COLS)} FROM _kv_ledger"
)
LEDGER_CLAIM = (
    f"INSERT INTO ingested_batches ({', '.join(_LEDGER_COLS)}) "
    f"SELECT {', '.join(_LEDGER_COLS)} FROM _kv_claim "
    "ON CONFLICT DO NOTHING RETURNING engine_id, boot_id, seq"
)

_STEP_COLS = ", ".join(("engine_id", "boot_id", *STEP_COLUMNS))
STEPS_INSERT = f"INSERT INTO steps ({_STEP_COLS}) SELECT {_STEP_COLS} FROM _kv_steps"
_REQUEST_COLS = ", ".join(("engine_id", "boot_id", *REQUEST_COLUMNS))
REQUESTS_INSERT = f"INSERT INTO requests ({_REQUEST_COLS}) SELECT {_REQUEST_COLS} FROM _kv_requests"

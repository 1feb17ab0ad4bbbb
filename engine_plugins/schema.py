"""The kvscope wire schema: what the engine plugin sends and the collector accepts.

Standard library only: the plugin (inside vLLM) and the collector both import it, so
sender and receiver cannot drift apart (``tests/test_schema_contract.py``). One ingest
batch carries the telemetry of one engine (one ``engine_index`` of one vLLM server
process) since the previous batch, as gzip-compressed JSON::

    {
      "schema_version": 1,
      "engine_id": "host:8000:0",      # stable across restarts: host, port, engine index
      "boot_id": "5b0c...",            # new on every process start
      "seq": 17,                       # 0, 1, 2, ... per (engine_id, boot_id)
      "sent_unix_s": 1764430000.25,
      "hello": {...} | null,           # HELLO_FIELDS; on the first batch and after reconnects
      "steps": {"ts_unix_s": [...], "batch_size": [...], ...},      # STEP_FIELDS, columnar
      "requests": {"finished_unix_s": [...], ...},                  # REQUEST_FIELDS, columnar
      "exporter": {"dropped_steps": 0, ...}                         # EXPORTER_FIELDS, cumulative
    }

``(engine_id, boot_id, seq)`` is the idempotency key: a batch is stored once however
often it is resent. Columns are equal-length lists; :func:`validate_batch` checks every
value and raises :class:`SchemaError` naming the field. Hello fields added after
version 1's release are optional (``Field.optional``): sent only when they have a
value, since an older receiver rejects them as unknown. Bump ``SCHEMA_VERSION`` on any
change a receiver of the old version would misread.

What each field means: docs/plugin.md#what-it-sends; the bounds: docs/reliability.md
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = frozenset({1})

INGEST_PATH = "/v1/ingest"
CONTENT_TYPE = "application/json"
CONTENT_ENCODING = "gzip"

#: Limits a receiver enforces (and a sender stays inside).
MAX_ROWS_PER_BATCH = 200_000
MAX_ID_CHARS = 200
MAX_LABEL_CHARS = 200
MAX_TEXT_CHARS = 1_000

#: Physical bounds: what an engine can produce, far above any real engine, low enough
#: that a batch's sums fit a 64-bit integer many thousand times over (200,000 rows x
#: 2^32 < 2^50), so no sum the receiver forms can overflow. See docs/reliability.md.
MAX_TOKENS = 2**32
"""Tokens in one step, or of one request (a step holds at most ``max_num_batched_tokens``
tokens, a request at most ``max_model_len``)."""
MAX_SEQS = 2**24
"""Requests running in one step, preempted in one step or times one request was preempted."""
MAX_QUEUE = 2**32
"""Requests waiting, or KV-cache blocks."""
MAX_COUNTER = 2**53
"""A cumulative count (exact in a double), or a step counter."""
MAX_UNIX_S = 2**33
"""Latest wall-clock time accepted by the schema (year 2242); the collector also bounds
times against its own clock (``max_clock_skew_s``, ``max_backfill_s``)."""
MAX_DURATION_S = 30 * 86_400.0
"""Longest latency or step time accepted (30 days)."""
MAX_SMALL = 2**16
"""Block size, engine index, parallel sizes."""

INT = "int"
FLOAT = "float"
STR = "str"
BOOL = "bool"


@dataclass(frozen=True)
class Field:
    """One field of the wire schema."""

    name: str
    kind: str
    """``int``, ``float``, ``str`` or ``bool``."""
    doc: str
    nullable: bool = False
    minimum: float | None = 0.0
    maximum: float | None = None
    max_chars: int = MAX_LABEL_CHARS
    optional: bool = False
    """May be absent from a record (it then reads as null). Fields added to schema
    version 1 after its release are optional, so batches of older plugins (and the
    bundled recordings) stay valid; an optional field is always nullable."""

    def __post_init__(self) -> None:
        if self.optional and not self.nullable:
            raise ValueError(f"field {self.name}: an optional field must be nullable")


# Per engine step: one row per record() call that carried scheduler stats.
STEP_FIELDS: tuple[Field, ...] = (
    Field(
        "ts_unix_s",
        FLOAT,
        "wall-clock time the step's stats reached the logger",
        maximum=MAX_UNIX_S,
    ),
    Field(
        "step",
        INT,
        "vLLM's scheduler step counter (or the logger's own count)",
        maximum=MAX_COUNTER,
    ),
    Field("batch_size", INT, "running requests in the step (num_running_reqs)", maximum=MAX_SEQS),
    Field("waiting", INT, "waiting requests, not deferred (num_waiting_reqs)", maximum=MAX_QUEUE),
    Field(
        "deferred",
        INT,
        "waiting requests deferred by transient constraints",
        maximum=MAX_QUEUE,
    ),
    Field("kv_usage_ratio", FLOAT, "fraction of KV-cache blocks in use", maximum=1.0 + 1e-6),
    Field(
        "kv_blocks_used",
        INT,
        "KV-cache blocks in use (ratio x num_gpu_blocks, rounded)",
        maximum=MAX_QUEUE,
    ),
    Field("prefix_queries", INT, "prefix-cache lookups in the step, in tokens", maximum=MAX_TOKENS),
    Field("prefix_hits", INT, "prefix-cache hits in the step, in tokens", maximum=MAX_TOKENS),
    Field("preemptions", INT, "requests preempted in the step", maximum=MAX_SEQS),
    Field("prompt_tokens", INT, "prompt tokens processed in the step", maximum=MAX_TOKENS),
    Field("generation_tokens", INT, "tokens generated in the step", maximum=MAX_TOKENS),
    Field(
        "iteration_s",
        FLOAT,
        "engine iteration time, where vLLM reports it",
        nullable=True,
        maximum=MAX_DURATION_S,
    ),
)

# Per finished request.
REQUEST_FIELDS: tuple[Field, ...] = (
    Field(
        "finished_unix_s",
        FLOAT,
        "wall-clock time the request's stats reached the logger",
        maximum=MAX_UNIX_S,
    ),
    Field("e2e_s", FLOAT, "end-to-end latency, arrival to last token", maximum=MAX_DURATION_S),
    Field("queue_s", FLOAT, "time in the waiting queue", maximum=MAX_DURATION_S),
    Field("prefill_s", FLOAT, "time from first scheduling to first token", maximum=MAX_DURATION_S),
    Field("decode_s", FLOAT, "time from first token to last token", maximum=MAX_DURATION_S),
    Field(
        "ttft_s",
        FLOAT,
        "time to first token, where available",
        nullable=True,
        maximum=MAX_DURATION_S,
    ),
    Field("prompt_tokens", INT, "prompt length in tokens", maximum=MAX_TOKENS),
    Field("generation_tokens", INT, "generated tokens", maximum=MAX_TOKENS),
    Field("cached_tokens", INT, "prompt tokens served from the prefix cache", maximum=MAX_TOKENS),
    Field("preemptions", INT, "times the request was preempted", maximum=MAX_SEQS),
    Field("finish_reason", STR, "stop, length, abort, error, ...", max_chars=32),
)

# Engine identity and configuration, sent once per start and after each reconnect.
HELLO_FIELDS: tuple[Field, ...] = (
    Field("engine_id", STR, "stable id: host:port:engine_index", max_chars=MAX_ID_CHARS),
    Field("boot_id", STR, "random id of this process start", max_chars=MAX_ID_CHARS),
    Field("host", STR, "host or pod name"),
    Field("port", INT, "API server port (0 when unknown)", maximum=65535),
    Field("pid", INT, "API server process id", maximum=MAX_QUEUE),
    Field("engine_index", INT, "data-parallel engine index", maximum=MAX_SMALL),
    Field("pool", STR, "deployment / pool label (KVSCOPE_POOL)"),
    Field("model", STR, "served model name"),
    Field("started_unix_s", FLOAT, "when the logger was created", maximum=MAX_UNIX_S),
    Field("vllm_version", STR, "vLLM version", max_chars=64),
    Field("kvscope_version", STR, "kvscope plugin version", max_chars=64),
    Field("num_gpu_blocks", INT, "KV-cache blocks in total", nullable=True, maximum=MAX_QUEUE),
    Field("block_size", INT, "tokens per KV-cache block", nullable=True, maximum=MAX_SMALL),
    Field(
        "max_num_seqs", INT, "scheduler cap on running requests", nullable=True, maximum=MAX_SEQS
    ),
    Field(
        "max_num_batched_tokens",
        INT,
        "scheduler token budget per step",
        nullable=True,
        maximum=MAX_TOKENS,
    ),
    Field("max_model_len", INT, "maximum context length", nullable=True, maximum=MAX_TOKENS),
    Field("enable_prefix_caching", BOOL, "prefix caching on", nullable=True),
    Field("kv_cache_dtype", STR, "KV-cache dtype (auto, fp8, ...)", nullable=True, max_chars=64),
    Field(
        "gpu_memory_utilization",
        FLOAT,
        "fraction of device memory vLLM may use",
        nullable=True,
        maximum=1.0,
    ),
    Field("tensor_parallel_size", INT, "tensor-parallel size", nullable=True, maximum=MAX_SMALL),
    Field(
        "pipeline_parallel_size", INT, "pipeline-parallel size", nullable=True, maximum=MAX_SMALL
    ),
    Field("data_parallel_size", INT, "data-parallel size", nullable=True, maximum=MAX_SMALL),
    Field(
        "kv_events_endpoint",
        STR,
        "ZMQ endpoint of vLLM's KV-cache event publisher for this engine (with the "
        "data-parallel port offset), when it publishes over ZMQ",
        nullable=True,
        optional=True,
        max_chars=MAX_TEXT_CHARS,
    ),
    Field(
        "simulated",
        BOOL,
        "true for an engine twin (vLLM's scheduler replaying traffic with a step-time model "
        "in place of the forward pass), absent for a real server",
        nullable=True,
        optional=True,
    ),
)

# Exporter counters, cumulative since the process started.
EXPORTER_FIELDS: tuple[Field, ...] = (
    Field("dropped_steps", INT, "step rows dropped (buffer full or batch undeliverable)"),
    Field("dropped_requests", INT, "request rows dropped"),
    Field("dropped_batches", INT, "batches given up on"),
    Field("send_failures", INT, "failed delivery attempts (retried or not)"),
    Field("record_errors", INT, "exceptions caught inside record()"),
    # Added after release (optional): dropped batches by reason, and the on-disk spool.
    Field(
        "dropped_batches_full",
        INT,
        "batches dropped because the pending queue (memory, or the spool's size cap) was full",
        nullable=True,
        optional=True,
    ),
    Field(
        "dropped_batches_rejected",
        INT,
        "batches the collector refused with a status that is not retried",
        nullable=True,
        optional=True,
    ),
    Field(
        "spooled_batches", INT, "batches written to the on-disk spool", nullable=True, optional=True
    ),
    Field(
        "spool_corrupt_records",
        INT,
        "torn or corrupt spool records skipped (e.g. after a kill mid-write)",
        nullable=True,
        optional=True,
    ),
)

# Every exporter counter is cumulative: at most MAX_COUNTER.
EXPORTER_FIELDS = tuple(dataclasses.replace(f, maximum=MAX_COUNTER) for f in EXPORTER_FIELDS)

ENVELOPE_KEYS = frozenset(
    {
        "schema_version",
        "engine_id",
        "boot_id",
        "seq",
        "sent_unix_s",
        "hello",
        "steps",
        "requests",
        "exporter",
    }
)

STEP_COLUMNS: tuple[str, ...] = tuple(f.name for f in STEP_FIELDS)
REQUEST_COLUMNS: tuple[str, ...] = tuple(f.name for f in REQUEST_FIELDS)
HELLO_KEYS: tuple[str, ...] = tuple(f.name for f in HELLO_FIELDS)
EXPORTER_KEYS: tuple[str, ...] = tuple(f.name for f in EXPORTER_FIELDS)


class SchemaError(ValueError):
    """A batch does not follow the wire schema; the message names the field."""


def _check_value(where: str, f: Field, v: Any) -> None:
    if v is None:
        if f.nullable:
            return
        raise SchemaError(f"{where}: must not be null")
    if f.kind == STR:
        if not isinstance(v, str):
            raise SchemaError(f"{where}: expected a string, got {type(v).__name__}")
        if len(v) > f.max_chars:
            raise SchemaError(f"{where}: longer than {f.max_chars} characters")
        _check_text(where, v)
        return
    if f.kind == BOOL:
        if not isinstance(v, bool):
            raise SchemaError(f"{where}: expected true or false, got {type(v).__name__}")
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SchemaError(f"{where}: expected a number, got {type(v).__name__}")
    if f.kind == INT and not isinstance(v, int) and not (isinstance(v, float) and v.is_integer()):
        raise SchemaError(f"{where}: expected an integer, got {v!r}")
    if isinstance(v, float) and not math.isfinite(v):
        raise SchemaError(f"{where}: must be finite, got {v!r}")
    if f.minimum is not None and v < f.minimum:
        raise SchemaError(f"{where}: must be >= {f.minimum:g}, got {v!r}")
    if f.maximum is not None and v > f.maximum:
        raise SchemaError(f"{where}: must be <= {f.maximum:g}, got {v!r}")


def _check_text(where: str, v: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate from a JSON ``\\ud800``
    escape): no store or exposition can carry it."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise SchemaError(f"{where}: not valid Unicode text (a lone surrogate)") from None


def _check_record(where: str, fields: tuple[Field, ...], obj: Any, *, required: bool) -> None:
    if not isinstance(obj, dict):
        raise SchemaError(f"{where}: expected an object, got {type(obj).__name__}")
    known = {f.name for f in fields}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise SchemaError(f"{where}: unknown field(s) {', '.join(map(repr, unknown[:5]))}")
    for f in fields:
        if f.name not in obj:
            if required and not (f.nullable or f.optional):
                raise SchemaError(f"{where}.{f.name}: missing")
            continue
        _check_value(f"{where}.{f.name}", f, obj[f.name])


def _check_columns(where: str, fields: tuple[Field, ...], cols: Any) -> int:
    if not isinstance(cols, dict):
        raise SchemaError(f"{where}: expected an object of columns, got {type(cols).__name__}")
    if not cols:
        return 0
    names = [f.name for f in fields]
    unknown = sorted(set(cols) - set(names))
    if unknown:
        raise SchemaError(f"{where}: unknown column(s) {', '.join(map(repr, unknown[:5]))}")
    missing = [n for n in names if n not in cols]
    if missing:
        raise SchemaError(f"{where}: missing column(s) {', '.join(map(repr, missing[:5]))}")
    n_rows = -1
    for f in fields:
        col = cols[f.name]
        if not isinstance(col, list):
            raise SchemaError(f"{where}.{f.name}: expected a list, got {type(col).__name__}")
        if n_rows < 0:
            n_rows = len(col)
        elif len(col) != n_rows:
            raise SchemaError(
                f"{where}.{f.name}: {len(col)} values where {fields[0].name} has {n_rows}"
            )
        if n_rows > MAX_ROWS_PER_BATCH:
            raise SchemaError(f"{where}: more than {MAX_ROWS_PER_BATCH} rows")
        if _column_ok(f, col):
            continue
        for i, v in enumerate(col):
            _check_value(f"{where}.{f.name}[{i}]", f, v)
    return max(n_rows, 0)


_NUMBER_TYPES = {INT: frozenset({int}), FLOAT: frozenset({int, float})}
_NONE_TYPE = type(None)


def _column_ok(f: Field, col: list[Any]) -> bool:
    """Whether every value of ``col`` passes :func:`_check_value` (a fast path).

    Looks at the whole column with builtins that run in C (``set(map(type, ...))``,
    ``min``, ``max``, ``sum``). False means "not sure": the caller then checks value by
    value and raises the error naming the first bad one, so the result and every error
    message stay those of :func:`_check_value`.
    """
    if not col:
        return True
    types = set(map(type, col))
    if f.nullable and _NONE_TYPE in types:
        types.discard(_NONE_TYPE)
        col = [v for v in col if v is not None]
        if not col:
            return True
    if f.kind == STR:
        if types != {str} or max(map(len, col)) > f.max_chars:
            return False
        try:
            "".join(col).encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if f.kind == BOOL:
        return types == {bool}
    if not types <= _NUMBER_TYPES[f.kind]:
        return False  # floats in an int column, bools, strings...: value by value
    if float in types:
        try:
            if not math.isfinite(sum(col)):
                return False  # an inf or nan (or an overflowing sum): value by value
        except OverflowError:
            return False
    if f.minimum is not None and min(col) < f.minimum:
        return False
    return f.maximum is None or max(col) <= f.maximum


def validate_batch(obj: Any) -> dict[str, Any]:
    """Check a decoded batch against the schema; return it unchanged or raise SchemaError."""
    if not isinstance(obj, dict):
        raise SchemaError(f"batch: expected a JSON object, got {type(obj).__name__}")
    version = obj.get("schema_version")
    if (
        isinstance(version, bool)
        or not isinstance(version, int)
        or (version not in SUPPORTED_SCHEMA_VERSIONS)
    ):
        raise SchemaError(
            f"schema_version: {version!r} is not supported (this receiver accepts "
            f"{sorted(SUPPORTED_SCHEMA_VERSIONS)}); upgrade the collector or the plugin"
        )
    unknown = sorted(set(obj) - ENVELOPE_KEYS)
    if unknown:
        raise SchemaError(f"batch: unknown field(s) {', '.join(map(repr, unknown[:5]))}")
    for key in ("engine_id", "boot_id"):
        v = obj.get(key)
        if not isinstance(v, str) or not v:
            raise SchemaError(f"{key}: expected a non-empty string")
        if len(v) > MAX_ID_CHARS:
            raise SchemaError(f"{key}: longer than {MAX_ID_CHARS} characters")
        _check_text(key, v)
    seq = obj.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_COUNTER:
        raise SchemaError(f"seq: expected an integer in 0..{MAX_COUNTER}, got {seq!r}")
    sent = obj.get("sent_unix_s")
    if isinstance(sent, bool) or not isinstance(sent, (int, float)) or not math.isfinite(sent):
        raise SchemaError(f"sent_unix_s: expected a finite number, got {sent!r}")
    if not 0 <= sent <= MAX_UNIX_S:
        raise SchemaError(f"sent_unix_s: must be in 0..{MAX_UNIX_S}, got {sent!r}")
    hello = obj.get("hello")
    if hello is not None:
        _check_record("hello", HELLO_FIELDS, hello, required=True)
        if hello["engine_id"] != obj["engine_id"] or hello["boot_id"] != obj["boot_id"]:
            raise SchemaError("hello: engine_id and boot_id must match the batch's")
    _check_columns("steps", STEP_FIELDS, obj.get("steps", {}))
    _check_columns("requests", REQUEST_FIELDS, obj.get("requests", {}))
    _check_record("exporter", EXPORTER_FIELDS, obj.get("exporter", {}), required=False)
    return obj


def empty_columns(fields: tuple[Field, ...]) -> dict[str, list[Any]]:
    """Return a dict of empty lists, one per field, in schema order."""
    return {f.name: [] for f in fields}

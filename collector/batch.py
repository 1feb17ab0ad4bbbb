"""Decoding an ingest body into a validated, columnar :class:`PreparedBatch`.

The wire schema (:mod:`kvscope.engine_plugins.schema`) checks every value; this module adds
what only the receiver cares about (integers must fit a 64-bit column, floats must
fit a double) and converts the lists into numpy arrays once, so the store and the
metrics state work on arrays.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
    SchemaError,
    validate_batch,
)

INT64_MAX = 2**63 - 1

BatchKey = tuple[str, str, int]
"""``(engine_id, boot_id, seq)``: the idempotency key."""


@dataclass
class PreparedBatch:
    """One validated batch, columns as numpy arrays (in schema order)."""

    engine_id: str
    boot_id: str
    seq: int
    sent_unix_s: float
    received_unix_s: float
    hello: dict[str, Any] | None
    exporter: dict[str, int]
    steps: dict[str, np.ndarray] = field(repr=False)
    requests: dict[str, np.ndarray] = field(repr=False)
    n_steps: int = 0
    n_requests: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the column arrays (what the batch holds while it waits for the writer)."""
        return sum(a.nbytes for cols in (self.steps, self.requests) for a in cols.values())

    @property
    def key(self) -> BatchKey:
        """The idempotency key."""
        return (self.engine_id, self.boot_id, self.seq)


def decode_json(body: bytes) -> Any:
    """Parse a (decompressed) body; raise SchemaError with a readable message."""
    try:
        return json.loads(body)
    except RecursionError:
        raise SchemaError("body: JSON nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise SchemaError(f"body: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:  # JSONDecodeError, and int-digit limits
        raise SchemaError(f"body: invalid JSON: {exc}") from None


def _check_int_range(where: str, values: list[Any]) -> None:
    if values and (max(values) > INT64_MAX or min(values) < -INT64_MAX):
        raise SchemaError(f"{where}: integer out of range (limit {INT64_MAX})")


def _to_array(where: str, f: Field, col: list[Any]) -> np.ndarray:
    try:
        if f.kind == INT:
            if f.nullable and None in col:
                # Nullable integers travel as float64 with NaN (stored as NULL).
                return np.array(col, dtype=np.float64)
            _check_int_range(where, col)
            return np.array(col, dtype=np.int64)
        if f.kind == FLOAT:
            return np.array(col, dtype=np.float64)
        if f.kind == BOOL:
            return np.array(col, dtype=object if f.nullable else np.bool_)
        if f.kind == STR:
            arr = np.empty(len(col), dtype=object)
            arr[:] = col
            return arr
    except (OverflowError, ValueError, TypeError) as exc:
        raise SchemaError(f"{where}: value out of range ({exc})") from None
    raise AssertionError(f"unknown field kind {f.kind!r}")  # pragma: no cover


def _columns(
    where: str, fields: tuple[Field, ...], cols: dict[str, list[Any]]
) -> dict[str, np.ndarray]:
    if not cols:
        return {f.name: _to_array(f"{where}.{f.name}", f, []) for f in fields}
    return {f.name: _to_array(f"{where}.{f.name}", f, cols[f.name]) for f in fields}


def _record(where: str, fields: tuple[Field, ...], obj: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields:
        v = obj.get(f.name)
        if v is not None and f.kind == INT:
            _check_int_range(f"{where}.{f.name}", [v])
            v = int(v)
        elif v is not None and f.kind == FLOAT:
            try:
                v = float(v)
            except OverflowError:
                raise SchemaError(f"{where}.{f.name}: value out of range") from None
        out[f.name] = v
    return out


def prepare_batch(obj: Any, received_unix_s: float) -> PreparedBatch:
    """Validate a decoded batch and convert it; raise SchemaError naming the field."""
    validate_batch(obj)
    _check_int_range("seq", [obj["seq"]])
    try:
        sent = float(obj["sent_unix_s"])
    except OverflowError:
        raise SchemaError("sent_unix_s: value out of range") from None
    steps = _columns("steps", STEP_FIELDS, obj.get("steps") or {})
    requests = _columns("requests", REQUEST_FIELDS, obj.get("requests") or {})
    hello_obj = obj.get("hello")
    hello = _record("hello", HELLO_FIELDS, hello_obj) if hello_obj is not None else None
    exporter_obj = obj.get("exporter") or {}
    exporter = {
        k: v for k, v in _record("exporter", EXPORTER_FIELDS, exporter_obj).items() if v is not None
    }
    return PreparedBatch(
        engine_id=obj["engine_id"],
        boot_id=obj["boot_id"],
        seq=int(obj["seq"]),
        sent_unix_s=sent,
        received_unix_s=received_unix_s,
        hello=hello,
        exporter=exporter,
        steps=steps,
        requests=requests,
        n_steps=len(steps[STEP_FIELDS[0].name]),
        n_requests=len(requests[REQUEST_FIELDS[0].name]),
    )


def check_times(batch: PreparedBatch, max_ahead_s: float, max_behind_s: float) -> None:
    """Refuse a batch whose times lie more than ``max_ahead_s`` after the collector's clock
    (its receive time) or, for step and request times, more than ``max_behind_s`` before it
    (0: no lower bound). A hello's ``started_unix_s`` is bounded ahead only: a server up
    for months says so on every reconnect. Raises SchemaError naming the field and bound."""
    now = batch.received_unix_s
    latest = now + max_ahead_s
    earliest = now - max_behind_s if max_behind_s > 0 else -math.inf

    def check(where: str, lo: float, hi: float, bounded_below: bool = True) -> None:
        if hi > latest:
            raise SchemaError(
                f"{where}: {hi:.3f} is {hi - now:,.0f} s ahead of the collector's clock "
                f"(at most {max_ahead_s:g} s allowed: synchronise the engine's clock)"
            )
        if bounded_below and lo < earliest:
            raise SchemaError(
                f"{where}: {lo:.3f} is {now - lo:,.0f} s behind the collector's clock (at "
                f"most {max_behind_s:g} s of backfill allowed; raise the collector's "
                "--max-backfill to import older data)"
            )

    check("sent_unix_s", batch.sent_unix_s, batch.sent_unix_s, bounded_below=False)
    if batch.hello is not None:
        t = float(batch.hello["started_unix_s"])
        check("hello.started_unix_s", t, t, bounded_below=False)
    for where, col in (
        ("steps.ts_unix_s", batch.steps["ts_unix_s"] if batch.n_steps else None),
        (
            "requests.finished_unix_s",
            batch.requests["finished_unix_s"] if batch.n_requests else None,
        ),
    ):
        if col is not None:
            check(where, float(col.min()), float(col.max()))


def parse_body(body: bytes, received_unix_s: float) -> PreparedBatch:
    """Decode JSON and prepare the batch (raises SchemaError)."""
    return prepare_batch(decode_json(body), received_unix_s)

"""Writing a group of prepared batches inside one open DuckDB transaction.

:func:`ingest_in_transaction` runs one statement per table for the whole group (columns
concatenated across batches into numpy arrays, read by DuckDB's replacement scan):

1. idempotency: the keys go into ``ingested_batches``; only batches whose key was
   inserted are new (a key repeated in the group counts once);
2. ``steps`` and ``requests`` rows of the new batches;
3. ``windows_1s``, aggregated in numpy (:mod:`kvscope.collector._windows`): a later
   second is inserted, an earlier one (split over groups, late data) merged with ``ON
   CONFLICT DO UPDATE``: counts, sums and extremes exactly, the batch percentiles as the
   step-weighted mean of the parts' (``n_parts`` > 1 marks such a merge);
4. ``engine_configs``, ``engines`` (the hello with the latest ``started_unix_s`` wins)
   and ``exporter_stats`` (cumulative, merged with ``greatest``; written on change).

A :class:`WriteCache` (owned by the store, updated only after COMMIT) remembers what the
store holds, so the common case needs no upsert. The caller owns BEGIN/COMMIT/ROLLBACK.

Details: docs/collector.md#the-store
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvscope.collector import _ingest_sql as sql
from kvscope.collector import _windows
from kvscope.collector._frames import obj_array, typed_column
from kvscope.collector.batch import BatchKey, PreparedBatch
from kvscope.collector.tables import HELLO_DATA_COLUMNS
from kvscope.engine_plugins.schema import (
    EXPORTER_KEYS,
    FLOAT,
    HELLO_FIELDS,
    INT,
    REQUEST_COLUMNS,
    STEP_COLUMNS,
)

HelloKey = tuple[str, str]

STORED = "stored"
DUPLICATE = "duplicate"


@dataclass(frozen=True)
class IngestResult:
    """What became of one batch."""

    status: str
    """``stored`` or ``duplicate``."""
    need_hello: bool
    """True when the store holds no hello for the batch's (engine_id, boot_id)."""


@dataclass
class WriteCache:
    """What the store holds, as far as the writer needs to know it."""

    hello_keys: set[HelloKey] = field(default_factory=set)
    max_seq: dict[HelloKey, int] = field(default_factory=dict)
    """Highest seq stored per (engine_id, boot_id), for boots active recently."""
    engines: set[str] = field(default_factory=set)
    window_max_s: dict[str, int] = field(default_factory=dict)
    request_max_s: float | None = None
    """The latest ``finished_unix_s`` stored (what the retentions count back from, with
    the latest window)."""
    window_minutes: set[int] = field(default_factory=set)
    """Start of each minute windows were written in since the last rollup (see
    :mod:`kvscope.collector._rollup`)."""
    request_minutes: set[int] = field(default_factory=set)
    """Start of each minute requests finished in that were written since the last rollup
    (see :mod:`kvscope.collector._request_rollup`)."""
    exporter: dict[HelloKey, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def load(cls, con: Any, recent_since_unix_s: float) -> WriteCache:
        """Read the cache from the store (at open); ``max_seq`` only for boots with a
        batch received since ``recent_since_unix_s`` (older boots take the slow path)."""
        c = cls()
        c.hello_keys = {
            (r[0], r[1])
            for r in con.execute("SELECT engine_id, boot_id FROM engine_configs").fetchall()
        }
        c.max_seq = {
            (r[0], r[1]): int(r[2])
            for r in con.execute(
                "SELECT engine_id, boot_id, max(seq) FROM ingested_batches "
                "WHERE received_unix_s >= ? GROUP BY engine_id, boot_id",
                [recent_since_unix_s],
            ).fetchall()
        }
        c.engines = {r[0] for r in con.execute("SELECT engine_id FROM engines").fetchall()}
        c.window_max_s = dict(
            con.execute("SELECT engine_id, max(ts_s) FROM windows_1s GROUP BY engine_id").fetchall()
        )
        row = con.execute("SELECT max(finished_unix_s) FROM requests").fetchone()
        c.request_max_s = float(row[0]) if row and row[0] is not None else None
        cols = ", ".join(EXPORTER_KEYS)
        for r in con.execute(f"SELECT engine_id, boot_id, {cols} FROM exporter_stats").fetchall():
            c.exporter[(r[0], r[1])] = {
                k: v for k, v in zip(EXPORTER_KEYS, r[2:], strict=True) if v is not None
            }
        return c

    def update(self, other: WriteCache) -> None:
        """Merge what a committed transaction added."""
        self.hello_keys |= other.hello_keys
        for k, q in other.max_seq.items():
            if q > self.max_seq.get(k, -1):
                self.max_seq[k] = q
        self.engines |= other.engines
        for e, s in other.window_max_s.items():
            if s > self.window_max_s.get(e, s - 1):
                self.window_max_s[e] = s
        self.window_minutes |= other.window_minutes
        self.request_minutes |= other.request_minutes
        if other.request_max_s is not None:
            mine = self.request_max_s
            self.request_max_s = (
                other.request_max_s if mine is None else max(mine, other.request_max_s)
            )
        self.exporter.update(other.exporter)


_KIND_OF = {f.name: f.kind for f in HELLO_FIELDS}

# DuckDB reads a DataFrame, or a dict of numpy arrays (cheaper to scan), named in SQL
# from a local variable of the calling function (a replacement scan); each helper
# below binds such a ``_kv_*`` local. NaN in a float column reads as NULL.


def _ledger_rows(candidates: list[PreparedBatch]) -> dict[str, np.ndarray]:
    return {
        "engine_id": obj_array([b.engine_id for b in candidates]),
        "boot_id": obj_array([b.boot_id for b in candidates]),
        "seq": np.array([b.seq for b in candidates], dtype=np.int64),
        "received_unix_s": np.array([b.received_unix_s for b in candidates], dtype=np.float64),
        "sent_unix_s": np.array([b.sent_unix_s for b in candidates], dtype=np.float64),
        "n_steps": np.array([b.n_steps for b in candidates], dtype=np.int64),
        "n_requests": np.array([b.n_requests for b in candidates], dtype=np.int64),
        "has_hello": np.array([b.hello is not None for b in candidates], dtype=np.bool_),
    }


def _claim_keys(
    con: Any, candidates: list[PreparedBatch], out: WriteCache, known: WriteCache
) -> set[BatchKey]:
    """Insert the ledger rows; return the keys that were not stored before.

    A seq above the highest stored for its (cached) boot cannot be a duplicate: plain
    INSERT. Others (resends, out-of-order retries, new or long-silent boots) go with
    ``ON CONFLICT DO NOTHING RETURNING``, which reports the ones that were new.
    """
    unknown = 2**63  # a boot not in the cache may have any seq stored
    fast = [b for b in candidates if b.seq > known.max_seq.get((b.engine_id, b.boot_id), unknown)]
    slow = [b for b in candidates if b.seq <= known.max_seq.get((b.engine_id, b.boot_id), unknown)]
    claimed = {b.key for b in fast}
    if fast:
        _kv_ledger = _ledger_rows(fast)
        con.execute(sql.LEDGER_INSERT)
    if slow:
        _kv_claim = _ledger_rows(slow)
        claimed.update((r[0], r[1], int(r[2])) for r in con.execute(sql.LEDGER_CLAIM).fetchall())
    for b in candidates:
        if b.key in claimed:
            k = (b.engine_id, b.boot_id)
            out.max_seq[k] = max(b.seq, out.max_seq.get(k, -1))
    return claimed


def _concat(parts: list[dict[str, np.ndarray]], columns: tuple[str, ...]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return {c: parts[0][c] for c in columns}
    return {c: np.concatenate([p[c] for p in parts]) for c in columns}


def _write_steps(con: Any, new: list[PreparedBatch], out: WriteCache, known: WriteCache) -> None:
    rows = [b for b in new if b.n_steps]
    if not rows:
        return
    names = list(dict.fromkeys(b.engine_id for b in rows))
    index = {e: i for i, e in enumerate(names)}
    counts = [b.n_steps for b in rows]
    codes = np.repeat(np.array([index[b.engine_id] for b in rows], dtype=np.int64), counts)
    cols = _concat([b.steps for b in rows], STEP_COLUMNS)
    names_arr = obj_array(names)
    _kv_steps = {
        "engine_id": names_arr[codes],
        "boot_id": np.repeat(obj_array([b.boot_id for b in rows]), counts),
        **cols,
    }
    con.execute(sql.STEPS_INSERT)

    w_codes, w = _windows.aggregate(codes, cols)
    # A window after the engine's latest stored second cannot exist yet: plain insert.
    latest = np.array([known.window_max_s.get(e, -(2**62)) for e in names], dtype=np.int64)
    fresh = w["ts_s"] > latest[w_codes]
    frame = {"engine_id": names_arr[w_codes], **w}
    if fresh.all():
        _kv_windows = frame
        con.execute(sql.WINDOW_INSERT)
    else:
        _kv_windows = {k: v[fresh] for k, v in frame.items()}
        _kv_merge = {k: v[~fresh] for k, v in frame.items()}
        if fresh.any():
            con.execute(sql.WINDOW_INSERT)
        con.execute(sql.WINDOW_MERGE)
    out.window_minutes.update(np.unique(w["ts_s"] // 60 * 60).tolist())
    group_max = np.full(len(names), -(2**62), dtype=np.int64)
    np.maximum.at(group_max, w_codes, w["ts_s"])
    for e, s in zip(names, group_max.tolist(), strict=True):
        out.window_max_s[e] = s


def _write_requests(con: Any, new: list[PreparedBatch], out: WriteCache) -> None:
    rows = [b for b in new if b.n_requests]
    if not rows:
        return
    counts = [b.n_requests for b in rows]
    _kv_requests = {
        "engine_id": np.repeat(obj_array([b.engine_id for b in rows]), counts),
        "boot_id": np.repeat(obj_array([b.boot_id for b in rows]), counts),
        **_concat([b.requests for b in rows], REQUEST_COLUMNS),
    }
    con.execute(sql.REQUESTS_INSERT)
    finished = np.asarray(_kv_requests["finished_unix_s"], dtype=float)
    if len(finished) and np.isfinite(finished).any():
        newest = float(np.nanmax(finished))
        out.request_max_s = max(newest, out.request_max_s or newest)
        ok = finished[np.isfinite(finished)]
        out.request_minutes.update((np.unique(np.floor(ok / 60.0)) * 60).astype(int).tolist())


def _write_engines(con: Any, new: list[PreparedBatch], out: WriteCache, known: WriteCache) -> None:
    per: dict[str, dict[str, Any]] = {}
    for b in new:
        r = per.get(b.engine_id)
        if r is None:
            r = per[b.engine_id] = {
                "first_seen_unix_s": b.received_unix_s,
                "last_seen_unix_s": b.received_unix_s,
                "last_step_unix_s": None,
                "hello": None,
                "hello_unix_s": None,
            }
        r["first_seen_unix_s"] = min(r["first_seen_unix_s"], b.received_unix_s)
        r["last_seen_unix_s"] = max(r["last_seen_unix_s"], b.received_unix_s)
        r["last_boot_id"] = b.boot_id
        if b.n_steps:
            ts = float(b.steps["ts_unix_s"].max())
            prev = r["last_step_unix_s"]
            r["last_step_unix_s"] = ts if prev is None else max(ts, prev)
        h = b.hello
        if h is not None and (
            r["hello"] is None or h["started_unix_s"] >= r["hello"]["started_unix_s"]
        ):
            r["hello"], r["hello_unix_s"] = h, b.received_unix_s
    full = [e for e, r in per.items() if r["hello"] is not None or e not in known.engines]
    touch = [e for e, r in per.items() if r["hello"] is None and e in known.engines]
    if touch:
        rows = [per[e] for e in touch]
        _kv_touch = {
            "engine_id": obj_array(touch),
            "last_seen_unix_s": typed_column(FLOAT, [r["last_seen_unix_s"] for r in rows]),
            "last_step_unix_s": typed_column(FLOAT, [r["last_step_unix_s"] for r in rows]),
            "last_boot_id": obj_array([r["last_boot_id"] for r in rows]),
        }
        con.execute(sql.ENGINE_TOUCH)
    if full:
        rows = [per[e] for e in full]
        hellos = [r["hello"] for r in rows]
        data: dict[str, Any] = {
            "engine_id": obj_array(full),
            "boot_id": obj_array([h["boot_id"] if h else None for h in hellos]),
        }
        for c in HELLO_DATA_COLUMNS:
            data[c] = typed_column(_KIND_OF[c], [h[c] if h else None for h in hellos])
        data["has_hello"] = np.array([h is not None for h in hellos], dtype=np.bool_)
        for c in ("hello_unix_s", "first_seen_unix_s", "last_seen_unix_s", "last_step_unix_s"):
            data[c] = typed_column(FLOAT, [r[c] for r in rows])
        data["last_boot_id"] = obj_array([r["last_boot_id"] for r in rows])
        _kv_engines = pd.DataFrame(data, copy=False)
        con.execute(sql.ENGINE_UPSERT)
        out.engines.update(full)


def _write_configs(con: Any, new: list[PreparedBatch], out: WriteCache, known: WriteCache) -> None:
    fresh: dict[HelloKey, PreparedBatch] = {}
    for b in new:
        k = (b.engine_id, b.boot_id)
        if b.hello is not None and k not in known.hello_keys and k not in fresh:
            fresh[k] = b
    if not fresh:
        return
    hellos = [b.hello for b in fresh.values() if b.hello is not None]
    data: dict[str, Any] = {
        "engine_id": obj_array([k[0] for k in fresh]),
        "boot_id": obj_array([k[1] for k in fresh]),
        "received_unix_s": typed_column(FLOAT, [b.received_unix_s for b in fresh.values()]),
    }
    for c in HELLO_DATA_COLUMNS:
        data[c] = typed_column(_KIND_OF[c], [h[c] for h in hellos])
    _kv_configs = pd.DataFrame(data, copy=False)
    con.execute(sql.CONFIG_INSERT)
    out.hello_keys.update(fresh)


def _write_exporter(con: Any, new: list[PreparedBatch], out: WriteCache, known: WriteCache) -> None:
    merged: dict[HelloKey, dict[str, Any]] = {}
    for b in new:
        if not b.exporter:
            continue
        k = (b.engine_id, b.boot_id)
        r = merged.get(k)
        if r is None:
            r = merged[k] = dict(known.exporter.get(k, {}))
        for name, v in b.exporter.items():
            r[name] = max(v, r.get(name, v))
        r["_updated"] = max(b.received_unix_s, r.get("_updated", 0.0))
    changed = {
        k: r
        for k, r in merged.items()
        if {n: v for n, v in r.items() if n != "_updated"} != known.exporter.get(k)
    }
    if not changed:
        return
    rows = list(changed.values())
    data: dict[str, Any] = {
        "engine_id": obj_array([k[0] for k in changed]),
        "boot_id": obj_array([k[1] for k in changed]),
    }
    for c in EXPORTER_KEYS:
        data[c] = typed_column(INT, [r.get(c) for r in rows])
    data["updated_unix_s"] = typed_column(FLOAT, [r["_updated"] for r in rows])
    _kv_exporter = pd.DataFrame(data, copy=False)
    con.execute(sql.EXPORTER_UPSERT)
    for k, r in changed.items():
        out.exporter[k] = {n: v for n, v in r.items() if n != "_updated"}


def ingest_in_transaction(
    con: Any, batches: list[PreparedBatch], cache: WriteCache
) -> tuple[list[IngestResult], WriteCache]:
    """Write the group; return per-batch results and what to add to ``cache`` after COMMIT.

    ``cache`` is only read here.
    """
    first: dict[BatchKey, int] = {}
    for i, b in enumerate(batches):
        first.setdefault(b.key, i)
    candidates = [batches[i] for i in first.values()]
    added = WriteCache()
    claimed = _claim_keys(con, candidates, added, cache)
    new = [b for b in candidates if b.key in claimed]
    if new:
        _write_steps(con, new, added, cache)
        _write_requests(con, new, added)
        _write_configs(con, new, added, cache)
        _write_engines(con, new, added, cache)
        _write_exporter(con, new, added, cache)
    results = []
    for i, b in enumerate(batches):
        stored = first[b.key] == i and b.key in claimed
        hk = (b.engine_id, b.boot_id)
        results.append(
            IngestResult(
                STORED if stored else DUPLICATE,
                need_hello=hk not in cache.hello_keys and hk not in added.hello_keys,
            )
        )
    return results, added

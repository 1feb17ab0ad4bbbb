"""The kvscope store: one DuckDB file holding engines, raw steps, 1-second windows,
finished requests and the idempotency ledger.

Writes go through one connection guarded by a lock (in the service, only the writer
thread writes). :meth:`Store.ingest` commits a whole group of batches in one
transaction; if that fails it retries each batch in its own, so one bad batch cannot
fail the others. Reads run on per-thread cursors and see committed data only.

Tables (every column in :mod:`kvscope.collector.tables`): ``engines`` (current identity
per ``engine_id``), ``engine_configs`` (one row per hello), ``steps``, ``windows_1s``,
``windows_1m`` (:mod:`kvscope.collector._rollup`), ``requests``, ``requests_1m``
(:mod:`kvscope.collector._request_rollup`), ``ingested_batches`` (the ledger, key
(engine_id, boot_id, seq)), ``exporter_stats`` (the plugin's counters per boot),
``kv_event_windows`` (:mod:`kvscope.collector.kv_events`), ``meta`` (layout version)
and ``saved_state`` (state kept across restarts). Each raw or per-second table is
deleted after its retention, once rolled up where it has a tier.

Details: docs/collector.md#the-store, retentions:
docs/collector.md#retention-and-the-1-minute-tier
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import duckdb
import pandas as pd

from kvscope.collector import _quarantine, _reads, _request_rollup, _rollup
from kvscope.collector._ingest import (
    DUPLICATE,
    STORED,
    IngestResult,
    WriteCache,
    ingest_in_transaction,
)
from kvscope.collector.batch import PreparedBatch
from kvscope.collector.tables import (
    KV_EVENT_COLUMNS,
    KV_EVENT_FIELDS,
    KV_EVENT_LAST,
    TABLES,
    StoreVersionError,
    ensure_schema,
)

__all__ = ["DUPLICATE", "STORED", "IngestResult", "Store", "StoreVersionError"]

log = logging.getLogger(__name__)

_KV_COLS = ", ".join(KV_EVENT_COLUMNS)
KV_EVENT_UPSERT = (
    f"INSERT INTO kv_event_windows ({_KV_COLS}) SELECT {_KV_COLS} FROM _kv_rows "
    "ON CONFLICT (engine_id, ts_s) DO UPDATE SET "
    + ", ".join(
        f"{c} = coalesce(excluded.{c}, kv_event_windows.{c})"
        if c in KV_EVENT_LAST
        else f"{c} = kv_event_windows.{c} + excluded.{c}"
        for c, _ in KV_EVENT_FIELDS
    )
)

RECENT_BOOTS_S = 3600.0
"""At open, the writer remembers the highest seq of boots that sent within this long."""


class Store:
    """A DuckDB-backed store; safe to read from many threads while one thread writes."""

    rolled_until_s: float | None = None
    """The end of the minutes rolled up by the last lifecycle pass (None before it)."""
    rollup_pending_minutes: int = 0
    """Minutes written behind the rolled-up end (late or old data, both tiers) that the last
    lifecycle pass left to the next ones when its budget ran out (0: it keeps up)."""

    def __init__(self, path: str, memory_limit_mib: int | None = None) -> None:
        self.path = path
        config: dict[str, str | bool | int | float | list[str]] = (
            {} if memory_limit_mib is None else {"memory_limit": f"{memory_limit_mib}MiB"}
        )
        self._con = duckdb.connect(path, config=config)
        try:
            ensure_schema(self._con)
        except BaseException:
            self._con.close()
            raise
        self._write_lock = threading.Lock()
        self._read_root = self._con.cursor()
        self._cursor_lock = threading.Lock()
        self._cursors: list[Any] = []
        self._local = threading.local()
        self._closed = False
        try:
            _quarantine.quarantine(self._con, time.time())
        except BaseException:
            self._con.close()
            raise
        self._cache = WriteCache.load(self._con, time.time() - RECENT_BOOTS_S)

    # -- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        """Close all connections (idempotent). DuckDB checkpoints the file on close."""
        with self._write_lock, self._cursor_lock:
            if self._closed:
                return
            self._closed = True
            for cur in self._cursors:
                cur.close()
            self._cursors.clear()
            self._read_root.close()
            self._con.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    # -- writes ----------------------------------------------------------------------

    def ingest(self, batches: Sequence[PreparedBatch]) -> list[IngestResult | Exception]:
        """Store a group of batches; return one result (or the exception) per batch.

        Everything of the group is committed in one transaction before this returns.
        If it fails, each batch is retried alone; a batch that fails alone gets its
        exception in the returned list and leaves nothing behind.
        """
        batches = list(batches)
        if not batches:
            return []
        with self._write_lock:
            self._check_open()
            try:
                return list(self._ingest_tx(batches))
            except Exception as exc:
                if len(batches) == 1:
                    return [exc]
                log.warning(
                    "group of %d batches failed (%s); retrying one by one", len(batches), exc
                )
            out: list[IngestResult | Exception] = []
            for b in batches:
                try:
                    out.extend(self._ingest_tx([b]))
                except Exception as exc:
                    out.append(exc)
            return out

    def ingest_one(self, batch: PreparedBatch) -> IngestResult:
        """Store one batch in its own transaction; raise on failure."""
        res = self.ingest([batch])[0]
        if isinstance(res, Exception):
            raise res
        return res

    def _ingest_tx(self, batches: list[PreparedBatch]) -> list[IngestResult]:
        con = self._con
        con.execute("BEGIN TRANSACTION")
        try:
            results, added = ingest_in_transaction(con, batches, self._cache)
            con.execute("COMMIT")
        except BaseException:
            # The failed transaction may already be rolled back.
            with contextlib.suppress(duckdb.Error):
                con.execute("ROLLBACK")
            raise
        self._cache.update(added)
        return results

    def delete_old_steps(self, older_than_unix_s: float) -> int:
        """Delete raw steps with ``ts_unix_s`` < the cutoff; return how many."""
        return self._delete("steps", "ts_unix_s", older_than_unix_s)

    def delete_old_ledger(self, older_than_unix_s: float) -> int:
        """Delete idempotency-ledger rows received before the cutoff; return how many."""
        return self._delete("ingested_batches", "received_unix_s", older_than_unix_s)

    def _delete(self, table: str, col: str, cutoff: float) -> int:
        with self._write_lock:
            self._check_open()
            row = self._con.execute(f"DELETE FROM {table} WHERE {col} < ?", [cutoff]).fetchone()
            return int(row[0]) if row else 0

    def apply_retention(
        self,
        raw_step_retention_s: float,
        ledger_retention_s: float,
        now_unix_s: float | None = None,
    ) -> dict[str, int]:
        """Delete steps and ledger rows past their retention (0 = keep); return counts."""
        now = time.time() if now_unix_s is None else now_unix_s
        out = {"steps": 0, "ingested_batches": 0}
        if raw_step_retention_s > 0:
            out["steps"] = self.delete_old_steps(now - raw_step_retention_s)
        if ledger_retention_s > 0:
            out["ingested_batches"] = self.delete_old_ledger(now - ledger_retention_s)
        return out

    def apply_lifecycle(
        self,
        *,
        window_retention_s: float,
        request_retention_s: float,
        rollup_retention_s: float,
        request_rollup_retention_s: float | None = None,
        rollup_lookback_s: float = 120.0,
        now_unix_s: float | None = None,
        rollup_budget_s: float | None = _rollup.ROLLUP_PASS_BUDGET_S,
    ) -> dict[str, int]:
        """Roll up the complete minutes into ``windows_1m`` and ``requests_1m`` (see
        :mod:`kvscope.collector._rollup` and :mod:`kvscope.collector._request_rollup`),
        then delete 1-second windows past ``window_retention_s`` and requests finished
        before ``request_retention_s`` whose minute is rolled up, 1-minute windows past
        ``rollup_retention_s`` and request minutes past ``request_rollup_retention_s``
        (``None``: ``rollup_retention_s``); 0 keeps. A backlog and late minutes are
        rolled up for about ``rollup_budget_s`` a call, both tiers together (at least a
        statement of each kind and tier; ``None``: whole); the rest waits for the next
        call, and only what is rolled up is deleted.

        As in Prometheus, the retentions count back from the newest data (the latest
        1-second window or finished request, or now if that is later than now): a store of
        old data (an import, a test's fixed timestamps) is not emptied by the wall clock.
        Returns the minute rows written (``windows_1m_written``, ``requests_1m_written``)
        and the rows deleted per table."""
        now = time.time() if now_unix_s is None else now_unix_s
        with self._write_lock:
            self._check_open()
            newest = max(
                [float(v) + 1.0 for v in self._cache.window_max_s.values()]
                + ([self._cache.request_max_s] if self._cache.request_max_s is not None else []),
                default=None,
            )
            ref = now if newest is None else min(now, newest)
            t0 = time.monotonic()
            n, rolled, waiting = self._roll_up(
                _rollup.WINDOWS_1M,
                "window_minutes",
                window_retention_s,
                ref,
                now,
                rollup_lookback_s,
                rollup_budget_s,
            )
            left_s = rollup_budget_s
            if left_s is not None:  # one budget for both tiers
                left_s = max(0.0, left_s - (time.monotonic() - t0))
            n_req, req_rolled, waiting_req = self._roll_up(
                _request_rollup.REQUESTS_1M,
                "request_minutes",
                request_retention_s,
                ref,
                now,
                rollup_lookback_s,
                left_s,
            )
            # Minutes waiting for a pass keep their rows: nothing from the first one on is
            # deleted yet.
            hold = min(self._cache.window_minutes, default=math.inf)
            hold_req = min(self._cache.request_minutes, default=math.inf)
        self.rolled_until_s = float(rolled)
        self.rollup_pending_minutes = waiting + waiting_req
        out = {"windows_1m_written": n, "requests_1m_written": n_req}
        if window_retention_s > 0:
            cutoff = min(ref - window_retention_s, float(rolled), hold)
            out["windows_1s"] = self._delete("windows_1s", "ts_s", cutoff)
        if request_retention_s > 0:
            # Whole minutes, so a minute's requests are either all kept or all in the tier.
            kept_from = min(_rollup.minute_floor(ref - request_retention_s), req_rolled, hold_req)
            out["requests"] = self._delete("requests", "finished_unix_s", kept_from)
            with self._write_lock:
                self._check_open()
                if kept_from > (self.requests_kept_from() or -math.inf):
                    _rollup.set_meta(
                        self._con, _request_rollup.REQUESTS_KEPT_FROM_KEY, str(int(kept_from))
                    )
        if rollup_retention_s > 0:
            out["windows_1m"] = self._delete("windows_1m", "ts_s", ref - rollup_retention_s)
        req_keep = (
            rollup_retention_s if request_rollup_retention_s is None else request_rollup_retention_s
        )
        if req_keep > 0:
            out["requests_1m"] = self._delete("requests_1m", "ts_s", ref - req_keep)
        return out

    def _roll_up(
        self,
        tier: _rollup.Tier,
        written_attr: str,
        retention_s: float,
        ref: float,
        now: float,
        lookback_s: float,
        budget_s: float | None,
    ) -> tuple[int, int, int]:
        """One tier's rollup pass (the caller holds the write lock) for about ``budget_s``:
        rows written, the end of the rolled-up minutes and how many minutes written behind
        it wait for the next pass (kept in the write cache with the incomplete ones)."""
        t0 = time.monotonic()
        written: set[int] = getattr(self._cache, written_attr)
        setattr(self._cache, written_attr, set())
        behind: set[int] = set()
        if retention_s > 0:
            # A minute that began before the retention may have lost rows to it: late
            # data there is not rolled up again (its row would lose them); it only fills
            # the tier where it has no row (``tier.fill_sql``), and is deleted with its
            # neighbours.
            kept_from = _rollup.minute_floor(ref - retention_s) + _rollup.MINUTE_S
            behind = {m for m in written if m < kept_from}
            written = written - behind
        try:
            n, rolled, later = _rollup.roll_up(self._con, now, lookback_s, written, tier, budget_s)
            left_s = None if budget_s is None else max(0.0, budget_s - (time.monotonic() - t0))
            # behind minutes from ``rolled`` on are rolled up by the passes to come
            filled, unfilled = _rollup.fill(
                self._con, {m for m in behind if m < rolled}, tier, left_s
            )
        except BaseException:
            getattr(self._cache, written_attr).update(written | behind)
            raise
        getattr(self._cache, written_attr).update(later | unfilled)
        return n + filled, rolled, len(unfilled) + sum(m < rolled for m in later)

    def requests_kept_from(self) -> float | None:
        """Requests finished before this (unix seconds) were deleted by the retention and
        are only in ``requests_1m`` (None: none deleted yet)."""
        rows = (
            self._cursor()
            .execute(
                "SELECT value FROM meta WHERE key = ?", [_request_rollup.REQUESTS_KEPT_FROM_KEY]
            )
            .fetchall()  # the whole result: the cursor is free for the next statement
        )
        return float(rows[0][0]) if rows else None

    def write_kv_event_windows(self, rows: pd.DataFrame) -> int:
        """Merge per-(engine_id, ts_s) KV-event counters (columns ``KV_EVENT_COLUMNS``,
        one row per key): counts add up, held counts and block size take the new value.
        Returns the rows written."""
        if rows.empty:
            return 0
        with self._write_lock:
            self._check_open()
            _kv_rows = rows[list(KV_EVENT_COLUMNS)]
            self._con.execute(KV_EVENT_UPSERT)
            return len(_kv_rows)

    def apply_kv_event_retention(
        self, retention_s: float, now_unix_s: float | None = None
    ) -> dict[str, int]:
        """Delete KV-event windows older than ``retention_s`` (0 = keep); return the count."""
        if retention_s <= 0:
            return {"kv_event_windows": 0}
        now = time.time() if now_unix_s is None else now_unix_s
        return {"kv_event_windows": self._delete("kv_event_windows", "ts_s", now - retention_s)}

    def save_state(self, key: str, value: str) -> None:
        """Keep a small text value (e.g. metric state) across restarts."""
        with self._write_lock:
            self._check_open()
            self._con.execute(
                "INSERT INTO saved_state VALUES (?, ?, ?) ON CONFLICT (key) DO UPDATE "
                "SET value = excluded.value, saved_unix_s = excluded.saved_unix_s",
                [key, value, time.time()],
            )

    def take_state(self, key: str) -> str | None:
        """Return a value saved by :meth:`save_state` and delete it (None if absent)."""
        with self._write_lock:
            self._check_open()
            row = self._con.execute(
                "DELETE FROM saved_state WHERE key = ? RETURNING value", [key]
            ).fetchone()
            return None if row is None else str(row[0])

    def has_hello(self, engine_id: str, boot_id: str) -> bool:
        """True when a hello of this (engine_id, boot_id) is stored."""
        return (engine_id, boot_id) in self._cache.hello_keys

    # -- reads -----------------------------------------------------------------------

    def _cursor(self) -> Any:
        cur = getattr(self._local, "cursor", None)
        if cur is None:
            with self._cursor_lock:
                self._check_open()
                cur = self._read_root.cursor()
                self._cursors.append(cur)
            self._local.cursor = cur
        self._check_open()
        return cur

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("store is closed")

    def engines(self) -> pd.DataFrame:
        """Columns: engine_id, boot_id, the hello fields, has_hello, hello_unix_s,
        first_seen_unix_s, last_seen_unix_s, last_step_unix_s, last_boot_id."""
        return _reads.engines(self._cursor())

    def engine_configs(self, engine_id: str | None = None) -> pd.DataFrame:
        """Columns: engine_id, boot_id, received_unix_s and the hello fields."""
        return _reads.engine_configs(self._cursor(), engine_id)

    def windows(
        self,
        engine_id: str | None = None,
        pool: str | None = None,
        since_unix_s: float | None = None,
        until_unix_s: float | None = None,
        limit: int | None = None,
    ) -> pd.DataFrame:
        """Columns: engine_id, ts_s and the window aggregates (see :mod:`kvscope.collector.tables`), pool, model."""
        return _reads.windows(self._cursor(), engine_id, pool, since_unix_s, until_unix_s, limit)

    def minute_windows(
        self,
        engine_id: str | None = None,
        pool: str | None = None,
        since_unix_s: float | None = None,
        until_unix_s: float | None = None,
        limit: int | None = None,
    ) -> pd.DataFrame:
        """The downsampled tier: engine_id, ts_s (minute start) and the minute aggregates
        (see :mod:`kvscope.collector._rollup`), pool, model."""
        return _reads.minute_windows(
            self._cursor(), engine_id, pool, since_unix_s, until_unix_s, limit
        )

    def roll_up_now(self, now_unix_s: float | None = None, lookback_s: float = 120.0) -> int:
        """Roll up the complete minutes without deleting anything (what the retention
        task does first); returns the minute rows written."""
        return self.apply_lifecycle(
            window_retention_s=0,
            request_retention_s=0,
            rollup_retention_s=0,
            rollup_lookback_s=lookback_s,
            now_unix_s=now_unix_s,
            rollup_budget_s=None,
        )["windows_1m_written"]

    def steps(
        self,
        engine_id: str | None = None,
        pool: str | None = None,
        since_unix_s: float | None = None,
        until_unix_s: float | None = None,
        limit: int | None = None,
        every: int = 1,
    ) -> pd.DataFrame:
        """Columns: engine_id, boot_id and the wire's STEP_FIELDS; ``every`` > 1: every
        ``every``-th step of the range only."""
        return _reads.steps(
            self._cursor(), engine_id, pool, since_unix_s, until_unix_s, limit, every
        )

    def requests(
        self,
        engine_id: str | None = None,
        pool: str | None = None,
        since_unix_s: float | None = None,
        until_unix_s: float | None = None,
        limit: int | None = None,
    ) -> pd.DataFrame:
        """Columns: engine_id, boot_id and the wire's REQUEST_FIELDS."""
        return _reads.requests(self._cursor(), engine_id, pool, since_unix_s, until_unix_s, limit)

    def request_stats(
        self,
        engine_id: str | None = None,
        pool: str | None = None,
        since_unix_s: float | None = None,
        until_unix_s: float | None = None,
        group_by: str = "engine",
    ) -> pd.DataFrame:
        """Latency percentiles and token sums of finished requests (see ``_reads``)."""
        return _reads.request_stats(
            self._cursor(), engine_id, pool, since_unix_s, until_unix_s, group_by
        )

    def totals(self, source: str = "windows", engine_id: str | None = None) -> pd.DataFrame:
        """Per-engine sums: engine_id, n_steps, preemptions, prompt_tokens,
        generation_tokens, prefix_queries, prefix_hits; ``source`` steps or windows."""
        return _reads.totals(self._cursor(), source, engine_id)

    def kv_event_windows(
        self,
        engine_id: str | None = None,
        pool: str | None = None,
        since_unix_s: float | None = None,
        until_unix_s: float | None = None,
        limit: int | None = None,
    ) -> pd.DataFrame:
        """Columns: engine_id, ts_s, the KV-event counters (see :mod:`kvscope.collector.tables`), pool."""
        return _reads.kv_event_windows(
            self._cursor(), engine_id, pool, since_unix_s, until_unix_s, limit
        )

    def kv_event_totals(self) -> pd.DataFrame:
        """Per-engine sums of the KV-event counters (engine_id and the additive columns)."""
        return _reads.kv_event_totals(self._cursor())

    def finished_request_counts(self) -> pd.DataFrame:
        """Columns: engine_id, n_requests."""
        return _reads.finished_request_counts(self._cursor())

    def request_histograms(self, histograms: Sequence[Any]) -> pd.DataFrame:
        """Columns: engine_id, family, bucket, n, total: per engine, the stored finished
        requests per bucket of each histogram (``name``, ``bounds``, ``sql`` as
        :data:`kvscope.collector.metrics.REQUEST_HISTOGRAMS`)."""
        return _reads.request_histograms(self._cursor(), histograms)

    def finish_reason_counts(self) -> pd.DataFrame:
        """Columns: engine_id, finish_reason, n."""
        return _reads.finish_reason_counts(self._cursor())

    def window_sample(
        self,
        max_windows_per_engine: int,
        pool: str | None = None,
        since_unix_s: float | None = None,
        until_unix_s: float | None = None,
    ) -> dict[str, pd.DataFrame]:
        """Windows, requests and KV-event windows of whole 5-minute blocks, about
        ``max_windows_per_engine`` windows per engine, and the true ``counts`` per engine
        (see ``_reads.sample``): the advisor's input at fleet scale."""
        return _reads.sample(
            self._cursor(), max_windows_per_engine, pool, since_unix_s, until_unix_s
        )

    def usage_days(
        self, knees: pd.DataFrame, since_unix_s: float, until_unix_s: float
    ) -> pd.DataFrame:
        """Per engine (``knees``: engine_id, knee) and UTC day: window sums, seconds past
        the knee and requests finished (``kvscope.advisor.usage.DAY_COLUMNS``), in SQL;
        minutes whose 1-second windows or request rows were deleted are counted from the
        1-minute tiers."""
        tables = getattr(self, "tables", None)  # a read-only store of an older schema
        kept_from = self.requests_kept_from() if tables is None or "requests_1m" in tables else None
        return _reads.usage_days(
            self._cursor(),
            knees,
            since_unix_s,
            until_unix_s,
            minutes=tables is None or "windows_1m" in tables,
            requests_kept_from=kept_from,
        )

    def request_minutes(
        self,
        engine_id: str | None = None,
        pool: str | None = None,
        since_unix_s: float | None = None,
        until_unix_s: float | None = None,
        limit: int | None = None,
        step_s: int = 60,
        deleted_only: bool = False,
    ) -> pd.DataFrame:
        """The request tier (see :mod:`kvscope.collector._request_rollup`) summed per
        engine over ``step_s``; with ``deleted_only`` only the minutes before
        :meth:`requests_kept_from` (none when no request was deleted)."""
        if deleted_only:
            kept_from = self.requests_kept_from()
            if kept_from is None:
                kept_from = -math.inf
            until_unix_s = kept_from if until_unix_s is None else min(until_unix_s, kept_from)
            if since_unix_s is not None and until_unix_s <= since_unix_s:
                # Nothing of the range was deleted: no minute (the read takes the minutes
                # overlapping the range, so an end at a start inside a minute would still
                # return that minute, whose requests are kept as rows).
                since_unix_s = until_unix_s = math.floor(since_unix_s / 60.0) * 60.0
        if until_unix_s is not None and not math.isfinite(until_unix_s):
            until_unix_s = -1.0
        return _reads.request_minutes(
            self._cursor(), engine_id, pool, since_unix_s, until_unix_s, limit, step_s
        )

    def daily_load_peaks(
        self,
        pool: str | None = None,
        since_unix_s: float | None = None,
        until_unix_s: float | None = None,
    ) -> pd.DataFrame:
        """Per engine and UTC day of the 1-minute windows: engine_id, pool,
        day_start_unix_s, load_max, active_s, generation_tokens."""
        return _reads.daily_load_peaks(self._cursor(), pool, since_unix_s, until_unix_s)

    def exporter_stats(self, engine_id: str | None = None) -> pd.DataFrame:
        """Columns: engine_id, boot_id, the EXPORTER_FIELDS, updated_unix_s."""
        return _reads.exporter_stats(self._cursor(), engine_id)

    def memory_bytes(self) -> int:
        """Memory DuckDB's buffer manager holds now (bounded by ``memory_limit_mib``)."""
        row = (
            self._cursor().execute("SELECT sum(memory_usage_bytes) FROM duckdb_memory()").fetchone()
        )
        return int(row[0] or 0) if row else 0

    def quarantined_counts(self) -> dict[str, int]:
        """Rows in ``quarantined_rows`` per source table (see :mod:`kvscope.collector._quarantine`)."""
        return _quarantine.counts(self._cursor())

    def table_counts(self) -> dict[str, int]:
        """Rows per table (for health checks and tests)."""
        return _reads.table_counts(self._cursor(), tuple(TABLES))

"""The background exporter: one per process, shared by all engine loggers in it.

Hot path (``record()`` on vLLM's event loop): append one tuple to a bounded
``deque(maxlen=...)`` of its engine's :class:`EngineBuffer` and bump a counter.
No lock, no I/O. When a deque is full, the append evicts the oldest row; the
exporter counts that drop exactly as ``produced - taken - len(deque)``.

The exporter thread (``kvscope-exporter``, a daemon) wakes on ``Event.wait``
just after each wall-clock boundary of ``flush_interval_s`` and, per engine:

1. drains the deques; token-only rows are folded into step rows
   (:class:`engine_plugins._rows.StepFolder`);
2. holds back step rows of the current, incomplete wall-clock second, so that a
   1-second window normally arrives in one batch (the final flush sends all);
3. builds one columnar batch (schema envelope, ``seq`` 0, 1, 2, ... per
   ``(engine_id, boot_id)``), JSON, gzip, and queues it;
4. sends queued batches in order to ``{KVSCOPE_COLLECTOR_URL}/v1/ingest``.

Delivery: 2xx acknowledges. 408, 425, 429 and 5xx, and connection errors or
timeouts, are retried with exponential backoff and jitter (``Retry-After`` is
honoured); the batch keeps its ``seq``. Any other status drops the batch (counted,
the collector's message logged). At most ``max_pending_batches`` batches (and
``MAX_PENDING_BYTES``) wait; beyond that the oldest is dropped and counted
(``dropped_batches`` plus its rows in ``dropped_steps`` / ``dropped_requests``).

An idle engine still sends an empty batch: for its hello, every ``HEARTBEAT_S``, and
in the cycle after it dropped something, so that the counters of the drops arrive.

Hello (engine identity and configuration): carried by every batch built while
the collector has not acknowledged the current hello. It becomes due again when
the plugin changes it (e.g. ``num_gpu_blocks`` known after start-up), after any
failed delivery (the collector may have restarted), and when a response says
``{"need_hello": true}``. A queued batch sent while the hello is due gets it added.

Spool (``KVSCOPE_SPOOL_DIR``, off by default; :mod:`engine_plugins._spool`): while
deliveries fail, every queued batch is moved, in order, to segment files on disk
(written and fsynced by this thread, once per cycle); batches beyond
``max_pending_batches`` go there instead of being dropped, and so does whatever is
undelivered at exit. The spool is sent first (oldest first) once the collector
answers again, in a process that starts later on the same host and port too, with
each batch's original idempotency key, so the collector stores it once. Beyond
``KVSCOPE_SPOOL_MAX_BYTES`` the oldest segments are deleted and their batches
counted as dropped (``dropped_batches_full``); a torn or corrupt record is skipped
and counted (``spool_corrupt_records``).

Exit: an ``atexit`` hook flushes everything (no hold-back) and returns within
``shutdown_timeout_s`` however the collector behaves. After ``fork`` the child
starts with no exporter; the next logger created there (or an existing one, on its
next ``log()``) gets a fresh one with a new ``boot_id``.

Accounting, per engine and in total (:meth:`Exporter.stats`), exact whenever no
``record()`` runs concurrently::

    steps_produced    == steps_sent + steps_merged + steps_dropped + steps_buffered
    requests_produced == requests_sent + requests_dropped + requests_buffered

where ``buffered`` includes this boot's rows in the spool. ``KVSCOPE_STATS_FILE``
makes the thread write these counters as JSON after every cycle.
"""

from __future__ import annotations

import atexit
import gzip
import json
import math
import os
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

from engine_plugins._buffer import EngineBuffer
from engine_plugins._config import Settings
from engine_plugins._http import OK, RETRY, IngestClient, Response, classify
from engine_plugins._logging import ERRORS, LOGGER
from engine_plugins._rows import ColumnBuilder
from engine_plugins._spool import Spool, SpoolBusy, SpoolEntry
from engine_plugins.schema import SCHEMA_VERSION

#: Most rows of one kind in one batch (the schema allows more; smaller is kinder).
MAX_ROWS_PER_BATCH = 50_000
#: Most bytes of encoded batches kept waiting (besides ``max_pending_batches``).
MAX_PENDING_BYTES = 64 * 1024 * 1024
#: An idle engine still sends an (empty) batch this often, as a sign of life.
HEARTBEAT_S = 15.0
#: First and largest backoff delay after a failed delivery.
INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
#: Longest one cycle spends replaying the spool (as a share of the flush interval).
SPOOL_REPLAY_SHARE = 0.8
#: Share of the exit deadline kept for writing undelivered batches to the spool.
SPOOL_EXIT_RESERVE = 0.25
#: Ticks run this long after a wall-clock boundary.
TICK_OFFSET_S = 0.05
_GZIP_LEVEL = 5
#: Counters whose change makes an idle engine send a batch without waiting a heartbeat.
_LOSS_COUNTERS = ("dropped_steps", "dropped_requests", "dropped_batches",
                  "spool_corrupt_records")  # fmt: skip

__all__ = ["EngineBuffer", "Exporter", "current_exporter", "get_exporter"]


@dataclass
class _Batch:
    eng: EngineBuffer
    seq: int
    body: bytes
    n_steps: int
    n_requests: int
    hello_version: int
    """Version of the hello inside, 0 for none."""


def _encode(payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return gzip.compress(data, compresslevel=_GZIP_LEVEL, mtime=0)


def _is_ready(row: tuple[Any, ...], cutoff_unix_s: float) -> bool:
    """Whether a step row may go now: not of the current second (nor the next one,
    allowing for clock steps); a row stamped further ahead is not held back."""
    ts = row[0]
    return not (isinstance(ts, (int, float)) and cutoff_unix_s <= ts < cutoff_unix_s + 2.0)


class Exporter:
    """Turns the buffers of all engines of this process into delivered batches."""

    def __init__(
        self,
        settings: Settings,
        *,
        boot_id: str | None = None,
        client: IngestClient | None = None,
    ) -> None:
        if client is None:
            if settings.collector_url is None:
                raise ValueError("an Exporter needs settings.collector_url")
            client = IngestClient(settings.collector_url, settings.token, settings.ca_file)
        self.settings = settings
        self.boot_id = boot_id or uuid.uuid4().hex
        self.pid = os.getpid()
        self._client = client
        self._engines: dict[str, EngineBuffer] = {}
        self._pending: deque[_Batch] = deque()
        self._pending_bytes = 0
        self._lock = threading.Lock()  # exporter state; held briefly, never during I/O
        self._tick_lock = threading.Lock()  # one tick at a time; held during I/O
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._final_deadline_mono_s: float | None = None
        self._closed = False
        self._columns = ColumnBuilder()
        self._rng = random.Random()
        self._failures = 0  # consecutive failed delivery attempts
        self._next_attempt_mono_s = 0.0
        self.exporter_errors = 0
        self._spool: Spool | None = None
        self._spool_tried = False
        self.replayed_batches = 0
        """Batches of earlier boots delivered from the spool."""

    # -- engines ---------------------------------------------------------------------

    def register(self, engine_id: str, hello: dict[str, Any]) -> EngineBuffer:
        """Return the buffer of ``engine_id`` (created on first use) with ``hello`` set."""
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is None:
                eng = EngineBuffer(
                    engine_id, self.boot_id, self.settings.buffer_steps,
                    self.settings.buffer_requests,
                )  # fmt: skip
                self._engines[engine_id] = eng
            eng.set_hello(hello)
            return eng

    # -- thread ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the exporter thread (once)."""
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="kvscope-exporter", daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the exporter thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _next_wait_s(self) -> float:
        interval = self.settings.flush_interval_s
        wait = interval - (time.time() % interval) + TICK_OFFSET_S
        return min(max(wait, 0.01), interval + TICK_OFFSET_S)

    def _run(self) -> None:
        while not self._stop.wait(self._next_wait_s()):
            self._safe_tick(final=False, deadline_mono_s=None)
        self._safe_tick(final=True, deadline_mono_s=self._final_deadline_mono_s)

    def _safe_tick(self, *, final: bool, deadline_mono_s: float | None) -> None:
        try:
            with self._tick_lock:
                self._tick_locked(time.time(), final, deadline_mono_s)
        except Exception:  # the exporter thread must survive anything
            self.exporter_errors += 1
            ERRORS.warning("exporter:tick", "kvscope: exporter cycle failed", exc_info=True)

    # -- one cycle -------------------------------------------------------------------

    def tick(self, *, now_unix_s: float | None = None, final: bool = False,
             deadline_mono_s: float | None = None) -> None:  # fmt: skip
        """Run one cycle in the calling thread: build batches, then send what is due.

        ``final`` sends every row (no hold-back), ignores the backoff, and counts
        what still could not be delivered as dropped.
        """
        with self._tick_lock:
            self._tick_locked(time.time() if now_unix_s is None else now_unix_s, final,
                              deadline_mono_s)  # fmt: skip

    def _tick_locked(self, now_unix_s: float, final: bool, deadline_mono_s: float | None) -> None:
        if not self._spool_tried and self.settings.spool_dir:
            self._open_spool()
        with self._lock:
            for eng in list(self._engines.values()):
                self._build(eng, now_unix_s, final)
        spool = self._spool
        try:
            if spool is not None:
                self._spill(everything=self._failures > 0)
                send_deadline = deadline_mono_s
                if final and deadline_mono_s is not None:
                    send_deadline = deadline_mono_s - SPOOL_EXIT_RESERVE * max(
                        deadline_mono_s - time.monotonic(), 0.0)
                if self._send_spooled(final, send_deadline):
                    self._send_pending(final, send_deadline)
            else:
                self._send_pending(final, deadline_mono_s)
            if final:
                if spool is not None:
                    self._spill(everything=True)
                with self._lock:
                    while self._pending:
                        self._drop(self._pending.popleft(), "exit")
        finally:
            if spool is not None:
                self._sync_spool(close=final)
            if self.settings.stats_file:
                self._write_stats()

    def _drain(
        self, eng: EngineBuffer, now_unix_s: float, final: bool
    ) -> tuple[list[Any], list[Any]]:
        steps, n = eng.steps, len(eng.steps)
        eng.steps_taken += n
        folder, held = eng.folder, eng.held_steps
        for _ in range(n):
            row = folder.feed(steps.popleft())
            if row is not None:
                held.append(row)
        carry = folder.take_carry(now_unix_s, final=final)
        if carry is not None:
            held.append(carry)
        requests, n = eng.requests, len(eng.requests)
        eng.requests_taken += n
        req_rows = [requests.popleft() for _ in range(n)]
        if final:
            ready, eng.held_steps = held, []
            return ready, req_rows
        cutoff = math.floor(now_unix_s)
        ready = [r for r in held if _is_ready(r, cutoff)]
        eng.held_steps = (
            [] if len(ready) == len(held) else [r for r in held if not _is_ready(r, cutoff)]
        )
        return ready, req_rows

    def _build(self, eng: EngineBuffer, now_unix_s: float, final: bool) -> None:
        steps, reqs = self._drain(eng, now_unix_s, final)
        now_mono = time.monotonic()
        counters = eng.counters()
        # An idle engine sends an empty batch for its hello, as a heartbeat, and when it
        # dropped something since the last batch was built (e.g. to make room for it).
        last = eng.last_counters
        idle_due = (eng.hello_due or now_mono - eng.last_built_mono_s >= HEARTBEAT_S
                    or any(counters[k] != last.get(k, 0) for k in _LOSS_COUNTERS))  # fmt: skip
        if not (steps or reqs or (idle_due and eng.pending_batches == 0)):
            return
        eng.last_built_mono_s = now_mono
        hello = eng.hello
        blocks = hello.get("num_gpu_blocks") if hello else None
        num_gpu_blocks = blocks if isinstance(blocks, int) else None
        for start in range(0, max(len(steps), len(reqs), 1), MAX_ROWS_PER_BATCH):
            step_chunk = steps[start : start + MAX_ROWS_PER_BATCH]
            req_chunk = reqs[start : start + MAX_ROWS_PER_BATCH]
            hello_version = eng.hello_version if eng.hello_due else 0
            payload = {
                "schema_version": SCHEMA_VERSION,
                "engine_id": eng.engine_id,
                "boot_id": eng.boot_id,
                "seq": eng.next_seq,
                "sent_unix_s": now_unix_s,
                "hello": eng.hello if hello_version else None,
                "steps": self._columns.steps(step_chunk, num_gpu_blocks),
                "requests": self._columns.requests(req_chunk),
                "exporter": counters,
            }
            eng.last_counters = counters
            batch = _Batch(eng, eng.next_seq, _encode(payload), len(step_chunk),
                           len(req_chunk), hello_version)  # fmt: skip
            eng.next_seq += 1
            eng.batches_built += 1
            eng.pending_batches += 1
            eng.pending_steps += batch.n_steps
            eng.pending_requests += batch.n_requests
            self._pending.append(batch)
            self._pending_bytes += len(batch.body)
            while self._spool is None and self._over_cap():
                self._drop(self._pending.popleft(), "full")

    def _over_cap(self) -> bool:
        return len(self._pending) > 1 and (
            len(self._pending) > self.settings.max_pending_batches
            or self._pending_bytes > MAX_PENDING_BYTES
        )

    def _drop(self, batch: _Batch, reason: str) -> None:
        eng = batch.eng
        eng.dropped_batches += 1
        if reason == "full":
            eng.dropped_full += 1
        elif reason == "rejected":
            eng.dropped_rejected += 1
        else:
            eng.dropped_exit += 1
        eng.batch_dropped_steps += batch.n_steps
        eng.batch_dropped_requests += batch.n_requests
        self._unqueue(batch)

    def _unqueue(self, batch: _Batch) -> None:
        self._pending_bytes -= len(batch.body)
        eng = batch.eng
        eng.pending_batches -= 1
        eng.pending_steps -= batch.n_steps
        eng.pending_requests -= batch.n_requests

    # -- delivery --------------------------------------------------------------------

    def _body(self, batch: _Batch) -> bytes:
        """The batch's body, with the current hello added if it is due and missing."""
        eng = batch.eng
        version = eng.hello_version
        if eng.hello_due and batch.hello_version != version:
            payload = json.loads(gzip.decompress(batch.body))
            payload["hello"] = eng.hello
            body = _encode(payload)
            self._pending_bytes += len(body) - len(batch.body)
            batch.body = body
            batch.hello_version = version
        return batch.body

    def _send_pending(self, final: bool, deadline_mono_s: float | None) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                if not final and time.monotonic() < self._next_attempt_mono_s:
                    return
                batch = self._pending[0]
                body = self._body(batch)
            timeout_s = self.settings.timeout_s
            if deadline_mono_s is not None:
                remaining_s = deadline_mono_s - time.monotonic()
                if remaining_s < 0.01:
                    return
                timeout_s = min(timeout_s, remaining_s)
            try:
                resp: Response | None = self._client.post(body, timeout_s)
                error: BaseException | None = None
            except Exception as exc:  # connection refused, timeout, reset, DNS, ...
                resp, error = None, exc
            with self._lock:
                if resp is None:
                    self._failed(batch.eng, None, error)
                    return
                if not self._handle(batch, resp):
                    return

    def _handle(self, batch: _Batch, resp: Response) -> bool:
        """Account for a response to ``batch`` (the queue head); return whether to go on."""
        eng = batch.eng
        verdict = classify(resp.status)
        need_hello = resp.need_hello()
        if verdict == OK:
            self._pending.popleft()
            self._unqueue(batch)
            eng.batches_sent += 1
            eng.steps_sent += batch.n_steps
            eng.requests_sent += batch.n_requests
            if batch.hello_version:
                eng.hellos_sent += 1
                eng.hello_acked_version = batch.hello_version
            if need_hello:
                eng.hello_acked_version = 0
            if self._failures:
                LOGGER.info("kvscope: delivery to the collector resumed after %d failed "
                            "attempt(s)", self._failures)  # fmt: skip
                self._failures = 0
            return True
        if verdict == RETRY:
            self._failed(batch.eng, resp, None)
            return False
        eng.send_failures += 1
        if need_hello and eng.hello is not None and batch.hello_version != eng.hello_version:
            eng.hello_acked_version = 0  # resent at once, now with the hello
            return True
        self._pending.popleft()
        self._drop(batch, "rejected")
        ERRORS.warning(
            f"http:{resp.status}",
            "kvscope: the collector refused batch %d of %s with HTTP %d (%s); dropped it "
            "(%d steps, %d requests)",
            batch.seq, eng.engine_id, resp.status, resp.message(), batch.n_steps,
            batch.n_requests,
        )  # fmt: skip
        return True

    def _failed(self, eng: EngineBuffer | None, resp: Response | None,
                error: BaseException | None) -> None:  # fmt: skip
        if eng is not None:
            eng.send_failures += 1
        self._failures += 1
        for eng in self._engines.values():
            eng.hello_acked_version = 0  # the collector may come back without our hello
        if resp is not None and resp.retry_after_s is not None:
            delay_s = resp.retry_after_s * self._rng.uniform(1.0, 1.1)
        else:
            base_s = min(MAX_BACKOFF_S, INITIAL_BACKOFF_S * 2 ** min(self._failures - 1, 30))
            delay_s = base_s * self._rng.uniform(0.5, 1.0)
        self._next_attempt_mono_s = time.monotonic() + delay_s
        what = f"HTTP {resp.status}" if resp is not None else f"{type(error).__name__}: {error}"
        ERRORS.warning(
            "http:retry",
            "kvscope: cannot deliver to the collector at %s (%s); retrying in %.1f s, "
            "%d batch(es) waiting",
            self.settings.collector_url, what, delay_s,
            len(self._pending) + (len(self._spool) if self._spool is not None else 0),
        )  # fmt: skip

    # -- spool -----------------------------------------------------------------------

    def _open_spool(self) -> None:
        self._spool_tried = True
        assert self.settings.spool_dir is not None
        path = os.path.join(self.settings.spool_dir, self.settings.spool_key)
        try:
            spool = Spool(path, self.settings.spool_max_bytes)
        except SpoolBusy as exc:
            ERRORS.warning("spool:busy", "kvscope: %s; this process keeps undeliverable "
                           "batches in memory only", exc)  # fmt: skip
            return
        except OSError as exc:
            ERRORS.warning("spool:open", "kvscope: cannot open the spool %s (%s); this process "
                           "keeps undeliverable batches in memory only", path, exc)  # fmt: skip
            return
        with self._lock:
            self._spool = spool
        if len(spool) or spool.corrupt_records:
            LOGGER.info("kvscope: spool %s holds %d batch(es) (%d bytes) to replay; %d torn or "
                        "corrupt record(s) skipped", path, len(spool), spool.size_bytes,
                        spool.corrupt_records)  # fmt: skip

    def _engine_for(self, entry: SpoolEntry) -> tuple[EngineBuffer | None, bool]:
        """The engine buffer a spooled batch belongs to (or, for an earlier boot, the
        same engine id's, else the first engine's) and whether it is of this boot."""
        eng = self._engines.get(str(entry.meta.get("engine_id")))
        this_boot = eng is not None and entry.meta.get("boot_id") == self.boot_id
        if eng is None and self._engines:
            eng = next(iter(self._engines.values()))
        return eng, this_boot

    def _spill(self, *, everything: bool) -> None:
        """Move queued batches to the spool: all of them, or those beyond the caps."""
        spool = self._spool
        assert spool is not None
        with self._lock:
            while self._pending and (everything or self._over_cap()):
                batch = self._pending.popleft()
                eng = batch.eng
                body = batch.body
                if batch.hello_version == 0 and eng.hello is not None:
                    payload = json.loads(gzip.decompress(body))
                    payload["hello"] = eng.hello  # a later process cannot add it
                    body = _encode(payload)
                meta = {"engine_id": eng.engine_id, "boot_id": eng.boot_id, "seq": batch.seq,
                        "n_steps": batch.n_steps, "n_requests": batch.n_requests}  # fmt: skip
                try:
                    dropped = spool.append(meta, body)
                except OSError as exc:
                    self._pending.appendleft(batch)
                    ERRORS.warning("spool:write", "kvscope: cannot write to the spool (%s); "
                                   "batches stay in memory", exc)  # fmt: skip
                    while self._over_cap():
                        self._drop(self._pending.popleft(), "full")
                    return
                self._unqueue(batch)
                eng.spooled_batches += 1
                eng.spool_batches += 1
                eng.spool_steps += batch.n_steps
                eng.spool_requests += batch.n_requests
                for entry in dropped:
                    self._spool_dropped(entry)

    def _spool_dropped(self, entry: SpoolEntry) -> None:
        eng, this_boot = self._engine_for(entry)
        if eng is None:
            return
        eng.dropped_full += 1
        if this_boot:
            n_steps, n_requests = int(entry.meta["n_steps"]), int(entry.meta["n_requests"])
            eng.spool_batches -= 1
            eng.spool_steps -= n_steps
            eng.spool_requests -= n_requests
            eng.dropped_batches += 1
            eng.batch_dropped_steps += n_steps
            eng.batch_dropped_requests += n_requests

    def _spool_done(self, entry: SpoolEntry, sent: bool) -> None:
        """Account for a spooled batch delivered (``sent``) or refused by the collector."""
        eng, this_boot = self._engine_for(entry)
        if not this_boot:
            if sent:
                self.replayed_batches += 1
            elif eng is not None:
                eng.dropped_rejected += 1
            return
        assert eng is not None
        n_steps, n_requests = int(entry.meta["n_steps"]), int(entry.meta["n_requests"])
        eng.spool_batches -= 1
        eng.spool_steps -= n_steps
        eng.spool_requests -= n_requests
        if sent:
            eng.batches_sent += 1
            eng.steps_sent += n_steps
            eng.requests_sent += n_requests
        else:
            eng.dropped_batches += 1
            eng.dropped_rejected += 1
            eng.batch_dropped_steps += n_steps
            eng.batch_dropped_requests += n_requests

    def _send_spooled(self, final: bool, deadline_mono_s: float | None) -> bool:
        """Send spooled batches, oldest first; return whether the spool is now empty."""
        spool = self._spool
        assert spool is not None
        budget_end = time.monotonic() + SPOOL_REPLAY_SHARE * self.settings.flush_interval_s
        while True:
            if not final and (time.monotonic() < self._next_attempt_mono_s
                              or time.monotonic() > budget_end):  # fmt: skip
                return not len(spool)
            got = spool.peek()
            if got is None:
                return True
            entry, body = got
            timeout_s = self.settings.timeout_s
            if deadline_mono_s is not None:
                remaining_s = deadline_mono_s - time.monotonic()
                if remaining_s < 0.01:
                    return False
                timeout_s = min(timeout_s, remaining_s)
            try:
                resp: Response | None = self._client.post(body, timeout_s)
                error: BaseException | None = None
            except Exception as exc:
                resp, error = None, exc
            with self._lock:
                eng, _ = self._engine_for(entry)
                if resp is None or classify(resp.status) == RETRY:
                    self._failed(eng, resp, error)
                    return False
                spool.pop()
                if classify(resp.status) == OK:
                    self._spool_done(entry, sent=True)
                    if self._failures:
                        LOGGER.info("kvscope: delivery to the collector resumed after %d "
                                    "failed attempt(s)", self._failures)  # fmt: skip
                        self._failures = 0
                else:
                    self._spool_done(entry, sent=False)
                    if eng is not None:
                        eng.send_failures += 1
                    ERRORS.warning(
                        f"http:{resp.status}",
                        "kvscope: the collector refused spooled batch %s of %s with HTTP %d "
                        "(%s); dropped it", entry.meta.get("seq"), entry.meta.get("engine_id"),
                        resp.status, resp.message(),
                    )  # fmt: skip

    def _sync_spool(self, *, close: bool) -> None:
        spool = self._spool
        assert spool is not None
        try:
            spool.sync()
        except OSError as exc:
            ERRORS.warning("spool:sync", "kvscope: cannot fsync the spool (%s)", exc)
        with self._lock:
            if self._engines:
                next(iter(self._engines.values())).spool_corrupt_records = spool.corrupt_records
            if close:
                spool.close()

    def _write_stats(self) -> None:
        path = self.settings.stats_file
        assert path is not None
        data: dict[str, Any] = {"pid": self.pid, "boot_id": self.boot_id,
                                "written_unix_s": time.time(), "total": self.stats(),
                                "engines": {}}  # fmt: skip
        for engine_id in list(self._engines):
            data["engines"][engine_id] = self.stats(engine_id)
        tmp = f"{path}.{self.pid}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(data, fh)
            os.replace(tmp, path)
        except OSError as exc:
            ERRORS.warning("stats:write", "kvscope: cannot write KVSCOPE_STATS_FILE (%s)", exc)

    # -- shutdown --------------------------------------------------------------------

    def shutdown(self, timeout_s: float | None = None) -> bool:
        """Flush everything and stop, within ``timeout_s`` (default: the setting).

        Returns whether the flush finished in time. Never blocks longer than the
        timeout (plus scheduling noise), whatever the collector does.
        """
        if self._closed:
            return True
        self._closed = True
        timeout_s = self.settings.shutdown_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + max(timeout_s, 0.0)
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._final_deadline_mono_s = deadline
            self._stop.set()
            thread.join(max(deadline - time.monotonic(), 0.0))
            done = not thread.is_alive()
        else:
            done = self._tick_lock.acquire(timeout=max(deadline - time.monotonic(), 0.0))
            if done:
                try:
                    self._tick_locked(time.time(), True, deadline)
                except Exception:
                    self.exporter_errors += 1
                    ERRORS.warning("exporter:final", "kvscope: final flush failed", exc_info=True)
                finally:
                    self._tick_lock.release()
        if done:
            self._client.close()
        return done

    # -- introspection -----------------------------------------------------------------

    def stats(self, engine_id: str | None = None) -> dict[str, int]:
        """A snapshot of the exporter's counters, for one engine or summed over all."""
        keys = (
            "steps_produced", "steps_sent", "steps_merged", "steps_dropped", "steps_buffered",
            "requests_produced", "requests_sent", "requests_dropped", "requests_buffered",
            "batches_built", "batches_sent", "batches_dropped", "batches_pending",
            "send_failures", "hellos_sent", "record_errors",
            "batches_dropped_full", "batches_dropped_rejected", "batches_dropped_exit",
            "batches_spooled", "batches_in_spool",
        )  # fmt: skip
        out = dict.fromkeys(keys, 0)
        with self._lock:
            engines = list(self._engines.values())
            if engine_id is not None:
                engines = [e for e in engines if e.engine_id == engine_id]
            for e in engines:
                steps_produced, requests_produced = e.steps_produced, e.requests_produced
                in_steps = e.refresh_buffer_drops()
                in_requests = len(e.requests)
                values = (
                    steps_produced, e.steps_sent, e.folder.merged_rows,
                    e.buffer_dropped_steps + e.batch_dropped_steps,
                    in_steps + len(e.held_steps) + e.folder.carry_rows + e.pending_steps
                    + e.spool_steps,
                    requests_produced, e.requests_sent,
                    e.buffer_dropped_requests + e.batch_dropped_requests,
                    in_requests + e.pending_requests + e.spool_requests,
                    e.batches_built, e.batches_sent, e.dropped_batches, e.pending_batches,
                    e.send_failures, e.hellos_sent, e.record_errors,
                    e.dropped_full, e.dropped_rejected, e.dropped_exit,
                    e.spooled_batches, e.spool_batches,
                )  # fmt: skip
                for key, value in zip(keys, values, strict=True):
                    out[key] += value
            out["engines"] = len(engines)
            out["invalid_values"] = self._columns.invalid_values
            out["exporter_errors"] = self.exporter_errors
            out["pending_bytes"] = self._pending_bytes
            spool = self._spool
            out["spool_records"] = len(spool) if spool is not None else 0
            out["spool_bytes"] = spool.size_bytes if spool is not None else 0
            out["spool_corrupt_records"] = spool.corrupt_records if spool is not None else 0
            out["replayed_batches"] = self.replayed_batches
        return out


# -- the process-wide exporter ---------------------------------------------------------

_EXPORTER: Exporter | None = None
_SINGLETON_LOCK = threading.Lock()
_ATEXIT_REGISTERED = False


def get_exporter(settings: Settings) -> Exporter:
    """Return this process's exporter, creating and starting it on first use."""
    global _EXPORTER, _ATEXIT_REGISTERED
    with _SINGLETON_LOCK:
        if _EXPORTER is None or _EXPORTER.pid != os.getpid():
            exporter = Exporter(settings)
            exporter.start()
            _EXPORTER = exporter
            if not _ATEXIT_REGISTERED:
                atexit.register(_shutdown_at_exit)
                _ATEXIT_REGISTERED = True
        return _EXPORTER


def current_exporter() -> Exporter | None:
    """Return this process's exporter if one was created, else None."""
    exporter = _EXPORTER
    return exporter if exporter is not None and exporter.pid == os.getpid() else None


def _shutdown_at_exit() -> None:
    exporter = current_exporter()
    if exporter is not None:
        exporter.shutdown()


def _after_fork_in_child() -> None:
    # The parent's thread does not exist here and its locks may be held: forget it.
    global _EXPORTER, _SINGLETON_LOCK
    _SINGLETON_LOCK = threading.Lock()
    _EXPORTER = None


os.register_at_fork(after_in_child=_after_fork_in_child)

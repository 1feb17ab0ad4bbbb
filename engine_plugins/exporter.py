"""The background exporter: one per process, shared by all engine loggers in it.

Hot path (``record()`` on vLLM's event loop): append one tuple to a bounded
``deque(maxlen=...)`` of its engine's :class:`EngineBuffer` and bump a counter.
No lock, no I/O. When a deque is full, the append evicts the oldest row; the
exporter counts that drop exactly as ``produced - taken - len(deque)``.

The exporter thread (``kvscope-exporter``, a daemon) wakes on ``Event.wait``
just after each wall-clock boundary of ``flush_interval_s`` and, per engine:

1. drains the deques; token-only rows are folded into step rows
   (:class:`kvscope.engine_plugins._rows.StepFolder`);
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

Spool (``KVSCOPE_SPOOL_DIR``, off by default; :mod:`kvscope.engine_plugins._spool`): while
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

Layout: :class:`Exporter` (this module: the thread, the cycle, exit and the
process-wide instance) combines one part per concern: batch building
(:mod:`kvscope.engine_plugins._batching`), delivery with retry and backoff
(:mod:`kvscope.engine_plugins._delivery`), the spool's spill and replay
(:mod:`kvscope.engine_plugins._spool_replay`), and the accounting
(:mod:`kvscope.engine_plugins._exp_stats`), over their shared state and pending queue
(:mod:`kvscope.engine_plugins._exp_state`).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Any

from kvscope.engine_plugins._batching import HEARTBEAT_S, MAX_ROWS_PER_BATCH, BatchBuilding
from kvscope.engine_plugins._buffer import EngineBuffer
from kvscope.engine_plugins._config import Settings
from kvscope.engine_plugins._delivery import INITIAL_BACKOFF_S, MAX_BACKOFF_S
from kvscope.engine_plugins._exp_state import MAX_PENDING_BYTES
from kvscope.engine_plugins._exp_stats import Accounting
from kvscope.engine_plugins._http import IngestClient
from kvscope.engine_plugins._logging import ERRORS
from kvscope.engine_plugins._spool_replay import SPOOL_REPLAY_SHARE, SpoolReplay

#: Share of the exit deadline kept for writing undelivered batches to the spool.
SPOOL_EXIT_RESERVE = 0.25
#: Ticks run this long after a wall-clock boundary.
TICK_OFFSET_S = 0.05

# The tunables are re-exported for reading; each is used (and patched) in its own module.
__all__ = [
    "HEARTBEAT_S", "INITIAL_BACKOFF_S", "MAX_BACKOFF_S", "MAX_PENDING_BYTES",
    "MAX_ROWS_PER_BATCH", "SPOOL_EXIT_RESERVE", "SPOOL_REPLAY_SHARE", "TICK_OFFSET_S",
    "EngineBuffer", "Exporter", "current_exporter", "get_exporter",
]  # fmt: skip


class Exporter(BatchBuilding, SpoolReplay, Accounting):
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
        super().__init__(settings, client, boot_id)

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

"""The background exporter: one per process, shared by all engine loggers in it.

Hot path (``record()`` on vLLM's event loop): append one tuple to a bounded
``deque(maxlen=...)`` of its engine's :class:`EngineBuffer` and bump a counter; no lock,
no I/O. A full deque evicts its oldest row, counted as ``produced - taken - len(deque)``.

The thread ``kvscope-exporter`` (a daemon) wakes on ``Event.wait`` just after each
wall-clock boundary of ``flush_interval_s`` for one cycle, :meth:`Exporter._tick`: the
``BatchBuilder`` drains the buffers into encoded batches, queued in a ``BatchQueue``;
the ``Sender`` delivers them oldest first (a spool's first); what stays undelivered
beyond ``max_pending_batches`` or ``MAX_PENDING_BYTES`` is dropped and counted, or, with
``KVSCOPE_SPOOL_DIR``, spooled to disk (``Spooler``). Each reports to ``Accounting``.

Replies: 2xx acknowledges. 408, 425, 429, 5xx, connection errors and timeouts are
retried after a backoff, the batch unchanged (same bytes, same ``seq``). Any other
status drops the batch (counted, the message logged), except ``{"need_hello": true}``
for a batch without the hello: an empty batch carrying it goes first, then the batch.

Hello: a batch carries it while the collector has not acknowledged the current one (a
built batch never changes); it is due again when it changes, after a failed delivery
and when a reply asks. An idle engine sends an empty batch every ``HEARTBEAT_S`` and
after a drop. A spool holds, after any batch lacking the hello, one carrying it.

Exit: an ``atexit`` hook flushes everything within ``shutdown_timeout_s``. After
``fork`` the child's next logger gets a fresh exporter, with a new ``boot_id``.
``_tick_lock`` runs one cycle at a time (held during I/O); ``_lock`` guards the engines
and the accounting, never held during an HTTP request or an ``fsync``.

Guarantees and their measurements: docs/reliability.md#the-engine-plugin
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import uuid
from typing import Any

from kvscope.engine_plugins._accounting import Accounting, write_stats_file
from kvscope.engine_plugins._batch import MAX_PENDING_BYTES, Batch, BatchQueue
from kvscope.engine_plugins._buffer import EngineBuffer
from kvscope.engine_plugins._builder import HEARTBEAT_S, MAX_ROWS_PER_BATCH, BatchBuilder
from kvscope.engine_plugins._config import Settings
from kvscope.engine_plugins._http import OK, RETRY, IngestClient
from kvscope.engine_plugins._logging import ERRORS
from kvscope.engine_plugins._sender import INITIAL_BACKOFF_S, MAX_BACKOFF_S, Reply, Sender
from kvscope.engine_plugins._spool import SpoolEntry
from kvscope.engine_plugins._spooler import Spooler

#: Longest one cycle spends replaying the spool (as a share of the flush interval).
SPOOL_REPLAY_SHARE = 0.8
#: Share of the exit deadline kept for writing undelivered batches to the spool.
SPOOL_EXIT_RESERVE = 0.25
#: Ticks run this long after a wall-clock boundary.
TICK_OFFSET_S = 0.05

# The tunables are re-exported for reading; each is used (and patched) in its own module.
__all__ = [
    "HEARTBEAT_S",
    "INITIAL_BACKOFF_S",
    "MAX_BACKOFF_S",
    "MAX_PENDING_BYTES",
    "MAX_ROWS_PER_BATCH",
    "SPOOL_EXIT_RESERVE",
    "SPOOL_REPLAY_SHARE",
    "TICK_OFFSET_S",
    "EngineBuffer",
    "Exporter",
    "current_exporter",
    "get_exporter",
]


class Exporter:
    """Turns the buffers of all engines of this process into delivered batches.

    Owns the exporter thread, the engines' buffers and the queue of undelivered
    batches; the builder, the sender, the spool and the accounting do the work.
    """

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
        self._engines: dict[str, EngineBuffer] = {}
        self._accounting = Accounting(self.boot_id, self.pid)
        self._builder = BatchBuilder(self._accounting)
        self._queue = BatchQueue(settings.max_pending_batches)
        self._sender = Sender(client, settings)
        self._spool: Spooler | None = None
        """Opened by the first cycle (in the exporter thread) when ``spool_dir`` is set."""
        self._spool_tried = False
        self._lock = threading.Lock()  # what stats() reads; never held during HTTP or fsync
        self._tick_lock = threading.Lock()  # one cycle at a time; held during I/O
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._final_deadline_mono_s: float | None = None
        self._closed = False

    # -- engines ---------------------------------------------------------------------

    def register(self, engine_id: str, hello: dict[str, Any]) -> EngineBuffer:
        """Return the buffer of ``engine_id`` (created on first use) with ``hello`` set."""
        with self._lock:
            eng = self._engines.get(engine_id)
            if eng is None:
                eng = EngineBuffer(
                    engine_id,
                    self.boot_id,
                    self.settings.buffer_steps,
                    self.settings.buffer_requests,
                )
                self._engines[engine_id] = eng
                self._accounting.add_engine(eng)
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
                self._tick(time.time(), final, deadline_mono_s)
        except Exception:  # the exporter thread must survive anything
            self._count_error()
            ERRORS.warning("exporter:tick", "kvscope: exporter cycle failed", exc_info=True)

    def _count_error(self) -> None:
        with self._lock:
            self._accounting.exporter_error()

    # -- one cycle -------------------------------------------------------------------

    def tick(
        self,
        *,
        now_unix_s: float | None = None,
        final: bool = False,
        deadline_mono_s: float | None = None,
    ) -> None:
        """Run one cycle in the calling thread: build batches, then send what is due.

        ``final`` sends every row (no hold-back), ignores the backoff, and counts
        what still could not be delivered (nor spooled) as dropped.
        """
        with self._tick_lock:
            self._tick(time.time() if now_unix_s is None else now_unix_s, final, deadline_mono_s)

    def _tick(self, now_unix_s: float, final: bool, deadline_mono_s: float | None) -> None:
        """One cycle: build every engine's batches, deliver in order, keep what failed."""
        spool = self._open_spool()
        with self._lock:
            for batch in self._builder.build(self._engines.values(), now_unix_s, final):
                self._queue.push(batch)
            if spool is None:
                self._drop_beyond_caps()
        try:
            if spool is None:
                self._send_queue(final, deadline_mono_s)
            else:
                # While deliveries fail every batch goes to disk, else those beyond the
                # caps; the spool is older than the queue, so it is sent first.
                self._spill(spool, everything=self._sender.failing)
                send_deadline = _keep_exit_reserve(final, deadline_mono_s)
                if self._replay_spool(spool, final, send_deadline):
                    self._send_queue(final, send_deadline)
            if final:
                if spool is not None:
                    self._spill(spool, everything=True)
                with self._lock:
                    while self._queue.head() is not None:
                        self._accounting.dropped(self._queue.pop(), "exit")
        finally:
            if spool is not None:
                spool.sync(close=final)
            if self.settings.stats_file:
                with self._lock:
                    document = self._accounting.stats_document()
                write_stats_file(self.settings.stats_file, document, self.pid)

    # -- delivery --------------------------------------------------------------------

    def _send_queue(self, final: bool, deadline_mono_s: float | None) -> None:
        """Send queued batches, oldest first, until none is left, one fails, or the
        deadline is near; outside the final cycle, only when the backoff allows."""
        while (batch := self._queue.head()) is not None:
            if not final and not self._sender.ready():
                return
            reply = self._sender.send(batch.body, deadline_mono_s, waiting=self._waiting())
            if reply is None:
                return
            with self._lock:
                if not self._settle_queued(batch, reply):
                    return

    def _settle_queued(self, batch: Batch, reply: Reply) -> bool:
        """Act on the reply to ``batch`` (the queue's head); return whether to send on."""
        if reply.verdict == OK:
            self._queue.pop()
            self._accounting.sent(batch)
            self._builder.acknowledged(batch, need_hello=reply.need_hello)
            return True
        self._accounting.send_failed(batch.engine_id)
        if reply.verdict == RETRY:
            self._builder.resend_hello()  # the collector may come back without the hellos
            return False
        eng = self._engines[batch.engine_id]
        wants_hello = reply.need_hello and self._builder.lacks_hello(batch, eng)
        if wants_hello and not batch.hello_sent_ahead:
            batch.hello_sent_ahead = True
            self._queue.push_front(self._builder.hello_batch(eng, time.time()))
            return True
        self._queue.pop()
        self._accounting.dropped(batch, "rejected")
        ERRORS.warning(
            f"http:{reply.status}",
            "kvscope: the collector refused batch %d of %s with HTTP %d (%s); dropped it "
            "(%d steps, %d requests)",
            batch.seq,
            batch.engine_id,
            reply.status,
            reply.message,
            batch.n_steps,
            batch.n_requests,
        )
        return True

    def _replay_spool(self, spool: Spooler, final: bool, deadline_mono_s: float | None) -> bool:
        """Send spooled batches, oldest first, for at most ``SPOOL_REPLAY_SHARE`` of the
        flush interval (the final cycle: until the deadline); return whether the spool
        is now empty."""
        budget_end = time.monotonic() + SPOOL_REPLAY_SHARE * self.settings.flush_interval_s
        while True:
            if not final and (not self._sender.ready() or time.monotonic() > budget_end):
                return not len(spool)
            with self._lock:
                oldest = spool.oldest()
            if oldest is None:
                return True
            entry, body = oldest
            reply = self._sender.send(body, deadline_mono_s, waiting=self._waiting())
            if reply is None:
                return False
            with self._lock:
                if not self._settle_spooled(spool, entry, reply):
                    return False

    def _settle_spooled(self, spool: Spooler, entry: SpoolEntry, reply: Reply) -> bool:
        """Act on the reply to ``entry`` (the spool's oldest); return whether to send on."""
        engine_id = str(entry.meta.get("engine_id"))
        if reply.verdict == RETRY:
            self._accounting.send_failed(engine_id)
            self._builder.resend_hello()  # the collector may come back without the hellos
            return False
        spool.remove_oldest(entry, delivered=reply.verdict == OK)
        if reply.verdict == OK:
            if reply.need_hello and entry.meta.get("boot_id") == self.boot_id:
                self._builder.resend_hello(engine_id)
            return True
        self._accounting.send_failed(engine_id)
        ERRORS.warning(
            f"http:{reply.status}",
            "kvscope: the collector refused spooled batch %s of %s with HTTP %d (%s); dropped it",
            entry.meta.get("seq"),
            engine_id,
            reply.status,
            reply.message,
        )
        return True

    def _waiting(self) -> int:
        """Batches waiting for delivery, in memory and on disk."""
        return len(self._queue) + (len(self._spool) if self._spool is not None else 0)

    # -- keeping what was not delivered ----------------------------------------------

    def _drop_beyond_caps(self) -> None:
        """Drop the oldest queued batches while the queue is beyond its caps."""
        while self._queue.over_cap():
            self._accounting.dropped(self._queue.pop(), "full")

    def _open_spool(self) -> Spooler | None:
        """The spool, opened on the first call if ``spool_dir`` is set."""
        if not self._spool_tried and self.settings.spool_dir:
            self._spool_tried = True
            spool = Spooler.open(self.settings, self._accounting)
            if spool is not None:
                with self._lock:
                    self._spool = spool
                    spool.report_size()
        return self._spool

    def _spill(self, spool: Spooler, *, everything: bool) -> None:
        """Move queued batches, oldest first, to the spool: all, or those beyond the caps.

        When an engine's last batch moved lacks the hello, an empty batch carrying it
        follows. If the disk refuses a batch, the rest stays queued, within the caps.
        """
        lacking: set[str] = set()
        with self._lock:
            while (batch := self._queue.head()) is not None:
                if not (everything or self._queue.over_cap()):
                    break
                if not spool.append(batch):
                    self._drop_beyond_caps()
                    return
                self._queue.pop()
                if batch.hello_version:
                    lacking.discard(batch.engine_id)
                else:
                    lacking.add(batch.engine_id)
            for engine_id in lacking:
                eng = self._engines[engine_id]
                if eng.hello is None:
                    continue
                hello = self._builder.hello_batch(eng, time.time())
                if not spool.append(hello):
                    self._queue.push_front(hello)
                    return

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
                    self._tick(time.time(), True, deadline)
                except Exception:
                    self._count_error()
                    ERRORS.warning("exporter:final", "kvscope: final flush failed", exc_info=True)
                finally:
                    self._tick_lock.release()
        if done:
            self._sender.close()
        return done

    # -- introspection -----------------------------------------------------------------

    def stats(self, engine_id: str | None = None) -> dict[str, int]:
        """A snapshot of the exporter's counters, for one engine or summed over all
        (:class:`kvscope.engine_plugins._accounting.Accounting`)."""
        with self._lock:
            return self._accounting.stats(engine_id)

    @property
    def replayed_batches(self) -> int:
        """Batches of earlier boots delivered from the spool."""
        return self._accounting.replayed_batches


def _keep_exit_reserve(final: bool, deadline_mono_s: float | None) -> float | None:
    """The deadline for sending: in the final cycle, ``SPOOL_EXIT_RESERVE`` of the time
    left is kept for writing what is still undelivered to the spool."""
    if not final or deadline_mono_s is None:
        return deadline_mono_s
    return deadline_mono_s - SPOOL_EXIT_RESERVE * max(deadline_mono_s - time.monotonic(), 0.0)


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

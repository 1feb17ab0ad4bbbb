"""The exporter's accounting: what became of every row and batch, per engine and in total.

:class:`Accounting` owns the exporter's counters. The builder, the queue and the spool
report to it as a batch goes through its life::

    built (pending) --+--> sent
                      +--> dropped: full (beyond the caps), rejected (refused), exit
                      +--> spooled --+--> sent
                                     +--> dropped: rejected (refused)
                                     +--> dropped: full (deleted by the size cap)

Rows not yet drained are counted by the engine buffers. Exact whenever no ``record()``
runs concurrently (``buffered`` includes this boot's rows in the spool)::

    steps_produced    == steps_sent + steps_merged + steps_dropped + steps_buffered
    requests_produced == requests_sent + requests_dropped + requests_buffered

A spooled batch of an earlier boot counts under its engine id (else the first engine):
``replayed_batches`` when delivered, ``dropped_batches_*`` otherwise.
:meth:`Accounting.counters` are what each batch carries (the schema's ``exporter``),
:meth:`Accounting.stats` backs ``Exporter.stats()`` and :func:`write_stats_file`.
Not thread-safe: the exporter reports and reads under its lock.

Details: docs/reliability.md#the-engine-plugin
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from kvscope.engine_plugins._batch import Batch
from kvscope.engine_plugins._buffer import EngineBuffer
from kvscope.engine_plugins._logging import ERRORS

#: The keys of :meth:`Accounting.stats` summed over engines, in order.
ENGINE_STATS_KEYS = (
    "steps_produced", "steps_sent", "steps_merged", "steps_dropped", "steps_buffered",
    "requests_produced", "requests_sent", "requests_dropped", "requests_buffered",
    "batches_built", "batches_sent", "batches_dropped", "batches_pending",
    "send_failures", "hellos_sent", "record_errors",
    "batches_dropped_full", "batches_dropped_rejected", "batches_dropped_exit",
    "batches_spooled", "batches_in_spool",
)  # fmt: skip


@dataclass
class EngineCounts:
    """The counters of one engine beyond its buffer's own."""

    buffer: EngineBuffer
    batches_built: int = 0
    batches_sent: int = 0
    steps_sent: int = 0
    requests_sent: int = 0
    hellos_sent: int = 0
    send_failures: int = 0
    # Built and queued, not yet sent, dropped or spooled.
    pending_batches: int = 0
    pending_steps: int = 0
    pending_requests: int = 0
    # Batches dropped (each also counts by reason, except an earlier boot's spooled
    # batch, which counts only by reason) and their rows.
    dropped_batches: int = 0
    dropped_steps: int = 0
    dropped_requests: int = 0
    dropped_full: int = 0
    dropped_rejected: int = 0
    dropped_exit: int = 0
    # This boot's batches in the spool now, and the batches ever spooled.
    spool_batches: int = 0
    spool_steps: int = 0
    spool_requests: int = 0
    spooled_batches: int = 0
    # Reported by the builder: step rows it holds back (incomplete second, carried
    # token-only rows) and raw rows it merged into others (cumulative).
    held_steps: int = 0
    merged_steps: int = 0


class Accounting:
    """The exporter's counters, fed by reports; snapshots for batches, stats and file."""

    def __init__(self, boot_id: str, pid: int) -> None:
        self.boot_id = boot_id
        self.pid = pid
        self._engines: dict[str, EngineCounts] = {}
        self.pending_bytes = 0
        self.exporter_errors = 0
        """Exporter cycles that failed (the thread survives them)."""
        self.replayed_batches = 0
        """Batches of earlier boots delivered from the spool."""
        self.invalid_values = 0
        """Values replaced while building columns (cumulative)."""
        self.spool_records = self.spool_bytes = self.spool_corrupt_records = 0

    def add_engine(self, buffer: EngineBuffer) -> None:
        """Start counting for the engine of ``buffer``."""
        self._engines.setdefault(buffer.engine_id, EngineCounts(buffer))

    def pending_batches(self, engine_id: str) -> int:
        """The engine's batches waiting in memory."""
        return self._engines[engine_id].pending_batches

    # -- reports: a batch's life ---------------------------------------------------------

    def built(self, batch: Batch) -> None:
        """``batch`` was built and queued."""
        c = self._engines[batch.engine_id]
        c.batches_built += 1
        c.pending_batches += 1
        c.pending_steps += batch.n_steps
        c.pending_requests += batch.n_requests
        self.pending_bytes += len(batch.body)

    def sent(self, batch: Batch) -> None:
        """The collector acknowledged queued ``batch``."""
        c = self._unqueue(batch)
        c.batches_sent += 1
        c.steps_sent += batch.n_steps
        c.requests_sent += batch.n_requests
        if batch.hello_version:
            c.hellos_sent += 1

    def dropped(self, batch: Batch, reason: str) -> None:
        """Queued ``batch`` was given up: ``full``, ``rejected`` or ``exit``."""
        c = self._unqueue(batch)
        if reason == "full":
            c.dropped_full += 1
        elif reason == "rejected":
            c.dropped_rejected += 1
        else:
            c.dropped_exit += 1
        self._count_drop(c, batch.n_steps, batch.n_requests)

    def spooled(self, batch: Batch) -> None:
        """Queued ``batch`` was written to the spool."""
        c = self._unqueue(batch)
        c.spooled_batches += 1
        c.spool_batches += 1
        c.spool_steps += batch.n_steps
        c.spool_requests += batch.n_requests

    def spool_delivered(self, meta: dict[str, Any]) -> None:
        """The collector acknowledged the spooled batch described by ``meta``."""
        c, this_boot = self._spool_owner(meta)
        if not this_boot:
            self.replayed_batches += 1
            return
        assert c is not None
        n_steps, n_requests = self._leave_spool(c, meta)
        c.batches_sent += 1
        c.steps_sent += n_steps
        c.requests_sent += n_requests

    def spool_refused(self, meta: dict[str, Any]) -> None:
        """The collector refused the spooled batch described by ``meta``; it is dropped."""
        c, this_boot = self._spool_owner(meta)
        if c is None:
            return
        c.dropped_rejected += 1
        if this_boot:
            self._count_drop(c, *self._leave_spool(c, meta))

    def spool_evicted(self, meta: dict[str, Any]) -> None:
        """The spool's size cap deleted the batch described by ``meta``."""
        c, this_boot = self._spool_owner(meta)
        if c is None:
            return
        c.dropped_full += 1
        if this_boot:
            self._count_drop(c, *self._leave_spool(c, meta))

    # -- reports: everything else ------------------------------------------------------------

    def send_failed(self, engine_id: str) -> None:
        """A delivery of one of the engine's batches failed or was refused."""
        c = self._engines.get(engine_id) or self._first()
        if c is not None:
            c.send_failures += 1

    def rows_held(self, engine_id: str, held: int, merged: int) -> None:
        """The builder now holds ``held`` step rows back and merged ``merged`` in all."""
        c = self._engines[engine_id]
        c.held_steps, c.merged_steps = held, merged

    def values_replaced(self, total: int) -> None:
        """The builder has replaced ``total`` unreadable values so far."""
        self.invalid_values = total

    def spool_size(self, records: int, size_bytes: int, corrupt_records: int) -> None:
        """The spool now holds ``records`` in ``size_bytes`` and skipped ``corrupt_records``."""
        self.spool_records, self.spool_bytes = records, size_bytes
        self.spool_corrupt_records = corrupt_records

    def exporter_error(self) -> None:
        """An exporter cycle failed."""
        self.exporter_errors += 1

    # -- snapshots -------------------------------------------------------------------------

    def counters(self, engine_id: str) -> dict[str, int]:
        """The cumulative exporter counters of the wire schema (``EXPORTER_FIELDS``).

        The spool's corrupt records are process-wide: only the first engine carries them.
        """
        c = self._engines[engine_id]
        buf = c.buffer
        buf.refresh_buffer_drops()
        first = next(iter(self._engines)) == engine_id
        return {
            "dropped_steps": buf.buffer_dropped_steps + c.dropped_steps,
            "dropped_requests": buf.buffer_dropped_requests + c.dropped_requests,
            "dropped_batches": c.dropped_batches,
            "send_failures": c.send_failures,
            "record_errors": buf.record_errors,
            "dropped_batches_full": c.dropped_full,
            "dropped_batches_rejected": c.dropped_rejected,
            "spooled_batches": c.spooled_batches,
            "spool_corrupt_records": self.spool_corrupt_records if first else 0,
        }

    def stats(self, engine_id: str | None = None) -> dict[str, int]:
        """The counters for one engine or summed over all, with the process-wide ones."""
        out = dict.fromkeys(ENGINE_STATS_KEYS, 0)
        engines = list(self._engines.values())
        if engine_id is not None:
            engines = [c for c in engines if c.buffer.engine_id == engine_id]
        for c in engines:
            buf = c.buffer
            # ``produced`` before the deques' lengths: a concurrent record() can only
            # make ``buffered`` low, never high.
            steps_produced, requests_produced = buf.steps_produced, buf.requests_produced
            in_steps = buf.refresh_buffer_drops()
            in_requests = len(buf.requests)
            values = (
                steps_produced, c.steps_sent, c.merged_steps,
                buf.buffer_dropped_steps + c.dropped_steps,
                in_steps + c.held_steps + c.pending_steps + c.spool_steps,
                requests_produced, c.requests_sent,
                buf.buffer_dropped_requests + c.dropped_requests,
                in_requests + c.pending_requests + c.spool_requests,
                c.batches_built, c.batches_sent, c.dropped_batches, c.pending_batches,
                c.send_failures, c.hellos_sent, buf.record_errors,
                c.dropped_full, c.dropped_rejected, c.dropped_exit,
                c.spooled_batches, c.spool_batches,
            )  # fmt: skip
            for key, value in zip(ENGINE_STATS_KEYS, values, strict=True):
                out[key] += value
        out["engines"] = len(engines)
        out["invalid_values"] = self.invalid_values
        out["exporter_errors"] = self.exporter_errors
        out["pending_bytes"] = self.pending_bytes
        out["spool_records"] = self.spool_records
        out["spool_bytes"] = self.spool_bytes
        out["spool_corrupt_records"] = self.spool_corrupt_records
        out["replayed_batches"] = self.replayed_batches
        return out

    def stats_document(self) -> dict[str, Any]:
        """What ``KVSCOPE_STATS_FILE`` holds: the totals and each engine's stats."""
        engines = {engine_id: self.stats(engine_id) for engine_id in self._engines}
        return {
            "pid": self.pid,
            "boot_id": self.boot_id,
            "written_unix_s": time.time(),
            "total": self.stats(),
            "engines": engines,
        }

    # -- helpers ---------------------------------------------------------------------------

    def _first(self) -> EngineCounts | None:
        return next(iter(self._engines.values()), None)

    def _unqueue(self, batch: Batch) -> EngineCounts:
        c = self._engines[batch.engine_id]
        c.pending_batches -= 1
        c.pending_steps -= batch.n_steps
        c.pending_requests -= batch.n_requests
        self.pending_bytes -= len(batch.body)
        return c

    @staticmethod
    def _count_drop(c: EngineCounts, n_steps: int, n_requests: int) -> None:
        c.dropped_batches += 1
        c.dropped_steps += n_steps
        c.dropped_requests += n_requests

    def _spool_owner(self, meta: dict[str, Any]) -> tuple[EngineCounts | None, bool]:
        """The counts a spooled batch is reported under, and whether it is of this boot."""
        c = self._engines.get(str(meta.get("engine_id")))
        this_boot = c is not None and meta.get("boot_id") == self.boot_id
        return (c or self._first()), this_boot

    @staticmethod
    def _leave_spool(c: EngineCounts, meta: dict[str, Any]) -> tuple[int, int]:
        n_steps, n_requests = int(meta["n_steps"]), int(meta["n_requests"])
        c.spool_batches -= 1
        c.spool_steps -= n_steps
        c.spool_requests -= n_requests
        return n_steps, n_requests


def write_stats_file(path: str, document: dict[str, Any], pid: int) -> None:
    """Replace ``path`` with ``document`` as JSON (atomically: a reader never sees half)."""
    tmp = f"{path}.{pid}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(document, fh)
        os.replace(tmp, path)
    except OSError as exc:
        ERRORS.warning("stats:write", "kvscope: cannot write KVSCOPE_STATS_FILE (%s)", exc)

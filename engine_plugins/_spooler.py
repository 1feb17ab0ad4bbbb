"""The exporter's spool: batches the collector could not take yet, on disk, in order.

:class:`Spooler` keeps batches in the on-disk store of
:mod:`kvscope.engine_plugins._spool` (``<KVSCOPE_SPOOL_DIR>/<spool_key>``, one process
at a time) and hands them back oldest first, also to a process that starts later on
the same host and port. A batch is stored exactly as it was built, so its replay
carries the original idempotency key and the collector stores it once. The store's
size cap deletes the oldest segments; their batches are reported as dropped
(``full``). The spooler reports every change to the accounting: a batch of this boot
stays counted as buffered until it is delivered, refused or deleted.

Only the exporter thread uses it; :meth:`Spooler.open` runs in that thread too.
"""

from __future__ import annotations

import os

from kvscope.engine_plugins._accounting import Accounting
from kvscope.engine_plugins._batch import Batch
from kvscope.engine_plugins._config import Settings
from kvscope.engine_plugins._logging import ERRORS, LOGGER
from kvscope.engine_plugins._spool import Spool, SpoolBusy, SpoolEntry


class Spooler:
    """Stores undeliverable batches on disk and replays them in order."""

    def __init__(self, store: Spool, accounting: Accounting) -> None:
        self.store = store
        self._accounting = accounting

    @classmethod
    def open(cls, settings: Settings, accounting: Accounting) -> Spooler | None:
        """Open this server's spool; None (logged) if it is in use or cannot be opened."""
        assert settings.spool_dir is not None
        path = os.path.join(settings.spool_dir, settings.spool_key)
        try:
            store = Spool(path, settings.spool_max_bytes)
        except SpoolBusy as exc:
            ERRORS.warning(
                "spool:busy",
                "kvscope: %s; this process keeps undeliverable batches in memory only",
                exc,
            )
            return None
        except OSError as exc:
            ERRORS.warning(
                "spool:open",
                "kvscope: cannot open the spool %s (%s); this process "
                "keeps undeliverable batches in memory only",
                path,
                exc,
            )
            return None
        if len(store) or store.corrupt_records:
            LOGGER.info(
                "kvscope: spool %s holds %d batch(es) (%d bytes) to replay; %d torn or "
                "corrupt record(s) skipped",
                path,
                len(store),
                store.size_bytes,
                store.corrupt_records,
            )
        return cls(store, accounting)

    def __len__(self) -> int:
        return len(self.store)

    def append(self, batch: Batch) -> bool:
        """Store ``batch`` behind the others; False (logged) if the disk refused it."""
        try:
            evicted = self.store.append(batch.spool_meta(), batch.body)
        except OSError as exc:
            ERRORS.warning(
                "spool:write",
                "kvscope: cannot write to the spool (%s); batches stay in memory",
                exc,
            )
            return False
        self._accounting.spooled(batch)
        for entry in evicted:
            self._accounting.spool_evicted(entry.meta)
        self.report_size()
        return True

    def oldest(self) -> tuple[SpoolEntry, bytes] | None:
        """The oldest stored batch and its body, or None when the spool is empty."""
        got = self.store.peek()  # skips (and counts) records that no longer read back
        self.report_size()
        return got

    def remove_oldest(self, entry: SpoolEntry, *, delivered: bool) -> None:
        """Remove ``entry`` (the oldest), which the collector acknowledged or refused."""
        self.store.pop()
        if delivered:
            self._accounting.spool_delivered(entry.meta)
        else:
            self._accounting.spool_refused(entry.meta)
        self.report_size()

    def report_size(self) -> None:
        """Tell the accounting the spool's size and its count of corrupt records."""
        self._accounting.spool_size(
            len(self.store), self.store.size_bytes, self.store.corrupt_records
        )

    def sync(self, *, close: bool) -> None:
        """Make what was stored durable (``fsync``); ``close`` also releases the spool."""
        try:
            self.store.sync()
        except OSError as exc:
            ERRORS.warning("spool:sync", "kvscope: cannot fsync the spool (%s)", exc)
        if close:
            self.store.close()

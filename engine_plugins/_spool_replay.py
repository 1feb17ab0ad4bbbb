"""The exporter's use of the on-disk spool (:mod:`kvscope.engine_plugins._spool`).

While deliveries fail, queued batches move, in order, to the spool (batches beyond
the caps go there instead of being dropped); the spool is sent first, oldest first,
once the collector answers again, also by a later process on the same host and port,
with each batch's original idempotency key. Spooled batches of this boot stay in
the accounting as buffered until delivered, refused, or evicted by the size cap.
"""

from __future__ import annotations

import gzip
import json
import os
import time

from kvscope.engine_plugins._buffer import EngineBuffer
from kvscope.engine_plugins._delivery import Delivery
from kvscope.engine_plugins._exp_state import encode_batch
from kvscope.engine_plugins._http import OK, RETRY, Response, classify
from kvscope.engine_plugins._logging import ERRORS, LOGGER
from kvscope.engine_plugins._spool import Spool, SpoolBusy, SpoolEntry

#: Longest one cycle spends replaying the spool (as a share of the flush interval).
SPOOL_REPLAY_SHARE = 0.8


class SpoolReplay(Delivery):
    """Spills the pending queue to the spool and replays it."""

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
                    body = encode_batch(payload)
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

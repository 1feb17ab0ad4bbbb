"""Delivery of queued batches, in order, with retry and backoff.

2xx acknowledges. 408, 425, 429 and 5xx, and connection errors or timeouts, are
retried with exponential backoff and jitter (``Retry-After`` is honoured); the batch
keeps its ``seq``. Any other status drops the batch (counted, the collector's message
logged), except that a refusal asking for the hello resends the batch with it. A
failed delivery makes every engine's hello due again (the collector may have
restarted).
"""

from __future__ import annotations

import gzip
import json
import time

from kvscope.engine_plugins._buffer import EngineBuffer
from kvscope.engine_plugins._exp_state import Batch, ExporterState, encode_batch
from kvscope.engine_plugins._http import OK, RETRY, Response, classify
from kvscope.engine_plugins._logging import ERRORS, LOGGER

#: First and largest backoff delay after a failed delivery.
INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


class Delivery(ExporterState):
    """Sends the pending queue and keeps the backoff state."""

    def _body(self, batch: Batch) -> bytes:
        """The batch's body, with the current hello added if it is due and missing."""
        eng = batch.eng
        version = eng.hello_version
        if eng.hello_due and batch.hello_version != version:
            payload = json.loads(gzip.decompress(batch.body))
            payload["hello"] = eng.hello
            body = encode_batch(payload)
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

    def _handle(self, batch: Batch, resp: Response) -> bool:
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

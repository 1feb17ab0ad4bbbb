"""The sender: delivers one encoded batch at a time to the collector, with backoff.

:meth:`Sender.send` POSTs a body as it is (:class:`kvscope.engine_plugins._http.IngestClient`,
one kept-alive connection, a hard timeout cut to the caller's deadline) and reads the
collector's reply into a :class:`Reply`: 2xx acknowledges (``OK``); 408, 425, 429
and 5xx, and connection errors or timeouts, are to be retried (``RETRY``); any other
status refuses the batch (``DROP``). A reply may ask for the engine hello
(``{"need_hello": true}``).

The sender owns the retry state: after a failed delivery it waits with exponential
backoff and jitter (``Retry-After`` is honoured) before :meth:`Sender.ready` allows
the next attempt, and it logs failures (rate-limited) and the resumption. The caller
sends batches in order and decides what becomes of each (queue, spool, accounting).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from kvscope.engine_plugins._config import Settings
from kvscope.engine_plugins._http import DROP, OK, RETRY, IngestClient, Response, classify
from kvscope.engine_plugins._logging import ERRORS, LOGGER

#: First and largest backoff delay after a failed delivery.
INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class Reply:
    """What became of one delivery attempt."""

    verdict: str
    """``OK``, ``RETRY`` or ``DROP`` (:func:`kvscope.engine_plugins._http.classify`)."""
    status: int | None = None
    """The HTTP status, None when no response arrived."""
    need_hello: bool = False
    """Whether the collector asked for the engine hello."""
    message: str = ""
    """The collector's error message, for the log."""


class Sender:
    """POSTs batches to the collector and keeps the backoff between failed attempts."""

    def __init__(self, client: IngestClient, settings: Settings) -> None:
        self._client = client
        self._settings = settings
        self._rng = random.Random()
        self.failures = 0
        """Consecutive failed delivery attempts (0 while the collector answers)."""
        self._next_attempt_mono_s = 0.0

    @property
    def failing(self) -> bool:
        """Whether the latest delivery attempt failed."""
        return self.failures > 0

    def ready(self) -> bool:
        """Whether the backoff allows an attempt now."""
        return time.monotonic() >= self._next_attempt_mono_s

    def send(self, body: bytes, deadline_mono_s: float | None, *, waiting: int) -> Reply | None:
        """POST ``body``; return the reply, or None if ``deadline_mono_s`` leaves no time.

        A ``RETRY`` arms the backoff and is logged with the ``waiting`` batch count.
        """
        timeout_s = self._settings.timeout_s
        if deadline_mono_s is not None:
            remaining_s = deadline_mono_s - time.monotonic()
            if remaining_s < 0.01:
                return None
            timeout_s = min(timeout_s, remaining_s)
        try:
            resp = self._client.post(body, timeout_s)
        except Exception as exc:  # connection refused, timeout, reset, DNS, ...
            self._back_off(None, exc, waiting)
            return Reply(RETRY)
        verdict = classify(resp.status)
        if verdict == RETRY:
            self._back_off(resp, None, waiting)
            return Reply(RETRY, resp.status)
        if verdict == OK:
            if self.failures:
                LOGGER.info(
                    "kvscope: delivery to the collector resumed after %d failed attempt(s)",
                    self.failures,
                )
                self.failures = 0
            return Reply(OK, resp.status, resp.need_hello())
        return Reply(DROP, resp.status, resp.need_hello(), resp.message())

    def close(self) -> None:
        """Close the connection to the collector."""
        self._client.close()

    def _back_off(self, resp: Response | None, error: BaseException | None, waiting: int) -> None:
        self.failures += 1
        if resp is not None and resp.retry_after_s is not None:
            delay_s = resp.retry_after_s * self._rng.uniform(1.0, 1.1)
        else:
            base_s = min(MAX_BACKOFF_S, INITIAL_BACKOFF_S * 2 ** min(self.failures - 1, 30))
            delay_s = base_s * self._rng.uniform(0.5, 1.0)
        self._next_attempt_mono_s = time.monotonic() + delay_s
        what = f"HTTP {resp.status}" if resp is not None else f"{type(error).__name__}: {error}"
        ERRORS.warning(
            "http:retry",
            "kvscope: cannot deliver to the collector at %s (%s); retrying in %.1f s, "
            "%d batch(es) waiting",
            self._settings.collector_url,
            what,
            delay_s,
            waiting,
        )

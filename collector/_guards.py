"""Limits that keep the collector up under overload and against hostile clients.

* :class:`ByteBudget`: the ingest bodies held at once (being read, parsed, or waiting
  for the writer), summed in decompressed bytes. A request that would go past the
  limit is refused with 503 and ``Retry-After``, so memory stays bounded however many
  clients send at once. Used only on the event loop (no lock).
* :class:`NewEngineGate`: at most ``per_minute`` engine ids not seen before are
  admitted per sliding minute; known engines always pass. :class:`BootGate`: the same
  for each engine's boot ids.
* :class:`GuardedRunner`: an :class:`aiohttp.web.AppRunner` whose connections must
  complete each request head within ``header_timeout_s`` of its first byte (or of
  connecting), else they are closed and counted. aiohttp itself has no such timeout:
  a client sending its headers a byte at a time ("slowloris") would hold a connection
  and its memory for as long as it likes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

__all__ = [
    "BootGate",
    "ByteBudget",
    "GuardedRunner",
    "Lease",
    "MalformedRequestLog",
    "NewEngineGate",
    "Overbudget",
]


class Overbudget(Exception):
    """Taking these bytes would pass the budget's limit."""


class ByteBudget:
    """A limit on bytes held at once; :meth:`lease` hands out per-request shares."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0

    def lease(self) -> Lease:
        """A share for one request; release it when the request is answered."""
        return Lease(self)


class Lease:
    """The bytes one request holds of a :class:`ByteBudget`."""

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self.held = 0

    def take(self, n: int) -> None:
        """Hold ``n`` more bytes or raise :class:`Overbudget` (holding nothing more)."""
        b = self._budget
        if b.used + n > b.limit:
            raise Overbudget(f"{b.used} of {b.limit} ingest bytes in flight")
        b.used += n
        self.held += n
        b.peak = max(b.peak, b.used)

    def give_back(self, n: int) -> None:
        """Give back ``n`` of the bytes held (what was held for a step now done)."""
        n = min(n, self.held)
        self._budget.used -= n
        self.held -= n

    def release(self) -> None:
        """Give back everything held (idempotent)."""
        self._budget.used -= self.held
        self.held = 0


class NewEngineGate:
    """Admits at most ``per_minute`` new engine ids per sliding minute."""

    def __init__(
        self,
        per_minute: int,
        known: Callable[[str], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_minute = per_minute
        self._known = known
        self._clock = clock
        self._admitted: collections.OrderedDict[str, float] = collections.OrderedDict()

    def admit(self, engine_id: str) -> bool:
        """True if the engine is known, recently admitted, or a new one fits the rate."""
        if engine_id in self._admitted or self._known(engine_id):
            return True
        now = self._clock()
        while self._admitted and next(iter(self._admitted.values())) <= now - 60.0:
            self._admitted.popitem(last=False)
        if len(self._admitted) >= self.per_minute:
            return False
        self._admitted[engine_id] = now
        return True


class BootGate:
    """Admits at most ``per_minute`` new boot ids (process starts) per engine per sliding
    minute: a :class:`NewEngineGate` per engine, over its boot ids. ``known(engine_id,
    boot_id)`` says whether the store holds the boot. At most ``max_engines`` engines are
    tracked (the least recently seen forgotten first)."""

    def __init__(
        self,
        per_minute: int,
        known: Callable[[str, str], bool],
        clock: Callable[[], float] = time.monotonic,
        max_engines: int = 100_000,
    ) -> None:
        self.per_minute = per_minute
        self._known = known
        self._clock = clock
        self._max_engines = max_engines
        self._gates: collections.OrderedDict[str, NewEngineGate] = collections.OrderedDict()

    def admit(self, engine_id: str, boot_id: str) -> bool:
        """True if the boot is known, recently admitted, or a new one fits the rate."""
        gate = self._gates.get(engine_id)
        if gate is None:
            if self._known(engine_id, boot_id):
                return True
            gate = NewEngineGate(self.per_minute, lambda b: self._known(engine_id, b), self._clock)
            self._gates[engine_id] = gate
            while len(self._gates) > self._max_engines:
                self._gates.popitem(last=False)
        else:
            self._gates.move_to_end(engine_id)
        return gate.admit(boot_id)


class _GuardedHandler(RequestHandler):
    """Closes a connection whose request head does not arrive in time.

    It reads three attributes of aiohttp's handler (``_request_count``, ``_messages``,
    ``_request_in_progress``, present since aiohttp 3.9); should a version lack them,
    the deadline is never armed and aiohttp's own keep-alive timeout is all there is.
    """

    _kvs_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._kvs_arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._kvs_disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        before = getattr(self, "_request_count", None)
        super().data_received(data)
        if before is None:
            return
        if self._request_count > before:
            self._kvs_disarm()  # a head is complete
        elif data and not self._busy():
            self._kvs_arm()  # bytes of a head that is not complete yet

    def _busy(self) -> bool:
        """A request is being handled or queued (its head arrived)."""
        return bool(getattr(self, "_request_in_progress", True) or getattr(self, "_messages", 1))

    def _kvs_arm(self) -> None:
        if self._kvs_deadline is None and hasattr(self, "_request_count"):
            server: Any = self._manager
            self._kvs_deadline = self._loop.call_later(
                server.kvscope_header_timeout_s, self._kvs_expire
            )

    def _kvs_disarm(self) -> None:
        if self._kvs_deadline is not None:
            self._kvs_deadline.cancel()
            self._kvs_deadline = None

    def _kvs_expire(self) -> None:
        self._kvs_deadline = None
        if self._busy():
            return
        server: Any = self._manager
        server.kvscope_slow_closed += 1
        self.force_close()
        if self.transport is not None:
            self.transport.close()


class _GuardedServer(Server):
    kvscope_header_timeout_s = 10.0
    kvscope_slow_closed = 0

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, loop=self._loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """An AppRunner whose connections get a deadline for each request head."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _GuardedServer
        guarded: Any = server
        guarded.kvscope_header_timeout_s = self._header_timeout_s
        guarded.kvscope_slow_closed = 0
        return server

    @property
    def slow_connections_closed(self) -> int:
        """Connections closed because their request head was too slow."""
        server: Any = self.server
        return int(getattr(server, "kvscope_slow_closed", 0))


class MalformedRequestLog(logging.Filter):
    """Keeps aiohttp's record of each malformed HTTP request (a request line over 8 KiB,
    a bad header: aiohttp answers 400 itself) from flooding the log with a traceback per
    request: such records are counted, and one line without the traceback is let through
    a minute. Installed on the ``aiohttp.server`` logger by the collector."""

    def __init__(self, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.count = 0
        self._every_s = every_s
        self._clock = clock
        self._next = -math.inf

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self.count += 1
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self._every_s
        record.msg = "malformed HTTP request answered 400 (%s); %d so far, logged once a minute"
        record.args = (f"{type(exc).__name__}: {exc}"[:200], self.count)
        record.exc_info = None
        record.exc_text = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True

"""Request and response bodies within bounds of memory and time.

Reading an ingest body: it is read chunk by chunk; reading stops as soon as the
compressed size exceeds ``max_body_bytes`` or the decompressed size exceeds
``max_decompressed_bytes`` (zlib's ``max_length`` bounds every decompression step, so a
small "bomb" never expands past the limit in memory), and the body grows in one buffer
(no second copy when it is complete). The aiohttp server must be created with
``auto_decompress=False`` (see :func:`kvscope.collector.server.create_runner`), otherwise
aiohttp would inflate the body before these checks.

Writing a response (:class:`ResponseWriter`): a ``web.Response`` hands its whole body to
the transport, which copies what the socket does not take at once into its buffer and
waits, without a deadline, for the client to read it: a client that never reads would
hold its response twice for as long as it stays connected. Here the body is written in
chunks, each once the transport's buffer is under its high-water mark (asyncio's
default, 64 KiB), within a deadline; past it the connection is reset (both buffers
dropped) and counted. :class:`SharedBody` lets the requests that overlap share one
rendering.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import struct
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from kvscope.collector._guards import Lease, Overbudget

CHUNK_BYTES = 64 * 1024
CHUNK_OUT_BYTES = 1024 * 1024
RESPONSE_CHUNK_BYTES = 128 * 1024
"""Bytes of a response handed to the transport at a time (each waits for its buffer to
drain under the high-water mark first)."""
SHARE_MAX_AGE_S = 1.0
"""Oldest rendering a request may be given while another response still sends it."""
GZIP_ENCODINGS = frozenset({"gzip", "x-gzip"})
IDENTITY_ENCODINGS = frozenset({"", "identity"})


class BodyError(Exception):
    """The body cannot be accepted; carries the HTTP status and a counter reason."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


def _too_large(what: str, limit: int) -> BodyError:
    return BodyError(413, "too_large", f"body: {what} exceeds the limit of {limit} bytes")


class _Inflater:
    """Incremental gzip decoder with an output cap."""

    def __init__(self, max_out: int, lease: Lease | None) -> None:
        self._d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        self._max = max_out
        self._lease = lease
        self._out = io.BytesIO()
        self._n = 0

    def feed(self, data: bytes) -> None:
        while data:
            if self._d.eof:
                raise BodyError(400, "bad_encoding", "body: data after the end of the gzip stream")
            try:
                # At most 1 MiB per call: zlib's output buffer is never much
                # larger than what is kept, so memory stays near the limit.
                out = self._d.decompress(data, min(self._max - self._n + 1, CHUNK_OUT_BYTES))
            except zlib.error as exc:
                raise BodyError(400, "bad_encoding", f"body: invalid gzip data ({exc})") from None
            self._take(out)
            data = self._d.unconsumed_tail
        if self._d.eof and self._d.unused_data:
            raise BodyError(400, "bad_encoding", "body: data after the end of the gzip stream")

    def _take(self, out: bytes) -> None:
        self._n += len(out)
        if self._n > self._max:
            raise _too_large("decompressed body", self._max)
        _hold(self._lease, len(out))
        self._out.write(out)

    def finish(self) -> bytes:
        if not self._d.eof:
            raise BodyError(400, "bad_encoding", "body: truncated gzip stream")
        return self._out.getvalue()  # the buffer itself, not a copy


def _hold(lease: Lease | None, n: int) -> None:
    if lease is not None:
        try:
            lease.take(n)
        except Overbudget as exc:
            raise BodyError(
                503, "overloaded", f"collector overloaded: {exc}; retry later"
            ) from None


async def read_body(
    request: web.Request,
    max_body_bytes: int,
    max_decompressed_bytes: int,
    lease: Lease | None = None,
) -> bytes:
    """Return the decoded body or raise :class:`BodyError` (413, 415, 400, or 503 when
    holding it would pass ``lease``'s budget: the decoded bytes are taken from it)."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in GZIP_ENCODINGS and encoding not in IDENTITY_ENCODINGS:
        raise BodyError(
            415,
            "unsupported_encoding",
            f"Content-Encoding {encoding!r} is not supported; send gzip or identity",
        )
    gzip = encoding in GZIP_ENCODINGS
    length = request.content_length
    if length is not None and length > max_body_bytes:
        raise _too_large("body", max_body_bytes)
    if not gzip:
        max_body_bytes = min(max_body_bytes, max_decompressed_bytes)
    if length is not None:
        _hold(lease, 0 if gzip else length)  # refuse early what cannot fit anyway
        if lease is not None:
            lease.release()
    inflater = _Inflater(max_decompressed_bytes, lease) if gzip else None
    out = io.BytesIO()
    n = 0
    async for chunk in request.content.iter_chunked(CHUNK_BYTES):
        n += len(chunk)
        if n > max_body_bytes:
            raise _too_large("body", max_body_bytes)
        if inflater is not None:
            inflater.feed(chunk)
        else:
            _hold(lease, len(chunk))
            out.write(chunk)
    if inflater is not None:
        if n == 0:
            raise BodyError(400, "bad_encoding", "body: empty")
        return inflater.finish()
    return out.getvalue()


class ResponseWriter:
    """Writes response bodies in chunks within a deadline; counts the readers cut off.

    A connection being written holds at most the transport's high-water mark plus one
    chunk besides the body itself (which :class:`SharedBody` may share).
    """

    def __init__(self, chunk_bytes: int = RESPONSE_CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self.slow_readers_closed = 0
        """Connections aborted because their response was not written in time."""

    async def send(
        self, request: web.Request, body: bytes, content_type: str, timeout_s: float
    ) -> web.StreamResponse:
        """Write ``body`` as a 200 response within ``timeout_s`` or abort the connection."""
        resp = web.StreamResponse(headers={"Content-Type": content_type})
        resp.content_length = len(body)
        try:
            async with asyncio.timeout(timeout_s):
                await resp.prepare(request)
                if request.method != "HEAD":
                    view = memoryview(body)
                    for start in range(0, len(body), self.chunk_bytes):
                        # aiohttp drains (waits for the client) past 64 KiB written.
                        await resp.write(view[start : start + self.chunk_bytes])
                await resp.write_eof()
        except TimeoutError:
            self.slow_readers_closed += 1
            _reset(request.transport)
        except ConnectionError:
            pass  # the client went away; aiohttp sees the connection lost
        return resp


def _reset(transport: asyncio.Transport | None) -> None:
    """Close a connection now, dropping what it has not sent: asyncio's ``abort`` drops
    its own buffer, and a zero linger time makes the kernel drop the socket's (a plain
    close would keep sending it, megabytes, to a client that does not read) and reset."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


@dataclass
class _Rendering:
    body: bytes
    at: float
    users: int = 0


class SharedBody:
    """One rendering of a response body shared by the requests that overlap it.

    A request arriving while the body is being rendered, or while another response still
    sends a rendering at most ``max_age_s`` old, gets that rendering: slow readers share
    one body instead of holding one each. A request after the others are answered gets a
    fresh one. Used on the event loop only.
    """

    def __init__(
        self, max_age_s: float = SHARE_MAX_AGE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_age_s = max_age_s
        self._clock = clock
        self._current: _Rendering | None = None
        self._pending: asyncio.Future[_Rendering] | None = None
        self.renders = 0
        """Renderings made so far."""

    @contextlib.asynccontextmanager
    async def use(self, render: Callable[[], Awaitable[bytes]]) -> AsyncIterator[bytes]:
        """The body to send: shared, or rendered by ``render`` (once for all waiting)."""
        cur = self._current
        if cur is None or cur.users == 0 or self._clock() - cur.at > self.max_age_s:
            if self._pending is None:
                self._pending = asyncio.ensure_future(self._render(render))
                self._pending.add_done_callback(_retrieve)
            cur = await asyncio.shield(self._pending)
        cur.users += 1
        try:
            yield cur.body
        finally:
            cur.users -= 1
            if cur.users == 0 and self._current is cur:
                self._current = None  # nobody sends it: let it go

    async def _render(self, render: Callable[[], Awaitable[bytes]]) -> _Rendering:
        try:
            body = await render()
        finally:
            self._pending = None
        self.renders += 1
        self._current = _Rendering(body, self._clock())
        return self._current


def _retrieve(fut: asyncio.Future[_Rendering]) -> None:
    """Mark a failed rendering's exception seen (its waiters may all be gone)."""
    if not fut.cancelled():
        fut.exception()

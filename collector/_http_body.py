"""Reading an ingest body with size limits and incremental gzip decompression.

The body is read chunk by chunk; reading stops as soon as the compressed size
exceeds ``max_body_bytes`` or the decompressed size exceeds ``max_decompressed_bytes``
(zlib's ``max_length`` bounds every decompression step, so a small "bomb" never
expands past the limit in memory). The aiohttp server must be created with
``auto_decompress=False`` (see :func:`kvscope.collector.server.create_runner`), otherwise
aiohttp would inflate the body before these checks.
"""

from __future__ import annotations

import zlib

from aiohttp import web

from kvscope.collector._guards import Lease, Overbudget

CHUNK_BYTES = 64 * 1024
CHUNK_OUT_BYTES = 1024 * 1024
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
        self._parts: list[bytes] = []
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
        self._parts.append(out)

    def finish(self) -> bytes:
        if not self._d.eof:
            raise BodyError(400, "bad_encoding", "body: truncated gzip stream")
        return b"".join(self._parts)


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
    parts: list[bytes] = []
    n = 0
    async for chunk in request.content.iter_chunked(CHUNK_BYTES):
        n += len(chunk)
        if n > max_body_bytes:
            raise _too_large("body", max_body_bytes)
        if inflater is not None:
            inflater.feed(chunk)
        else:
            _hold(lease, len(chunk))
            parts.append(chunk)
    if inflater is not None:
        if n == 0:
            raise BodyError(400, "bad_encoding", "body: empty")
        return inflater.finish()
    return b"".join(parts)

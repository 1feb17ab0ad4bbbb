"""A minimal HTTP client for the exporter: one kept-alive connection, hard timeouts.

Standard library only (``http.client``). :func:`classify` decides what the exporter
does with a response; :func:`retry_after_s` reads a ``Retry-After`` header.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import json
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvscope.engine_plugins import __version__
from kvscope.engine_plugins.schema import CONTENT_ENCODING, CONTENT_TYPE, INGEST_PATH

#: Statuses after which the same batch is sent again later (with backoff).
RETRYABLE_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
#: Longest ``Retry-After`` honoured, in seconds.
MAX_RETRY_AFTER_S = 300.0
#: Most bytes of a response body read (the rest is discarded with the connection).
MAX_RESPONSE_BYTES = 65_536

OK, RETRY, DROP = "ok", "retry", "drop"


@dataclass(frozen=True)
class Response:
    """What the exporter needs from one HTTP response."""

    status: int
    body: bytes
    retry_after_s: float | None

    def json(self) -> Any:
        """The body as JSON, or None if it is not JSON."""
        try:
            return json.loads(self.body.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return None

    def need_hello(self) -> bool:
        """Whether the collector asked for the engine hello (``{"need_hello": true}``)."""
        obj = self.json()
        return isinstance(obj, dict) and obj.get("need_hello") is True

    def message(self) -> str:
        """The collector's error message, for the log (short)."""
        obj = self.json()
        if isinstance(obj, dict):
            for key in ("error", "detail", "message"):
                if key in obj:
                    return str(obj[key])[:500]
        return self.body[:500].decode("utf-8", "replace")


def classify(status: int) -> str:
    """Return OK for 2xx, RETRY for :data:`RETRYABLE_STATUSES` and 5xx, DROP otherwise."""
    if 200 <= status < 300:
        return OK
    if status in RETRYABLE_STATUSES or 500 <= status < 600:
        return RETRY
    return DROP


def retry_after_s(value: str | None, now_unix_s: float | None = None) -> float | None:
    """Parse ``Retry-After`` (delta seconds or an HTTP date) into seconds from now."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        now = time.time() if now_unix_s is None else now_unix_s
        seconds = when.timestamp() - now
    if seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


class IngestClient:
    """POSTs gzip-compressed JSON batches to ``{base_url}/v1/ingest``."""

    def __init__(self, base_url: str, token: str | None = None, ca_file: str | None = None) -> None:
        parts = urlsplit(base_url)
        self._ca_file = ca_file
        self._ssl: ssl.SSLContext | None = None
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "localhost"
        self._port = parts.port or (443 if self._https else 80)
        self.path = (parts.path.rstrip("/") or "") + INGEST_PATH
        self._headers = {
            "Content-Type": CONTENT_TYPE,
            "Content-Encoding": CONTENT_ENCODING,
            "User-Agent": f"kvscope-engine-plugin/{__version__}",
        }
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        conn = self._conn
        if conn is None:
            if self._https:
                if self._ssl is None:  # built once: loading CAs costs milliseconds
                    self._ssl = ssl.create_default_context(cafile=self._ca_file)
                conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=timeout_s, context=self._ssl
                )
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
            self._conn = conn
        else:
            conn.timeout = timeout_s
            if conn.sock is not None:
                conn.sock.settimeout(timeout_s)
        return conn

    def post(self, body: bytes, timeout_s: float) -> Response:
        """Send one batch; raise ``OSError`` / ``http.client.HTTPException`` on failure."""
        conn = self._connection(timeout_s)
        try:
            conn.request("POST", self.path, body=body, headers=self._headers)
            resp = conn.getresponse()
            data = resp.read(MAX_RESPONSE_BYTES)
            retry_after = retry_after_s(resp.getheader("Retry-After"))
            if resp.will_close or not resp.isclosed():
                self.close()
        except BaseException:
            self.close()
            raise
        return Response(resp.status, data, retry_after)

    def close(self) -> None:
        """Close the kept-alive connection, if any."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a broken socket may fail to close
                conn.close()

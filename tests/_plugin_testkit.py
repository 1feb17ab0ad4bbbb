"""Helpers shared by the engine-plugin tests (tests/engine_plugins, tests/faults_plugin):
exporter settings for tests, a real local HTTP server that records every batch and
answers as scripted, and the exporter's accounting check."""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvscope.engine_plugins._config import Settings
from kvscope.engine_plugins.exporter import Exporter


def make_settings(url: str, **kw: Any) -> Settings:
    """Settings for tests: small buffers and timeouts unless overridden."""
    base: dict[str, Any] = dict(
        collector_url=url,
        host="testhost",
        port=8123,
        flush_interval_s=0.1,
        buffer_steps=1_000,
        buffer_requests=1_000,
        max_pending_batches=10,
        timeout_s=1.0,
        shutdown_timeout_s=1.0,
    )
    base.update(kw)
    return Settings(**base)


@dataclass
class Received:
    """One request the server received, when (monotonic), and the status it answered."""

    path: str
    headers: dict[str, str]
    raw: bytes
    batch: Any
    """The decoded JSON body, None if it did not decode."""
    status: int
    mono_s: float


class RecordingServer:
    """A real HTTP/1.1 server on 127.0.0.1 that records POSTs and answers as scripted.

    ``script`` holds ``(status, headers, body)`` answers used in order (``answer()``
    queues one); once empty, every request gets ``default`` (200 unless changed).
    A body of None is ``{"status": "stored", "need_hello": false}`` for 2xx, else an
    error message.
    """

    def __init__(self, port: int = 0) -> None:
        self.received: list[Received] = []
        self.script: deque[tuple[int, dict[str, str], bytes | None]] = deque()
        self.default: tuple[int, dict[str, str]] = (200, {})
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                now = time.monotonic()
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                try:
                    data = raw
                    if self.headers.get("Content-Encoding") == "gzip":
                        data = gzip.decompress(raw)
                    batch = json.loads(data)
                except Exception:
                    batch = None
                with server._lock:
                    if server.script:
                        status, headers, body = server.script.popleft()
                    else:
                        (status, headers), body = server.default, None
                    server.received.append(
                        Received(self.path, dict(self.headers.items()), raw, batch, status, now)
                    )
                if body is None:
                    body = json.dumps(
                        {"status": "stored", "need_hello": False}
                        if status < 300
                        else {"error": f"scripted {status}"}
                    ).encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    def answer(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        """Queue one scripted answer (``body`` is sent as JSON)."""
        payload = None if body is None else json.dumps(body).encode()
        self.script.append((status, headers or {}, payload))

    def batches(
        self, status: int | None = None, *, acknowledged: bool = True
    ) -> list[dict[str, Any]]:
        """Decoded batches received: only those answered 2xx unless ``acknowledged`` is
        False, and only those answered ``status`` if given."""
        with self._lock:
            return [
                r.batch
                for r in self.received
                if r.batch is not None
                and (not acknowledged or 200 <= r.status < 300)
                and (status is None or r.status == status)
            ]

    def times(self) -> list[float]:
        """Arrival times (monotonic) of all requests, in order."""
        with self._lock:
            return [r.mono_s for r in self.received]

    def wait_for(self, n: int, timeout_s: float = 5.0) -> bool:
        """Wait until ``n`` requests were received."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.received) >= n:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def assert_accounting(exp: Exporter) -> dict[str, int]:
    """Check the exporter's conservation identities; return its total stats."""
    s = exp.stats()
    assert s["steps_produced"] == (
        s["steps_sent"] + s["steps_merged"] + s["steps_dropped"] + s["steps_buffered"]
    ), s
    assert s["requests_produced"] == (
        s["requests_sent"] + s["requests_dropped"] + s["requests_buffered"]
    ), s
    return s

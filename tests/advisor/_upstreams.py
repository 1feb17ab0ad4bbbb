"""Small real HTTP upstreams for the gateway tests: each counts the requests it is serving,
holds each POST until released (or for a fixed time), and can answer past a limit with 503
at once, as vLLM does at ``--max-num-queued-reqs``."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Upstream

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # health and model probes of a router
        self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        up = self.server
        with up.lock:
            if up.reject_all or (up.limit is not None and up.now >= up.limit):
                up.rejected += 1
                busy = True
            else:
                busy = False
                up.now += 1
                up.total += 1
                up.peak = max(up.peak, up.now)
        if busy:
            self._send(503, {"error": "busy"})
            return
        try:
            if up.hold_s is None:
                up.release.wait(30)
            else:
                time.sleep(up.hold_s)
        finally:
            with up.lock:
                up.now -= 1
        self._send(200, {"id": "x", "object": "text_completion", "choices": [{"text": "ok"}]})


class Upstream(ThreadingHTTPServer):
    """A stand-in replica on 127.0.0.1. ``hold_s``: how long a POST takes (None: until
    ``release`` is set); ``limit``: requests it serves at once before answering 503;
    ``reject_all``: answer every POST 503 (a replica at its admission limit)."""

    daemon_threads = True

    def __init__(
        self,
        *,
        hold_s: float | None = None,
        limit: int | None = None,
        reject_all: bool = False,
    ) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hold_s, self.limit, self.reject_all = hold_s, limit, reject_all
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.now = self.peak = self.total = self.rejected = 0
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()


def post(port: int, path: str = "/v1/completions", timeout_s: float = 60.0) -> tuple[int, bytes]:
    """One POST through the gateway (no proxies from the environment); (status, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1})
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class Burst:
    """``n`` POSTs sent at once from threads; ``statuses`` fills as they are answered."""

    def __init__(self, port: int, n: int, *, gap_s: float = 0.0) -> None:
        self.statuses: list[int] = []
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._one, args=(port,), daemon=True) for _ in range(n)
        ]
        for t in self._threads:
            t.start()
            if gap_s:
                time.sleep(gap_s)

    def _one(self, port: int) -> None:
        try:
            status, _ = post(port)
        except OSError:
            status = -1
        with self._lock:
            self.statuses.append(status)

    def answered(self) -> int:
        with self._lock:
            return len(self.statuses)

    def join(self, timeout_s: float = 60.0) -> list[int]:
        for t in self._threads:
            t.join(timeout_s)
        return sorted(self.statuses)


def settle(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    """Wait until ``condition`` holds (it reads counters other threads move)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the gateway did not settle")
        time.sleep(0.05)

"""Helpers for the plugin fault tests: a scripted HTTP server that timestamps every
request, step rows the way ``record()`` appends them, and reads of a real collector."""

from __future__ import annotations

import gzip
import json
import re
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from collector.process import CollectorProcess
from engine_plugins._config import Settings
from engine_plugins.exporter import EngineBuffer, Exporter

HELLO: dict[str, Any] = {
    "host": "fphost", "port": 9100, "pid": 1, "engine_index": 0, "pool": "fp",
    "model": "m", "started_unix_s": 1_700_000_000.0, "vllm_version": "0.32.0",
    "kvscope_version": "0.1.0", "num_gpu_blocks": 48, "block_size": 32, "max_num_seqs": 6,
    "max_num_batched_tokens": 512, "max_model_len": 512, "enable_prefix_caching": True,
    "kv_cache_dtype": "auto", "gpu_memory_utilization": 0.9, "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1, "data_parallel_size": 1,
}  # fmt: skip
ENGINE_ID = "fphost:9100:0"


def fp_settings(url: str, **kw: Any) -> Settings:
    """Settings for these tests: small caps and timeouts unless overridden."""
    base: dict[str, Any] = dict(
        collector_url=url, host="fphost", port=9100, flush_interval_s=0.1,
        buffer_steps=5_000, buffer_requests=5_000, max_pending_batches=10,
        timeout_s=1.0, shutdown_timeout_s=1.0,
    )  # fmt: skip
    base.update(kw)
    return Settings(**base)


def fp_exporter(url: str, **kw: Any) -> tuple[Exporter, EngineBuffer]:
    exp = Exporter(fp_settings(url, **kw))
    return exp, exp.register(ENGINE_ID, dict(HELLO))


def push(eng: EngineBuffer, n_steps: int, ts_unix_s: float, n_requests: int = 0) -> None:
    """Append rows the way ``record()`` does (step rows as ``_adapter.step_row`` builds)."""
    for i in range(n_steps):
        eng.steps.append((ts_unix_s + i * 1e-4, i + 1, 4, 1, 0, 0.5, 10, 5, 0, 3, 2, 9.0))
        eng.steps_produced += 1
    for _ in range(n_requests):
        eng.requests.append((ts_unix_s, 1.0, 0.0, 0.1, 0.9, None, 10, 5, 0, 0, "stop"))
        eng.requests_produced += 1


def check_accounting(exp: Exporter) -> dict[str, int]:
    s = exp.stats()
    assert s["steps_produced"] == (
        s["steps_sent"] + s["steps_merged"] + s["steps_dropped"] + s["steps_buffered"]
    ), s
    assert s["requests_produced"] == (
        s["requests_sent"] + s["requests_dropped"] + s["requests_buffered"]
    ), s
    return s


class ScriptedServer:
    """A real HTTP/1.1 server on 127.0.0.1 answering POSTs as scripted.

    ``answer(status, headers)`` is used for every request until changed. Each request
    is kept with its arrival time (monotonic) and decoded batch.
    """

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, int, dict[str, Any] | None]] = []
        self.script: deque[tuple[int, dict[str, str]]] = deque()
        self.default: tuple[int, dict[str, str]] = (200, {})
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                now = time.monotonic()
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                try:
                    batch = json.loads(gzip.decompress(raw))
                except Exception:
                    batch = None
                with server._lock:
                    status, headers = server.script.popleft() if server.script else server.default
                    server.arrivals.append((now, status, batch))
                body = json.dumps({"status": "stored", "need_hello": False} if status < 300
                                  else {"error": f"scripted {status}"}).encode()  # fmt: skip
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def times(self) -> list[float]:
        with self._lock:
            return [t for t, _, _ in self.arrivals]

    def batches(self, status: int | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [b for _, s, b in self.arrivals
                    if b is not None and (status is None or s == status)]  # fmt: skip

    def wait_for(self, n: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.arrivals) >= n:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def stored_counts(collector: CollectorProcess) -> tuple[dict[str, int], dict[str, int]]:
    """Steps and finished requests stored per engine, read through the query API."""
    steps = {r["engine_id"]: int(r["n_steps"])
             for r in collector.get_json("/v1/totals", params={"source": "steps"})["rows"]}
    reqs = {r["engine_id"]: int(r["n_requests"]) for r in collector.get_json(
        "/v1/request_stats", params={"since": "0", "group_by": "engine"})["rows"]}  # fmt: skip
    return steps, reqs


_SAMPLE = re.compile(r'^(\w+)\{([^}]*)\} (\S+)$')


def metric(collector: CollectorProcess, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` on the collector's /metrics with these labels."""
    total, found = 0.0, False
    for line in collector.get_text("/metrics").splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    if not found:
        raise AssertionError(f"{name}{labels} not on the collector's /metrics")
    return total

"""Shared pieces of the collector fault-injection tests: a real collector process, raw
HTTP requests, valid batches, memory readings and /metrics parsing."""

from __future__ import annotations

import http.client
import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "collector"))

from _collector_helpers import batch, encode, hello

from kvscope.collector.process import CollectorProcess

__all__ = [
    "QUIET",
    "RssSampler",
    "batch",
    "counter",
    "encode",
    "hello",
    "post",
    "request",
    "rss_bytes",
    "start_collector",
    "unique_steps_batch",
]

QUIET = [
    "--kv-events",
    "off",
    "--advise-interval-s",
    "0",
    "--raw-retention-s",
    "0",
    "--max-backfill",
    "0",
]
"""Flags that keep a test collector to the ingest path (no KV-event subscriber, no
advisor thread, no retention of the old test timestamps, which the door accepts)."""


def start_collector(
    store: Path, *extra: str, token: str | None = None, port: int | None = None
) -> CollectorProcess:
    """A started ``kvscope collector`` process on a loopback port."""
    return CollectorProcess(store, token=token, port=port, extra_args=[*QUIET, *extra]).start()


def request(
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request on a fresh connection: (status, lower-cased headers, body)."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def post(
    url: str, obj: Any, *, token: str | None = None, compress: bool = True, timeout_s: float = 30.0
) -> tuple[int, dict[str, str], bytes]:
    """POST one batch as the plugin does (gzip JSON)."""
    headers = {"Content-Type": "application/json"}
    if compress:
        headers["Content-Encoding"] = "gzip"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return request(url, "POST", "/v1/ingest", encode(obj, compress=compress), headers, timeout_s)


def unique_steps_batch(
    engine_id: str, seq: int, n_steps: int, t0: float, with_hello: bool = False
) -> dict[str, Any]:
    """A valid batch whose step numbers (``seq * n_steps + i``) are unique per engine, so a
    stored duplicate would show as a repeated step."""
    b = batch(
        engine_id,
        "boot-1",
        seq,
        with_hello=with_hello,
        step_ts=[t0 + seq + i / n_steps for i in range(n_steps)],
    )
    b["steps"]["step"] = [seq * n_steps + i for i in range(n_steps)]
    return b


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class RssSampler(threading.Thread):
    """Samples a process's RSS every 10 ms until ``stop`` is set; keeps the peak."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(0.01)


def counter(metrics_text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of a /metrics text, None if absent."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pat = re.compile(
        rf"^{re.escape(name)}(?:{{{re.escape(want)}}})? (\S+)$"
        if want
        else rf"^{re.escape(name)} (\S+)$",
        re.M,
    )
    m = pat.search(metrics_text)
    return float(m.group(1)) if m else None


def wait_drained(c: CollectorProcess, timeout_s: float = 60.0) -> float:
    """Wait until the writer has no pending batch; return the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if json.loads(c.request("/healthz")[1])["pending_batches"] == 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"the writer did not drain in {timeout_s:g} s")

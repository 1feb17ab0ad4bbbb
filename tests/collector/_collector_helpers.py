"""Building valid wire batches for the collector tests."""

from __future__ import annotations

import gzip
import json
from typing import Any

from kvscope.engine_plugins.schema import SCHEMA_VERSION


def hello(engine_id: str, boot_id: str, **over: Any) -> dict[str, Any]:
    """A complete, valid hello record."""
    h: dict[str, Any] = {
        "engine_id": engine_id,
        "boot_id": boot_id,
        "host": "node-1",
        "port": 8000,
        "pid": 4242,
        "engine_index": 0,
        "pool": "pool-a",
        "model": "qwen-0.5b",
        "started_unix_s": 1_700_000_000.0,
        "vllm_version": "0.32.0",
        "kvscope_version": "0.1.0",
        "num_gpu_blocks": 1000,
        "block_size": 16,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "max_model_len": 4096,
        "enable_prefix_caching": True,
        "kv_cache_dtype": "auto",
        "gpu_memory_utilization": 0.9,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
    }
    h.update(over)
    return h


def steps(
    ts: list[float], *, batch: list[int] | None = None, **cols: list[Any]
) -> dict[str, list[Any]]:
    """Step columns for the given timestamps; other columns default to simple values."""
    n = len(ts)
    out: dict[str, list[Any]] = {
        "ts_unix_s": list(ts),
        "step": list(range(n)),
        "batch_size": batch if batch is not None else [i % 7 + 1 for i in range(n)],
        "waiting": [i % 3 for i in range(n)],
        "deferred": [0] * n,
        "kv_usage_ratio": [round((i % 10) / 10 + 0.05, 3) for i in range(n)],
        "kv_blocks_used": [(i % 10) * 100 + 50 for i in range(n)],
        "prefix_queries": [100] * n,
        "prefix_hits": [i % 100 for i in range(n)],
        "preemptions": [1 if i % 5 == 0 else 0 for i in range(n)],
        "prompt_tokens": [10 * (i % 4) for i in range(n)],
        "generation_tokens": [i % 7 + 1 for i in range(n)],
        "iteration_s": [0.02 if i % 2 else None for i in range(n)],
    }
    out.update(cols)
    return out


def requests(finished: list[float], **cols: list[Any]) -> dict[str, list[Any]]:
    """Request columns for the given finish times."""
    n = len(finished)
    out: dict[str, list[Any]] = {
        "finished_unix_s": list(finished),
        "e2e_s": [1.0 + i for i in range(n)],
        "queue_s": [0.1 * i for i in range(n)],
        "prefill_s": [0.05] * n,
        "decode_s": [0.5 + i for i in range(n)],
        "ttft_s": [0.2 + 0.1 * i if i % 3 else None for i in range(n)],
        "prompt_tokens": [100 + i for i in range(n)],
        "generation_tokens": [50 + i for i in range(n)],
        "cached_tokens": [16 * (i % 3) for i in range(n)],
        "preemptions": [i % 2 for i in range(n)],
        "finish_reason": ["stop" if i % 4 else "length" for i in range(n)],
    }
    out.update(cols)
    return out


def batch(
    engine_id: str = "host-a:8000:0",
    boot_id: str = "boot-1",
    seq: int = 0,
    *,
    with_hello: bool = False,
    step_ts: list[float] | None = None,
    req_ts: list[float] | None = None,
    exporter: dict[str, int] | None = None,
    **over: Any,
) -> dict[str, Any]:
    """A valid batch (dict) with optional hello, steps and requests."""
    b: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "engine_id": engine_id,
        "boot_id": boot_id,
        "seq": seq,
        "sent_unix_s": 1_700_000_100.0,
        "hello": hello(engine_id, boot_id) if with_hello else None,
        "steps": steps(step_ts) if step_ts else {},
        "requests": requests(req_ts) if req_ts else {},
        "exporter": exporter
        if exporter is not None
        else {
            "dropped_steps": 0,
            "dropped_requests": 0,
            "dropped_batches": 0,
            "send_failures": 0,
            "record_errors": 0,
        },
    }
    b.update(over)
    return b


def encode(obj: Any, *, compress: bool = True) -> bytes:
    """JSON (and gzip) as the plugin sends it."""
    raw = json.dumps(obj).encode()
    return gzip.compress(raw) if compress else raw


class LiveCollector:
    """A real collector on a loopback port, its event loop in a background thread."""

    def __init__(self, settings: Any, store: Any = None) -> None:
        import asyncio
        import threading

        from kvscope.collector.server import start

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="test-collector", daemon=True
        )
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(start(settings, store), self.loop)
        self.running = fut.result(timeout=30)
        self.url = self.running.url
        self.settings = settings

    @property
    def store(self) -> Any:
        return self.running.ctx.store

    @property
    def state(self) -> Any:
        return self.running.ctx.state

    def stop(self) -> None:
        import asyncio

        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.running.stop(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def http(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> tuple[int, dict[str, str], bytes]:
    """One real HTTP request; returns (status, headers, body)."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout_s)
    try:
        path = u.path + (f"?{u.query}" if u.query else "")
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def post_batch(
    base_url: str,
    obj: Any,
    *,
    compress: bool = True,
    token: str | None = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """POST a batch to /v1/ingest; returns (status, decoded JSON answer)."""
    body = raw if raw is not None else encode(obj, compress=compress)
    h = {"Content-Type": "application/json"}
    if compress and raw is None:
        h["Content-Encoding"] = "gzip"
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    h.update(headers or {})
    status, _, data = http("POST", base_url + "/v1/ingest", body, h)
    return status, json.loads(data) if data else None


def get_json(base_url: str, path: str) -> tuple[int, Any]:
    """GET a JSON endpoint."""
    status, _, data = http("GET", base_url + path)
    return status, json.loads(data)

"""Helpers for the plugin fault tests: step rows the way ``record()`` appends them, and
reads of a real collector (the scripted HTTP server is in tests/_plugin_testkit.py)."""

from __future__ import annotations

import re
from typing import Any

from _plugin_testkit import make_settings

from kvscope.collector.process import CollectorProcess
from kvscope.engine_plugins._config import Settings
from kvscope.engine_plugins.exporter import EngineBuffer, Exporter

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
    """Settings for these tests: this host and port, larger buffers, else as
    :func:`make_settings`."""
    base: dict[str, Any] = dict(host="fphost", port=9100, buffer_steps=5_000, buffer_requests=5_000)
    return make_settings(url, **{**base, **kw})


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


def stored_counts(collector: CollectorProcess) -> tuple[dict[str, int], dict[str, int]]:
    """Steps and finished requests stored per engine, read through the query API."""
    steps = {
        r["engine_id"]: int(r["n_steps"])
        for r in collector.get_json("/v1/totals", params={"source": "steps"})["rows"]
    }
    reqs = {
        r["engine_id"]: int(r["n_requests"])
        for r in collector.get_json(
            "/v1/request_stats", params={"since": "0", "group_by": "engine"}
        )["rows"]
    }
    return steps, reqs


_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$")


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

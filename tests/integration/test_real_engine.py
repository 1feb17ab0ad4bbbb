"""The real vLLM CPU engine streams per-step telemetry through kvscope.

The engine runs with the kvscope plugin installed (entry point), a collector in its
own process, and a short concurrency sweep that drives it into KV-cache overload.
What the collector stored must agree with vLLM's own /metrics counters exactly.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request

import pytest

from kvscope.collector.process import CollectorProcess
from kvscope.lab.engine import parse_prometheus_text

from .conftest import (
    BLOCK_SIZE,
    MAX_NUM_SEQS,
    MODEL_NAME,
    NUM_GPU_BLOCKS,
    OVERLOAD_LEVELS,
    POOL,
    OverloadRun,
    collector_totals,
    vllm_totals,
    wait_until_equal,
)

pytestmark = pytest.mark.engine


def test_sweep_completed_every_level_without_errors(overload_run: OverloadRun):
    levels = overload_run.sweep.levels
    assert [lv.concurrency for lv in levels] == OVERLOAD_LEVELS
    for lv in levels:
        assert lv.error_count == 0, lv
        assert lv.requests_completed > 0, lv


def test_stored_totals_equal_vllm_counters(overload_run: OverloadRun):
    vllm, kvscope = overload_run.settled_totals()
    assert kvscope == vllm, f"kvscope {kvscope} != vLLM {vllm}"
    # The comparison is not vacuous: the run produced all of these.
    for key in (
        "prompt_tokens",
        "generation_tokens",
        "prefix_queries",
        "prefix_hits",
        "finished_requests",
    ):
        assert vllm[key] > 0, key


def test_overload_saturates_the_kv_cache_and_preempts(overload_run: OverloadRun):
    windows = overload_run.collector.get_json(
        "/v1/windows", params={"since": "0", "format": "columns", "limit": 1_000_000}
    )["columns"]
    assert max(windows["kv_usage_max"]) >= 0.95
    assert max(windows["waiting_max"]) > 0
    assert overload_run.vllm_after["preemptions"] > 0


def test_batch_size_never_exceeds_max_num_seqs(overload_run: OverloadRun):
    steps = overload_run.collector.get_json(
        "/v1/steps", params={"since": "0", "format": "columns", "limit": 1_000_000}
    )["columns"]
    assert len(steps["batch_size"]) > 100
    assert 0 < max(steps["batch_size"]) <= MAX_NUM_SEQS
    blocks = NUM_GPU_BLOCKS
    assert max(steps["kv_blocks_used"]) <= blocks


def test_engine_hello_carries_identity_and_configuration(overload_run: OverloadRun):
    engines = overload_run.collector.get_json("/v1/engines")["rows"]
    assert len(engines) == 1
    e = engines[0]
    assert e["pool"] == POOL
    assert e["model"] == MODEL_NAME
    assert e["engine_id"].endswith(f":{overload_run.server.port}:0")
    assert e["pid"] == overload_run.server.pid
    assert e["num_gpu_blocks"] == NUM_GPU_BLOCKS
    assert e["block_size"] == BLOCK_SIZE
    assert e["max_num_seqs"] == MAX_NUM_SEQS
    assert e["max_model_len"] == overload_run.server.max_model_len
    assert e["enable_prefix_caching"] is True
    assert e["vllm_version"].startswith("0.32")


def test_metrics_endpoint_passes_promtool_and_matches_vllm(overload_run: OverloadRun):
    vllm, _ = overload_run.settled_totals()
    text = overload_run.collector.get_text("/metrics")
    check = subprocess.run(
        ["promtool", "check", "metrics"], input=text.encode(), capture_output=True, timeout=60
    )
    # promtool exits 0 when the exposition is valid (lint warnings go to stdout).
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    samples = parse_prometheus_text(text)

    def value(name: str) -> float:
        vals = [v for (n, labels), v in samples.items() if n == name and ("pool", POOL) in labels]
        assert vals, f"{name} missing for pool {POOL}"
        return sum(vals)

    assert value("kvscope_engine_generation_tokens_total") == vllm["generation_tokens"]
    assert value("kvscope_engine_preemptions_total") == vllm["preemptions"]
    assert value("kvscope_engine_step_kv_usage_ratio_count") == value("kvscope_engine_steps_total")
    assert value("kvscope_engine_step_batch_size_count") > 100


def test_sweep_cli_against_the_real_server(overload_run: OverloadRun, tmp_path):
    """`kvscope sweep` from the command line; runs after the tests that compare totals."""
    import sys

    out_json = tmp_path / "sweep.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope.cli.main",
            "sweep",
            "--url",
            overload_run.server.url,
            "--concurrency",
            "1,4",
            "--duration",
            "2",
            "--warmup",
            "0.5",
            "--no-progress",
            "--out",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out_json.read_text())
    assert result["model"] == MODEL_NAME
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 4]
    assert all(lv["output_tokens_per_s"] > 0 for lv in result["levels"])
    assert "out tok/s" in proc.stdout


def test_engine_keeps_serving_when_the_collector_goes_away(overload_run: OverloadRun):
    """Kill the collector, keep using the engine, bring the collector back."""
    collector, server = overload_run.collector, overload_run.server
    collector.stop(sig=signal.SIGKILL)
    t0 = time.monotonic()
    for i in range(4):
        body = json.dumps(
            {"model": MODEL_NAME, "prompt": f"hello world {i}", "max_tokens": 16}
        ).encode()
        req = urllib.request.Request(
            server.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
            assert json.loads(resp.read())["choices"][0]["text"] is not None
    assert time.monotonic() - t0 < 30
    assert server.healthy()
    # The collector comes back on the same store; the exporter's retained batches
    # arrive and the totals agree with vLLM's again.
    revived = CollectorProcess(
        collector.store_path, port=collector.port, log_path=overload_run.workdir / "collector2.log"
    )
    revived.start()
    overload_run.collector = revived
    vllm, kvscope = wait_until_equal(
        lambda: vllm_totals(server.metrics_text()), lambda: collector_totals(revived), timeout_s=30
    )
    assert kvscope == vllm

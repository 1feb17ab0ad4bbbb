"""Session fixtures that run the real vLLM CPU engine with the kvscope plugin.

One engine start costs 40-60 s on these machines, so the overload run is made once
per test session and every test reads what it left: the collector's store (through
its HTTP API), vLLM's own /metrics before and after, and the sweep's results.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from collector.lab import VllmServer, build_model, default_model_dir, vllm_counter_totals
from collector.process import CollectorProcess
from collector.sweep import SweepConfig, SweepResult, run_sweep

MAX_NUM_SEQS = 16
NUM_GPU_BLOCKS = 48
BLOCK_SIZE = 32
POOL = "it-pool"
MODEL_NAME = "kvscope-it"


@dataclass
class OverloadRun:
    collector: CollectorProcess
    server: VllmServer
    sweep: SweepResult
    vllm_before: dict[str, float]
    vllm_after: dict[str, float]
    workdir: Path

    def kvscope_totals(self) -> dict[str, float]:
        return collector_totals(self.collector)


def collector_totals(collector: CollectorProcess) -> dict[str, float]:
    """Sums over every stored step and request, read through the query API.

    Step sums come from the raw steps and, separately, from the 1-second windows;
    both must agree or the windows are not exact.
    """
    def sums(source: str) -> dict[str, float]:
        rows = collector.get_json("/v1/totals", params={"source": source})["rows"]
        return {k: float(sum(r[k] for r in rows)) for k in
                ("preemptions", "prompt_tokens", "generation_tokens", "prefix_queries",
                 "prefix_hits")}

    # Two reads are two snapshots: while batches still arrive the windows (read second)
    # may hold more than the steps. Re-read until a window read is bracketed by two
    # equal step reads; then the two sources must agree.
    for _ in range(40):
        from_steps, from_windows = sums("steps"), sums("windows")
        if sums("steps") == from_steps:
            break
        time.sleep(0.25)
    assert from_steps == from_windows, (from_steps, from_windows)
    stats = collector.get_json("/v1/request_stats",
                               params={"since": "0", "group_by": "all"})["rows"]
    from_steps["finished_requests"] = float(stats[0]["n_requests"]) if stats else 0.0
    return from_steps


def vllm_totals(metrics_text: str) -> dict[str, float]:
    t = vllm_counter_totals(metrics_text)
    return {
        "preemptions": t["vllm:num_preemptions_total"],
        "prompt_tokens": t["vllm:prompt_tokens_total"],
        "generation_tokens": t["vllm:generation_tokens_total"],
        "prefix_queries": t["vllm:prefix_cache_queries_total"],
        "prefix_hits": t["vllm:prefix_cache_hits_total"],
        "finished_requests": t["vllm:request_success_total"],
    }


def wait_until_equal(read_a, read_b, timeout_s: float = 20.0) -> tuple[Any, Any]:
    """Poll until two readings agree (the exporter ships every ~1 s) or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        a, b = read_a(), read_b()
        if a == b or time.monotonic() > deadline:
            return a, b
        time.sleep(0.5)


@pytest.fixture(scope="session")
def mid_model() -> Path:
    return build_model(default_model_dir("mid"), "mid")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_model(default_model_dir("tiny"), "tiny")


@pytest.fixture(scope="session")
def overload_run(mid_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OverloadRun]:
    """A KV-starved engine (48 blocks of 32 tokens) driven past its plateau."""
    workdir = tmp_path_factory.mktemp("overload")
    collector = CollectorProcess(workdir / "store.duckdb", log_path=workdir / "collector.log")
    collector.start()
    server = VllmServer(
        mid_model,
        served_model_name=MODEL_NAME,
        num_gpu_blocks=NUM_GPU_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
        enable_prefix_caching=True,
        env={
            "KVSCOPE_COLLECTOR_URL": collector.url,
            "KVSCOPE_POOL": POOL,
            "KVSCOPE_FLUSH_INTERVAL_S": "0.5",
        },
        log_path=workdir / "vllm.log",
    )
    run: OverloadRun | None = None
    try:
        server.start()
        before = vllm_totals(server.metrics_text())
        sweep = run_sweep(
            SweepConfig(
                url=server.url, model=MODEL_NAME, concurrency=[2, 8, 32], duration_s=6.0,
                warmup_s=1.0, cooldown_s=0.5, prompt_words=(8, 40), output_tokens=(96, 128),
                shared_prefix_words=64, prefix_groups=4, seed=7, progress=False,
            )
        )
        after, _ = wait_until_equal(
            lambda: vllm_totals(server.metrics_text()),
            lambda: collector_totals(collector),
        )
        run = OverloadRun(collector, server, sweep, before, after, workdir)
        yield run
    finally:
        server.stop()
        collector.stop()
        if run is not None and run.collector is not collector:
            run.collector.stop()  # a test may have replaced it with a revived one

"""The advisor on GPU-scale engines, with vLLM's scheduler deciding what happens.

Each test sweeps a twin of a GPU engine (tens of thousands of KV blocks, batches in the
hundreds, the published traces' request lengths), feeds it through the real plugin into
a real collector, and reads the advisor's verdict back over HTTP. The expected class is
not taken from the advisor's formulas: a control sweep on the same twin lifts the
suspected limit (eight times the blocks, or ``max_num_seqs``), and the limit is the
one whose lifting raises the plateau.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvscope.advisor import CollectorSource, EngineVerdict, analyze
from kvscope.collector.process import CollectorProcess
from kvscope.twin.feed import CollectorFeed
from kvscope.twin.shape import EngineShape, blocks_for, build_vllm_config, model_shape
from kvscope.twin.steptime import GPUS, RooflineStepCost
from kvscope.twin.streams import from_trace
from kvscope.twin.sweep import SweepResult, sweep

TRACES = Path(__file__).resolve().parents[2] / "traces"
MODEL = model_shape("llama-3.1-8b")
SECONDS = 60.0
AZURE = "AzureLLMInferenceTrace_conv.csv"


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorProcess]:
    d = tmp_path_factory.mktemp("gpu-scale")
    c = CollectorProcess(d / "store.duckdb", extra_args=["--kv-events", "off"]).start()
    yield c
    c.stop()


def _sweep(
    collector: CollectorProcess | None,
    shape: EngineShape,
    gpu: str,
    trace: str,
    levels: list[int],
    pool: str,
) -> tuple[SweepResult, float]:
    reqs = from_trace(TRACES / trace)
    start = time.time() - len(levels) * SECONDS - 300
    sink = None
    if collector is not None:
        sink = CollectorFeed(
            collector.url,
            build_vllm_config(shape),
            engine_id=f"{pool}:0",
            pool=pool,
            start_unix_s=start,
        )
    cost = RooflineStepCost(MODEL, GPUS[gpu])
    res = sweep(shape, cost, reqs, levels, seconds_per_level=SECONDS, sink=sink, start_unix_s=start)
    return res, start


def _verdict(collector: CollectorProcess, pool: str, since: float) -> EngineVerdict:
    report = analyze(CollectorSource(collector.url), since=since, pool=f"{pool}-twin")
    assert len(report.engines) == 1
    return report.engines[0]


def test_an_l40s_at_half_its_memory_is_kv_cache_bound(collector: CollectorProcess) -> None:
    # Azure conversations (~1,000-token prompts, ~250 outputs) on an 8B model on one L40S
    # with --gpu-memory-utilization 0.5: ~4,000 blocks, room for ~50 such requests.
    blocks = blocks_for(MODEL, GPUS["l40s"].memory_bytes, gpu_memory_utilization=0.5)
    shape = EngineShape(MODEL, num_gpu_blocks=blocks)
    levels = [8, 16, 32, 64, 128, 192]
    res, since = _sweep(collector, shape, "l40s", AZURE, levels, "l40s-kv")
    control, _ = _sweep(None, shape.with_(num_gpu_blocks=8 * blocks), "l40s", AZURE, [192], "x")
    top = res.levels[-1]
    assert top.kv_usage_mean > 0.9 and top.mean_waiting > 50
    # The control: eight times the blocks lifts the plateau, so the cache binds.
    assert control.levels[0].output_tokens_per_s > 1.3 * top.output_tokens_per_s
    v = _verdict(collector, "l40s-kv", since)
    assert v.bottleneck == "kv_cache_bound", v
    assert v.saturated and v.recommended_concurrency_cap is not None
    # The cap sits where the cache fills (~50 requests), not at the top load.
    assert 24 <= v.recommended_concurrency_cap <= 96, v


def test_a_low_max_num_seqs_on_an_a100_binds_before_the_cache(collector: CollectorProcess) -> None:
    # The same requests on an A100 with ~26,000 blocks, but --max-num-seqs 16.
    blocks = blocks_for(MODEL, GPUS["a100-80gb"].memory_bytes)
    shape = EngineShape(MODEL, num_gpu_blocks=blocks, max_num_seqs=16)
    levels = [4, 8, 16, 32, 64, 128]
    res, since = _sweep(collector, shape, "a100-80gb", AZURE, levels, "a100-seqs")
    control, _ = _sweep(None, shape.with_(max_num_seqs=256), "a100-80gb", AZURE, [128], "x")
    top = res.levels[-1]
    assert top.mean_running <= 16 and top.kv_usage_mean < 0.2
    assert control.levels[0].output_tokens_per_s > 1.5 * top.output_tokens_per_s
    v = _verdict(collector, "a100-seqs", since)
    assert v.bottleneck == "max_num_seqs_bound", v

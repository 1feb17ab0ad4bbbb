"""Cost of kvscope's ``record()`` against vLLM's own stat loggers, on the same objects.

Builds a real ``VllmConfig`` (a tiny local Llama config, no weights), vLLM's
``PrometheusStatLogger`` (once: it registers global prometheus_client metrics) and
``LoggingStatLogger``, and kvscope's ``KvscopeStatLogger`` with its exporter
running for real: ``KVSCOPE_COLLECTOR_URL`` points at a throwaway local HTTP server
that accepts every batch, so the exporter thread drains, encodes and posts while
``record()`` is measured.

Two cases, with real ``SchedulerStats`` / ``IterationStats`` of a decode step of
batch 12 (one prefill among them): without finished requests, and with 3.

Method: per logger and case, ``--rounds`` rounds of ``--calls`` calls each,
loggers interleaved within a round; a round's mean ns per call is one sample;
the table shows the median and p90 over rounds. The loop overhead (~30-60 ns) is
included for every logger alike. The garbage collector is paused while timing.

Usage::

    python bench/bench_record.py [--rounds 200] [--calls 200]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 768,
    "intermediate_size": 2048, "num_attention_heads": 12, "num_key_value_heads": 4,
    "num_hidden_layers": 6, "vocab_size": 512, "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
}  # fmt: skip

BATCH = 12
TARGET_RATIO = 0.10


class _Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    batches = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        type(self).batches += 1
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def start_sink() -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def make_vllm_config(model_dir: Path) -> Any:
    from vllm.config import ModelConfig, VllmConfig

    (model_dir / "config.json").write_text(json.dumps(_TINY_LLAMA))
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, served_model_name="bench")
    cfg = VllmConfig(model_config=model)
    cfg.cache_config.num_gpu_blocks = 48
    return cfg


def make_stats(n_finished: int) -> tuple[Any, Any]:
    """Real stats of one decode step of BATCH requests, one of them prefilling."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import (
        FinishedRequestStats,
        IterationStats,
        PrefillStats,
        PrefixCacheStats,
        SchedulerStats,
    )

    pcs = PrefixCacheStats()
    pcs.record(num_tokens=130, num_hits=64, preempted=False)
    sched = SchedulerStats(
        num_running_reqs=BATCH, num_waiting_reqs=3, kv_cache_usage=0.83, prefix_cache_stats=pcs
    )
    it = IterationStats()
    it.num_generation_tokens = BATCH
    ps = PrefillStats()
    ps.set(num_prompt_tokens=130, num_local_cached_tokens=64, num_external_cached_tokens=0)
    it.prompt_token_stats.update_from_output(ps)
    it.time_to_first_tokens_iter.append(0.21)
    it.inter_token_latencies_iter.extend([0.011] * (BATCH - 1))
    for i in range(n_finished):
        it.finished_requests.append(
            FinishedRequestStats(
                finish_reason=FinishReason.LENGTH,
                request_id=f"r{i}",
                e2e_latency=3.2,
                num_prompt_tokens=130,
                num_generation_tokens=128,
                max_tokens_param=128,
                queued_time=0.4,
                prefill_time=0.05,
                inference_time=2.8,
                decode_time=2.75,
                mean_time_per_output_token=0.0216,
                num_cached_tokens=64,
            )
        )
    return sched, it


def time_round(record: Callable[..., Any], sched: Any, it: Any, calls: int) -> float:
    """Mean ns per call over ``calls`` calls."""
    rng = range(calls)
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        for _ in rng:
            record(sched, it, None, 0)
        t1 = time.perf_counter_ns()
    finally:
        gc.enable()
    return (t1 - t0) / calls


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)

    sink = start_sink()
    os.environ["KVSCOPE_COLLECTOR_URL"] = f"http://127.0.0.1:{sink.server_address[1]}"
    # A buffer sized like a busy engine's few seconds: the bench calls record()
    # ~10^5-10^6 times a second, far above any engine, and the exporter should
    # not spend its time encoding that flood while record() is being timed.
    os.environ.setdefault("KVSCOPE_BUFFER_STEPS", "5000")
    os.environ.setdefault("KVSCOPE_BUFFER_REQUESTS", "5000")

    import vllm
    from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger

    from kvscope.engine_plugins.exporter import current_exporter
    from kvscope.engine_plugins.plugin import KvscopeStatLogger

    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_vllm_config(Path(tmp))
    prom = PrometheusStatLogger(cfg, [0])
    logging_logger = LoggingStatLogger(cfg, 0)
    kvscope = KvscopeStatLogger(cfg, 0)
    exporter = current_exporter()
    assert exporter is not None and exporter.running, "the kvscope exporter is not running"

    loggers: dict[str, Callable[..., Any]] = {
        "kvscope KvscopeStatLogger": kvscope.record,
        "vLLM PrometheusStatLogger": prom.record,
        "vLLM LoggingStatLogger": logging_logger.record,
    }
    cases = {"step, no finished requests": 0, "step, 3 finished requests": 3}

    print(
        f"vLLM {vllm.__version__}, Python {sys.version.split()[0]}, "
        f"{args.rounds} rounds x {args.calls} calls, exporter active"
    )
    print()
    header = f"{'case':<30} {'logger':<27} {'median ns':>10} {'p90 ns':>10}"
    print(header)
    print("-" * len(header))
    ratios: dict[str, float] = {}
    for case, n_finished in cases.items():
        sched, it = make_stats(n_finished)
        for record in loggers.values():  # warm-up
            time_round(record, sched, it, args.calls)
        samples: dict[str, list[float]] = {name: [] for name in loggers}
        for _ in range(args.rounds):
            for name, record in loggers.items():
                samples[name].append(time_round(record, sched, it, args.calls))
            time.sleep(0)  # let the exporter thread run between rounds, as vLLM would
        medians = {name: statistics.median(v) for name, v in samples.items()}
        for name, values in samples.items():
            print(f"{case:<30} {name:<27} {medians[name]:>10.0f} {p90(values):>10.0f}")
        ratios[case] = medians["kvscope KvscopeStatLogger"] / medians["vLLM PrometheusStatLogger"]
        print()

    for case, ratio in ratios.items():
        verdict = "ok" if ratio <= TARGET_RATIO else "ABOVE TARGET"
        print(
            f"ratio kvscope / vLLM Prometheus, {case:<28} {ratio:6.3f}  "
            f"(target <= {TARGET_RATIO:.2f}: {verdict})"
        )

    exporter.shutdown(2.0)
    stats = exporter.stats()
    print()
    print(
        f"exporter: {stats['batches_sent']} batches sent ({_Sink.batches} received), "
        f"{stats['steps_sent']} steps sent, {stats['steps_dropped']} dropped by the "
        f"bounded buffer, {stats['record_errors']} record errors"
    )
    sink.shutdown()
    return 0 if all(r <= TARGET_RATIO for r in ratios.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

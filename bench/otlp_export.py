"""What the OTLP export costs: per export against a /metrics scrape, and to ingest.

One command (about two minutes on a 2-core machine)::

    .venv/bin/python bench/otlp_export.py [--engines 100,1000] [--ingest-engines 300] [--rounds 3]

1. **Per export** (in process): a :class:`~kvscope.collector.metrics.FleetState` holding N
   engines, each fed two real batches of the recorded KV-starved vLLM run (the hello
   batch and one with steps) under its own engine id. Baseline: ``render()``, what
   one ``/metrics`` scrape costs. Then one OTLP export cycle on the calling thread
   (:meth:`OtlpExport.flush`: the SDK collects every observable instrument, the
   histograms are added, the batch is encoded and POSTed to a real OTLP/HTTP
   receiver on loopback that decodes it). Medians of ``--repeats`` runs; the table
   gives the ratio to the scrape and the request size.
2. **Ingest** (processes): a collector process per run, fed the same real batches as
   ``--ingest-engines`` engines (two batches each) by four sender threads, with the OTLP export off
   (baseline), on every second to a receiver answering 200, and on every second to a
   receiver answering 503. Batches per second and ack latency (median, P99) per
   configuration; medians over ``--rounds`` rounds, run in turn so drift on a shared
   machine spreads over all three.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvscope.collector._ingest import STORED, IngestResult  # noqa: E402
from kvscope.collector.batch import prepare_batch  # noqa: E402
from kvscope.collector.metrics import FleetState  # noqa: E402
from kvscope.collector.otlp import OtlpExport  # noqa: E402
from kvscope.collector.process import CollectorProcess  # noqa: E402
from kvscope.collector.settings import Settings  # noqa: E402
from kvscope.engine_plugins.schema import INGEST_PATH  # noqa: E402
from kvscope.lab.recording import load_recording, rebased  # noqa: E402

RECORDING = ROOT / "lab" / "recordings" / "overload_kv_starved.jsonl.gz"


class _Receiver(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, status: int = 200) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.status = status
        self.sizes: list[int] = []
        self.wire_sizes: list[int] = []
        self.points = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/metrics"

    def __enter__(self) -> _Receiver:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: _Receiver

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
        )

        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.server.status == 200:
            self.server.wire_sizes.append(len(body))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            req = ExportMetricsServiceRequest()
            req.ParseFromString(body)
            self.server.sizes.append(len(body))
            self.server.points = sum(
                len(getattr(m, m.WhichOneof("data")).data_points)
                for rm in req.resource_metrics
                for sm in rm.scope_metrics
                for m in sm.metrics
            )
        self.send_response(self.server.status)
        self.send_header("Content-Length", "0")
        self.end_headers()


def fleet_batches(n_engines: int) -> list[dict[str, Any]]:
    """Two real batches per engine (the hello batch and one with steps), renamed."""
    rec = load_recording(RECORDING)
    hello = rec.batches[0]
    steps = max(rec.batches[1:], key=lambda b: len(b.get("steps", {}).get("ts_unix_s", [])))
    shift = time.time() - 60 - max(steps["steps"]["ts_unix_s"])
    out = []
    for i in range(n_engines):
        for b in rebased([hello, steps], shift_s=shift, boot_ids={}):
            b["engine_id"] = f"bench-{i:05d}:8000:0"
            if b.get("hello"):
                b["hello"]["engine_id"] = b["engine_id"]
            out.append(b)
    return out


def median_ms(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def bench_export(engine_counts: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for n in engine_counts:
        state = FleetState(max_exported_engines=max(n, 2_000))
        prepared = [prepare_batch(copy.deepcopy(b), time.time()) for b in fleet_batches(n)]
        state.apply(prepared, [IngestResult(STORED, False)] * len(prepared))
        with _Receiver() as rx:
            settings = Settings(
                otlp_endpoint=rx.url, otlp_interval_s=3600, max_exported_engines=max(n, 2_000)
            )
            export = OtlpExport(settings, state).start()
            try:
                assert export.flush(), "the warm-up export failed"
                render = median_ms(state.render, repeats)
                snapshot = median_ms(state.snapshot, repeats)
                cycle = median_ms(export.flush, repeats)
            finally:
                export.shutdown()
            rows.append(
                {
                    "engines": n,
                    "render_ms": render,
                    "snapshot_ms": snapshot,
                    "export_ms": cycle,
                    "ratio": cycle / render,
                    "request_kib": statistics.median(rx.sizes) / 1024,
                    "wire_kib": statistics.median(rx.wire_sizes) / 1024,
                    "points": rx.points,
                }
            )
    return rows


def _post(url: str, body: bytes) -> float:
    req = urllib.request.Request(
        url + INGEST_PATH,
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
        assert resp.status == 200
    return time.perf_counter() - t0


def ingest_run(bodies: list[bytes], otlp_status: int | None, workdir: Path) -> dict[str, float]:
    with _Receiver(otlp_status or 200) as rx:
        extra = [
            "--kv-events",
            "off",
            "--advise-interval-s",
            "0",
            "--raw-retention-s",
            "0",
            "--max-new-engines-per-minute",
            "100000",
        ]
        if otlp_status is not None:
            extra += ["--otlp-endpoint", rx.url, "--otlp-interval", "1"]
        store = Path(tempfile.mkdtemp(dir=workdir)) / "kvscope.duckdb"
        with CollectorProcess(store, extra_args=extra) as c:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(4) as pool:
                lat = list(pool.map(lambda b: _post(c.url, b), bodies))
            elapsed = time.perf_counter() - t0
            time.sleep(1.5)  # let an export see the whole fleet
            m = c.get_text("/metrics")
        exports = {
            r: _sample(m, f'kvscope_collector_otlp_exports_total{{result="{r}"}}')
            for r in ("success", "failure")
        }
    lat.sort()
    return {
        "batches_per_s": len(bodies) / elapsed,
        "ack_p50_ms": lat[len(lat) // 2] * 1000,
        "ack_p99_ms": lat[int(len(lat) * 0.99)] * 1000,
        **exports,
    }


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def bench_ingest(n_engines: int, rounds: int) -> dict[str, dict[str, float]]:
    bodies = [
        gzip.compress(json.dumps(b, separators=(",", ":")).encode())
        for b in fleet_batches(n_engines)
    ]
    configs = {
        "OTLP off (baseline)": None,
        "OTLP every 1 s, receiver 200": 200,
        "OTLP every 1 s, receiver 503": 503,
    }
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, status in configs.items():
                print(f"  round {r + 1}/{rounds}: {name}", file=sys.stderr, flush=True)
                runs[name].append(ingest_run(bodies, status, Path(tmp)))
    return {
        name: {k: statistics.median(run[k] for run in rs) for k in rs[0]}
        for name, rs in runs.items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--engines",
        default="100,1000",
        help="fleet sizes for the per-export table (default: 100,1000)",
    )
    ap.add_argument("--repeats", type=int, default=7, help="runs per median (default: 7)")
    ap.add_argument(
        "--ingest-engines",
        type=int,
        default=300,
        help="engines of the ingest runs, two batches each (default: 300)",
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="ingest rounds per configuration (default: 3)"
    )
    args = ap.parse_args()
    print("per export (in process):", file=sys.stderr)
    rows = bench_export([int(x) for x in args.engines.split(",")], args.repeats)
    print(
        "\n| engines | /metrics render (baseline) | snapshot | OTLP export cycle "
        "(collect + encode + gzip + POST) | export / render | request (gzip) | data points |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['engines']} | {r['render_ms']:.1f} ms | {r['snapshot_ms']:.1f} ms | "
            f"{r['export_ms']:.1f} ms | {r['ratio']:.2f}x | {r['request_kib']:.0f} KiB "
            f"({r['wire_kib']:.0f} KiB) | "
            f"{r['points']} |"
        )
    if args.rounds < 1:
        return 0
    n = args.ingest_engines
    print(f"\ningest: {n} engines, {2 * n} real batches, 4 senders", file=sys.stderr)
    res = bench_ingest(n, args.rounds)
    base = res["OTLP off (baseline)"]["batches_per_s"]
    print(
        "\n| configuration | batches/s | vs baseline | ack p50 | ack p99 | exports ok | "
        "exports failed |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in res.items():
        print(
            f"| {name} | {r['batches_per_s']:.0f} | {r['batches_per_s'] / base:.2f}x | "
            f"{r['ack_p50_ms']:.1f} ms | {r['ack_p99_ms']:.1f} ms | {r['success']:.0f} | "
            f"{r['failure']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    raise SystemExit(run_stoppable(main))

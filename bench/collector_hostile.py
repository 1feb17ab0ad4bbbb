"""The collector under hostile load, nothing lost: 200 ingest connections at once, 200
slowloris connections, and ``kill -9`` several times meanwhile, restarting on the same store.

One command (about a minute)::

    .venv/bin/python bench/collector_hostile.py [--senders 200] [--slow 200] [--kills 5]

A real collector process (``kvscope collector``, a fresh store) takes ``--senders`` threads,
each an engine of its own on its own keep-alive connection, posting one batch after another
(10 steps each, stamped now, unique step numbers); ``--slow`` connections send a header byte
every second (slowloris) and are opened again when the collector closes them. While they
run, the collector is killed with SIGKILL ``--kills`` times at random moments and started
again on the same store and port; a sender whose batch got no answer or a 5xx/503/429 sends
the same batch again (same idempotency key), as the engine plugin does. At the end every
acknowledged batch must be stored exactly once: the stored steps equal 10 x the batches
acknowledged, per engine.

The table: the phase baseline (senders alone, no kill, no slowloris) against the hostile
phase: batches acknowledged per second, acknowledgement P50/P99, the collector's peak RSS,
slowloris connections the collector closed, and steps lost or stored twice (both must be 0).
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import random
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvscope.collector.process import CollectorProcess
from kvscope.engine_plugins.schema import INGEST_PATH, SCHEMA_VERSION

STEPS = 10


def _batch(engine_id: str, seq: int, with_hello: bool) -> bytes:
    now = time.time()
    hello = {
        "engine_id": engine_id, "boot_id": "b1", "host": "h", "port": 8000, "pid": 1,
        "engine_index": 0, "pool": "hostile", "model": "m", "started_unix_s": now - 60,
        "vllm_version": "0.32.0", "kvscope_version": "0", "num_gpu_blocks": 100,
        "block_size": 16, "max_num_seqs": 256, "max_num_batched_tokens": 2048,
        "max_model_len": 4096, "enable_prefix_caching": True, "kv_cache_dtype": "auto",
        "gpu_memory_utilization": 0.9, "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1, "data_parallel_size": 1,
    }  # fmt: skip
    steps = {
        "ts_unix_s": [now - 1 + i / STEPS for i in range(STEPS)],
        "step": [seq * STEPS + i for i in range(STEPS)],
        "batch_size": [4] * STEPS, "waiting": [0] * STEPS, "deferred": [0] * STEPS,
        "kv_usage_ratio": [0.5] * STEPS, "kv_blocks_used": [50] * STEPS,
        "prefix_queries": [0] * STEPS, "prefix_hits": [0] * STEPS,
        "preemptions": [0] * STEPS, "prompt_tokens": [8] * STEPS,
        "generation_tokens": [4] * STEPS, "iteration_s": [0.01] * STEPS,
    }  # fmt: skip
    b = {
        "schema_version": SCHEMA_VERSION, "engine_id": engine_id, "boot_id": "b1",
        "seq": seq, "sent_unix_s": now, "hello": hello if with_hello else None,
        "steps": steps, "requests": {}, "exporter": {},
    }  # fmt: skip
    return gzip.compress(json.dumps(b).encode())


class Sender(threading.Thread):
    """One engine: posts batches until stopped, resending a batch until it is answered 200."""

    def __init__(self, i: int, port: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.engine_id, self.port, self.stop = f"hostile-{i}", port, stop
        self.acked: set[int] = set()
        self.latencies: list[float] = []
        self.retries = 0

    def run(self) -> None:
        conn: http.client.HTTPConnection | None = None
        seq = 0
        body = _batch(self.engine_id, seq, True)
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                conn.request(
                    "POST",
                    INGEST_PATH,
                    body,
                    {"Content-Type": "application/json", "Content-Encoding": "gzip"},
                )
                resp = conn.getresponse()
                resp.read()
                status = resp.status
            except (OSError, http.client.HTTPException):
                status = 0
                if conn is not None:
                    conn.close()
                conn = None
            if status == 200:
                self.acked.add(seq)
                self.latencies.append(time.perf_counter() - t0)
                seq += 1
                body = _batch(self.engine_id, seq, False)
            else:
                self.retries += 1
                time.sleep(0.2 + random.random() * 0.3)
        if conn is not None:
            conn.close()


class Slowloris(threading.Thread):
    """A connection that sends one header byte a second; reconnects when closed."""

    def __init__(self, port: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.port, self.stop, self.closed = port, stop, 0

    def run(self) -> None:
        head = b"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
        while not self.stop.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            except OSError:
                time.sleep(0.5)
                continue
            try:
                for i in range(len(head)):
                    if self.stop.is_set():
                        break
                    s.sendall(head[i : i + 1])
                    time.sleep(1.0)
            except OSError:
                self.closed += 1
            finally:
                s.close()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _phase(
    c: CollectorProcess, senders: int, slow: int, kills: int, seconds: float
) -> dict[str, Any]:
    stop = threading.Event()
    threads = [Sender(i, c.port, stop) for i in range(senders)]
    loris = [Slowloris(c.port, stop) for _ in range(slow)]
    for t in (*threads, *loris):
        t.start()
    peak = 0.0
    kill_at = sorted(random.uniform(0.1, 0.8) * seconds for _ in range(kills))
    t0 = time.monotonic()
    while (now := time.monotonic() - t0) < seconds:
        if c.proc is not None and c.proc.poll() is None:
            peak = max(peak, rss_mib(c.proc.pid))
        if kill_at and now >= kill_at[0]:
            kill_at.pop(0)
            c.stop(sig=9)
            c.start()
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(timeout=40)
    acked = {t.engine_id: len(t.acked) for t in threads}
    lat = sorted(x for t in threads for x in t.latencies)
    return {
        "acked": acked,
        "per_s": sum(acked.values()) / seconds,
        "p50_ms": 1000 * statistics.median(lat) if lat else float("nan"),
        "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else float("nan"),
        "peak_rss_mib": peak,
        "retries": sum(t.retries for t in threads),
        "slow_closed": sum(t.closed for t in loris),
    }


def _stored(c: CollectorProcess) -> dict[str, int]:
    rows = c.get_json("/v1/totals", params={"source": "steps"})["rows"]
    return {r["engine_id"]: int(r["n_steps"]) for r in rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--senders", type=int, default=200, help="ingest connections (default 200)")
    p.add_argument("--slow", type=int, default=200, help="slowloris connections (default 200)")
    p.add_argument("--kills", type=int, default=5, help="kill -9 during the run (default 5)")
    p.add_argument("--seconds", type=float, default=30.0, help="each phase's length (default 30)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the kill times")
    args = p.parse_args(argv)
    random.seed(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, slow, kills in (("baseline", 0, 0), ("hostile", args.slow, args.kills)):
            store = Path(d) / f"{name}.duckdb"
            c = CollectorProcess(
                store,
                extra_args=["--kv-events", "off", "--advise-interval-s", "0"],
                startup_timeout_s=60,
            ).start()
            try:
                r = _phase(c, args.senders, slow, kills, args.seconds)
                time.sleep(1.0)
                stored = _stored(c)
            finally:
                c.stop()
            lost = sum(max(0, n * STEPS - stored.get(e, 0)) for e, n in r["acked"].items())
            extra = sum(max(0, stored.get(e, 0) - n * STEPS) for e, n in r["acked"].items())
            rows.append((name, slow, kills, r, lost, extra))
    print(
        f"{'phase':<9} {'senders':>7} {'slow':>5} {'kill -9':>7} {'acked/s':>8} "
        f"{'P50 ms':>7} {'P99 ms':>7} {'RSS MiB':>8} {'resent':>7} {'slow cut':>8} "
        f"{'lost':>5} {'twice':>5}"
    )
    for name, slow, kills, r, lost, extra in rows:
        print(
            f"{name:<9} {args.senders:>7} {slow:>5} {kills:>7} {r['per_s']:>8.0f} "
            f"{r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f} {r['peak_rss_mib']:>8.0f} "
            f"{r['retries']:>7} {r['slow_closed']:>8} {lost:>5} {extra:>5}"
        )
    base, hostile = rows[0][3], rows[1][3]
    print(
        f"hostile/baseline: acked per second {hostile['per_s'] / base['per_s']:.2f}, "
        f"P99 {hostile['p99_ms'] / base['p99_ms']:.2f}, peak RSS "
        f"{hostile['peak_rss_mib'] / max(base['peak_rss_mib'], 1):.2f}"
    )
    bad = sum(r[4] + r[5] for r in rows)
    print("nothing lost, nothing stored twice" if bad == 0 else f"LOST OR DOUBLED: {bad} steps")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    raise SystemExit(run_stoppable(main))

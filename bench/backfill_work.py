"""What one batch of old data makes the collector's writer do: another engine's ingest latency
while the retention task rolls that batch up.

One command (under half a minute; the code before the rollup's budget took 6 minutes)::

    .venv/bin/python bench/backfill_work.py [--steps 20000] [--gap-min 61] [--baseline-s 10]

What it does
------------
A real collector process (``kvscope collector``, a fresh store, the retention task every
``--retention-interval`` seconds instead of every minute, 1-minute windows kept forever so
they can be counted) takes a small batch of engine B (5 steps, stamped now) every 0.2 s:
the baseline, ``--baseline-s`` seconds long. Then engine A sends one batch of ``--steps``
steps ``--gap-min`` minutes apart, the newest 16 days old: every step is a minute of its
own, older than the window retention (15 days), as an import of old recordings or a
hostile sender would send it (``--max-backfill 0``: the collector accepts times of any
age). B goes on posting, one POST at a time, until every one of A's minutes is in
``windows_1m`` (read through ``/v1/windows_1m``) or ``--max-wait`` has passed.

The table: B's POSTs (sent to answered) with no backfill and during it, median, P99 and
maximum, and the ratio of the maxima; then how long A's minutes took to be rolled up (from
A's answer) and the most minutes waiting as the collector exports them
(``kvscope_collector_rollup_pending_minute_windows``). A POST of B waits for the writer,
so its latency is how long a rollup pass holds the writer.
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvscope.cli._lifecycle import run_stoppable
from kvscope.collector.process import CollectorProcess
from kvscope.engine_plugins.schema import SCHEMA_VERSION
from kvscope.lab.recording import load_recording

RECORDINGS_DIR = Path(__file__).resolve().parent.parent / "lab" / "recordings"
DAY_S = 86400.0
B_EVERY_S = 0.2
PENDING_GAUGE = "kvscope_collector_rollup_pending_minute_windows"


def _hello(engine_id: str, now: float) -> dict[str, Any]:
    rec = load_recording(next(iter(sorted(RECORDINGS_DIR.glob("*.jsonl.gz")))))
    hello = next(b["hello"] for b in rec.batches if b.get("hello"))
    return {**hello, "engine_id": engine_id, "boot_id": "boot-1", "started_unix_s": now - 60}


def wire_batch(engine_id: str, seq: int, ts: list[float], now: float) -> dict[str, Any]:
    """A valid batch of steps at ``ts`` (with the engine's hello when ``seq`` is 0)."""
    n = len(ts)
    return {
        "schema_version": SCHEMA_VERSION,
        "engine_id": engine_id,
        "boot_id": "boot-1",
        "seq": seq,
        "sent_unix_s": now,
        "hello": _hello(engine_id, now) if seq == 0 else None,
        "steps": {
            "ts_unix_s": ts,
            "step": [seq * n + i for i in range(n)],
            "batch_size": [i % 7 + 1 for i in range(n)],
            "waiting": [i % 3 for i in range(n)],
            "deferred": [0] * n,
            "kv_usage_ratio": [0.5] * n,
            "kv_blocks_used": [500] * n,
            "prefix_queries": [100] * n,
            "prefix_hits": [50] * n,
            "preemptions": [0] * n,
            "prompt_tokens": [10] * n,
            "generation_tokens": [i % 7 + 1 for i in range(n)],
            "iteration_s": [0.02] * n,
        },
        "requests": {},
    }


def post(url: str, obj: Any, timeout_s: float) -> tuple[int, float]:
    """POST one batch as the plugin does (gzip JSON): (status, seconds to the answer)."""
    body = gzip.compress(json.dumps(obj).encode())
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    t0 = time.monotonic()
    try:
        conn.request(
            "POST",
            "/v1/ingest",
            body,
            {"Content-Type": "application/json", "Content-Encoding": "gzip"},
        )
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.monotonic() - t0
    finally:
        conn.close()


class EngineB(threading.Thread):
    """Posts 5 steps stamped now every ``B_EVERY_S``, one POST at a time; keeps
    (phase, latency) of each."""

    def __init__(self, url: str, timeout_s: float) -> None:
        super().__init__(daemon=True, name="engine-b")
        self.url, self.timeout_s = url, timeout_s
        self.phase = "baseline"
        self.samples: list[tuple[str, float]] = []
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        seq = 0
        while not self.stop.is_set():
            now = time.time()
            b = wire_batch("engine-b", seq, [now - 0.15 + 0.03 * i for i in range(5)], now)
            phase = self.phase
            try:
                status, dt = post(self.url, b, self.timeout_s)
            except OSError as exc:
                self.failures.append(f"{phase}: {exc}")
                continue
            if status != 200:
                self.failures.append(f"{phase}: HTTP {status}")
            self.samples.append((phase, dt))
            seq += 1
            self.stop.wait(max(0.0, B_EVERY_S - dt))


def _minutes_rolled(c: CollectorProcess, since: float) -> int:
    cols = c.get_json(
        "/v1/windows_1m",
        params={"engine": "engine-a", "since": int(since), "fields": "ts_s", "format": "columns"},
        timeout_s=30.0,
    )
    return int(cols["n_rows"])


def _pending(c: CollectorProcess) -> float | None:
    for line in c.get_text("/metrics", timeout_s=30.0).splitlines():
        if line.startswith(PENDING_GAUGE + " "):
            return float(line.split()[1])
    return None


def _row(name: str, lat: list[float]) -> str:
    if not lat:
        return f"{name:<18} {0:>6}"
    lat = sorted(lat)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    return (
        f"{name:<18} {len(lat):>6} {statistics.median(lat) * 1000:>9.1f} "
        f"{p99 * 1000:>9.1f} {lat[-1] * 1000:>10.1f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20_000, help="steps of A's batch")
    ap.add_argument("--gap-min", type=float, default=61.0, help="minutes between A's steps")
    ap.add_argument("--baseline-s", type=float, default=10.0, help="B alone, seconds")
    ap.add_argument("--retention-interval", type=float, default=0.5, help="seconds")
    ap.add_argument("--max-wait", type=float, default=600.0, help="seconds, for A's minutes")
    ap.add_argument("--post-timeout", type=float, default=900.0, help="seconds per POST")
    args = ap.parse_args()

    extra = [
        "--kv-events",
        "off",
        "--advise-interval-s",
        "0",
        "--raw-retention-s",
        "0",
        "--rollup-retention",
        "0",
        "--retention-interval",
        str(args.retention_interval),
        "--max-backfill",
        "0",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        c = CollectorProcess(Path(tmp) / "backfill.duckdb", extra_args=extra).start()
        b = EngineB(c.url, args.post_timeout)
        try:
            b.start()
            time.sleep(args.baseline_s)
            now = time.time()
            newest = now - 16 * DAY_S
            ts = [newest - i * args.gap_min * 60 for i in range(args.steps)][::-1]
            a = wire_batch("engine-a", 0, ts, now)
            size = len(gzip.compress(json.dumps(a).encode()))
            b.phase = "backfill"
            status, ack_s = post(c.url, a, args.post_timeout)
            if status != 200:
                print(f"A's batch answered HTTP {status}", file=sys.stderr)
                return 1
            t_ack = time.monotonic()
            want = len({int(t // 60) for t in ts})
            done_s, got, peak = None, 0, None
            while time.monotonic() - t_ack < args.max_wait:
                got = _minutes_rolled(c, ts[0] - 60)
                p = _pending(c)
                if p is not None:
                    peak = p if peak is None else max(peak, p)
                if got >= want:
                    done_s = time.monotonic() - t_ack
                    break
                time.sleep(0.5)
        finally:
            b.stop.set()
            b.join(timeout=args.post_timeout)
            c.stop()
    base = [dt for ph, dt in b.samples if ph == "baseline"]
    during = [dt for ph, dt in b.samples if ph == "backfill"]
    print(
        f"A: one batch of {args.steps} steps {args.gap_min:g} min apart, newest 16 days old "
        f"({size / 2**20:.2f} MiB gzipped), answered in {ack_s * 1000:.0f} ms"
    )
    print(f"retention task every {args.retention_interval:g} s; B posts 5 steps every 0.2 s\n")
    print(f"{'B ingest latency':<18} {'posts':>6} {'median ms':>9} {'p99 ms':>9} {'max ms':>10}")
    print(_row("no backfill", base))
    print(_row("during backfill", during))
    if base and during:
        print(f"{'ratio of maxima':<18} {'':>6} {'':>9} {'':>9} {max(during) / max(base):>9.1f}x")
    print()
    if done_s is None:
        print(f"A's minutes rolled up: {got} of {want} after {args.max_wait:g} s (gave up)")
    else:
        print(f"A's {want} minutes all in windows_1m {done_s:.1f} s after A's answer")
    print(
        f"most minutes waiting ({PENDING_GAUGE}): "
        + ("not exported" if peak is None else f"{peak:.0f}")
    )
    if b.failures:
        print(f"B's failed POSTs: {len(b.failures)} (first: {b.failures[0]})")
    return 0 if done_s is not None and not b.failures else 1


if __name__ == "__main__":
    sys.exit(run_stoppable(main))

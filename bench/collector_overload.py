"""The collector at ten times its expected ingest rate, with and without its memory limits.

One command::

    .venv/bin/python bench/collector_overload.py [--runs 3] [--burst-s 5] [--steps 4000]

Each case starts a real ``kvscope collector`` process on a fresh store and drives it
over loopback, open loop (new batches keep coming whatever the answers):

1. the **expected rate** (the baseline, same run): 10 engines x 1 batch/s, each batch
   ``--steps`` steps (about 0.26 MiB of JSON at 4,000);
2. a **burst** at ten times that for ``--burst-s`` seconds;
3. the expected rate again (recovery).

Cases: **limited** (``--max-inflight-mib 16 --store-memory-mib 64``) and **unlimited**
(4096 MiB and 2048 MiB: what the limits would allow on this machine is never reached).
The process's RSS is sampled every 10 ms (``/proc``). The table gives, per case, the
medians over ``--runs`` of: peak RSS at the expected rate and in the burst, the growth,
the share of burst batches answered 200 and 503 (anything else is a failure), and the
acknowledgement latency p50 before and after the burst.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvscope.collector.process import CollectorProcess
from kvscope.engine_plugins.schema import SCHEMA_VERSION

N_ENGINES = 10
EXPECTED_PER_S = 10.0
CASES = {"limited": ("16", "64"), "unlimited": ("4096", "2048")}
Result = list[tuple[int, float]]


def _bodies(n_steps: int) -> list[tuple[bytes, bytes]]:
    out = []
    for i in range(N_ENGINES):
        eid = f"bench-host:{8000 + i}:0"
        steps = {
            "ts_unix_s": [1.7e9 + j / n_steps for j in range(n_steps)],
            "step": list(range(n_steps)),
            "batch_size": [j % 7 + 1 for j in range(n_steps)],
            "waiting": [j % 3 for j in range(n_steps)],
            "deferred": [0] * n_steps,
            "kv_usage_ratio": [round((j % 10) / 10 + 0.05, 3) for j in range(n_steps)],
            "kv_blocks_used": [(j % 10) * 100 for j in range(n_steps)],
            "prefix_queries": [100] * n_steps,
            "prefix_hits": [j % 100 for j in range(n_steps)],
            "preemptions": [0] * n_steps,
            "prompt_tokens": [10] * n_steps,
            "generation_tokens": [j % 7 + 1 for j in range(n_steps)],
            "iteration_s": [0.02] * n_steps,
        }
        b = {
            "schema_version": SCHEMA_VERSION,
            "engine_id": eid,
            "boot_id": "b",
            "seq": 987654321,
            "sent_unix_s": 1.7e9,
            "hello": None,
            "steps": steps,
            "requests": {},
            "exporter": {},
        }
        head, tail = json.dumps(b).encode().split(b"987654321", 1)
        out.append((head, tail))
    return out


async def _drive(
    url: str, rate: float, duration_s: float, bodies: list[tuple[bytes, bytes]], seq0: int
) -> Result:
    results: Result = []
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    ) as session:

        async def one(k: int) -> None:
            head, tail = bodies[k % len(bodies)]
            t = time.perf_counter()
            try:
                async with session.post(
                    url + "/v1/ingest", data=head + str(seq0 + k).encode() + tail
                ) as r:
                    await r.read()
                    results.append((r.status, time.perf_counter() - t))
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                results.append((0, time.perf_counter() - t))

        tasks, start = [], time.perf_counter()
        for k in range(int(rate * duration_s)):
            delay = start + k / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(k)))
        await asyncio.gather(*tasks)
    return results


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _phase(
    pid: int, url: str, rate: float, duration_s: float, bodies: list[tuple[bytes, bytes]], seq0: int
) -> tuple[Result, int]:
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss(pid))
            time.sleep(0.01)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        return asyncio.run(_drive(url, rate, duration_s, bodies, seq0)), peak[0]
    finally:
        stop.set()
        t.join()


def _p50(res: Result) -> float:
    ok = [s for st, s in res if st == 200]
    return statistics.median(ok) if ok else float("nan")


def run_case(
    workdir: Path, name: str, burst_s: float, bodies: list[tuple[bytes, bytes]]
) -> dict[str, float]:
    inflight, store_mib = CASES[name]
    c = CollectorProcess(
        workdir / f"{name}-{time.monotonic_ns()}.duckdb",
        extra_args=[
            "--kv-events",
            "off",
            "--advise-interval-s",
            "0",
            "--raw-retention-s",
            "0",
            "--max-inflight-mib",
            inflight,
            "--store-memory-mib",
            store_mib,
        ],
    ).start()
    try:
        assert c.proc is not None
        pid = c.proc.pid
        normal, normal_rss = _phase(pid, c.url, EXPECTED_PER_S, 3.0, bodies, 0)
        burst, burst_rss = _phase(pid, c.url, EXPECTED_PER_S * 10, burst_s, bodies, 10_000)
        while json.loads(c.request("/healthz")[1])["pending_batches"]:
            time.sleep(0.05)
        after, _ = _phase(pid, c.url, EXPECTED_PER_S, 2.0, bodies, 1_000_000)
    finally:
        c.stop()
    n = len(burst)
    return {
        "normal_rss": normal_rss / 2**20,
        "burst_rss": burst_rss / 2**20,
        "growth": (burst_rss - normal_rss) / 2**20,
        "ok": sum(s == 200 for s, _ in burst) / n,
        "shed": sum(s == 503 for s, _ in burst) / n,
        "failed": sum(s not in (200, 503) for s, _ in burst) / n,
        "p50_before": _p50(normal),
        "p50_after": _p50(after),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=3, help="runs per case (medians; default 3)")
    ap.add_argument("--burst-s", type=float, default=5.0, help="burst seconds (default 5)")
    ap.add_argument("--steps", type=int, default=4000, help="steps per batch (default 4000)")
    args = ap.parse_args(argv)
    bodies = _bodies(args.steps)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory(prefix="kvscope-overload-") as tmp:
        for i in range(args.runs):
            for name in CASES:
                rows[name].append(run_case(Path(tmp), name, args.burst_s, bodies))
                print(f"  run {i + 1}/{args.runs} {name}: done", file=sys.stderr)
    print(
        f"\nburst {EXPECTED_PER_S * 10:g} batches/s ({args.steps} steps, "
        f"{len(b''.join(bodies[0])) / 2**20:.2f} MiB each) for {args.burst_s:g} s; "
        f"baseline {EXPECTED_PER_S:g}/s in the same run; medians of {args.runs}"
    )
    head = (
        f"{'case':<10} {'RSS base':>9} {'RSS burst':>10} {'growth':>8} {'200':>6} {'503':>6} "
        f"{'failed':>7} {'p50 before':>11} {'p50 after':>10}"
    )
    print(head)
    print("-" * len(head))
    for name, runs in rows.items():
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"{name:<10} {m['normal_rss']:>6.0f} MiB {m['burst_rss']:>6.0f} MiB "
            f"{m['growth']:>+4.0f} MiB {m['ok']:>6.0%} {m['shed']:>6.0%} {m['failed']:>7.0%} "
            f"{m['p50_before'] * 1e3:>8.0f} ms {m['p50_after'] * 1e3:>7.0f} ms"
        )
    lim, unl = (statistics.median(r["growth"] for r in rows[n]) for n in ("limited", "unlimited"))
    print(f"\nRSS growth limited / unlimited: {lim / unl:.2f}" if unl > 0 else "")
    return 0


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    raise SystemExit(run_stoppable(main))

"""Collector ingest at fleet scale: how many engines one collector process sustains.

One command (about three minutes with the defaults)::

    .venv/bin/python bench/collector_ingest.py [--levels 100,250,500,1000,1500,2000]
        [--duration 20] [--warmup 5] [--steps-per-s 50] [--json out.json]

What it does
------------
A real collector process (``kvscope collector``, a fresh DuckDB store, default
settings) pinned to one core (``--collector-core``, 0); simulated engines in worker
processes pinned to the other cores (:mod:`_fleet`): each engine is a real plugin
exporter (own buffer, thread and keep-alive connection) fed ``--steps-per-s`` steps
a second, with their finished requests, replayed from the bundled real vLLM
recordings, and shipping a batch a second through the plugin's own encoding and
HTTP client. Fleet sizes are stepped up (``--levels``); each level runs
``--warmup`` + ``--duration`` seconds with a fresh boot of every engine.

Per level: acknowledgement time of every POST (request sent to answer read, as the
plugin sees it) over the measured seconds, median and P99; failed or refused POSTs;
steps delivered against steps produced; the collector's CPU (cores busy, from
``/proc``) and memory (RSS) sampled every second, and the load generators' CPU. A
level is *sustained* when the P99 is under ``--p99-target`` (1 s), no POST failed,
nothing was dropped and at least 97% of the produced steps were delivered within
the level. The run stops after the first level that is not (``--keep-going`` runs
them all).

The ``cpu wait`` column is the time the collector's threads were runnable but not
running (Linux schedstat): other processes on its core. ``eng/core`` is the fleet
one core would carry at the level's CPU cost per batch (one batch per engine a
second), a figure less sensitive to that contention than the latency.

Baseline, in the same run and on the collector's core: decoding and validating the
same bodies alone (gunzip, JSON, the wire schema and the numpy columns:
``kvscope.collector.batch.parse_body``), no HTTP and no store. The table sets the
collector's CPU per batch against it, so what HTTP, the store and ``/metrics`` state
add is visible.

At the end: the store's size on disk after the collector's shutdown checkpoint, per
step stored, and bytes on the wire per step; the stored rows are checked against
what the exporters saw acknowledged (nothing acknowledged may be missing).

The machine is shared: other processes on the collector's core show up as noise
(``--json`` keeps the samples). ``pgrep`` output of a running vLLM engine, which
pins its worker to core 0, is printed as a warning.
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
from _fleet import FleetRun, dump_json, percentile, run_workers
from tqdm import tqdm

from kvscope.collector.batch import parse_body
from kvscope.collector.process import CollectorProcess

P99_TARGET_S = 1.0
DELIVERED_RATIO = 0.97
TARGET_ENGINES = 1000
CONTENDED_WAIT = 0.25
"""Seconds per second the collector's threads may wait for their core before a level
counts as contended (the machine is shared)."""
FLEET_ARGS = ["--max-new-engines-per-minute", "1000000"]
"""A whole fleet registers at once here; the default guard (600 new engine ids a minute)
would answer part of it 429 for a minute."""


def run_queue_wait_s(pid: int) -> float:
    """Seconds the threads of ``pid`` spent runnable but waiting for a CPU (Linux schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


class Monitor:
    """Samples a process's CPU seconds and RSS every ``interval_s`` in a thread."""

    def __init__(self, pid: int, interval_s: float = 1.0) -> None:
        self.proc = psutil.Process(pid)
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        with self.proc.oneshot():
            t = self.proc.cpu_times()
            rss = self.proc.memory_info().rss
        self.samples.append((time.time(), t.user + t.system, rss, run_queue_wait_s(self.proc.pid)))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except psutil.Error:
                return

    def start(self) -> Monitor:
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> tuple[float, int, float]:
        """Cores busy between ``t0`` and ``t1`` (nearest samples inside), peak RSS, and
        seconds per second its threads waited for a CPU (other processes on its core)."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return float("nan"), 0, float("nan")
        (a, ca, _, wa), (b, cb, _, wb) = inside[0], inside[-1]
        return (cb - ca) / (b - a), max(s[2] for s in inside), (wb - wa) / (b - a)


@dataclass
class Level:
    engines: int
    posts: int
    ack_p50_s: float
    ack_p99_s: float
    ack_max_s: float
    failed_posts: int
    warmup_failed_posts: int
    failed_statuses: list[int]
    """HTTP statuses of failed POSTs (0: timeout or connection error)."""
    steps_produced: int
    steps_delivered_ratio: float
    dropped_steps: int
    collector_cores: float
    collector_rss_mib: float
    collector_cpu_wait: float
    """Seconds per second the collector's threads were runnable but not running."""
    loadgen_cores: float
    collector_cpu_ms_per_batch: float
    wire_bytes_per_step: float
    sustained: bool


def measure_level(
    fleet: FleetRun,
    mon: Monitor,
    warmup_s: float,
    steps_per_s: float,
    p99_target_s: float,
    n_loadgen_cores: int,
) -> Level:
    t0 = fleet.started_unix_s + warmup_s
    t1 = fleet.started_unix_s + fleet.duration_s
    window = [p for p in fleet.posts if t0 <= p[0] <= t1]
    acks = [p[1] for p in window if p[2] == 200]
    # POSTs refused or timed out, answered within the measured seconds; those of the
    # warm-up (a whole fleet registering at once, each hello an upsert) are counted apart.
    failed = sum(1 for p in fleet.posts if p[2] != 200 and t0 <= p[0] <= t1)
    warmup_failed = sum(1 for p in fleet.posts if p[2] != 200 and p[0] < t0)
    statuses = sorted({p[2] for p in fleet.posts if p[2] != 200})
    cores, rss, waited = mon.between(t0, t1)
    st = fleet.stats
    produced = st.get("steps_produced", 0)
    delivered = st.get("steps_sent", 0) + st.get("steps_merged", 0)
    dropped = st.get("steps_dropped", 0) + st.get("requests_dropped", 0)
    ratio = delivered / produced if produced else 0.0
    ok_posts = [p for p in fleet.posts if p[2] == 200]
    wire = sum(p[3] for p in ok_posts) / max(1, st.get("steps_sent", 0))
    batches_per_s = len(window) / max(1e-9, t1 - t0)
    p99 = percentile(acks, 0.99)
    sustained = (
        bool(acks)
        and p99 < p99_target_s
        and failed == 0
        and dropped == 0
        and ratio >= DELIVERED_RATIO
    )
    return Level(
        engines=fleet.n_engines,
        posts=len(fleet.posts),
        ack_p50_s=percentile(acks, 0.5),
        ack_p99_s=p99,
        ack_max_s=max(acks, default=float("nan")),
        failed_posts=failed,
        warmup_failed_posts=warmup_failed,
        failed_statuses=statuses,
        steps_produced=produced,
        steps_delivered_ratio=ratio,
        dropped_steps=dropped,
        collector_cores=cores,
        collector_rss_mib=rss / 2**20,
        collector_cpu_wait=waited,
        loadgen_cores=fleet.loadgen_cpu_s / max(fleet.loadgen_wall_s, fleet.duration_s),
        collector_cpu_ms_per_batch=1000 * cores / batches_per_s if batches_per_s else float("nan"),
        wire_bytes_per_step=wire,
        sustained=sustained,
    )


def decode_baseline(samples: list[bytes], core: int, rounds: int = 30) -> float:
    """Median seconds to gunzip + decode + validate one body (``parse_body``), on ``core``."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        per_round = []
        for _ in range(rounds):
            t = time.perf_counter()
            for body in samples:
                parse_body(gzip.decompress(body), time.time())
            per_round.append((time.perf_counter() - t) / len(samples))
    finally:
        os.sched_setaffinity(0, before)
    return statistics.median(per_round)


def store_rows(path: Path) -> dict[str, int]:
    import duckdb

    con = duckdb.connect(str(path), read_only=True)
    try:
        tables = [
            r[0]
            for r in con.execute(
                "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main'"
            ).fetchall()
        ]
        return {t: int(con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0]) for t in tables}
    finally:
        con.close()


def warn_if_engine_running() -> None:
    out = subprocess.run(
        ["pgrep", "-fa", "vllm.entrypoints|vllm serve"], capture_output=True, text=True
    ).stdout.strip()
    if out:
        print(
            f"warning: a vLLM engine is running on this machine (it pins a worker to core "
            f"0); figures will be noisy:\n{out}",
            file=sys.stderr,
        )


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated engine counts, got {text!r}"
        ) from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("engine counts must be >= 1")
    return levels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="See the module docstring for the method."
    )
    parser.add_argument(
        "--levels",
        type=parse_levels,
        default=parse_levels("100,250,500,1000,1500,2000"),
        help="fleet sizes to step through (default: 100,250,500,1000,1500,2000)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=20.0,
        help="seconds each level runs, warm-up included (default: 20)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=5.0,
        help="first seconds of a level not measured (default: 5)",
    )
    parser.add_argument(
        "--steps-per-s",
        type=float,
        default=50.0,
        help="engine steps per second per engine (default: 50)",
    )
    parser.add_argument(
        "--engines-per-worker",
        type=int,
        default=250,
        help="simulated engines per load-generator process (default: 250)",
    )
    parser.add_argument(
        "--collector-core",
        type=int,
        default=0,
        help="the core the collector is pinned to (default: 0); load generators get the others",
    )
    parser.add_argument(
        "--p99-target",
        type=float,
        default=P99_TARGET_S,
        help="acknowledgement P99 a sustained level stays under (default: 1 s)",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="nice value for the collector and the load generators (default 0; "
        "negative needs root: on a shared machine it keeps other work "
        "from taking their cores, which the 'cpu wait' column shows)",
    )
    parser.add_argument(
        "--keep-going", action="store_true", help="run every level even after one is not sustained"
    )
    parser.add_argument(
        "--collector-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `kvscope collector` (repeatable)",
    )
    parser.add_argument(
        "--store", default=None, help="store file (default: a temporary one, removed afterwards)"
    )
    parser.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.warmup >= args.duration:
        parser.error("--warmup must be shorter than --duration")
    cores = sorted(os.sched_getaffinity(0))
    if args.collector_core not in cores or len(cores) < 2:
        parser.error(
            f"--collector-core must be one of {cores}, and another core must be left "
            "for the load generators"
        )
    loadgen_cores = tuple(c for c in cores if c != args.collector_core)
    warn_if_engine_running()

    tmp = tempfile.TemporaryDirectory(prefix="kvscope-ingest-")
    store = Path(args.store) if args.store else Path(tmp.name) / "fleet.duckdb"
    main_affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {args.collector_core})  # the collector inherits it
    main_nice = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)  # so do the collector and the workers
    except PermissionError:
        parser.error(f"--nice {args.nice}: not permitted (a negative value needs root)")
    try:
        collector = CollectorProcess(
            store, extra_args=FLEET_ARGS + args.collector_arg, startup_timeout_s=120.0
        ).start()
    finally:
        os.sched_setaffinity(0, main_affinity)
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    assert collector.proc is not None
    mon = Monitor(collector.proc.pid).start()
    time.sleep(2.0)
    idle_rss = mon.samples[-1][2]
    print(
        f"collector pid {collector.proc.pid} on core {args.collector_core}, idle RSS "
        f"{idle_rss / 2**20:.0f} MiB; load generators on cores {list(loadgen_cores)}; "
        f"{args.steps_per_s:g} steps/s per engine, {args.duration:g} s per level "
        f"({args.warmup:g} s warm-up)"
    )

    levels: list[Level] = []
    samples: list[bytes] = []
    acked_steps = acked_requests = 0
    try:
        bar = tqdm(args.levels, desc="fleet sizes", unit="level", file=sys.stderr)
        for n in bar:
            bar.set_postfix_str(f"{n} engines")
            fleet = run_workers(
                collector.url,
                n,
                args.duration,
                steps_per_s=args.steps_per_s,
                engines_per_worker=args.engines_per_worker,
                cores=loadgen_cores,
                seed=len(levels),
            )
            time.sleep(1.5)
            level = measure_level(
                fleet, mon, args.warmup, args.steps_per_s, args.p99_target, len(loadgen_cores)
            )
            levels.append(level)
            samples = fleet.samples or samples
            acked_steps += fleet.stats.get("steps_sent", 0)
            acked_requests += fleet.stats.get("requests_sent", 0)
            tqdm.write(
                f"{n:>6} engines: ack P99 {level.ack_p99_s:.3f} s, collector "
                f"{level.collector_cores:.2f} cores, "
                f"{'sustained' if level.sustained else 'NOT sustained'}"
                + (
                    f" (failed POSTs with status {level.failed_statuses}; 0 = timeout)"
                    if level.failed_statuses
                    else ""
                ),
                file=sys.stderr,
            )
            if not level.sustained and not args.keep_going:
                break
        bar.close()
        decode_s = decode_baseline(samples, args.collector_core) if samples else float("nan")
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, main_nice)
        mon.stop()
        collector.stop()
    disk_bytes = store.stat().st_size + sum(
        p.stat().st_size for p in store.parent.glob(store.name + ".wal")
    )
    rows = store_rows(store)
    tmp.cleanup() if not args.store else None

    print()
    header = (
        f"{'engines':>7} {'batches/s':>9} {'ack p50':>8} {'ack p99':>8} {'ack max':>8} "
        f"{'failed':>6} {'warmup':>6} {'deliv':>6} {'coll. cores':>11} {'RSS MiB':>8} "
        f"{'ms/batch':>8} {'x decode':>8} {'eng/core':>8} {'loadgen cores':>13}  sustained"
    )
    print(header)
    print("-" * len(header))
    for lv in levels:
        bps = lv.collector_cores / (lv.collector_cpu_ms_per_batch / 1000)
        print(
            f"{lv.engines:>7} {bps:>9.0f} {lv.ack_p50_s:>8.3f} {lv.ack_p99_s:>8.3f} "
            f"{lv.ack_max_s:>8.3f} {lv.failed_posts:>6} {lv.warmup_failed_posts:>6} "
            f"{lv.steps_delivered_ratio:>6.1%} "
            f"{lv.collector_cores:>11.2f} {lv.collector_cpu_wait:>8.2f} "
            f"{lv.collector_rss_mib:>8.0f} "
            f"{lv.collector_cpu_ms_per_batch:>8.2f} "
            f"{lv.collector_cpu_ms_per_batch / (decode_s * 1000):>8.1f} "
            f"{1000 / lv.collector_cpu_ms_per_batch:>8.0f} "
            f"{lv.loadgen_cores:>13.2f}  {'yes' if lv.sustained else 'NO'}"
        )
    print()
    sustained = [lv for lv in levels if lv.sustained]
    best = max(sustained, key=lambda lv: lv.engines) if sustained else None
    print(
        f"baseline, decode + validate only (parse_body on {len(samples)} of the bodies, "
        f"core {args.collector_core}): {decode_s * 1e3:.3f} ms per batch "
        f"= {1 / decode_s:,.0f} batches/s on one core"
    )
    if best is not None:
        per_k_cores = best.collector_cores / best.engines * 1000
        per_k_mib = (best.collector_rss_mib - idle_rss / 2**20) / best.engines * 1000
        print(
            f"largest sustained fleet: {best.engines} engines (ack P99 {best.ack_p99_s:.3f} s); "
            f"per 1,000 engines: {per_k_cores:.2f} cores, {per_k_mib:.0f} MiB RSS above idle"
        )
    else:
        per_k_cores = per_k_mib = float("nan")
        print("no level was sustained")
    quiet = [lv for lv in levels if lv.collector_cpu_wait <= CONTENDED_WAIT]
    if len(quiet) < len(levels):
        print(
            f"levels where the collector waited over {CONTENDED_WAIT:g} s per s for its core "
            "(other processes on it) measured the machine, not the collector"
        )
    if quiet:
        q = min(quiet, key=lambda lv: lv.collector_cpu_ms_per_batch)
        print(
            f"CPU-bound capacity from the least contended level ({q.engines} engines): "
            f"{q.collector_cpu_ms_per_batch:.2f} ms of collector CPU per batch = "
            f"{1000 / q.collector_cpu_ms_per_batch:,.0f} engines per core at one batch a "
            f"second"
        )
    steps = rows.get("steps", 0)
    wire = statistics.median([lv.wire_bytes_per_step for lv in levels]) if levels else 0.0
    print(
        f"wire: {wire:.1f} bytes per step (gzip, requests and envelope included); disk: "
        f"{disk_bytes / 2**20:.1f} MiB for {steps:,} steps = {disk_bytes / max(1, steps):.1f} "
        f"bytes per step (all tables)"
    )
    lost_steps = acked_steps - steps
    lost_requests = acked_requests - rows.get("requests", 0)
    print(
        f"stored {steps:,} steps and {rows.get('requests', 0):,} requests; the exporters saw "
        f"{acked_steps:,} and {acked_requests:,} acknowledged"
        f"{'' if lost_steps <= 0 and lost_requests <= 0 else ': ACKNOWLEDGED ROWS MISSING'}"
    )
    target_ok = best is not None and best.engines >= TARGET_ENGINES
    print(
        f"target: >= {TARGET_ENGINES} engines on one core with ack P99 < {args.p99_target:g} s: "
        f"{'met' if target_ok else 'MISSED'}"
    )
    dump_json(
        args.json,
        {
            "levels": [asdict(lv) for lv in levels],
            "decode_only_s_per_batch": decode_s,
            "largest_sustained_engines": best.engines if best else None,
            "cores_per_1000_engines": per_k_cores,
            "rss_mib_per_1000_engines": per_k_mib,
            "idle_rss_mib": idle_rss / 2**20,
            "wire_bytes_per_step": wire,
            "disk_bytes": disk_bytes,
            "store_rows": rows,
            "disk_bytes_per_step": disk_bytes / max(1, steps),
            "monitor_samples": mon.samples,
            "args": {k: v for k, v in vars(args).items()},
        },
    )
    return 0 if target_ok and lost_steps <= 0 and lost_requests <= 0 else 1


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    # SIGTERM unwinds like Ctrl-C: the engine's process group and the collector (in
    # sessions of their own) are stopped on the way out.
    raise SystemExit(run_stoppable(main))

"""A simulated fleet of engines for the collector benchmarks (shared by
``collector_ingest.py``, ``storage_growth.py`` and ``metrics_scrape.py``).

Each simulated engine is one real :class:`kvscope.engine_plugins.exporter.Exporter` (its own
buffer, its own ``kvscope-exporter`` thread, its own keep-alive HTTP connection)
whose buffer is fed exactly as the plugin's ``record()`` feeds it: raw step rows
appended to the bounded deque, finished requests to the other. Batches are folded,
held back, columnised, JSON-encoded, gzipped and POSTed by the plugin's own code.

What is fed comes from the bundled real recordings (``lab/recordings``): every
step and finished request the real vLLM engine reported, turned back into the raw
row layouts of :mod:`kvscope.engine_plugins._rows`. Each engine replays one recording from
its own random offset, at ``steps_per_s`` steps a second, stamped with the current
time; finished requests come with the steps they came with in the recording (about
1.8 per second at 50 steps/s).

A worker process hosts many engines; :func:`run_workers` starts several, on the
cores given, and gathers what each measured (every POST's acknowledgement time,
bytes sent, rows sent and dropped, a sample of the bodies).
"""

from __future__ import annotations

import bisect
import json
import multiprocessing as mp
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscope.engine_plugins._config import Settings as PluginSettings
from kvscope.engine_plugins._http import IngestClient, Response
from kvscope.lab.recording import load_recording

RECORDINGS_DIR = Path(__file__).resolve().parent.parent / "lab" / "recordings"
FEED_INTERVAL_S = 0.1
BODY_SAMPLES_PER_WORKER = 40


@dataclass
class Trace:
    """One recording as raw rows: ``steps`` in order, ``requests[i]`` finished at step i."""

    name: str
    steps: list[tuple[Any, ...]]
    requests: dict[int, list[tuple[Any, ...]]]
    hello: dict[str, Any]


def load_traces() -> list[Trace]:
    """Every bundled recording as a :class:`Trace` (raw layouts of ``kvscope.engine_plugins._rows``)."""
    traces = []
    for path in sorted(RECORDINGS_DIR.glob("*.jsonl.gz")):
        rec = load_recording(path)
        steps: list[tuple[Any, ...]] = []
        reqs: list[tuple[Any, ...]] = []
        hello: dict[str, Any] = {}
        for b in rec.batches:
            hello = b.get("hello") or hello
            s = b.get("steps") or {}
            for i in range(len(s.get("ts_unix_s", []))):
                it = s["iteration_s"][i]
                steps.append(
                    (
                        s["ts_unix_s"][i],
                        s["step"][i],
                        s["batch_size"][i],
                        s["waiting"][i],
                        s["deferred"][i],
                        s["kv_usage_ratio"][i],
                        s["prefix_queries"][i],
                        s["prefix_hits"][i],
                        s["preemptions"][i],
                        s["prompt_tokens"][i],
                        s["generation_tokens"][i],
                        None if it is None else it * 1000.0,
                    )
                )
            r = b.get("requests") or {}
            for i in range(len(r.get("finished_unix_s", []))):
                reqs.append(
                    (
                        r["finished_unix_s"][i],
                        r["e2e_s"][i],
                        r["queue_s"][i],
                        r["prefill_s"][i],
                        r["decode_s"][i],
                        r["ttft_s"][i],
                        r["prompt_tokens"][i],
                        r["generation_tokens"][i],
                        r["cached_tokens"][i],
                        r["preemptions"][i],
                        r["finish_reason"][i],
                    )
                )
        order = sorted(range(len(steps)), key=lambda k: steps[k][0])
        steps = [steps[k] for k in order]
        step_ts = [row[0] for row in steps]
        by_step: dict[int, list[tuple[Any, ...]]] = {}
        for row in reqs:
            k = min(bisect.bisect_left(step_ts, row[0]), len(steps) - 1)
            by_step.setdefault(k, []).append(row)
        traces.append(Trace(path.name.split(".")[0], steps, by_step, hello))
    return traces


class TimedClient(IngestClient):
    """The plugin's HTTP client, timing every POST (request sent to answer read)."""

    def __init__(
        self, url: str, log: list[tuple[float, float, int, int]], samples: list[bytes]
    ) -> None:
        super().__init__(url)
        self.log = log
        self.samples = samples

    def post(self, body: bytes, timeout_s: float) -> Response:
        t0 = time.perf_counter()
        status = 0
        try:
            resp = super().post(body, timeout_s)
            status = resp.status
            return resp
        finally:
            self.log.append((time.time(), time.perf_counter() - t0, status, len(body)))
            if len(self.samples) < BODY_SAMPLES_PER_WORKER and status == 200:
                self.samples.append(body)


@dataclass
class WorkerSpec:
    url: str
    first_engine: int
    n_engines: int
    duration_s: float
    steps_per_s: float
    seed: int
    cores: tuple[int, ...] = ()
    pool_size: int = 50


@dataclass
class WorkerResult:
    posts: list[tuple[float, float, int, int]] = field(default_factory=list)
    """(unix time answered, seconds, HTTP status or 0, body bytes) per POST."""
    stats: dict[str, int] = field(default_factory=dict)
    samples: list[bytes] = field(default_factory=list)
    cpu_s: float = 0.0
    wall_s: float = 0.0
    """From the fleet's start to the end of the exit flush."""


def engine_id(i: int) -> str:
    return f"sim-{i:05d}.fleet:8000:0"


def _worker(spec: WorkerSpec, out: Any, ready: Any, go: Any) -> None:
    from kvscope.engine_plugins.exporter import Exporter

    if spec.cores:
        os.sched_setaffinity(0, set(spec.cores))
    rng = random.Random(spec.seed)
    traces = load_traces()
    settings = PluginSettings(collector_url=spec.url, pool="fleet", flush_interval_s=1.0)
    posts: list[tuple[float, float, int, int]] = []
    samples: list[bytes] = []
    engines = []
    for i in range(spec.first_engine, spec.first_engine + spec.n_engines):
        trace = traces[i % len(traces)]
        exporter = Exporter(settings, client=TimedClient(spec.url, posts, samples))
        hello = {
            **trace.hello,
            "host": f"sim-{i:05d}.fleet",
            "port": 8000,
            "pid": os.getpid(),
            "pool": f"fleet-{i // spec.pool_size:03d}",
            "started_unix_s": time.time(),
        }
        buf = exporter.register(engine_id(i), hello)
        engines.append([exporter, buf, trace, rng.randrange(len(trace.steps)), 0])
    ready.put(os.getpid())
    go.wait()
    for e in engines:
        e[0].start()
    t_start = time.monotonic()
    cpu0 = time.process_time()
    end = t_start + spec.duration_s
    due = 0.0
    while True:
        now_mono = time.monotonic()
        if now_mono >= end:
            break
        target = (now_mono - t_start) * spec.steps_per_s
        n_new = int(target) - int(due)
        due = target
        ts = time.time()
        if n_new > 0:
            for e in engines:
                _, buf, trace, pos, step = e
                steps, reqs, n_trace = trace.steps, trace.requests, len(trace.steps)
                for k in range(n_new):
                    row = steps[pos]
                    step += 1
                    # record(): one raw row per step, stamped now (spread over the feed tick)
                    buf.steps.append((ts - (n_new - 1 - k) / spec.steps_per_s, step, *row[2:]))
                    buf.steps_produced += 1
                    fins = reqs.get(pos)
                    if fins:
                        buf.requests.extend((ts, *r[1:]) for r in fins)
                        buf.requests_produced += len(fins)
                    pos = pos + 1 if pos + 1 < n_trace else 0
                e[3], e[4] = pos, step
        time.sleep(max(0.0, FEED_INTERVAL_S - (time.monotonic() - now_mono)))
    for e in engines:  # the exit flush of every engine, at once (as at a fleet shutdown)
        e[0]._stop.set()
    for e in engines:
        e[0].shutdown(10.0)
    stats: dict[str, int] = {}
    for e in engines:
        for k, v in e[0].stats().items():
            stats[k] = stats.get(k, 0) + v
    out.put(
        WorkerResult(
            posts=posts,
            stats=stats,
            samples=samples,
            cpu_s=time.process_time() - cpu0,
            wall_s=time.monotonic() - t_start,
        )
    )


@dataclass
class FleetRun:
    """What a fleet of ``n_engines`` measured over one run."""

    n_engines: int
    duration_s: float
    posts: list[tuple[float, float, int, int]]
    stats: dict[str, int]
    samples: list[bytes]
    loadgen_cpu_s: float
    started_unix_s: float
    loadgen_wall_s: float


def run_workers(
    url: str,
    n_engines: int,
    duration_s: float,
    *,
    steps_per_s: float = 50.0,
    engines_per_worker: int = 250,
    cores: tuple[int, ...] = (),
    seed: int = 0,
    id_offset: int = 0,
) -> FleetRun:
    """Run ``n_engines`` simulated engines for ``duration_s`` in worker processes."""
    ctx = mp.get_context("fork")
    q, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    n_workers = max(1, -(-n_engines // engines_per_worker))
    procs = []
    for w in range(n_workers):
        first = w * n_engines // n_workers
        last = (w + 1) * n_engines // n_workers
        spec = WorkerSpec(
            url, id_offset + first, last - first, duration_s, steps_per_s, seed * 1000 + w, cores
        )
        p = ctx.Process(target=_worker, args=(spec, q, ready, go), daemon=True)
        p.start()
        procs.append(p)
    for _ in procs:  # every engine built before any starts: one start time for the fleet
        ready.get(timeout=300.0)
    start_at = time.time()
    go.set()
    results: list[WorkerResult] = [q.get(timeout=duration_s + 120.0) for _ in procs]
    for p in procs:
        p.join(10.0)
    posts = [p for r in results for p in r.posts]
    stats: dict[str, int] = {}
    for r in results:
        for k, v in r.stats.items():
            stats[k] = stats.get(k, 0) + v
    samples = [s for r in results for s in r.samples]
    return FleetRun(
        n_engines,
        duration_s,
        posts,
        stats,
        samples,
        sum(r.cpu_s for r in results),
        start_at,
        max(r.wall_s for r in results),
    )


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def dump_json(path: str | None, obj: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(obj, indent=2, default=str) + "\n")

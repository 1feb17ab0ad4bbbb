"""The advisor's cap, pasted into a real gateway in front of real engines, and measured.

One command (about five minutes per loop on a 2-core machine, engine starts included)::

    .venv/bin/python bench/gateway_loops.py [--loops nginx-one,nginx-pool,router-pool]
        [--json out.json]

Each loop starts KV-starved real vLLM CPU engines (the lab's "mid" model, 48 blocks of 32
tokens, the plugin shipping to a collector), sweeps them closed-loop up and back down
(:data:`SWEEP`), asks the advisor (:func:`kvscope.advisor.analyze`) for the pool's cap and
takes the configuration it renders for the gateway **as emitted** (only ``listen 80``
becomes a free local port). Then, on the same engines, the overload (the sweep's highest
concurrency, ``--top`` clients, each sending its next request when the last one is
answered) runs ``ROUNDS`` times through the gateway and ``ROUNDS`` times straight at the
engines (uncapped), interleaved, ``duration`` seconds each after a warm-up. A client whose
request the gateway refused waits ``REFUSED_BACKOFF_S`` before its next one, as a caller
that retries later.

What each gateway run is held to (ratios with their 95% interval over the runs,
:mod:`bench.noise`; the targets below, and the tests' bounds in :data:`GATE`):

- **in flight**: the highest count of requests at each engine (running + waiting +
  deferred, in every step kvscope's plugin recorded from the run's start to its end)
  never above that replica's cap;
- **throughput**: output tokens/s through the gateway at least ``MIN_THROUGHPUT_FRACTION``
  of the uncapped runs';
- **tail**: the admitted requests' e2e P99 (the client's) at most ``MAX_P99_RATIO`` of the
  uncapped one;
- **excess**: every refused request answered as the rendering says (nginx: 503 from
  ``limit_conn``; vllm-router: 429 from its bucket, or a replica's refusal passed on, see
  :data:`STATUSES`), nothing else;
- reported beside them: the admitted P99 against the rendering's predicted one.

The loops:

- ``nginx-one``: one engine behind nginx with the advisor's pool rendering (the engine is
  a pool of one: an ``upstream`` with ``max_conns`` and a pool ``limit_conn`` of the cap).
- ``nginx-pool``: two engines of one pool (each worker on a core of its own), the sweep
  spread round robin; nginx with the pool rendering (each replica's ``max_conns``, the
  pool ``limit_conn`` their sum). Also run: the old rendering, ``limit_conn`` keyed on
  ``$server_name`` with one replica's cap, which holds the whole pool to one replica's cap
  (checked exactly, on the pool's in-flight count; the throughput it costs against the
  rendered form's, in the same rounds, is refuted only when its interval lies wholly above
  ``MIN_THROUGHPUT_FRACTION``: :func:`old_form_checks`).
- ``router-pool``: the same pool and sweep (its uncapped runs are the reference of both
  pool loops), then both engines restarted on the same ports with the vLLM flags the
  router's rendering gives each replica (``replica_flags``: its cap and no vLLM queue,
  ``--max-num-queued-reqs C``; the router has no per-worker limit, so vLLM's admission limit
  holds each replica; ``--router-queue Q`` starts them at ``C + Q`` instead, how long the
  queued requests waited is reported) and vLLM's router with the rendered command
  (``--max-concurrent-requests`` the pool's sum, refill 1/s, no router queue, one retry,
  circuit breaker off). The excess gets 429 from the router or a replica's 503 passed on.
  The reference is the first start's (an engine start differs from the next by up to 10%
  here).

(For ``--loops nginx-pool`` alone the pool loop's uncapped runs are interleaved with the
nginx runs; with ``router-pool`` alone they run before the restart.)

The controls of the router loop: ``--router-control`` follows each router round with one
through nginx (the pool rendering) in front of the same restarted engines (loop
``nginx-restarted``), and ``--storm RATE`` adds one more through nginx while ``RATE`` refused
render calls a second hit each replica's API server (loop ``nginx-storm``,
:class:`RenderStorm`): what the restart costs, and what the refusals the router lets through
cost, each without the router.

The figures of the latest runs are in docs/gateways.md ("Measured on real engines").
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd

from bench.advisor_scenarios import MAX_P99_RATIO as MAX_P99_RATIO_CLIENT
from bench.advisor_scenarios import (
    MAX_P99_RATIO_FLAGS,
    REFUSED_BACKOFF_S,
    AdvisorLab,
)
from bench.advisor_scenarios import MIN_THROUGHPUT_FRACTION as MIN_THROUGHPUT_FRACTION_CLIENT
from bench.noise import FAILS, HOLDS, ratio, ratio_to
from bench.refusal_cost import PROMPT
from kvscope.advisor import CollectorSource, Report, analyze
from kvscope.advisor.gateways import ReplicaCap
from kvscope.collector.process import free_port
from kvscope.lab.engine import VllmServer, build_model, default_model_dir
from kvscope.lab.gateway import Nginx, VllmRouter, router_args
from kvscope.lab.sweep import LevelResult

MODEL_NAME = "kvscope-gateway"
JSON_HEADERS = {"Content-Type": "application/json"}
NUM_GPU_BLOCKS = 48
"""KV-starved (the lab's ``kv-starved`` regime): about seven requests of the sweep's
workload fill the cache, and the throughput plateaus while requests queue."""
MAX_NUM_SEQS = 256
SWEEP = (1, 2, 4, 8, 12, 16, 24, 32)
"""Clients per engine on the way up; back down from the level below the top to a quarter of
it (the machine's drift cancels, see ``AdvisorLab``)."""
ROUNDS = 3
MIN_THROUGHPUT_FRACTION = 0.9
"""The target: throughput through the gateway over the uncapped overload's, at least."""
MAX_P99_RATIO = 0.5
"""The target: the admitted requests' e2e P99 over the uncapped overload's, at most."""
MIN_THROUGHPUT_FRACTION_ROUTER = 0.45
"""What the pool keeps behind vllm-router on this rig, at least: the excess the router lets
through is refused at the replicas' API servers, which share the engines' two cores, and
that work slows the engines' steps (docs/gateways.md: 0.42-0.94 of the uncapped throughput
over nine runs, 0.74-0.83 of nginx's on the same restarted replicas, and nginx fell from
0.86 to 0.69 with the same refusals sent at the replicas without the router). The 0.9
target is reported beside it; a collapse below this (a rendering whose replicas refuse
what they should run) is refuted."""
GATE = {
    "nginx": (MIN_THROUGHPUT_FRACTION_CLIENT, MAX_P99_RATIO_CLIENT),
    "vllm-router": (MIN_THROUGHPUT_FRACTION_ROUTER, MAX_P99_RATIO_FLAGS),
}
"""What the tests refute, per gateway (throughput kept at least, admitted P99 over the
uncapped at most): nginx holds the cap as the advisor's cap as client concurrency does
(``bench/advisor_scenarios.py``: at least 85% kept, the tail at least 40% shorter); behind
vllm-router the replicas' vLLM flags hold it, on engines restarted for them: the tail is held
to what the flags are held to there (a fifth shorter), the throughput to
``MIN_THROUGHPUT_FRACTION_ROUTER``. The targets above are reported
beside them, with their verdicts."""
MAX_OVER_PREDICTED_P99 = 1.5
"""Reported: the admitted requests' e2e P99 over the rendering's predicted one, at most."""
LOOPS = ("nginx-one", "nginx-pool", "router-pool")


@dataclass
class Run:
    """One overload run through a target (the gateway, or the engines straight)."""

    setting: str
    clients: int
    tokens_per_s: float
    e2e_p99_s: float | None
    """The client's, over the admitted (completed) requests."""
    completed: int
    errors: dict[str, int]
    in_flight_max: dict[str, int]
    """Per engine: the highest running + waiting + deferred of any step in the run."""
    in_flight_mean: dict[str, float]
    pool_in_flight_max: int
    """The highest sum over the engines of their latest step's in-flight count."""
    engine_e2e_p99_s: float | None
    queue_p50_s: float | None
    """How long admitted requests waited in vLLM's queue (the engines' ``queue_s``)."""
    queue_p99_s: float | None
    started_unix_s: float
    finished_unix_s: float


@dataclass
class Check:
    name: str
    figure: str
    verdict: str


@dataclass
class LoopResult:
    loop: str
    caps: dict[str, int]
    """The advisor's cap per engine (``host:port``)."""
    gateway_config: str
    excess_says: str
    predicted_p99_e2e_s: float | None
    predicted_throughput_fraction: float | None
    runs: list[Run] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    """Against the targets (``MIN_THROUGHPUT_FRACTION``, ``MAX_P99_RATIO``)."""
    gate: list[Check] = field(default_factory=list)
    """Against the bounds the tests hold (``GATE``)."""
    gateway_log_lines: dict[str, int] = field(default_factory=dict)
    knee: float | None = None
    bottleneck: str = ""

    def of(self, setting: str) -> list[Run]:
        return [r for r in self.runs if r.setting == setting]

    @property
    def holds(self) -> bool:
        """No property refuted against the tests' bounds (:attr:`gate`)."""
        return all(c.verdict != FAILS for c in self.gate)


def _listen_local(config: str, port: int) -> str:
    """The rendered nginx text with its ``listen 80;`` on a free local port instead."""
    if config.count("listen 80;") != 1:
        raise ValueError("the nginx rendering has no single 'listen 80;' line:\n" + config)
    return config.replace("listen 80;", f"listen 127.0.0.1:{port};")


class RenderStorm:
    """Calls that vLLM's API servers refuse, at ``rate`` a second to each of ``ports``: the
    router's tokenize call (``POST /v1/completions/render``, 403 without
    ``--enable-scale-out``), without any request reaching an engine. In front of nginx it puts
    on the API servers the refusal work that the router's excess puts on them (measured:
    about 28 render calls and 23 refused completions a second to each replica), so a
    throughput lost behind the router can be set against that work alone."""

    def __init__(self, ports: list[int], rate: float) -> None:
        self.rate = rate
        self.statuses: dict[int, int] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(p,), daemon=True) for p in ports]
        self._lock = threading.Lock()

    def _run(self, port: int) -> None:
        body = json.dumps({"model": MODEL_NAME, "prompt": PROMPT})
        conn: http.client.HTTPConnection | None = None
        start, i = time.monotonic(), 0
        while not self._stop.is_set():
            try:
                conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=10.0)
                conn.request("POST", "/v1/completions/render", body, JSON_HEADERS)
                resp = conn.getresponse()
                resp.read()
                status = resp.status
            except (OSError, http.client.HTTPException):
                conn, status = None, 0
            with self._lock:
                self.statuses[status] = self.statuses.get(status, 0) + 1
            i += 1
            self._stop.wait(max(0.0, start + i / self.rate - time.monotonic()))

    def __enter__(self) -> RenderStorm:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=15.0)


def server_name_form(address_caps: dict[str, int], one_cap: int, port: int) -> str:
    """The old rendering: ``limit_conn`` keyed on ``$server_name`` with one replica's cap
    (``server_name`` set, so the key is not empty)."""
    servers = "\n".join(f"    server {a};" for a in address_caps)
    return f"""upstream vllm_old {{
{servers}
}}
limit_conn_zone $server_name zone=vllm_conn:1m;
server {{
    listen 127.0.0.1:{port};
    server_name vllm.local;
    location / {{
        limit_conn vllm_conn {one_cap};
        proxy_pass http://vllm_old;
        proxy_http_version 1.1;
        proxy_buffering off;
    }}
}}"""


class GatewayLab(AdvisorLab):
    """The collector, the engines and the gateways of the loops."""

    def __init__(
        self,
        workdir: str | Path,
        *,
        top: int = 32,
        pool_duration_s: float = 12.0,
        refused_backoff_s: float = REFUSED_BACKOFF_S,
        **kw: Any,
    ) -> None:
        """``pool_duration_s``: the seconds of each sweep level on a pool (``duration_s``,
        the lab's, on one engine). Two engines on one machine's cores each run at about
        half the speed of one alone, so a request lives about twice as long, and a level
        must outlast a request's life at the knee for the sweep to see the batch the cache
        holds. On an AVX2 machine with 5-second levels (a 128-token request there takes
        about 8 s at the knee) the pool's sweep read knees of 17.8 and caps of 18 where the
        cache holds 12-13 requests, and the caps cut the tail only to 0.76x; with
        12-second levels, caps of 12 and 13 and 0.56x (docs/gateways.md). One engine's
        sweep holds its levels 12 s too (``duration_s``): with 5-s levels two runs on
        AVX2 machines read a cap of 19 from it, the throughput still rising to 20 in flight
        on levels shorter than a request's life, where the cache holds 12 (the whole
        store, the overload runs included, gives 12). ``refused_backoff_s``: how long a
        client the gateway refused waits before its next request."""
        kw.setdefault("cap_duration_s", 20.0)
        kw.setdefault("duration_s", 12.0)
        super().__init__(workdir, **kw)
        self.top = top
        self.pool_duration_s = pool_duration_s
        self.refused_backoff_s = refused_backoff_s

    # -- engines ----------------------------------------------------------------------------

    @contextmanager
    def engines(
        self,
        pool: str,
        n: int,
        *,
        ports: list[int] | None = None,
        flags: list[dict[str, int]] | None = None,
        label: str = "",
    ) -> Iterator[list[VllmServer]]:
        """``n`` KV-starved engines of ``pool``, started together, each worker on a core of
        its own when there are two; the plugin names them by ``127.0.0.1:port`` so the
        rendered upstream addresses are reachable as they are. ``ports``: listen there (a
        restart keeps the addresses a rendering names); ``flags``: per engine, vLLM flags
        and values (``--max-num-seqs``, ``--max-num-queued-reqs``)."""
        assert self.model_dir is not None
        flags = flags or [{} for _ in range(n)]
        servers = [
            VllmServer(
                self.model_dir,
                served_model_name=MODEL_NAME,
                port=None if ports is None else ports[i],
                num_gpu_blocks=NUM_GPU_BLOCKS,
                max_num_seqs=flags[i].get("--max-num-seqs", MAX_NUM_SEQS),
                extra_args=tuple(
                    str(x) for k, v in flags[i].items() if k != "--max-num-seqs" for x in (k, v)
                ),
                enable_prefix_caching=True,
                engine_core_nice=19,
                env={
                    "KVSCOPE_COLLECTOR_URL": self._collector.url,
                    "KVSCOPE_POOL": pool,
                    "KVSCOPE_FLUSH_INTERVAL_S": "0.5",
                    "KVSCOPE_HOST": "127.0.0.1",
                    **({"VLLM_CPU_OMP_THREADS_BIND": str(i)} if n > 1 else {}),
                },
                log_path=self.workdir / f"vllm-{pool}{label}-{i}.log",
            )
            for i in range(n)
        ]
        try:
            with_flags = "; ".join(" ".join(f"{k} {v}" for k, v in f.items()) for f in flags)
            self._say(
                f"{pool}: starting {n} engine(s), {NUM_GPU_BLOCKS} KV blocks each"
                f"{f' ({with_flags})' if with_flags.strip('; ') else ''}"
            )
            for s in servers:
                s.launch()
            for s in servers:
                s.wait_started()
                self._say(f"{pool}: engine up in {s.startup_s:.0f} s at {s.url}")
            yield servers
        finally:
            for s in servers:
                s.stop()
            self._say(f"{pool}: engines stopped")

    def _engine_ids(self, pool: str, n: int) -> list[str]:
        deadline = time.monotonic() + 60.0
        while True:
            rows = self._collector.get_json("/v1/engines")["rows"]
            ids = sorted(str(r["engine_id"]) for r in rows if r.get("pool") == pool)
            if len(ids) >= n:
                return ids
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(ids)} of {n} engines of {pool} reached the collector")
            time.sleep(0.5)

    # -- load -------------------------------------------------------------------------------

    def _load(
        self,
        urls: list[str],
        concurrency: list[int],
        duration_s: float,
        warmup_s: float,
        seed: int,
        error_backoff_s: float = 0.1,
        steady_state: bool = False,
    ) -> list[LevelResult]:
        return self._sweep_urls(
            urls,
            concurrency,
            duration_s,
            warmup_s,
            seed,
            error_backoff_s,
            MODEL_NAME,
            steady_state=steady_state,
        ).levels

    def sweep_and_advise(self, pool: str, urls: list[str]) -> Report:
        """The sweep (up, then back down) spread round robin over ``urls``, and the
        advisor's report on it."""
        n = len(urls)
        up = [c * n for c in SWEEP]
        top = max(up)
        down = sorted((c for c in up if top > c and 4 * c >= top), reverse=True)
        self._say(f"{pool}: sweeping {','.join(map(str, up + down))} clients")
        self._load(urls, [4 * n], 1.0, 1.0, self.seed + 100)  # warm: first requests run slow
        since = time.time()
        duration = self.duration_s if n == 1 else self.pool_duration_s
        self._load(urls, up + down, duration, self.warmup_s, self.seed)
        time.sleep(2.0)  # the plugin's last flush
        report = analyze(CollectorSource(self._collector.url), since, time.time(), pool=pool)
        for v in report.engines:
            self._say(
                f"{pool}: {v.engine_id}: {v.bottleneck}, knee {v.knee_concurrency}, cap "
                f"{v.recommended_concurrency_cap}"
            )
        return report

    def overload(
        self, setting: str, urls: list[str], clients: int, seed: int, engine_ids: list[str]
    ) -> Run:
        """One overload run of ``clients`` through ``urls``, measured at the client and in
        every step the engines recorded."""
        gateway = setting != "uncapped"
        start = time.time()
        (lv,) = self._load(
            urls,
            [clients],
            self.cap_duration_s,
            self.cap_warmup_s,
            seed,
            error_backoff_s=self.refused_backoff_s if gateway else 0.1,
            steady_state=self.steady_runs,
        )
        time.sleep(1.5)  # the plugin's last flush of the run
        src = CollectorSource(self._collector.url)
        steps = src.steps(start - 1.0, lv.window_end_unix_s + 1.0)
        reqs = src.requests(lv.window_start_unix_s, lv.window_end_unix_s)
        in_max: dict[str, int] = {}
        in_mean: dict[str, float] = {}
        for eid in engine_ids:
            s = steps[steps["engine_id"] == eid] if len(steps) else steps
            load = _in_flight(s)
            in_max[eid] = int(load.max()) if len(load) else 0
            inside = (
                load[pd.to_numeric(s["ts_unix_s"]) >= lv.window_start_unix_s] if len(load) else load
            )
            in_mean[eid] = float(inside.mean()) if len(inside) else math.nan
        e2e = q50 = q99 = None
        if len(reqs):
            ok = reqs[reqs["finish_reason"] != "abort"]
            if len(ok):
                e2e = float(pd.to_numeric(ok["e2e_s"]).quantile(0.99))
                queue = pd.to_numeric(ok["queue_s"], errors="coerce").dropna()
                if len(queue):
                    q50, q99 = float(queue.quantile(0.5)), float(queue.quantile(0.99))
        run = Run(
            setting=setting,
            clients=clients,
            tokens_per_s=lv.output_tokens_per_s,
            e2e_p99_s=lv.e2e_p99_s,
            completed=lv.requests_completed,
            errors=dict(lv.errors),
            in_flight_max=in_max,
            in_flight_mean=in_mean,
            pool_in_flight_max=pool_in_flight_max(steps, engine_ids),
            engine_e2e_p99_s=e2e,
            queue_p50_s=q50,
            queue_p99_s=q99,
            started_unix_s=start,
            finished_unix_s=lv.window_end_unix_s,
        )
        self._say(
            f"  {setting}: {run.tokens_per_s:,.0f} tok/s, e2e P99 "
            f"{_s(run.e2e_p99_s)}, {run.completed} answered, errors {run.errors or 'none'}, "
            f"in flight max {_per_engine(in_max)}"
        )
        return run

    # -- the loops ----------------------------------------------------------------------------

    def _advise(
        self, pool: str, ids: list[str], urls: list[str]
    ) -> tuple[Report, dict[str, ReplicaCap]]:
        """The sweep, the advisor's report and every engine's cap (each engine must get one)."""
        report = self.sweep_and_advise(pool, urls)
        caps = {
            r.scope.engine_id: ReplicaCap.from_recommendation(r)
            for r in report.recommendations
            if r.kind == "concurrency_cap" and r.scope.engine_id in ids
        }
        missing = [e for e in ids if e not in caps]
        if missing:
            raise RuntimeError(f"{pool}: the advisor recommended no cap for {missing}")
        return report, caps

    @staticmethod
    def _pool_rendering(report: Report, n: int, gateway: str) -> dict[str, Any]:
        """The pool-scoped rendering for ``gateway`` (a pool of one: its engine's cap carries
        the pool's renderings)."""
        kind = "concurrency_cap" if n == 1 else "pool_concurrency_cap"
        for r in report.recommendations:
            g = (r.change.get("gateway") or {}).get(gateway)
            if r.kind == kind and g and g.get("scope") == "pool":
                return dict(g)
        raise RuntimeError(f"no pool-scoped {gateway} rendering in the advice")

    def _result(
        self, loop: str, report: Report, caps: dict[str, ReplicaCap], rendering: dict[str, Any]
    ) -> LoopResult:
        first = min(caps)
        verdict = next(v for v in report.engines if v.engine_id == first)
        return LoopResult(
            loop=loop,
            caps={c.address: c.cap for c in caps.values()},
            gateway_config=rendering["config"],
            excess_says=rendering["excess"],
            predicted_p99_e2e_s=rendering.get("p99_e2e_s"),
            predicted_throughput_fraction=verdict.predicted_throughput_fraction_at_cap,
            knee=verdict.knee_concurrency,
            bottleneck=verdict.bottleneck,
        )

    def _through_nginx(
        self,
        result: LoopResult,
        setting: str,
        site: tuple[str, int],
        clients: int,
        seed: int,
        ids: list[str],
    ) -> None:
        """One overload run through a real nginx serving ``site`` (its text and the port it
        listens on)."""
        text, port = site
        tag = setting.replace(" ", "-").replace("$", "")
        with Nginx(self.workdir / f"nginx-{result.loop}-{tag}", text, port) as gw:
            result.runs.append(self.overload(setting, [gw.url], clients, seed, ids))
            log = gw.log()
        for key in ("limiting connections", "no live upstreams"):
            name = f"{setting}: {key}"
            result.gateway_log_lines[name] = result.gateway_log_lines.get(name, 0) + log.count(key)

    def nginx_one(self) -> LoopResult:
        """Loop ``nginx-one`` (module docstring)."""
        pool = "gw-one"
        with self.engines(pool, 1) as servers:
            urls = [s.url for s in servers]
            ids = self._engine_ids(pool, 1)
            report, caps = self._advise(pool, ids, urls)
            rendering = self._pool_rendering(report, 1, "nginx")
            result = self._result("nginx-one", report, caps, rendering)
            self._say(f"{pool}: nginx with the rendering:\n{rendering['config']}")
            port = free_port()
            site = (_listen_local(rendering["config"], port), port)
            for r in range(ROUNDS):
                seed = self.seed + 10 * r
                self._through_nginx(result, "nginx", site, self.top, seed, ids)
                result.runs.append(self.overload("uncapped", urls, self.top, seed + 1, ids))
            judge(result, "nginx", caps)
        return result

    def pool_loops(
        self,
        nginx: bool,
        router: bool,
        router_queue: int | None = None,
        router_control: bool = False,
        storm_rate: float = 0.0,
    ) -> list[LoopResult]:
        """Loops ``nginx-pool`` and ``router-pool`` on one pool of two engines and one sweep
        (module docstring): the uncapped runs are set against both. ``router_queue``: the
        vLLM queue ``Q`` the replicas get behind the router instead of the advisor's
        (``--max-num-queued-reqs`` then ``C + router_queue``). ``router_control``: each
        router round is followed by one through nginx with the pool rendering, in front of
        the same restarted engines (loop ``nginx-restarted``: what the restart and the vLLM
        flags cost without the router); with ``storm_rate``, then one more through nginx while
        a :class:`RenderStorm` of that rate hits each replica (loop ``nginx-storm``)."""
        pool, n = "gw-pool", 2
        clients = self.top * n
        out: list[LoopResult] = []
        with self.engines(pool, n) as servers:
            urls = [s.url for s in servers]
            ports = [s.port for s in servers]
            ids = self._engine_ids(pool, n)
            report, caps = self._advise(pool, ids, urls)
            uncapped: list[Run] = []
            if nginx:
                rendering = self._pool_rendering(report, n, "nginx")
                res = self._result("nginx-pool", report, caps, rendering)
                self._say(f"{pool}: nginx with the rendering:\n{rendering['config']}")
                port, old_port = free_port(), free_port()
                site = (_listen_local(rendering["config"], port), port)
                one = min(res.caps.values())
                old = (server_name_form(res.caps, one, old_port), old_port)
                for r in range(ROUNDS):
                    seed = self.seed + 10 * r
                    self._through_nginx(res, "nginx", site, clients, seed, ids)
                    uncapped.append(self.overload("uncapped", urls, clients, seed + 1, ids))
                    self._through_nginx(res, "nginx $server_name", old, clients, seed + 2, ids)
                out.append(res)
            else:
                for r in range(ROUNDS):
                    uncapped.append(
                        self.overload("uncapped", urls, clients, self.seed + 10 * r, ids)
                    )
        if router:
            rendering = self._pool_rendering(report, n, "vllm_router")
            res = self._result("router-pool", report, caps, rendering)
            flags = replica_flags(report, caps, ports, router_queue, rendering)
            control: tuple[LoopResult, tuple[str, int]] | None = None
            storm: LoopResult | None = None
            if router_control:
                plain = self._pool_rendering(report, n, "nginx")
                port = free_port()
                control = (
                    self._result("nginx-restarted", report, caps, plain),
                    (_listen_local(plain["config"], port), port),
                )
                if storm_rate > 0:
                    storm = self._result("nginx-storm", report, caps, plain)
            with self.engines(pool, n, ports=ports, flags=flags, label="-flags"):
                args = router_args(rendering["config"])
                self._say(f"{pool}: vllm-router with the rendering:\n{rendering['config']}")
                for r in range(ROUNDS):
                    with VllmRouter(args, self.workdir / f"router-{r}.log") as gw:
                        res.runs.append(
                            self.overload("vllm-router", [gw.url], clients, self.seed + 30 + r, ids)
                        )
                    if control:
                        ctrl, site = control
                        self._through_nginx(ctrl, "nginx", site, clients, self.seed + 40 + r, ids)
                        if storm:
                            with RenderStorm(ports, storm_rate) as st:
                                self._through_nginx(
                                    storm, "nginx", site, clients, self.seed + 50 + r, ids
                                )
                            self._say(f"  render storm: {st.statuses}")
            out.append(res)
            if control:
                out.append(control[0])
            if storm:
                out.append(storm)
        for res in out:
            res.runs += uncapped
            setting = "vllm-router" if res.loop == "router-pool" else "nginx"
            bound = None
            if res.loop != "nginx-pool":
                admitted = dict(zip(ports, flags, strict=True))
                bound = {
                    eid: admitted[_port(c.address)]["--max-num-queued-reqs"]
                    for eid, c in caps.items()
                }
            judge(res, setting, caps, bound)
        return out


def _in_flight(steps: pd.DataFrame) -> pd.Series:
    """Requests at the engine in each step: running, waiting and deferred."""
    if not len(steps):
        return pd.Series(dtype=float)
    total = pd.to_numeric(steps["batch_size"], errors="coerce").fillna(0)
    for col in ("waiting", "deferred"):
        if col in steps:
            total = total + pd.to_numeric(steps[col], errors="coerce").fillna(0)
    return total


def pool_in_flight_max(steps: pd.DataFrame, engine_ids: list[str]) -> int:
    """The pool's highest in-flight count: at every step of any engine, the sum of each
    engine's count at its latest step (the engines step on their own clocks, so the sum of
    their separate maxima would overstate it)."""
    if not len(steps):
        return 0
    s = steps[steps["engine_id"].isin(engine_ids)].sort_values("ts_unix_s", kind="stable")
    latest: dict[str, float] = {}
    best = 0.0
    for eid, load in zip(s["engine_id"], _in_flight(s), strict=True):
        latest[str(eid)] = float(load)
        best = max(best, sum(latest.values()))
    return int(best)


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def replica_flags(
    report: Report,
    caps: dict[str, ReplicaCap],
    ports: list[int],
    router_queue: int | None,
    rendering: dict[str, Any] | None = None,
) -> list[dict[str, int]]:
    """The vLLM flags of each engine to restart on ``ports``, as flag -> value: those the
    gateway's ``rendering`` gives the replica at that port (``replica_flags``), else its own
    cap's; ``--max-num-queued-reqs C + router_queue`` if given."""
    by_port = {_port(c.address): eid for eid, c in caps.items()}
    behind = (rendering or {}).get("replica_flags") or {}
    out = []
    for port in ports:
        eid = by_port[port]
        given = behind.get(caps[eid].address)
        f = _parse_flags(given) if given else _flags(report, eid)
        if router_queue is not None:
            f["--max-num-queued-reqs"] = caps[eid].cap + router_queue
        out.append(f)
    return out


def _parse_flags(flags: list[str]) -> dict[str, int]:
    out = {}
    for f in flags:
        name, _, value = str(f).partition(" ")
        out[name] = int(value)
    return out


def _flags(report: Report, engine_id: str) -> dict[str, int]:
    """The vLLM flags of ``engine_id``'s cap recommendation, as flag -> value."""
    rec = next(
        r
        for r in report.recommendations
        if r.kind == "concurrency_cap" and r.scope.engine_id == engine_id
    )
    return _parse_flags(rec.change.get("vllm_flags", []))


STATUSES = {"nginx": {"http_503"}, "vllm-router": {"http_429", "http_503", "server_error"}}
"""What each rendering says the excess gets: nginx's ``limit_conn_status``; the router's
429 past its bucket and a replica's refusal at vLLM's admission limit passed on: 503, or for
a streaming request vLLM refuses after its 200 went out, an error event in the stream
(``server_error`` in the load generator's kinds)."""


def judge(
    result: LoopResult,
    setting: str,
    caps: dict[str, ReplicaCap],
    bound: dict[str, int] | None = None,
) -> None:
    """Set ``result.checks`` (the targets, and the admitted P99 against the rendering's) and
    ``result.gate`` (the tests' bounds for ``setting``, :data:`GATE`)."""
    result.checks = gateway_checks(result, setting, caps, bound)
    low, high = GATE[setting]
    result.gate = gateway_checks(
        result, setting, caps, bound, min_fraction=low, max_p99=high, against_prediction=False
    )


def gateway_checks(
    result: LoopResult,
    setting: str,
    caps: dict[str, ReplicaCap],
    bound: dict[str, int] | None = None,
    *,
    min_fraction: float = MIN_THROUGHPUT_FRACTION,
    max_p99: float = MAX_P99_RATIO,
    against_prediction: bool = True,
) -> list[Check]:
    """The loop's properties (module docstring), each with its verdict. ``bound``: requests
    in flight each engine may hold under this gateway (the router leaves the cap to vLLM's
    ``--max-num-queued-reqs``, which admits ``C``, or ``C + Q`` with a vLLM queue)."""
    gw, ref = result.of(setting), result.of("uncapped")
    out: list[Check] = []
    for eid, cap in caps.items():
        worst = max(r.in_flight_max.get(eid, 0) for r in gw)
        limit = cap.cap if bound is None else bound[eid]
        what = (
            f"cap {cap.cap}" if bound is None else f"cap {cap.cap} + vLLM queue {limit - cap.cap}"
        )
        out.append(
            Check(
                f"{cap.address} in flight <= {what}",
                f"max {worst} over {len(gw)} runs (uncapped: max "
                f"{max(r.in_flight_max.get(eid, 0) for r in ref)})",
                HOLDS if worst <= limit else FAILS,
            )
        )
    tp = ratio([r.tokens_per_s for r in gw], [r.tokens_per_s for r in ref])
    out.append(
        Check(
            f"throughput / uncapped >= {min_fraction}",
            tp.describe(),
            tp.at_least(min_fraction),
        )
    )
    p99s = [r.e2e_p99_s for r in gw if r.e2e_p99_s]
    p99r = [r.e2e_p99_s for r in ref if r.e2e_p99_s]
    if p99s and p99r:
        p = ratio(p99s, p99r)
        out.append(
            Check(
                f"admitted e2e P99 / uncapped <= {max_p99}",
                p.describe(),
                p.at_most(max_p99),
            )
        )
    predicted = result.predicted_p99_e2e_s
    if against_prediction and p99s and predicted and predicted > 0:
        over = ratio_to(p99s, predicted)
        out.append(
            Check(
                f"admitted e2e P99 / the rendering's {predicted:.2f} s <= {MAX_OVER_PREDICTED_P99}",
                over.describe(),
                over.at_most(MAX_OVER_PREDICTED_P99),
            )
        )
    kinds: dict[str, int] = {}
    for r in gw:
        for k, v in r.errors.items():
            kinds[k] = kinds.get(k, 0) + v
    allowed = STATUSES[setting]
    out.append(
        Check(
            f"the excess gets {' or '.join(sorted(k.removeprefix('http_') for k in allowed))}, "
            "nothing else",
            ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) or "nothing refused",
            HOLDS if kinds and set(kinds) <= allowed else FAILS,
        )
    )
    old = result.of("nginx $server_name")
    if old:
        out += old_form_checks(old, gw, min(result.caps.values()))
    return out


def old_form_checks(old: list[Run], rendered: list[Run], one: int) -> list[Check]:
    """What the old ``limit_conn $server_name`` rendering does to a pool, measured beside the
    rendered form in the same rounds: the whole pool held to one replica's cap ``one`` (exact,
    from every engine step), and the throughput that costs against the rendered form's
    (shown when its interval lies wholly below :data:`MIN_THROUGHPUT_FRACTION`, refuted when
    wholly above; two engines sharing two cores spread so widely between runs that three
    rounds often leave it within noise)."""
    pool_max = max(r.pool_in_flight_max for r in old)
    reached = max((r.pool_in_flight_max for r in rendered), default=0)
    out = [
        Check(
            f"old $server_name form: the pool held to one replica's cap {one}",
            f"pool in flight max {pool_max} (the rendered form: {reached})",
            HOLDS if pool_max <= one else FAILS,
        )
    ]
    if rendered:
        otp = ratio([r.tokens_per_s for r in old], [r.tokens_per_s for r in rendered])
        out.append(
            Check(
                f"old $server_name form: throughput / the rendered form's < "
                f"{MIN_THROUGHPUT_FRACTION}",
                otp.describe(),
                otp.at_most(MIN_THROUGHPUT_FRACTION),
            )
        )
    return out


def _s(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.2f} s"


def _per_engine(d: dict[str, Any]) -> str:
    return ", ".join(f"{k.rsplit(':', 2)[-2]}: {v}" for k, v in d.items())


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(vals) if vals else None


def table(results: list[LoopResult]) -> str:
    """Per loop: its settings' runs (medians) and the checks."""
    lines = []
    for res in results:
        knee = "-" if res.knee is None else f"{res.knee:.1f}"
        lines.append(
            f"\n## {res.loop}: {res.bottleneck}, knee {knee}, caps "
            + ", ".join(f"{a} {c}" for a, c in res.caps.items())
            + f"; predicted: admitted e2e P99 {_s(res.predicted_p99_e2e_s)}, throughput "
            + (
                "-"
                if res.predicted_throughput_fraction is None
                else f"{res.predicted_throughput_fraction:.0%}"
            )
            + " of the plateau"
        )
        lines.append(
            "| setting | runs | tok/s | e2e P99 (client) | e2e P99 (vLLM) | vLLM queue P50 / P99 "
            "| in flight max per engine | refused |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for setting in dict.fromkeys(r.setting for r in res.runs):
            rs = res.of(setting)
            ids = list(rs[0].in_flight_max)
            inflight = " / ".join(str(max(r.in_flight_max[e] for r in rs)) for e in ids)
            if len(ids) > 1:
                inflight += f" (pool {max(r.pool_in_flight_max for r in rs)})"
            refused: dict[str, int] = {}
            for r in rs:
                for k, v in r.errors.items():
                    refused[k] = refused.get(k, 0) + v
            lines.append(
                f"| {setting} | {len(rs)} | {statistics.median(r.tokens_per_s for r in rs):,.0f} "
                f"| {_s(_median([r.e2e_p99_s for r in rs]))} "
                f"| {_s(_median([r.engine_e2e_p99_s for r in rs]))} "
                f"| {_s(_median([r.queue_p50_s for r in rs]))} / "
                f"{_s(_median([r.queue_p99_s for r in rs]))} | {inflight} | "
                f"{', '.join(f'{v} {k}' for k, v in sorted(refused.items())) or '-'} |"
            )
        lines.append("")
        for c in res.checks:
            lines.append(f"- {c.verdict:>12}: {c.name}: {c.figure}")
        targets = {c.name for c in res.checks}
        for c in res.gate:
            if c.name not in targets:
                lines.append(f"- {c.verdict:>12}: {c.name} (the tests' bound): {c.figure}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--loops", default=",".join(LOOPS), help=f"comma-separated, of {', '.join(LOOPS)}"
    )
    ap.add_argument("--top", type=int, default=32, help="overload clients per engine")
    ap.add_argument(
        "--router-queue",
        type=int,
        default=None,
        metavar="Q",
        help="behind vllm-router, start the replicas with --max-num-queued-reqs C+Q "
        "(default: the router rendering's flags, C: no vLLM queue)",
    )
    ap.add_argument(
        "--refused-backoff",
        type=float,
        default=REFUSED_BACKOFF_S,
        metavar="S",
        help="seconds a client the gateway refused waits before its next request (default: "
        "%(default)s; longer sends fewer refused requests through the gateway)",
    )
    ap.add_argument(
        "--router-control",
        action="store_true",
        help="with router-pool: after each router round, one through nginx (the pool "
        "rendering) in front of the same restarted engines, reported as loop nginx-restarted",
    )
    ap.add_argument(
        "--storm",
        type=float,
        default=0.0,
        metavar="RATE",
        help="with --router-control: one more nginx round each time while RATE render calls a "
        "second, refused, hit each replica's API server (loop nginx-storm)",
    )
    ap.add_argument(
        "--duration", type=float, default=12.0, help="seconds per sweep level on one engine"
    )
    ap.add_argument(
        "--pool-duration",
        type=float,
        default=12.0,
        help="seconds per sweep level on a pool of engines sharing the machine (default: "
        "%(default)s; each engine runs slower, its requests live longer)",
    )
    ap.add_argument(
        "--workdir",
        default="/tmp/kvscope-gateway-loops",
        help="the store, the engines' and gateways' logs (default: %(default)s)",
    )
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args(argv)
    loops = [x for x in args.loops.split(",") if x]
    if args.storm > 0 and not args.router_control:
        ap.error("--storm runs inside the router loop's control rounds: add --router-control")
    unknown = sorted(set(loops) - set(LOOPS))
    if unknown:
        ap.error(f"unknown loop(s) {', '.join(unknown)}; choose from {', '.join(LOOPS)}")

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    model = build_model(default_model_dir("mid"), "mid")
    results = []
    with ExitStack() as stack:
        lab = GatewayLab(
            args.workdir,
            model_dir=model,
            top=args.top,
            duration_s=args.duration,
            pool_duration_s=args.pool_duration,
            refused_backoff_s=args.refused_backoff,
            log=log,
        )
        stack.enter_context(lab)
        if "nginx-one" in loops:
            results.append(lab.nginx_one())
            log(table(results[-1:]))
        if "nginx-pool" in loops or "router-pool" in loops:
            results += lab.pool_loops(
                "nginx-pool" in loops,
                "router-pool" in loops,
                router_queue=args.router_queue,
                router_control=args.router_control,
                storm_rate=args.storm,
            )
            log(table(results[-4:]))
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if all(r.holds for r in results) else 1


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    raise SystemExit(run_stoppable(main))

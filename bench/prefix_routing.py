"""Prefix-aware routing on a real two-engine pool: the advisor's prediction, then the test.

One command (about three minutes on a 2-core machine, two engine starts included)::

    .venv/bin/python bench/prefix_routing.py [--requests 300] [--json out.json]

What it does
------------
1. A collector process (KV-event subscription on, its default) and two real vLLM CPU
   engines of one pool on the lab's "mid" model, each with the kvscope plugin and
   vLLM's KV-cache events published over ZMQ (``--kv-events-config``); the collector
   finds the event streams through the engines' hellos. Each engine's worker gets
   its own core (``VLLM_CPU_OMP_THREADS_BIND``).
2. **Round robin**: a closed-loop load of ``concurrency`` clients sending ``requests``
   requests (``duration_s`` is only a time limit), spread over the two engines in turn. The workload has
   ``prefix_groups`` shared prefixes of ``prefix_words`` words (several KV blocks
   each; every request picks one at random, then a short unique body and a few
   output tokens), like system prompts or few-shot templates shared by many users.
   Round robin sends every group to both replicas, so each replica computes and
   caches every prefix once for itself.
3. The advisor reads the round-robin run back from the collector and, from the
   cross-replica duplication the KV events show, predicts the pool's hit rate under
   prefix-affine routing and recommends it.
4. **Prefix-affine**: both prefix caches are emptied (vLLM's ``/reset_prefix_cache``,
   so no run inherits the other's cache), then the same requests (same seed, same
   count) are sent with prefix-affine routing (a hash of the prompt's first words picks the
   replica).
5. Measured hit rates come from vLLM's own counters (``vllm:prefix_cache_hits_total``
   over ``vllm:prefix_cache_queries_total``, summed over both engines, before/after
   each run); engine-side TTFT from the requests the collector stored.

With ``--gateway vllm-router`` both runs go through vLLM's router instead of the load
generator's routing: ``--policy round_robin`` first, then the router started with the
advisor's ``vllm_router`` rendering as rendered (its command's arguments); requests per engine
then come from vLLM's counters. The engines start with ``--enable-scale-out``, which the
rendering asks of every worker (``worker_flags``: the router tokenizes prompts through the
workers' ``/v1/completions/render``); ``--no-scale-out`` leaves it off to show the router
routing without affinity.

The workload is sized so both replicas hold every prefix (no eviction): then the
tokens a prefix-aware router would have saved are exactly the blocks one replica
computed while the other held them, which is what the prediction counts.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvscope.advisor import CollectorSource, Report, analyze
from kvscope.collector.process import CollectorProcess, free_port
from kvscope.lab.engine import VllmServer, build_model, default_model_dir, vllm_counter_totals
from kvscope.lab.gateway import VllmRouter, router_args
from kvscope.lab.sweep import SweepConfig, SweepResult, run_sweep

POOL = "routing"
MODEL_NAME = "kvscope-routing"
NUM_GPU_BLOCKS = 4096
"""Per engine: 131,072 tokens of KV cache, room for every prefix with no eviction."""


@dataclass
class RunMeasure:
    """One routing policy's run over the pool."""

    policy: str
    since_unix_s: float
    until_unix_s: float
    requests_per_engine: list[int]
    queries: list[float]
    """``vllm:prefix_cache_queries_total`` gained per engine during the run (tokens)."""
    hits: list[float]
    completed: int
    errors: int
    client_ttft_p50_s: float | None
    engine_ttft_mean_s: float | None = None
    engine_ttft_p50_s: float | None = None
    engine_ttft_p90_s: float | None = None
    n_engine_requests: int = 0

    @property
    def hit_rate(self) -> float:
        q = sum(self.queries)
        return sum(self.hits) / q if q else math.nan

    @property
    def hit_rate_per_engine(self) -> list[float]:
        return [h / q if q else math.nan for h, q in zip(self.hits, self.queries, strict=True)]


@dataclass
class RoutingResult:
    round_robin: RunMeasure
    affine: RunMeasure | None
    predicted_hit_rate: float | None
    predicted_ttft_change_s: float | None
    recommendation: dict[str, Any] | None
    pool_evidence: dict[str, Any] = field(default_factory=dict)
    startup_s: list[float] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    gateway: str = "client"
    """``client``: the load generator routes (round robin, then prefix-affine);
    ``vllm-router``: vLLM's router does (``round_robin``, then the advisor's rendering)."""
    router_command: str | None = None
    """The advisor's vllm-router rendering the second run was routed by."""
    missing_worker_flags: list[str] = field(default_factory=list)
    """Flags the rendering asks of every vLLM worker that the engines were started without."""

    @property
    def measured_ttft_change_s(self) -> float | None:
        """Mean engine TTFT under the recommended routing minus under round robin."""
        if self.affine is None:
            return None
        a, b = self.affine.engine_ttft_mean_s, self.round_robin.engine_ttft_mean_s
        return None if a is None or b is None else a - b

    @property
    def ttft_change_error(self) -> float | None:
        """Measured over predicted mean TTFT change, less one (0: exactly as predicted;
        negative: a smaller change, or one in the other direction when below -1)."""
        m, p = self.measured_ttft_change_s, self.predicted_ttft_change_s
        return None if m is None or not p else m / p - 1.0

    @property
    def hit_rate_error(self) -> float | None:
        """Measured prefix-affine hit rate minus the predicted one (absolute)."""
        if self.affine is None or self.predicted_hit_rate is None:
            return None
        return self.affine.hit_rate - self.predicted_hit_rate

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("round_robin", "affine"):
            run = getattr(self, name)
            if run is not None:
                out[name]["hit_rate"] = run.hit_rate
                out[name]["hit_rate_per_engine"] = run.hit_rate_per_engine
        out["hit_rate_error"] = self.hit_rate_error
        out["measured_ttft_change_s"] = self.measured_ttft_change_s
        out["ttft_change_error"] = self.ttft_change_error
        return out


def _post(url: str, body: dict[str, Any] | None = None, timeout_s: float = 30.0) -> str:
    req = urllib.request.Request(
        url,
        data=json.dumps(body or {}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return resp.read().decode()


class RoutingLab:
    """A collector and two engines of one pool with KV-cache events on."""

    def __init__(
        self,
        workdir: str | Path,
        *,
        model_dir: str | Path | None = None,
        concurrency: int = 4,
        requests: int | None = 300,
        duration_s: float = 120.0,
        prefix_groups: int = 64,
        prefix_words: int = 300,
        body_words: tuple[int, int] = (8, 24),
        output_tokens: int = 16,
        seed: int = 11,
        log: Any = None,
        progress: bool = False,
        engine_args: tuple[str, ...] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.engine_args = tuple(engine_args)
        """More vLLM flags for both engines."""
        self.model_dir = Path(model_dir) if model_dir else None
        self.concurrency = concurrency
        self.requests = requests
        self.duration_s = duration_s
        self.prefix_groups = prefix_groups
        self.prefix_words = prefix_words
        self.body_words = body_words
        self.output_tokens = output_tokens
        self.seed = seed
        self.log = log or (lambda _text: None)
        self.progress = progress
        self.collector: CollectorProcess | None = None
        self.servers: list[VllmServer] = []
        self._t0 = time.monotonic()

    def _say(self, text: str) -> None:
        self.log(f"[{time.monotonic() - self._t0:6.1f} s] {text}")

    def start(self) -> RoutingLab:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.model_dir is None:
            self.model_dir = build_model(default_model_dir("mid"), "mid")
        self.collector = CollectorProcess(
            self.workdir / "store.duckdb", log_path=self.workdir / "collector.log"
        ).start()
        self._say(f"collector at {self.collector.url}")
        for i in range(2):
            port = free_port("127.0.0.1")
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{port}",
                "topic": "kv-events",
            }
            server = VllmServer(
                self.model_dir,
                served_model_name=MODEL_NAME,
                num_gpu_blocks=NUM_GPU_BLOCKS,
                enable_prefix_caching=True,
                extra_args=["--kv-events-config", json.dumps(events), *self.engine_args],
                env={
                    "KVSCOPE_COLLECTOR_URL": self.collector.url,
                    "KVSCOPE_POOL": POOL,
                    "KVSCOPE_FLUSH_INTERVAL_S": "0.5",
                    "VLLM_SERVER_DEV_MODE": "1",
                    # the advisor's renderings name each engine by this address
                    "KVSCOPE_HOST": "127.0.0.1",
                    "VLLM_CPU_OMP_THREADS_BIND": str(i),
                },
                log_path=self.workdir / f"vllm-{i}.log",
            )
            self.servers.append(server)
            server.launch()  # both start at once, each on a core of its own
        for i, server in enumerate(self.servers):
            server.wait_started()
            self._say(f"engine {i} up in {server.startup_s:.0f} s at {server.url}")
        self._wait_subscribed()
        return self

    def close(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers = []
        if self.collector is not None:
            self.collector.stop()
            self.collector = None

    def __enter__(self) -> RoutingLab:
        try:
            return self.start()
        except BaseException:
            self.close()  # no engine or collector outlives a failed start
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def _collector(self) -> CollectorProcess:
        if self.collector is None:
            raise RuntimeError("RoutingLab.start() first")
        return self.collector

    def _wait_subscribed(self, timeout_s: float = 120.0) -> None:
        """Until the collector subscribed to both engines' KV events (one request each,
        which also makes each engine send its hello)."""
        for server in self.servers:
            _post(
                f"{server.url}/v1/completions",
                {"model": MODEL_NAME, "prompt": "warm up", "max_tokens": 2},
                timeout_s=120.0,  # a slow machine's first request
            )
        deadline = time.monotonic() + timeout_s
        while True:
            text = self._collector.get_text("/metrics")
            subscribed = [
                line
                for line in text.splitlines()
                if line.startswith("kvscope_kv_events_subscribed{") and line.rstrip().endswith(" 1")
            ]
            if len(subscribed) >= len(self.servers):
                self._say(f"collector subscribed to {len(subscribed)} KV event streams")
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "the collector did not subscribe to both engines' KV "
                    f"events; see {self.workdir / 'collector.log'}"
                )
            time.sleep(0.5)

    def _reset_caches(self) -> None:
        for server in self.servers:
            deadline = time.monotonic() + 120.0
            while "true" not in _post(f"{server.url}/reset_prefix_cache").lower():
                if time.monotonic() > deadline:  # requests still running
                    raise RuntimeError(f"{server.url} refused to reset its prefix cache")
                time.sleep(0.5)

    def _counters(self) -> list[dict[str, float]]:
        return [vllm_counter_totals(s.metrics_text()) for s in self.servers]

    def _drain(self, timeout_s: float = 120.0) -> None:
        """Until the collector holds every prefix query vLLM counted (both engines)."""
        deadline = time.monotonic() + timeout_s
        while True:
            theirs = sum(c["vllm:prefix_cache_queries_total"] for c in self._counters())
            rows = self._collector.get_json("/v1/totals", params={"source": "windows"})["rows"]
            ours = sum(float(r["prefix_queries"]) for r in rows)
            if ours == theirs:
                time.sleep(1.5)  # KV events flush about once a second
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"collector holds {ours} prefix queries, vLLM counted {theirs}")
            time.sleep(0.5)

    def run(self, policy: str, via: str | None = None) -> RunMeasure:
        """One run of the workload under ``policy``: the load generator's own routing over
        the engines, or (``via``: a gateway's URL) every request to the gateway, which
        routes; requests per engine then come from vLLM's counters."""
        self._reset_caches()
        before = self._counters()
        since = time.time()
        self._say(
            f"{policy}: {self.concurrency} clients, {self.requests or 'unlimited'} requests "
            f"within {self.duration_s:g} s, {self.prefix_groups} prefixes of "
            f"{self.prefix_words} words"
        )
        sweep: SweepResult = run_sweep(
            SweepConfig(
                url=via or self.servers[0].url,
                replicas=[] if via else [s.url for s in self.servers[1:]],
                routing="round-robin" if via else policy,
                model=MODEL_NAME,
                concurrency=[self.concurrency],
                duration_s=self.duration_s,
                max_requests=self.requests,
                warmup_s=0.0,
                cooldown_s=0.0,
                prompt_words=self.body_words,
                output_tokens=(self.output_tokens,) * 2,
                shared_prefix_words=self.prefix_words,
                prefix_groups=self.prefix_groups,
                seed=self.seed,
                progress=self.progress,
            )
        )
        self._drain()
        until = time.time()
        after = self._counters()
        (lv,) = sweep.levels
        q = [
            a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
            for a, b in zip(after, before, strict=True)
        ]
        h = [
            a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"]
            for a, b in zip(after, before, strict=True)
        ]
        run = RunMeasure(
            policy=policy,
            since_unix_s=since,
            until_unix_s=until,
            requests_per_engine=(
                [
                    int(a["vllm:request_success_total"] - b["vllm:request_success_total"])
                    for a, b in zip(after, before, strict=True)
                ]
                if via
                else list(lv.requests_per_target or [])
            ),
            queries=q,
            hits=h,
            completed=lv.requests_completed,
            errors=lv.error_count,
            client_ttft_p50_s=lv.ttft_p50_s,
        )
        reqs = CollectorSource(self._collector.url).requests(since, until, pool=POOL)
        ttft = [float(x) for x in reqs["ttft_s"].dropna()] if len(reqs) else []
        if ttft:
            run.engine_ttft_mean_s = statistics.fmean(ttft)
            run.engine_ttft_p50_s = statistics.median(ttft)
            run.engine_ttft_p90_s = float(np.quantile(ttft, 0.9))
            run.n_engine_requests = len(ttft)
        self._say(
            f"{policy}: hit rate {run.hit_rate:.1%} (per engine "
            + ", ".join(f"{x:.1%}" for x in run.hit_rate_per_engine)
            + f"), {run.completed} requests in {run.until_unix_s - run.since_unix_s:.0f} s, "
            f"requests per engine {run.requests_per_engine}"
        )
        return run

    def advise(self, run: RunMeasure) -> Report:
        return analyze(
            CollectorSource(self._collector.url),
            math.floor(run.since_unix_s),
            math.ceil(run.until_unix_s),
            pool=POOL,
        )

    def _router(self, args: list[str], name: str) -> VllmRouter:
        return VllmRouter(args, self.workdir / f"router-{name}.log")

    def scenario(self, gateway: str = "client") -> RoutingResult:
        """Round robin, the advisor's prediction, then the routing it recommends; with
        ``gateway="vllm-router"`` both runs go through vLLM's router: ``--policy
        round_robin``, then the command the advisor rendered, as rendered."""
        if gateway not in ("client", "vllm-router"):
            raise ValueError(f"gateway must be client or vllm-router, not {gateway!r}")
        if gateway == "client":
            rr = self.run("round-robin")
        else:
            workers = ["--worker-urls", *(s.url for s in self.servers)]
            with self._router([*workers, "--policy", "round_robin"], "round_robin") as gw:
                rr = self.run("vllm-router round_robin", via=gw.url)
        report = self.advise(rr)
        rec = next((r for r in report.recommendations if r.kind == "prefix_aware_routing"), None)
        pool = next((p for p in report.pools if p.pool == POOL), None)
        predicted = getattr(pool, "predicted_prefix_hit_rate_affine", None)
        ttft_change = None
        if rec is not None:
            predicted = rec.expected_effect.get("predicted_hit_rate", predicted)
            ttft_change = rec.expected_effect.get("mean_ttft_change_s")
        evidence = {}
        found = report.findings_of("prefix_routing")
        if found:
            evidence = dict(found[0].evidence)
        self._say(f"advisor: {rec.summary if rec else 'no prefix-aware routing recommendation'}")
        command = None
        missing: list[str] = []
        if gateway == "client":
            affine: RunMeasure | None = self.run("prefix-affine")
        elif rec is None:
            affine = None
        else:
            router = rec.change["gateway"]["vllm_router"]
            command = str(router["config"])
            missing = [f for f in router.get("worker_flags", []) if f not in self.engine_args]
            if missing:
                self._say(f"the engines run without {' '.join(missing)}, which it needs")
            args = router_args(command)
            policy = args[args.index("--policy") + 1] if "--policy" in args else "default"
            self._say(f"vllm-router with the advisor's rendering:\n{command}")
            with self._router(args, policy) as gw:
                affine = self.run(f"vllm-router {policy}", via=gw.url)
        return RoutingResult(
            gateway=gateway,
            router_command=command,
            missing_worker_flags=missing,
            round_robin=rr,
            affine=affine,
            predicted_hit_rate=None if predicted is None else float(predicted),
            predicted_ttft_change_s=None if ttft_change is None else float(ttft_change),
            recommendation=None if rec is None else rec.to_dict(),
            pool_evidence=evidence,
            startup_s=[float(s.startup_s or 0.0) for s in self.servers],
            config={
                "concurrency": self.concurrency,
                "requests": self.requests,
                "duration_s": self.duration_s,
                "prefix_groups": self.prefix_groups,
                "prefix_words": self.prefix_words,
                "body_words": list(self.body_words),
                "output_tokens": self.output_tokens,
                "num_gpu_blocks": NUM_GPU_BLOCKS,
                "seed": self.seed,
                "engine_args": list(self.engine_args),
            },
        )


def _pct(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1%}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def format_result(res: RoutingResult) -> str:
    rows = [
        (
            "policy",
            "hit rate",
            "per engine",
            "requests per engine",
            "TTFT mean (engine)",
            "TTFT p50 (engine)",
            "TTFT p90 (engine)",
        )
    ]
    for run in (res.round_robin, res.affine):
        if run is None:
            continue
        rows.append(
            (
                run.policy,
                _pct(run.hit_rate),
                " / ".join(_pct(x) for x in run.hit_rate_per_engine),
                " / ".join(map(str, run.requests_per_engine)),
                _ms(run.engine_ttft_mean_s),
                _ms(run.engine_ttft_p50_s),
                _ms(run.engine_ttft_p90_s),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("")
    lines.append(
        f"advisor's prediction for {'prefix-affine routing' if res.gateway == 'client' else 'its vllm-router rendering'}: hit rate "
        f"{_pct(res.predicted_hit_rate)}, TTFT change "
        f"{'-' if res.predicted_ttft_change_s is None else f'{res.predicted_ttft_change_s * 1e3:+.0f} ms'}"
    )
    if res.affine is not None and res.predicted_hit_rate is not None:
        measured_ttft = res.measured_ttft_change_s
        err = res.ttft_change_error
        lines.append(
            f"measured: hit rate {_pct(res.affine.hit_rate)} "
            f"(error {res.hit_rate_error:+.1%} absolute), TTFT change "
            f"{'-' if measured_ttft is None else f'{measured_ttft * 1e3:+.0f} ms'}"
            f"{'' if err is None else f' ({err:+.0%} of the predicted change)'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--requests",
        type=int,
        default=300,
        help="requests per run, the same ones in both runs (default 300; 0: no limit)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=120.0,
        help="time limit of a run in seconds (default 120)",
    )
    p.add_argument("--concurrency", type=int, default=4, help="clients (default 4)")
    p.add_argument("--groups", type=int, default=64, help="shared prefixes (default 64)")
    p.add_argument(
        "--prefix-words", type=int, default=300, help="words per shared prefix (default 300)"
    )
    p.add_argument(
        "--gateway",
        choices=("client", "vllm-router"),
        default="client",
        help="who routes: the load generator (round robin, then prefix-affine; default) or "
        "vLLM's router (round_robin, then the advisor's rendering of it)",
    )
    p.add_argument(
        "--no-scale-out",
        action="store_true",
        help="with --gateway vllm-router: start the engines without --enable-scale-out, which "
        "the advisor's cache_aware rendering asks for (to see the router route without it)",
    )
    p.add_argument("--workdir", default=None, help="keep the store and logs here")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    import tempfile

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvscope-routing-"))
    with RoutingLab(
        workdir,
        concurrency=args.concurrency,
        requests=args.requests or None,
        duration_s=args.duration,
        prefix_groups=args.groups,
        prefix_words=args.prefix_words,
        log=lambda t: print(t, file=sys.stderr, flush=True),
        progress=True,
        engine_args=(
            ("--enable-scale-out",)
            if args.gateway == "vllm-router" and not args.no_scale_out
            else ()
        ),
    ) as lab:
        res = lab.scenario(args.gateway)
    print(format_result(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res.to_dict(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    raise SystemExit(run_stoppable(main))

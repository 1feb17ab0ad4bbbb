"""The vllm-router rendering against the real router (PyPI ``vllm-router``, the test extra):
every rendered flag exists in its ``--help`` and parses with its own argument parser to what
the rendering means, and the router run in front of two stand-in workers does with the
excess what the rendering says."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from vllm_router.launch_router import parse_router_args

from kvscope.advisor.gateways import (
    ReplicaCap,
    balance_routing,
    pool_renderings,
    prefix_routing,
    replica_renderings,
)
from kvscope.advisor.gateways.vllm_router import LAUNCH, VERSION
from kvscope.lab.gateway import VllmRouter, router_args
from tests.advisor._upstreams import Burst, Upstream, post


def _replicas(addresses: list[str], cap: int = 12, queue: int = 3) -> list[ReplicaCap]:
    return [ReplicaCap(address=a, cap=cap, max_num_seqs=cap, queue=queue) for a in addresses]


def _args(config: str) -> list[str]:
    """The arguments of a rendered router command line."""
    assert config.startswith(LAUNCH + " ")
    return router_args(config)


def _rendered() -> list[str]:
    pair = _replicas(["h1:8000", "h2:8000"])
    return [
        pool_renderings("demo", pair)["vllm_router"]["config"],
        prefix_routing(
            ["h1:8000", "h2:8000"],
            pair,
            available=0.4,
            hit_rate=0.3,
            predicted_hit_rate=0.5,
            predicted_hit_rate_max=0.6,
            imbalance_threshold=1.25,
        )["vllm_router"]["config"],
        balance_routing(["h1:8000", "h2:8000"], busiest="h1:8000:0", imbalance=1.6)["vllm_router"][
            "config"
        ],
    ]


def test_the_installed_router_is_the_version_the_rendering_describes() -> None:
    from importlib.metadata import version

    assert version("vllm-router") == VERSION


def test_every_rendered_flag_is_in_the_routers_help() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "vllm_router.launch_router", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    known = {w.rstrip(",") for w in res.stdout.split() if w.startswith("--")}
    for config in _rendered():
        flags = {a for a in _args(config) if a.startswith("--")}
        assert flags and flags <= known, flags - known


def test_rendered_commands_parse_to_what_the_rendering_means() -> None:
    cap, prefix, balance = (parse_router_args(_args(c)) for c in _rendered())
    assert cap.worker_urls == ["http://h1:8000", "http://h2:8000"]
    assert cap.max_concurrent_requests == 24  # the pool's sum, never one replica's 12
    assert cap.rate_limit_tokens_per_second == 1 and cap.queue_size == 0
    assert cap.disable_circuit_breaker is True
    assert cap.retry_max_retries == 2  # one retry on another worker, not the default 5
    assert prefix.policy == "cache_aware" and prefix.cache_threshold == 0.2
    assert prefix.balance_abs_threshold == 3 and prefix.balance_rel_threshold == 1.25
    assert balance.policy == "power_of_two"


@contextmanager
def _router(args: list[str], tmp: Path) -> Iterator[int]:
    with VllmRouter(args, tmp / "router.log") as router:
        yield router.port


@pytest.fixture
def workers() -> Iterator[tuple[Upstream, Upstream]]:
    """Two stand-in vLLM replicas: cap 2 and a queue of 1, so 503 past 3 in flight."""
    a, b = Upstream(hold_s=1.5, limit=3), Upstream(hold_s=1.5, limit=3)
    yield a, b
    a.stop()
    b.stop()


def test_past_the_pools_sum_the_router_answers_429_at_once(
    tmp_path: Path, workers: tuple[Upstream, Upstream]
) -> None:
    a, b = workers
    config = pool_renderings("t", _replicas([a.address, b.address], cap=2, queue=1))
    with _router(
        [*_args(config["vllm_router"]["config"]), "--policy", "round_robin"], tmp_path
    ) as port:
        t0 = time.monotonic()
        burst = Burst(port, 10)
        statuses = Counter(burst.join())
    # The bucket of 4 (2 + 2) lets 4 through (a fifth if the burst took a second to send:
    # the refill); no queue: the others get 429 at once.
    assert set(statuses) == {200, 429} and 4 <= statuses[200] <= 5, statuses
    assert a.peak + b.peak <= 4 and max(a.peak, b.peak) <= 3
    assert time.monotonic() - t0 < 10


def test_the_bucket_refills_while_requests_are_in_flight(
    tmp_path: Path, workers: tuple[Upstream, Upstream]
) -> None:
    """A burst limit, not a bound on requests in flight: with a bucket of 2 refilled at
    1/s, steady arrivals of 3-second requests get more than 2 in flight."""
    a, b = workers
    a.hold_s = b.hold_s = 3.0
    a.limit = b.limit = None
    args = _args(
        pool_renderings("t", _replicas([a.address, b.address], cap=1, queue=1))["vllm_router"][
            "config"
        ]
    )
    with _router([*args, "--policy", "round_robin"], tmp_path) as port:
        burst = Burst(port, 30, gap_s=0.1)
        statuses = Counter(burst.join())
    assert a.peak + b.peak > 2, (a.peak, b.peak)
    assert statuses[429] > 0 and statuses[200] > 2, statuses


@pytest.mark.parametrize("breaker_off", [True, False])
def test_the_circuit_breaker_takes_capped_workers_out_unless_disabled(
    tmp_path: Path, workers: tuple[Upstream, Upstream], breaker_off: bool
) -> None:
    """Workers answering 503 at their admission limit (vLLM's --max-num-queued-reqs) open
    the router's circuits: afterwards it answers 503 with both workers idle. The rendering
    turns the breaker off."""
    a, b = workers
    config = pool_renderings("t", _replicas([a.address, b.address]))["vllm_router"]["config"]
    assert "--disable-circuit-breaker" in _args(config)
    # Only the workers and the breaker flag: no router limit, every request reaches them.
    base = [
        "--worker-urls",
        f"http://{a.address}",
        f"http://{b.address}",
        "--policy",
        "round_robin",
    ]
    extra = ["--disable-circuit-breaker"] if breaker_off else []
    with _router([*base, *extra], tmp_path) as port:
        Burst(port, 40).join()
        assert a.rejected + b.rejected >= 20  # the workers were full
        time.sleep(2.0)  # both idle again
        after = [post(port)[0] for _ in range(3)]
    if breaker_off:
        assert after == [200, 200, 200]
    else:
        assert after == [503, 503, 503]


def test_the_worker_flag_cache_aware_needs_is_a_flag_of_the_installed_vllm() -> None:
    """``--enable-scale-out`` registers the render endpoint the router tokenizes with; a flag
    vLLM does not know would stop every worker from starting."""
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    from kvscope.advisor.gateways.vllm_router import CACHE_AWARE_WORKER_FLAGS

    fields = {f.replace("_", "-") for f in FrontendArgs.__dataclass_fields__}
    for flag in CACHE_AWARE_WORKER_FLAGS:
        assert flag.removeprefix("--") in fields, flag


def test_a_request_a_full_pool_refuses_reaches_each_replica_once(tmp_path: Path) -> None:
    """The rendered retry budget against the router's default: two workers at their admission
    limit (every POST answered 503). With the rendering each refused request is tried on both
    workers once and then passed on; with the router's defaults it reaches them five times,
    each one a request the full replicas' API servers have to answer."""
    a, b = Upstream(reject_all=True), Upstream(reject_all=True)
    try:
        config = pool_renderings("t", _replicas([a.address, b.address]))["vllm_router"]["config"]
        rendered = [*_args(config), "--policy", "round_robin"]
        i = rendered.index("--retry-max-retries")
        assert rendered[i + 1] == "2"
        default = rendered[:i] + rendered[i + 2 :]
        attempts = {}
        for name, args in (("rendered", rendered), ("default", default)):
            before = a.rejected + b.rejected
            with _router(args, tmp_path / name) as port:
                statuses = [post(port)[0] for _ in range(4)]
            assert statuses == [503] * 4, (name, statuses)
            attempts[name] = a.rejected + b.rejected - before
    finally:
        a.stop()
        b.stop()
    assert attempts == {"rendered": 8, "default": 20}, attempts
    assert a.rejected == b.rejected == 14  # the retry went to the other worker


def test_behind_the_router_each_replica_is_started_at_its_cap_with_no_vllm_queue() -> None:
    """The router has no per-worker limit, so each replica's vLLM flags hold its cap; behind
    it they keep no queue (the router's retry finds the replica with room), and the P99 the
    rendering promises is the one at the cap, not at the cap and a full queue."""
    pair = [
        ReplicaCap(address="h1:8000", cap=12, max_num_seqs=11, queue=3, p99_e2e_s=1.35,
                   p99_e2e_s_queued=1.9),
        ReplicaCap(address="h2:8000", cap=9, max_num_seqs=9, queue=2, p99_e2e_s=1.1,
                   p99_e2e_s_queued=1.6),
    ]  # fmt: skip
    router = pool_renderings("p", pair)["vllm_router"]
    assert router["replica_flags"] == {
        "h1:8000": ["--max-num-seqs 11", "--max-num-queued-reqs 12"],
        "h2:8000": ["--max-num-seqs 9", "--max-num-queued-reqs 9"],
    }
    assert router["p99_e2e_s"] == 1.35  # the slowest replica at its cap
    assert "h2:8000: --max-num-seqs 9 --max-num-queued-reqs 9" in router["excess"]
    # The flags alone, with no gateway, keep vLLM's queue.
    assert replica_renderings(pair[0])["vllm"]["config"] == (
        "--max-num-seqs 11 --max-num-queued-reqs 15"
    )

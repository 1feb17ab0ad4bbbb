"""The cap and routing advice in vLLM's router (PyPI ``vllm-router`` 0.1.17,
``python -m vllm_router.launch_router``).

The router has no per-worker limit, so each replica's vLLM flags hold its cap, with no
vLLM queue behind the router (``flags_behind_router``): a request that finds a replica
full is retried once on another instead. The router adds a pool-level burst limit.
:func:`router_cap` renders:

* ``--max-concurrent-requests`` as the sum of the caps with the slowest refill: it is a
  token bucket that refills while requests are in flight, a burst limit (429 past it);
* ``--queue-size 0``: the router's queue times out after one token's refill, whatever its
  timeout says;
* ``--retry-max-retries 2`` (one retry on another worker) and ``--disable-circuit-breaker``
  (the breaker counts capped replicas' 503s as failures and shuts every worker out).

:func:`router_prefix` renders ``--policy cache_aware`` with thresholds from the advisor's
figures (:func:`cache_threshold`, :func:`balance_thresholds`) and ``--enable-scale-out`` on
the workers, without which the router's tokenize call is refused and it routes with no
affinity; :func:`router_balance` renders ``--policy power_of_two``.

Flags are the router's own (``tests/advisor/test_gateways_router.py`` parses every rendered
command with its parser). What each does, measured: docs/gateways.md#vllm-router,
docs/gateways.md#routing-advice-for-vllm-router and docs/gateways.md#measured-on-real-engines.
"""

from __future__ import annotations

import math
from typing import Any

from kvscope.advisor.gateways.replica import POOL, ReplicaCap, by_address, rendering, seconds, worst

VERSION = "0.1.17"
LAUNCH = "python -m vllm_router.launch_router"
SOURCE = (
    f"vllm-router {VERSION} --help (flags) and behaviour measured in front of stand-in "
    "workers; vllm-project/router src/middleware.rs, src/core/token_bucket.rs, "
    "src/policies/cache_aware.rs"
)
RETRY_ATTEMPTS = 2
"""``--retry-max-retries``: the first attempt and one retry on another worker (the router's
default, 5, sends each request a full pool refuses to the replicas five times)."""
REFILL_PER_S = 1
"""``--rate-limit-tokens-per-second``: the smallest refill the router allows (0 counts as 1),
so that the bucket lets the fewest extra requests through under sustained overload."""
DEFAULT_CACHE_THRESHOLD = 0.3
"""The router's default ``--cache-threshold``."""
MIN_CACHE_THRESHOLD = 0.05
CACHE_AWARE_WORKER_FLAGS = ("--enable-scale-out",)
"""What ``cache_aware`` needs on each vLLM worker (vLLM 0.32: it registers the
``/v1/completions/render`` endpoint the router tokenizes prompts with; without it vLLM answers
403, and the router routes with no prefix affinity). See
docs/gateways.md#prefix-aware-routing-through-vllm-router."""


def _command(addresses: list[str], flags: list[str]) -> str:
    urls = " ".join(f"http://{a}" for a in addresses)
    return " \\\n    ".join([LAUNCH, f"--worker-urls {urls}", *flags])


def router_cap(replicas: list[ReplicaCap], uncapped: list[str] | None = None) -> dict[str, Any]:
    """The pool's burst limit (the sum of the caps, when every replica has one) in front of
    the replicas' own vLLM flags."""
    caps = by_address(replicas)
    free = sorted(set(uncapped or []) - set(caps))
    replica_flags = flags_behind_router(replicas)
    total = sum(caps.values())
    flags = []
    if not free:
        flags = [
            f"--max-concurrent-requests {total}",
            f"--rate-limit-tokens-per-second {REFILL_PER_S}",
            "--queue-size 0",
        ]
    flags += [f"--retry-max-retries {RETRY_ATTEMPTS}", "--disable-circuit-breaker"]
    p99 = worst([r.p99_e2e_s for r in replicas])
    head = (
        f"no pool limit: {', '.join(free)} has no cap. "
        if free
        else (
            f"up to {total} requests at once (the sum of the caps), then 429 at once; the "
            f"limit is a token bucket refilled at {REFILL_PER_S}/s, so under sustained "
            f"overload about {REFILL_PER_S} more request a second gets through and after a "
            "while the replicas' flags alone hold the load. No router "
            "queue: vllm-router 0.1.17 holds a queued request only about 1/refill s, "
            "whatever --queue-timeout-secs says, then answers 408. "
        )
    )
    starts = "; ".join(f"{a}: {' '.join(f)}" for a, f in replica_flags.items())
    excess = head + (
        "The router has no per-worker limit: start each replica with its cap and no vLLM "
        f"queue ({starts}); past the cap it answers 503 at once, the router retries that "
        f"503 once, on another worker if there is one ({RETRY_ATTEMPTS} attempts in all, not "
        "the default 5: "
        "each attempt is a request at a full replica's API server) and then passes it on (a "
        "streaming request vLLM refuses after its 200 has gone out gets an error event in "
        "the stream, passed on as it is). Every refused attempt is work at a replica's API "
        "server (the router's tokenize call and the 503, 1-2 ms of CPU each): where the API "
        "servers share cores with their engines (CPU hosts) it slows the engines' steps, "
        "measured at 0.74-0.83 of nginx's throughput on the same replicas, and nginx's "
        "per-replica max_conns, which sends no request to a full replica, is the better "
        "gateway there. The circuit breaker is off: it counts those 503s "
        "as failures and would take every worker out for 60 s after a burst. Admitted "
        f"requests run at the cap, e2e P99 {seconds(p99)}; with a vLLM queue behind the "
        "router (the flags alone keep one) they would also wait up to a request's life in it"
    )
    return rendering(
        _command(list(caps) + free, flags),
        "bash",
        POOL,
        excess=excess,
        p99_e2e_s=p99,
        source=SOURCE,
        replica_flags=replica_flags,
    )


def flags_behind_router(replicas: list[ReplicaCap]) -> dict[str, list[str]]:
    """Each replica's vLLM flags behind the router (by ``host:port``): its cap and no vLLM
    queue, ``--max-num-queued-reqs C`` (engines behind one API server add their caps up and
    each runs at most the smallest ``--max-num-seqs`` of them)."""
    out: dict[str, list[str]] = {}
    for address, cap in by_address(replicas).items():
        seqs = min(r.max_num_seqs for r in replicas if r.address == address)
        out[address] = [f"--max-num-seqs {seqs}", f"--max-num-queued-reqs {cap}"]
    return out


def cache_threshold(available: float | None) -> float:
    """Half the pool's available reuse (the share of looked-up prompt tokens some replica had
    seen before), so that a request sharing half as much of its prompt as the pool's average
    goes to the worker holding it; at most the router's default, at least 0.05."""
    if available is None or not math.isfinite(available):
        return DEFAULT_CACHE_THRESHOLD
    return round(min(DEFAULT_CACHE_THRESHOLD, max(MIN_CACHE_THRESHOLD, available / 2)), 2)


def balance_thresholds(replicas: list[ReplicaCap], rel: float) -> tuple[int, float] | None:
    """``--balance-abs-threshold``: the smallest vLLM queue ``Q`` of the pool's replicas (a
    worker that far ahead has requests waiting in vLLM while another has free room);
    ``--balance-rel-threshold``: the imbalance the advisor flags. None without caps."""
    if not replicas:
        return None
    return max(1, min(r.queue for r in replicas)), round(float(rel), 2)


def router_prefix(
    addresses: list[str],
    replicas: list[ReplicaCap],
    *,
    available: float | None,
    hit_rate: float | None,
    predicted_hit_rate: float | None,
    predicted_hit_rate_max: float | None,
    imbalance_threshold: float,
) -> dict[str, Any]:
    """``cache_aware`` for a pool whose replicas recompute prefixes another replica holds."""
    threshold = cache_threshold(available)
    flags = ["--policy cache_aware", f"--cache-threshold {threshold}"]
    balance = balance_thresholds(replicas, imbalance_threshold)
    if balance is not None:
        flags += [f"--balance-abs-threshold {balance[0]}", f"--balance-rel-threshold {balance[1]}"]
        load = (
            f"it takes the least busy worker instead once the busiest is more than "
            f"{balance[0]} requests ahead and {balance[1]}x its load"
        )
    else:
        load = (
            "no replica has a cap, so the balance thresholds stay at the router's defaults "
            "(64 requests, 1.5x)"
        )
    effect = (
        f"start every vLLM worker with {' '.join(CACHE_AWARE_WORKER_FLAGS)}: the router asks "
        "a worker to tokenize each prompt (POST /v1/completions/render), which vLLM refuses "
        "(403) without it, and the router then routes with no prefix affinity at all. "
        f"Requests go to the worker whose prefix tree matches more than {threshold:.0%} of "
        f"their text; {load}. Predicted pool prefix-cache hit rate {_pct(hit_rate)} -> "
        f"{_pct(predicted_hit_rate)} (at most {_pct(predicted_hit_rate_max)}): the reuse "
        "routing loses today, recovered if the router finds the holder (its tree is of "
        "request text, not the engines' KV blocks, and does not see their evictions)"
    )
    return rendering(
        _command(addresses, flags),
        "bash",
        POOL,
        effect=effect,
        source=SOURCE,
        worker_flags=list(CACHE_AWARE_WORKER_FLAGS),
    )


def router_balance(
    addresses: list[str], *, busiest: str | None, imbalance: float
) -> dict[str, Any]:
    """``power_of_two`` for a pool whose load is uneven and whose replicas lose no reuse."""
    effect = (
        f"each request goes to the less loaded of two workers picked at random (the router "
        f"counts its requests in flight per worker): the busiest replica ({busiest}, "
        f"{imbalance:.2f}x the pool mean) gets no more than its share"
    )
    return rendering(
        _command(addresses, ["--policy power_of_two"]),
        "bash",
        POOL,
        effect=effect,
        source=SOURCE,
    )


def _pct(v: float | None) -> str:
    return "?" if v is None or not math.isfinite(v) else f"{v:.0%}"

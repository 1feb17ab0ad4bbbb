"""The cap in open-source nginx and in ingress-nginx.

* :func:`nginx_replica`: a replica's ``server ADDRESS max_conns=C`` line, in an upstream
  with a shared ``zone`` (so all worker processes count together).
* :func:`nginx_pool`: the pool's upstream and a ``limit_conn`` of the sum of the caps,
  keyed on a constant in a zone of the pool's own, so the excess gets 503 before the
  upstream (nginx has no upstream queue: a request finding every server full gets 502).
  ``proxy_next_upstream`` stays at its default: nginx never sends a replica more than its
  cap, and retrying 503 would take replicas out for ``fail_timeout``.
* :func:`ingress_nginx`: ingress-nginx cannot hold the cap (no annotation sets
  ``max_conns``; ``limit-connections`` is per client IP), so the rendering says so and
  retries a replica's 503 on another pod (``proxy-next-upstream`` with ``non_idempotent``).

Checked on Debian's nginx 1.22.1 (``tests/advisor/test_gateways_nginx.py``) and the
ingress-nginx annotation docs; see docs/gateways.md#nginx and docs/gateways.md#ingress-nginx.
"""

from __future__ import annotations

from typing import Any

from kvscope.advisor.gateways.replica import (
    POOL,
    REPLICA,
    ReplicaCap,
    by_address,
    ident,
    rendering,
    seconds,
    worst,
)

NGINX_SOURCE = (
    "nginx.org: ngx_http_upstream_module (zone, server max_conns), ngx_http_limit_conn_module "
    "(limit_conn_zone, limit_conn, limit_conn_status); behaviour checked on Debian nginx "
    "1.22.1"
)
INGRESS_SOURCE = (
    "kubernetes/ingress-nginx docs/user-guide/nginx-configuration/annotations.md @003d71d9 "
    "(limit-connections, proxy-next-upstream, proxy-next-upstream-tries); "
    "internal/ingress/controller/template/template.go buildNextUpstream (non_idempotent)"
)
REJECT_STATUS = 503
"""``limit_conn_status``: vLLM answers its own admission limit with 503 too, so a client
sees one status for "the pool is full, retry later"."""


def nginx_replica(r: ReplicaCap) -> dict[str, Any]:
    """The replica's line of its pool's upstream (which needs a shared ``zone``)."""
    excess = (
        f"nginx sends {r.address} at most {r.cap} requests at once and gives the next to "
        "another server of the upstream; a request that finds every server at its max_conns "
        "fails at once with 502 (open-source nginx has no upstream queue), unless the pool's "
        f"limit_conn has rejected it first with {REJECT_STATUS}. Admitted requests' e2e P99 "
        f"{seconds(r.p99_e2e_s)} (uncapped {seconds(r.p99_e2e_s_uncapped)})"
    )
    return rendering(
        f"server {r.address} max_conns={r.cap};",
        "nginx",
        REPLICA,
        excess=excess,
        p99_e2e_s=r.p99_e2e_s,
        source=NGINX_SOURCE,
    )


def nginx_pool(
    pool: str | None,
    replicas: list[ReplicaCap],
    uncapped: list[str] | None = None,
    *,
    listen: str = "80",
) -> dict[str, Any]:
    """An ``upstream`` with a shared zone and every replica's ``max_conns``, and a pool-level
    ``limit_conn`` equal to their sum when every replica has a cap (a conf.d file)."""
    name = ident(pool)
    caps = by_address(replicas)
    free = sorted(set(uncapped or []) - set(caps))
    total = sum(caps.values())
    lines = [f"upstream {name} {{", f"    zone {name} 1m;"]
    lines += [f"    server {a} max_conns={c};" for a, c in caps.items()]
    lines += [f"    server {a};" for a in free]
    lines.append("}")
    location = []
    if not free:
        lines += [
            "# one key for the whole pool: the zone counts the pool's requests in flight",
            f"limit_conn_zone {name} zone={name}_inflight:1m;",
        ]
        location = [
            f"        limit_conn {name}_inflight {total};",
            f"        limit_conn_status {REJECT_STATUS};",
        ]
    lines += [
        "server {",
        f"    listen {listen};",
        "    location / {",
        *location,
        f"        proxy_pass http://{name};",
        "        proxy_http_version 1.1;",
        "        proxy_buffering off;",
        "    }",
        "}",
    ]
    p99 = worst([r.p99_e2e_s for r in replicas])
    each = ", ".join(f"{a} {c}" for a, c in caps.items())
    if free:
        excess = (
            f"no pool limit: {', '.join(free)} has no cap (not saturated or too little data), "
            f"so the pool's total is unknown. Capped replicas get at most their max_conns "
            f"({each}); a request finding every server full fails at once with 502"
        )
    else:
        excess = (
            f"at most {total} requests in flight over the pool and at most its cap at each "
            f"replica ({each}; the zone shares the counts between worker processes); the "
            f"next request is rejected at once with {REJECT_STATUS} (limit_conn_status). "
            "Nothing waits at the gateway: open-source nginx has no upstream queue. With a "
            "replica down the live ones fill first and the rest fails with 502. One nginx "
            "instance: with k of them, divide every number by k"
        )
    excess += (
        f". Admitted requests' e2e P99 {seconds(p99)} "
        f"(uncapped {seconds(worst([r.p99_e2e_s_uncapped for r in replicas]))})"
    )
    return rendering(
        "\n".join(lines), "nginx", POOL, excess=excess, p99_e2e_s=p99, source=NGINX_SOURCE
    )


def ingress_nginx(replicas: list[ReplicaCap], n_replicas: int) -> dict[str, Any]:
    """What ingress-nginx can do for the cap: not hold it, only retry a full replica's 503."""
    tries = max(2, n_replicas)
    config = "\n".join(
        [
            "metadata:",
            "  annotations:",
            '    nginx.ingress.kubernetes.io/proxy-next-upstream: "error http_503 non_idempotent"',
            f'    nginx.ingress.kubernetes.io/proxy-next-upstream-tries: "{tries}"',
        ]
    )
    limits = ", ".join(
        f"{r.address} {r.max_num_queued_reqs}" for r in sorted(replicas, key=lambda r: r.address)
    )
    p99 = worst([r.p99_e2e_s_queued for r in replicas])
    excess = (
        "ingress-nginx cannot hold the cap: no annotation sets a replica's max_conns, and "
        "nginx.ingress.kubernetes.io/limit-connections limits the concurrent connections of one "
        "client IP address (503 past it), neither a replica's nor the pool's, so it is left out. "
        "Each replica's vLLM flags hold its cap: past --max-num-queued-reqs "
        f"({limits}) the replica answers 503 at once, and these annotations retry that request "
        f"on another pod (up to {tries} tries; a POST only with non_idempotent), then pass the "
        f"503 on. Admitted requests wait in vLLM's queue: e2e P99 up to {seconds(p99)}"
    )
    return rendering(config, "yaml", POOL, excess=excess, p99_e2e_s=p99, source=INGRESS_SOURCE)

"""Gateway renderings of the advisor's concurrency cap and routing advice.

The cap is per replica (requests in flight at one vLLM server); a pool takes at most the sum
of its replicas' caps. Each rendering keeps the two apart: a per-replica limit is written per
server, a pool-level limit only as the sum of the caps and only when every replica has one.
Each says what happens to the requests beyond the cap and the e2e P99 the admitted ones can
expect.

A rendering is a dict (:func:`~kvscope.advisor.gateways.replica.rendering`: ``config``,
``format``, ``scope``, ``excess``, ``p99_e2e_s``, ``source``); a recommendation's
``change["gateway"]`` maps a gateway's name to one:

* ``vllm`` (:mod:`.vllm`): the replica's own flags;
* ``nginx``, ``ingress_nginx`` (:mod:`.nginx`);
* ``vllm_router`` (:mod:`.vllm_router`): the cap, and routing advice;
* ``epp``, ``wva`` (:mod:`.inference_gateway`).

:func:`replica_renderings` serve a ``concurrency_cap``, :func:`pool_renderings` a
``pool_concurrency_cap``, :func:`prefix_routing` and :func:`balance_routing` the routing
recommendations. See docs/gateways.md#which-recommendation-carries-what.
"""

from __future__ import annotations

from typing import Any

from kvscope.advisor.gateways.inference_gateway import epp, wva
from kvscope.advisor.gateways.nginx import ingress_nginx, nginx_pool, nginx_replica
from kvscope.advisor.gateways.replica import POOL, REPLICA, ReplicaCap, rendering
from kvscope.advisor.gateways.vllm import vllm_flags, vllm_replica
from kvscope.advisor.gateways.vllm_router import router_balance, router_cap, router_prefix

__all__ = [
    "LABELS",
    "POOL",
    "REPLICA",
    "ReplicaCap",
    "balance_routing",
    "gateway_blocks",
    "gateway_rows",
    "pool_renderings",
    "prefix_routing",
    "rendering",
    "replica_renderings",
    "vllm_flags",
]

LABELS = {
    "vllm": "vLLM flags",
    "nginx": "nginx",
    "nginx_upstream": "nginx upstream",
    "ingress_nginx": "ingress-nginx",
    "vllm_router": "vllm-router",
    "epp": "Inference Extension EPP",
    "wva": "llm-d WVA",
}


def replica_renderings(r: ReplicaCap) -> dict[str, dict[str, Any]]:
    """What one replica's cap recommendation carries: its vLLM flags and its nginx line."""
    return {"vllm": vllm_replica(r), "nginx": nginx_replica(r)}


def pool_renderings(
    pool: str | None,
    replicas: list[ReplicaCap],
    uncapped: list[str] | None = None,
    *,
    listen: str = "80",
) -> dict[str, dict[str, Any]]:
    """The pool's renderings over its capped ``replicas``; ``uncapped``: addresses of its
    replicas without a cap (they join the upstream and the router, and the pool then has no
    pool-level limit). A pool of one replica also carries that replica's vLLM flags."""
    free = sorted(set(uncapped or []))
    out: dict[str, dict[str, Any]] = {}
    if len(replicas) == 1 and not free:
        out["vllm"] = vllm_replica(replicas[0])
    out["nginx"] = nginx_pool(pool, replicas, free, listen=listen)
    out["ingress_nginx"] = ingress_nginx(replicas, len({r.address for r in replicas}) + len(free))
    out["vllm_router"] = router_cap(replicas, free)
    for name, r in (("epp", epp(replicas)), ("wva", wva(pool, replicas))):
        if r is not None:
            out[name] = r
    return out


def prefix_routing(
    addresses: list[str], replicas: list[ReplicaCap], **thresholds: Any
) -> dict[str, dict[str, Any]]:
    """The router's cache-aware policy for a pool that loses prefix reuse across replicas
    (``thresholds``: the keyword arguments of :func:`.vllm_router.router_prefix`)."""
    return {"vllm_router": router_prefix(addresses, replicas, **thresholds)}


def balance_routing(
    addresses: list[str], *, busiest: str | None, imbalance: float
) -> dict[str, dict[str, Any]]:
    """The router's load-aware policy for an uneven pool without reuse lost to routing."""
    return {"vllm_router": router_balance(addresses, busiest=busiest, imbalance=imbalance)}


def _notes(label: str, val: dict[str, Any], words: tuple[str, str]) -> list[tuple[str, str]]:
    out = []
    if val.get("excess"):
        out.append((f"{label}: {words[0]}", str(val["excess"])))
    if val.get("effect"):
        out.append((f"{label}: {words[1]}", str(val["effect"])))
    return out


def gateway_rows(gateway: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) rows of a ``change["gateway"]``: each rendering's config and what happens
    to the excess (or, for routing, what it changes). The ``vllm`` entry shows only the
    latter: its flags are the change's ``vllm_flags``."""
    rows: list[tuple[str, str]] = []
    for key, val in gateway.items():
        label = LABELS.get(str(key), str(key))
        if not isinstance(val, dict):
            rows.append((label, str(val)))
            continue
        if key != "vllm":
            rows.append((f"{label} ({val.get('scope', '')})", str(val.get("config", ""))))
        rows += _notes(label, val, ("excess", "effect"))
    return rows


def gateway_blocks(gateway: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(label, text, language) blocks of a ``change["gateway"]``, for the dashboard."""
    out: list[tuple[str, str, str]] = []
    for key, val in gateway.items():
        label = LABELS.get(str(key), str(key))
        if not isinstance(val, dict):
            out.append((label, str(val), "nginx" if str(key).startswith("nginx") else "text"))
            continue
        if key != "vllm":
            scope = val.get("scope", "")
            out.append(
                (f"{label} ({scope})", str(val.get("config", "")), val.get("format", "text"))
            )
        words = ("what happens to the excess", "what it changes")
        out += [(t, x, "text") for t, x in _notes(label, val, words)]
    return out

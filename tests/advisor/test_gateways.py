"""Gateway renderings of the cap and of routing advice: per replica against per pool, the
fields each gateway really has, and what the advisor hands them."""

from __future__ import annotations

import math
import re

import pandas as pd
import pytest
import yaml

from kvscope.advisor import FrameSource, analyze
from kvscope.advisor.datasets import make_engine, make_prefix_pool
from kvscope.advisor.gateways import (
    ReplicaCap,
    balance_routing,
    gateway_blocks,
    gateway_rows,
    pool_renderings,
    prefix_routing,
    replica_renderings,
)
from kvscope.advisor.gateways.inference_gateway import thresholds


def _replica(address: str, cap: int = 12, **kw: float) -> ReplicaCap:
    base = {
        "max_num_seqs": 11,
        "queue": 3,
        "p99_e2e_s": 1.3,
        "p99_e2e_s_queued": 1.6,
        "p99_e2e_s_uncapped": 5.7,
        "waiting_at_cap": 2.2,
        "kv_usage_at_cap": 0.957,
    }
    base.update(kw)
    return ReplicaCap(address=address, cap=cap, model="m", **base)  # type: ignore[arg-type]


PAIR = [_replica("h1:8000"), _replica("h2:8000")]


def _directives(conf: str, name: str) -> list[str]:
    """The simple directives ``name ...;`` of an nginx text (blocks left out)."""
    lines = [ln.strip() for ln in conf.splitlines()]
    return [ln for ln in lines if ln.startswith(name + " ") and ln.endswith(";")]


def test_two_replicas_of_cap_12_get_12_each_and_24_for_the_pool() -> None:
    g = pool_renderings("demo", PAIR)
    conf = g["nginx"]["config"]
    assert _directives(conf, "server") == [
        "server h1:8000 max_conns=12;",
        "server h2:8000 max_conns=12;",
    ]
    # The pool's limit is the sum of the caps, never one replica's cap.
    assert _directives(conf, "limit_conn") == ["limit_conn vllm_demo_inflight 24;"]
    assert _directives(conf, "limit_conn_status") == ["limit_conn_status 503;"]
    (zone,) = _directives(conf, "limit_conn_zone")
    assert "$server_name" not in zone and zone.endswith("zone=vllm_demo_inflight:1m;")
    assert _directives(conf, "zone") == ["zone vllm_demo 1m;"]  # max_conns across workers
    assert g["nginx"]["scope"] == "pool" and "503" in g["nginx"]["excess"]
    assert g["nginx"]["p99_e2e_s"] == 1.3  # admitted requests see the load of the cap
    router = g["vllm_router"]["config"]
    assert "--max-concurrent-requests 24" in router and "--max-concurrent-requests 12" not in router
    assert "--worker-urls http://h1:8000 http://h2:8000" in router
    assert "vllm" not in g  # each engine's own recommendation carries its flags


def test_one_replica_renders_its_server_line_and_its_flags_only() -> None:
    g = replica_renderings(_replica("h1:8000"))
    assert g["nginx"]["config"] == "server h1:8000 max_conns=12;"
    assert g["nginx"]["scope"] == g["vllm"]["scope"] == "replica"
    assert g["vllm"]["config"] == "--max-num-seqs 11 --max-num-queued-reqs 15"
    assert "limit_conn" not in g["nginx"]["config"]
    # With the flags alone the queue of 3 stays full: the P99 at 15 in flight.
    assert g["vllm"]["p99_e2e_s"] == 1.6 and "503" in g["vllm"]["excess"]


def test_a_pool_of_one_carries_the_replicas_flags_and_its_limit() -> None:
    g = pool_renderings("solo", [_replica("h1:8000", cap=7, queue=2)])
    assert g["vllm"]["config"].endswith("--max-num-queued-reqs 9")
    assert _directives(g["nginx"]["config"], "limit_conn") == ["limit_conn vllm_solo_inflight 7;"]


def test_engines_behind_one_address_add_up_and_an_uncapped_replica_drops_the_pool_limit() -> None:
    dp = [_replica("h1:8000", cap=5), _replica("h1:8000", cap=6), _replica("h2:8000", cap=4)]
    g = pool_renderings("p", dp)
    assert "server h1:8000 max_conns=11;" in g["nginx"]["config"]
    assert "limit_conn vllm_p_inflight 15;" in g["nginx"]["config"]
    g = pool_renderings("p", [_replica("h1:8000")], uncapped=["h2:8000"])
    conf = g["nginx"]["config"]
    assert "server h2:8000;" in conf and "server h1:8000 max_conns=12;" in conf
    assert not _directives(conf, "limit_conn") and not _directives(conf, "limit_conn_zone")
    router = g["vllm_router"]["config"]
    assert "--max-concurrent-requests" not in router and "http://h2:8000" in router
    assert "no pool limit" in g["nginx"]["excess"] and "no pool limit" in g["vllm_router"]["excess"]


def test_pool_names_become_nginx_names() -> None:
    conf = pool_renderings("llama-70b.prod", PAIR)["nginx"]["config"]
    assert "upstream vllm_llama_70b_prod {" in conf


def test_thresholds_are_the_smallest_measured_at_a_cap() -> None:
    reps = [
        _replica("a:1", waiting_at_cap=2.2, kv_usage_at_cap=0.957),
        _replica("b:1", waiting_at_cap=4.0, kv_usage_at_cap=0.91),
    ]
    assert thresholds(reps) == (3, 0.91)
    # A cap that leaves nothing waiting: one waiting request already means full.
    assert thresholds([_replica("a:1", waiting_at_cap=0.0)])[0] == 1
    none = [_replica("a:1", waiting_at_cap=math.nan, kv_usage_at_cap=math.nan)]
    assert thresholds(none) == (None, None)
    assert "epp" not in pool_renderings("p", none) and "wva" not in pool_renderings("p", none)


def test_only_fields_the_gateways_have_are_emitted() -> None:
    g = pool_renderings("demo", PAIR)
    text = "\n".join(str(v["config"]) for v in g.values())
    assert "maxConcurrency" not in text and "gateway_api" not in text
    assert yaml.safe_load(g["epp"]["config"]) == {
        "saturationDetector": {"queueDepthThreshold": 3, "kvCacheUtilThreshold": 0.95}
    }
    (entry,) = yaml.safe_load(g["wva"]["config"])["data"].values()
    assert set(yaml.safe_load(entry)) == {
        "model_id",
        "namespace",
        "kvCacheThreshold",
        "queueLengthThreshold",
    }
    annotations = yaml.safe_load(g["ingress_nginx"]["config"])["metadata"]["annotations"]
    assert set(annotations) == {
        "nginx.ingress.kubernetes.io/proxy-next-upstream",
        "nginx.ingress.kubernetes.io/proxy-next-upstream-tries",
    }
    # limit-connections is per client IP: said, not emitted as a cap.
    assert "client IP" in g["ingress_nginx"]["excess"]
    for v in g.values():
        assert v["source"] and v["excess"]


def test_routing_renders_the_routers_policy_and_thresholds() -> None:
    g = prefix_routing(
        ["h1:8000", "h2:8000"],
        PAIR,
        available=0.4,
        hit_rate=0.3,
        predicted_hit_rate=0.5,
        predicted_hit_rate_max=0.55,
        imbalance_threshold=1.25,
    )["vllm_router"]
    flags = g["config"]
    assert "--policy cache_aware" in flags and "--cache-threshold 0.2" in flags
    # A worker more than the replicas' vLLM queue ahead is past its cap: balance.
    assert "--balance-abs-threshold 3" in flags and "--balance-rel-threshold 1.25" in flags
    # cache_aware tokenizes through the workers' render endpoint: without it, no affinity.
    assert g["worker_flags"] == ["--enable-scale-out"] and "--enable-scale-out" in g["effect"]
    assert "30% -> 50%" in g["effect"] and "excess" not in g
    nocap = prefix_routing(
        ["a:1", "b:1"],
        [],
        available=0.9,
        hit_rate=0.3,
        predicted_hit_rate=0.5,
        predicted_hit_rate_max=0.55,
        imbalance_threshold=1.25,
    )["vllm_router"]
    assert "--cache-threshold 0.3" in nocap["config"]  # the router's default is the ceiling
    assert "--balance-abs-threshold" not in nocap["config"]
    bal = balance_routing(["a:1", "b:1"], busiest="a:1:0", imbalance=1.6)["vllm_router"]
    assert "--policy power_of_two" in bal["config"] and "1.60x" in bal["effect"]


def test_rows_and_blocks_show_each_config_and_what_happens_to_the_excess() -> None:
    g = pool_renderings("demo", [_replica("h1:8000")])
    rows = dict(gateway_rows(g))
    assert rows["nginx (pool)"] == g["nginx"]["config"]
    assert rows["nginx: excess"] == g["nginx"]["excess"]
    assert "vLLM flags (replica)" not in rows  # the change's vllm_flags already show them
    assert rows["vLLM flags: excess"] == g["vllm"]["excess"]
    blocks = gateway_blocks(g)
    assert ("nginx (pool)", g["nginx"]["config"], "nginx") in blocks
    assert ("Inference Extension EPP (pool)", g["epp"]["config"], "yaml") in blocks
    assert gateway_rows({"nginx_upstream": "upstream p { least_conn; }"}) == [
        ("nginx upstream", "upstream p { least_conn; }")
    ]


def test_the_advisor_hands_each_recommendation_its_renderings() -> None:
    a = make_engine("kv_cache_bound", seed=0, engine_id="h1:8000:0", pool="p")
    b = make_engine("kv_cache_bound", seed=1, engine_id="h2:8000:0", pool="p")
    rep = analyze(
        FrameSource(
            pd.concat([a.engines, b.engines], ignore_index=True),
            pd.concat([a.windows, b.windows], ignore_index=True),
            pd.concat([a.requests, b.requests], ignore_index=True),
        )
    )
    caps = {v.engine_id: v.recommended_concurrency_cap for v in rep.engines}
    assert None not in caps.values()
    for r in rep.recommendations:
        if r.kind == "concurrency_cap":  # per replica only: never a pool-level limit
            assert set(r.change["gateway"]) == {"vllm", "nginx"}
            cap = caps[str(r.scope.engine_id)]
            assert r.change["gateway"]["nginx"]["config"].endswith(f" max_conns={cap};")
            assert " ".join(r.change["vllm_flags"]) == r.change["gateway"]["vllm"]["config"]
    pool = next(r for r in rep.recommendations if r.kind == "pool_concurrency_cap")
    conf = pool.change["gateway"]["nginx"]["config"]
    assert f"server h1:8000 max_conns={caps['h1:8000:0']};" in conf
    assert f"server h2:8000 max_conns={caps['h2:8000:0']};" in conf
    total = sum(c for c in caps.values() if c is not None)
    assert _directives(conf, "limit_conn") == [f"limit_conn vllm_p_inflight {total};"]
    assert pool.change["concurrency_cap"] == total
    assert pool.expected_effect["p99_e2e_s"] > 0
    # A pool of one engine: that engine's recommendation carries the pool's renderings.
    s = make_engine("kv_cache_bound", seed=5)
    (one,) = [
        r
        for r in analyze(FrameSource(s.engines, s.windows, s.requests)).recommendations
        if r.kind == "concurrency_cap"
    ]
    cap = one.change["concurrency_cap"]
    assert {"vllm", "nginx", "vllm_router", "epp", "wva"} <= set(one.change["gateway"])
    assert f"limit_conn vllm_synth_inflight {cap};" in one.change["gateway"]["nginx"]["config"]
    ev = one.evidence
    assert 0 < ev["cap_kv_usage_ratio"] <= 1 and ev["cap_waiting"] >= 0
    assert ev["vllm_queue"] == math.ceil(cap / 4)


@pytest.mark.parametrize(
    ("dup", "policy"), [((0.2, 0.2), "cache_aware"), ((0.0, 0.0), "power_of_two")]
)
def test_routing_recommendations_carry_the_routers_policy(
    dup: tuple[float, float], policy: str
) -> None:
    s = make_prefix_pool(seed=3, dup_ratios=dup)
    rep = analyze(FrameSource(s.engines, s.windows, s.requests, s.kv_events))
    kinds = {r.kind: r for r in rep.recommendations}
    assert "least_loaded_routing" in kinds  # loads 8 and 2: uneven
    bal = kinds["least_loaded_routing"].change["gateway"]
    assert "nginx_upstream" in bal and f"--policy {policy}" in bal["vllm_router"]["config"]
    if policy == "cache_aware":
        pre = kinds["prefix_aware_routing"]
        router = pre.change["gateway"]["vllm_router"]
        assert router["config"] == bal["vllm_router"]["config"]
        m = re.search(r"--cache-threshold (\S+)", router["config"])
        assert m is not None
        threshold = float(m.group(1))
        assert threshold == pytest.approx(min(0.3, round(s.truth["available"] / 2, 2)))
        assert f"{pre.expected_effect['predicted_hit_rate']:.0%}" in router["effect"]
    else:
        assert "prefix_aware_routing" not in kinds

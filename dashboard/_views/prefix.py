"""Prefix cache and routing: hit rates per replica, TTFT with and without cached tokens,
duplication across replicas, load balance, and the routing recommendations."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from kvscope.advisor import Finding, PoolVerdict, Report
from kvscope.dashboard._charts_load import hit_rate_chart
from kvscope.dashboard._format import NONE, num, pct, sec
from kvscope.dashboard._status import pools_by_attention
from kvscope.dashboard._views.recommendations import recommendation_card
from kvscope.dashboard.data import Snapshot

ROUTING_KINDS = ("prefix_aware_routing", "least_loaded_routing")


def _pool_findings(report: Report, pool: str | None, kind: str) -> list[Finding]:
    return [
        f
        for f in report.findings
        if f.kind == kind and f.scope.pool == pool and f.scope.engine_id is None
    ]


def _replica_table(frame: dict[str, list]) -> pd.DataFrame:
    df = pd.DataFrame(frame)
    caching = {True: "on", False: "off"}
    return pd.DataFrame(
        {
            "replica": df.get("engine_id", pd.Series(dtype=str)),
            "hit rate": [pct(v) for v in df.get("hit_rate", [])],
            "prompt tokens looked up": [num(v, ",.0f") for v in df.get("prefix_queries", [])],
            "tokens found": [num(v, ",.0f") for v in df.get("prefix_hits", [])],
            "finished requests": [num(v, ",.0f") for v in df.get("n_requests", [])],
            "with cached tokens": [num(v, ",.0f") for v in df.get("n_cached_requests", [])],
            "prefix caching": [caching.get(v, "unknown") for v in df.get("prefix_caching", [])],
        }
    ).set_index("replica")


def no_hits_text(frame: dict[str, list]) -> str:
    """What an all-zero hit-rate chart means, in words (empty when a replica had hits)."""
    hits = pd.to_numeric(pd.Series(frame.get("prefix_hits", []), dtype=object), errors="coerce")
    looked = pd.to_numeric(
        pd.Series(frame.get("prefix_queries", []), dtype=object), errors="coerce"
    )
    if not len(looked) or looked.fillna(0).sum() <= 0:
        return "No prefix-cache lookups in this window (prefix caching off, or no prompts)."
    if hits.fillna(0).sum() <= 0:
        return (
            f"No prefix-cache hits in this window: 0% on every replica, of "
            f"{looked.fillna(0).sum():,.0f} prompt tokens looked up."
        )
    return ""


def _ttft_table(ev: dict[str, Any]) -> pd.DataFrame | None:
    rows = []
    for label, key in (
        ("with cached tokens", "ttft_cached"),
        ("without cached tokens", "ttft_uncached"),
    ):
        d = ev.get(key) or {}
        rows.append(
            {
                "requests": label,
                "n": num(d.get("n"), ",.0f"),
                "TTFT P50": sec(d.get("p50_s")),
                "TTFT P90": sec(d.get("p90_s")),
                "TTFT mean": sec(d.get("mean_s")),
            }
        )
    if not any((ev.get(k) or {}).get("n") for k in ("ttft_cached", "ttft_uncached")):
        return None
    return pd.DataFrame(rows).set_index("requests")


def _duplication(report: Report, pv: PoolVerdict) -> None:
    routing = _pool_findings(report, pv.pool, "prefix_routing")
    missing = _pool_findings(report, pv.pool, "kv_events_missing")
    if routing:
        f = routing[0]
        ev = f.evidence
        c = st.columns(5)
        c[0].metric("reuse available", pct(ev.get("available")))
        c[1].metric("captured by routing", pct(ev.get("captured")))
        c[2].metric("delivered (hit rate)", pct(ev.get("hit_rate")))
        c[3].metric(
            "routing loss",
            pct(ev.get("routing_loss")),
            help="share of looked-up tokens recomputed while another replica held them",
        )
        c[4].metric("cache duplicated across replicas", pct(ev.get("duplicated_cache_ratio")))
        (st.warning if f.severity == "warning" else st.info)(
            f"{f.summary} (confidence {f.confidence:.2f})"
        )
    for f in missing:
        (st.warning if f.severity == "warning" else st.info)(f.summary)
        flag = f.evidence.get("vllm_flag")
        if flag:
            st.caption(
                "vLLM flag that turns KV-cache events on (the collector subscribes to "
                "the endpoint each engine advertises):"
            )
            st.code(str(flag), language="bash", wrap_lines=True)
    if not routing and not missing and len(pv.engine_ids) < 2:
        st.caption("One replica: no duplication across replicas to measure.")


def _pool(report: Report, pv: PoolVerdict) -> None:
    st.subheader(f"pool {pv.pool}" if pv.pool is not None else "engines without a pool")
    cache = _pool_findings(report, pv.pool, "prefix_cache")
    c = st.columns(4)
    c[0].metric("prefix-cache hit rate", pct(pv.prefix_hit_rate))
    c[1].metric(
        "prefix-affine (predicted)",
        pct(pv.predicted_prefix_hit_rate_affine),
        help="hit rate predicted under prefix-affine routing; needs vLLM's KV-cache "
        "events from two replicas or more",
    )
    c[2].metric("routing loss", pct(pv.prefix_routing_loss))
    c[3].metric(
        "load imbalance",
        f"{pv.load_imbalance:.2f}x" if pv.load_imbalance is not None else NONE,
        help="busiest replica's mean in-flight load / the pool mean",
    )
    if cache:
        f = cache[0]
        st.markdown(f.summary)
        if f.frame:
            left, right = st.columns([3, 2])
            left.table(_replica_table(f.frame))
            right.altair_chart(hit_rate_chart(f.frame), width="stretch")
            empty = no_hits_text(f.frame)
            if empty:
                right.info(empty)
        ttft = _ttft_table(f.evidence)
        if ttft is not None:
            st.markdown("**Time to first token with and without cached prompt tokens**")
            st.table(ttft)
    st.markdown("**Duplication across replicas**")
    _duplication(report, pv)
    for f in _pool_findings(report, pv.pool, "load_imbalance"):
        st.markdown("**Load balance**")
        (st.warning if f.severity == "warning" else st.caption)(f.summary)
    for f in report.findings:
        if f.kind == "prefix_caching_off" and f.scope.pool == pv.pool:
            st.warning(f"`{f.scope.engine_id}`: {f.summary}")
    for i, r in enumerate(report.recommendations, start=1):
        if r.kind in ROUTING_KINDS and r.scope.pool == pv.pool:
            recommendation_card(i, r)


def render(snap: Snapshot) -> None:
    report = snap.report
    assert report is not None
    for pv, _ in pools_by_attention(report):
        _pool(report, pv)

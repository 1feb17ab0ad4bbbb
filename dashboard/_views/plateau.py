"""Plateau: throughput against load with the fitted curve, knee, plateau and cap, the
P99 curves on the same chart (its right axis), and the bottleneck with its evidence."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvscope.dashboard._charts_load import load_domain, plateau_chart
from kvscope.dashboard._format import NONE, facts, knee, num, pct, sec, tok
from kvscope.dashboard._views._common import pick_engine, verdict_headline
from kvscope.dashboard.data import Snapshot


def render(snap: Snapshot) -> None:
    report = snap.report
    assert report is not None
    v = pick_engine(report, "plateau_engine")
    curve_f = report.findings_of("throughput_curve", v.engine_id)
    lat_f = report.findings_of("latency_vs_load", v.engine_id)
    why = report.findings_of("bottleneck", v.engine_id)
    cap = v.recommended_concurrency_cap

    verdict_headline(v)
    c = st.columns(5)
    c[0].metric("knee (in flight)", knee(v.knee_concurrency))
    c[1].metric(
        "plateau (generated)",
        tok(v.plateau_tokens_per_s),
        help=f"{tok(v.plateau_total_tokens_per_s)} prompt and generated",
    )
    c[2].metric(
        "recommended cap (in flight)",
        str(cap) if cap is not None else NONE,
        help="no cap: the engine is not saturated" if cap is None else None,
    )
    c[3].metric("share of peak at the cap", pct(v.predicted_throughput_fraction_at_cap))
    c[4].metric(
        "e2e P99 at the cap",
        sec(v.predicted_p99_e2e_s_at_cap),
        help=f"uncapped: {sec(v.p99_e2e_s_at_max_load)} at {knee(v.max_load_seen)} in flight",
    )
    st.markdown(
        v.headroom
        + (f"; approaching **{v.approaching}**" if not v.saturated and v.approaching else "")
    )
    if cap is not None and v.p99_e2e_s_at_max_load is not None:
        st.markdown(
            f"Capped at **{cap}** in flight: **{pct(v.predicted_throughput_fraction_at_cap)}"
            f"** of peak throughput, e2e P99 **{sec(v.predicted_p99_e2e_s_at_cap)}**; "
            f"uncapped it reached {sec(v.p99_e2e_s_at_max_load)} at "
            f"{knee(v.max_load_seen)} in flight."
        )

    if not curve_f or not curve_f[0].frame:
        st.info(f"No throughput curve for this engine: {v.headroom or 'too little data'}.")
        return
    curve = curve_f[0].frame
    lat = lat_f[0].frame if lat_f and lat_f[0].frame else None
    domain = load_domain(curve, lat, [v.knee_concurrency, cap])
    st.altair_chart(
        plateau_chart(
            curve,
            lat,
            knee=v.knee_concurrency,
            plateau=v.plateau_tokens_per_s,
            cap=float(cap) if cap is not None else None,
            domain=domain,
        ),
        width="stretch",
    )
    st.caption(
        lat_f[0].summary
        if lat is not None
        else "No finished requests in the window: no latency curve."
    )

    st.subheader("Why: the bottleneck and its evidence")
    if why:
        f = why[0]
        st.markdown(f"**{f.summary}**  \nconfidence {f.confidence:.2f}")
        st.table(
            pd.DataFrame(facts(f.evidence), columns=["evidence", "value"]).set_index("evidence")
        )
    st.caption(curve_f[0].summary)
    kv = report.findings_of("kv_capacity", v.engine_id)
    if kv:
        st.subheader("KV capacity model")
        st.markdown(kv[0].summary)
        frame = kv[0].frame
        if frame:
            st.table(
                pd.DataFrame(
                    {
                        "what if": frame.get("what_if", []),
                        "KV blocks": [num(b, ",.0f") for b in frame.get("num_gpu_blocks", [])],
                        "room (sequences)": [num(b) for b in frame.get("kv_batch", [])],
                        "predicted plateau": [
                            tok(p) for p in frame.get("plateau_tokens_per_s", [])
                        ],
                        "gain": [num(g, "+.0%") for g in frame.get("gain_ratio", [])],
                    }
                ).set_index("what if")
            )

"""Latency: what the finished requests saw, per pool and engine: TTFT, ITL and e2e
percentiles, SLO attainment against targets, where a request's life goes, finish
reasons, lengths; then one engine's percentiles over time.

The numbers are the advisor's latency blocks
(:mod:`kvscope.advisor.request_latency`, run by the snapshot); targets changed on the page
are judged by the same function through :meth:`Snapshot.latency`."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import streamlit as st

from kvscope.advisor import PoolVerdict, Report
from kvscope.advisor.render_latency import latency_rows, p50_p90_p99, slo_rows
from kvscope.advisor.request_latency import RequestLatency, SloTargets
from kvscope.dashboard._charts_latency import (
    breakdown_chart,
    histogram_chart,
    percentile_chart,
    reasons_chart,
)
from kvscope.dashboard._views._common import pick_engine
from kvscope.dashboard.data import Snapshot

_KEYS = {"ttft": "TTFT", "itl": "ITL", "e2e": "e2e"}
LATENCY_HEAD = ["measure", "requests", "P50", "P90", "P99", "mean"]
SLO_HEAD = ["target", "met", "of", "share"]


def targets_input(snap: Snapshot) -> SloTargets:
    """Three number inputs (seconds, 0 = no target), the settings' ``--slo-*`` first."""
    default = snap.slo_targets
    with st.expander("SLO targets", expanded=True):
        cols = st.columns(3)
        values: dict[str, float | None] = {}
        for col, (key, label) in zip(cols, _KEYS.items(), strict=True):
            v = col.number_input(
                f"{label} target (s)",
                min_value=0.0,
                value=float(getattr(default, f"{key}_s") or 0.0),
                step=0.05 if key != "itl" else 0.005,
                format="%.3f",
                key=f"latency_slo_{key}",
                help="0: no target. The share of requests at or under it is shown.",
            )
            values[key] = float(v) if v else None
    return SloTargets(ttft_s=values["ttft"], itl_s=values["itl"], e2e_s=values["e2e"])


def _block(
    snap: Snapshot, ids: list[str], stored: RequestLatency | None, targets: SloTargets
) -> RequestLatency | None:
    """The report's block when the targets are those it ran with, else the same analysis
    judged against the page's targets."""
    if targets == snap.slo_targets:
        return stored
    return snap.latency(ids, targets)


def _table(head: list[str], rows: Sequence[tuple[str, ...]]) -> pd.DataFrame:
    return pd.DataFrame([list(r) for r in rows], columns=head).set_index(head[0])


def _pool(snap: Snapshot, report: Report, pv: PoolVerdict, targets: SloTargets) -> None:
    st.subheader(f"pool {pv.pool}" if pv.pool is not None else "engines without a pool")
    lat = _block(snap, pv.engine_ids, pv.latency, targets)
    if lat is None:
        st.info("No finished requests in this pool in the window.")
        return
    note = (
        (
            " (estimated from Prometheus histograms)"
            if snap.from_prometheus
            else " (partly estimated from the collector's request minutes: the range "
            "reaches past its request retention)"
        )
        if lat.weighted
        else ""
    )
    st.caption(
        f"{lat.n_requests:,} finished requests over {len(pv.engine_ids)} engine(s){note}. "
        "ITL: decode time / (output tokens − 1), requests with 2 output tokens or more."
    )
    left, right = st.columns([3, 2])
    left.table(_table(LATENCY_HEAD, latency_rows(lat)))
    if lat.slo:
        right.markdown("**SLO attainment**")
        right.table(_table(SLO_HEAD, slo_rows(lat)))
    else:
        right.caption("No SLO target set: give one above to see the share of requests meeting it.")
    blocks = {
        eid: b
        for eid in pv.engine_ids
        if (b := _block(snap, [eid], report.engine(eid).latency, targets)) is not None
    }
    if len(pv.engine_ids) > 1 and blocks:
        st.markdown("**Per engine**")
        rows = []
        for eid, b in blocks.items():
            row = {"engine": eid, "requests": f"{b.n_requests:,}"}
            for key, label in _KEYS.items():
                row[f"{label} P50 / P90 / P99"] = p50_p90_p99(b.quantiles(f"{key}_s"))
            for key, a in b.slo.items():
                name = _KEYS.get(key, "every target")
                row[f"{name} met"] = "–" if a.share is None else f"{a.share:.1%}"
            rows.append(row)
        st.table(pd.DataFrame(rows).set_index("engine"))
    left, right = st.columns(2)
    if blocks:
        left.altair_chart(breakdown_chart(blocks), width="stretch")
    if lat.finish_reasons:
        right.altair_chart(reasons_chart(lat.finish_reasons), width="stretch")


def _engine(snap: Snapshot, report: Report, targets: SloTargets) -> None:
    st.subheader("One engine over time")
    v = pick_engine(report, "latency_engine")
    series = snap.latency_over_time(v.engine_id)
    if not len(series):
        st.info("No finished requests of this engine in the window.")
        return
    charts = (
        ("ttft_s", "Time to first token", targets.ttft_s),
        ("itl_s", "Inter-token latency", targets.itl_s),
        ("e2e_s", "End-to-end latency", targets.e2e_s),
    )
    cols = st.columns(3)
    for col, (measure, title, target) in zip(cols, charts, strict=True):
        if (series["measure"] == measure).any():
            col.altair_chart(percentile_chart(series, measure, title, target), width="stretch")
        else:
            col.caption(f"{title}: no values in the window.")
    left, right = st.columns(2)
    for col, column, title in (
        (left, "prompt_tokens", "Prompt length"),
        (right, "generation_tokens", "Output length"),
    ):
        hist = snap.length_histogram(v.engine_id, column)
        if len(hist):
            col.altair_chart(histogram_chart(hist, title), width="stretch")


def render(snap: Snapshot) -> None:
    report = snap.report
    assert report is not None
    targets = targets_input(snap)
    for pv in report.pools:
        _pool(snap, report, pv, targets)
    if report.engines:
        _engine(snap, report, targets)

"""Engine detail: one engine's configuration, verdict and time series."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from kvscope.advisor import SourceError
from kvscope.dashboard._charts import (
    COUNT_FORMAT,
    ZOOM,
    engine_series,
    latency_chart,
    latency_series,
    time_chart,
)
from kvscope.dashboard._format import NONE, knee, num, pct, tok
from kvscope.dashboard._status import recent
from kvscope.dashboard._views._common import pick_engine, verdict_headline
from kvscope.dashboard._views._steps import steps_section
from kvscope.dashboard._window import zoom_range, zoom_to
from kvscope.dashboard.data import Snapshot, read_minute_windows
from kvscope.dashboard.settings import DashboardSettings


def _config_line(cfg: dict) -> str:
    blocks, size = cfg.get("num_gpu_blocks"), cfg.get("block_size")
    kv = (
        (
            f"{num(blocks, ',.0f')} blocks x {num(size, '.0f')} tokens = "
            f"{num((blocks or 0) * (size or 0), ',.0f')} tokens"
        )
        if blocks and size
        else "unknown"
    )
    on = cfg.get("enable_prefix_caching")
    caching = "unknown" if on is None else ("on" if on else "off")
    twin = (
        "**a twin** (vLLM's scheduler replaying traffic with a step-time model, not a server); "
        if cfg.get("simulated") is True
        else ""
    )
    return (
        f"{twin}model `{cfg.get('model')}`, vLLM {cfg.get('vllm_version')}; KV cache {kv}; "
        f"max_num_seqs {num(cfg.get('max_num_seqs'), '.0f')}, max_num_batched_tokens "
        f"{num(cfg.get('max_num_batched_tokens'), '.0f')}, prefix caching {caching}, "
        f"kv_cache_dtype {cfg.get('kv_cache_dtype')}, tensor parallel "
        f"{num(cfg.get('tensor_parallel_size'), '.0f')}"
    )


def _zoomable(snap: Snapshot, col: Any, name: str, chart: Any) -> None:
    """``chart`` in ``col``; an interval dragged across its time axis zooms every chart of
    the dashboard to it (the sidebar's range, kept in the URL)."""
    event = col.altair_chart(
        chart,
        width="stretch",
        on_select="rerun",
        selection_mode=ZOOM,
        # Fresh selection state for each window or range: a drag applied is not re-read.
        key=f"zoom {name} {snap.since_text} {snap.until_text}",
    )
    picked = zoom_range(getattr(event, "selection", None))
    if picked is not None:
        zoom_to(*picked)


def _prefix_note(s: pd.DataFrame) -> str:
    """Says so when the prefix chart's hits line lies on zero."""
    looked = float(s["prefix_queries_per_s"].fillna(0).sum())
    if looked <= 0:
        return "no prefix-cache lookups in this window"
    if float(s["prefix_hits_per_s"].fillna(0).sum()) <= 0:
        return "no prefix-cache hits in this window: the hits line lies on 0"
    return ""


def _span_text(seconds: int) -> str:
    if seconds % 3600 == 0:
        return f"{seconds // 3600} h"
    return f"{seconds // 60} min" if seconds % 60 == 0 else f"{seconds} s"


@st.cache_data(ttl=600, max_entries=64, show_spinner="Reading the 1-minute windows...")
def _minute_windows(
    _settings: DashboardSettings,
    key: str,
    engine_id: str,
    since_unix_s: float | None,
    until_unix_s: float | None,
) -> pd.DataFrame:
    """:func:`read_minute_windows`, kept per engine and range and shared by the sessions
    (each read of the collector brings a new range, so a new read)."""
    del key  # stands for the settings (secrets digested)
    return read_minute_windows(_settings, engine_id, since_unix_s, until_unix_s)


def _series(snap: Snapshot, engine_id: str, blocks: Any) -> tuple[pd.DataFrame, str]:
    """The engine's time series and where they come from: over a long window the
    collector's 1-minute windows (complete, and kept after the 1-second ones), else the
    windows the advisor read."""
    if snap.long_range:
        try:
            minutes = _minute_windows(
                snap.settings,
                snap.settings.cache_key(),
                engine_id,
                snap.since_unix_s,
                snap.until_unix_s,
            )
        except SourceError:
            minutes = pd.DataFrame()
        if len(minutes):
            return engine_series(minutes, blocks, 60.0, counts=True), ", from 1-minute windows"
    return engine_series(snap.engine_windows(engine_id), blocks, snap.window_s), ""


def render(snap: Snapshot) -> None:
    report = snap.report
    assert report is not None
    v = pick_engine(report, "engine_detail_engine")
    cfg = snap.engine_config(v.engine_id)
    st.markdown(f"pool **{v.pool}**; {snap.engine_state(v.engine_id).text}  \n{_config_line(cfg)}")
    r = recent(snap.engine_windows(v.engine_id), window_s=snap.window_s)
    verdict_headline(v)
    c = st.columns(6)
    c[0].metric(
        "batch (last 60 s)",
        num(r.batch_mean),
        help=f"of max_num_seqs {num(cfg.get('max_num_seqs'), '.0f')}",
    )
    c[1].metric("KV used (last 60 s)", pct(r.kv_usage_mean))
    c[2].metric("waiting (last 60 s)", num(r.waiting_mean))
    c[3].metric("generated (last 60 s)", tok(r.gen_tokens_per_s))
    c[4].metric("knee (in flight)", knee(v.knee_concurrency))
    c[5].metric(
        "recommended cap",
        str(v.recommended_concurrency_cap) if v.recommended_concurrency_cap is not None else NONE,
    )

    s, tier = _series(snap, v.engine_id, cfg.get("num_gpu_blocks"))
    if not len(s):
        st.info("No windows of this engine in the window.")
        return
    b = int(s["bucket_s"].iloc[0])
    per = "per second" if b == 1 else f"per {_span_text(b)}"
    st.subheader(f"Time series ({per}{tier})")
    st.caption(
        "Drag across a chart's time axis to zoom every chart to that stretch (the sidebar "
        "then shows it as a range, kept in the page's link; its Time switch goes back to "
        "the window)."
    )
    seqs, blocks = cfg.get("max_num_seqs"), cfg.get("num_gpu_blocks")
    left, right = st.columns(2)
    # Running and waiting share a chart (both are requests, as in vLLM's own "Scheduler
    # State" panel): each chart costs the page's first load about a quarter of a second
    # (docs/benchmarks.md, dashboard first load).
    _zoomable(
        snap,
        left,
        "batch",
        time_chart(
            s,
            {
                "batch_mean": "batch (mean)",
                "batch_max": "batch (max)",
                "waiting_mean": "waiting (mean)",
                "waiting_max": "waiting (max)",
            },
            "Batch size and waiting queue against max_num_seqs",
            "requests",
            [(seqs, f"max_num_seqs {num(seqs, '.0f')}")],
            y_format=COUNT_FORMAT,
            zoom=True,
        ),
    )
    _zoomable(
        snap,
        right,
        "kv",
        time_chart(
            s,
            {"kv_blocks_mean": "blocks in use (mean)", "kv_blocks_max": "blocks in use (max)"},
            "KV blocks in use against the total",
            "KV blocks",
            [(blocks, f"num_gpu_blocks {num(blocks, ',.0f')}")],
            y_format=COUNT_FORMAT,
            zoom=True,
        ),
    )
    _zoomable(
        snap,
        left,
        "preemptions",
        time_chart(
            s, {"preemptions_per_s": "preemptions/s"}, "Preemptions", "per second", zoom=True
        ),
    )
    _zoomable(
        snap,
        right,
        "prefix",
        time_chart(
            s,
            {"prefix_queries_per_s": "looked up", "prefix_hits_per_s": "hits"},
            "Prefix cache (prompt tokens/s)",
            "tokens/s",
            subtitle=_prefix_note(s),
            zoom=True,
        ),
    )
    _zoomable(
        snap,
        left,
        "throughput",
        time_chart(
            s,
            {"gen_tokens_per_s": "generated", "prompt_tokens_per_s": "prompt (computed)"},
            "Throughput",
            "tokens/s",
            [(v.plateau_tokens_per_s, "plateau (generated)")],
            zoom=True,
        ),
    )
    lat = latency_series(snap.engine_requests(v.engine_id))
    if len(lat):
        right.altair_chart(latency_chart(lat), width="stretch")
    else:
        right.caption("No finished requests of this engine in the window.")

    steps_section(snap, v.engine_id, seqs)

"""Fleet overview: every pool and engine, the ones needing attention first."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvscope.advisor import EngineVerdict
from kvscope.dashboard._format import NONE, knee, num, pct, tok
from kvscope.dashboard._status import (
    Attention,
    engine_attention,
    engine_status,
    engines_by_attention,
    pools_by_attention,
    recent,
)
from kvscope.dashboard.data import Snapshot


def _verdict_text(v: EngineVerdict) -> str:
    if v.bottleneck == "insufficient_data":
        return f"insufficient data ({v.headroom})"
    text = v.bottleneck + (", saturated" if v.saturated else ", headroom")
    if not v.saturated and v.approaching:
        text += f" (approaching {v.approaching})"
    if v.preemption_thrash:
        text += ", preemption thrash"
    return text


def _callout(snap: Snapshot, pool: str | None, att: Attention) -> None:
    assert snap.report is not None
    pv = next(p for p in snap.report.pools if p.pool == pool)
    parts = []
    for v in (snap.report.engine(e) for e in pv.engine_ids):
        if engine_attention(v).score:
            cap = (
                f", cap {v.recommended_concurrency_cap} in flight"
                if v.recommended_concurrency_cap is not None
                else ""
            )
            parts.append(
                f"`{v.engine_id}` {_verdict_text(v)}, knee {knee(v.knee_concurrency)}{cap}"
            )
    text = f"**pool {pool}: {att.text}**" + ("  \n" + "  \n".join(parts) if parts else "")
    severe = {"preemption thrash", "KV-bound", "saturated"} & set(att.reasons)
    st.warning(text, icon=":material/priority_high:" if severe else ":material/info:")


def _pool_table(snap: Snapshot) -> pd.DataFrame:
    assert snap.report is not None
    rows = []
    for pv, att in pools_by_attention(snap.report):
        rows.append(
            {
                "pool": str(pv.pool),
                "needs attention": att.text,
                "engines": len(pv.engine_ids),
                "bottlenecks": ", ".join(f"{k} x{n}" for k, n in pv.bottlenecks.items()),
                "plateau": tok(pv.plateau_tokens_per_s),
                "recommended cap": (
                    f"{pv.recommended_concurrency_cap} in flight"
                    if pv.recommended_concurrency_cap is not None
                    else NONE
                ),
                "prefix hit rate": pct(pv.prefix_hit_rate),
                "load imbalance": (
                    f"{pv.load_imbalance:.2f}x" if pv.load_imbalance is not None else NONE
                ),
            }
        )
    return pd.DataFrame(rows)


def _engine_table(snap: Snapshot) -> pd.DataFrame:
    assert snap.report is not None
    rows = []
    for v in engines_by_attention(snap.report):
        cfg = snap.engine_config(v.engine_id)
        r = recent(snap.engine_windows(v.engine_id), window_s=snap.window_s)
        seqs = cfg.get("max_num_seqs")
        rows.append(
            {
                "engine": v.engine_id,
                "pool": str(v.pool),
                "status": engine_status(cfg.get("last_step_unix_s"), snap.fetched_unix_s),
                "batch / max_num_seqs": f"{num(r.batch_mean)} / {num(seqs, '.0f')}",
                "KV used": pct(r.kv_usage_mean),
                "waiting": num(r.waiting_mean),
                "preemptions/s": num(r.preemptions_per_s),
                "generated": tok(r.gen_tokens_per_s),
                "prefix hit rate": pct(v.prefix_hit_rate),
                "verdict": _verdict_text(v),
                "knee (in flight)": knee(v.knee_concurrency),
                "plateau": tok(v.plateau_tokens_per_s),
                "cap": (
                    str(v.recommended_concurrency_cap)
                    if v.recommended_concurrency_cap is not None
                    else NONE
                ),
            }
        )
    return pd.DataFrame(rows)


def render(snap: Snapshot) -> None:
    report = snap.report
    assert report is not None
    ranked = pools_by_attention(report)
    live = sum(
        engine_status(snap.engine_config(v.engine_id).get("last_step_unix_s"), snap.fetched_unix_s)
        == "live"
        for v in report.engines
    )
    saturated = sum(v.saturated for v in report.engines)
    c = st.columns(4)
    c[0].metric(
        "engines analyzed",
        f"{len(report.engines)}",
        help=f"{live} live (a step in the last 15 s); "
        f"{report.coverage.get('n_engines_known', 0)} known to the "
        f"{'Prometheus' if snap.from_prometheus else 'collector'}",
    )
    c[1].metric("saturated", f"{saturated} of {len(report.engines)}")
    c[2].metric(
        "pools needing attention", f"{sum(a.score > 0 for _, a in ranked)} of {len(ranked)}"
    )
    c[3].metric("recommendations", f"{len(report.recommendations)}")

    for pv, att in ranked:
        if att.score > 0:
            _callout(snap, pv.pool, att)

    st.subheader("Pools, the ones needing attention first")
    st.table(_pool_table(snap).set_index("pool"))
    st.subheader("Engines")
    st.caption(
        "status: live, or silent for how long since its newest step; batch, KV "
        "used, waiting, preemptions and generated tokens over each engine's last "
        "60 s with data; prefix hit rate, verdict, knee, plateau and cap from the "
        "advisor over the window"
    )
    st.table(_engine_table(snap).set_index("engine"))
    analyzed = {v.engine_id for v in report.engines}
    if "engine_id" in snap.engines:
        idle = snap.engines[~snap.engines["engine_id"].isin(analyzed)]
        if len(idle):
            st.subheader("Engines without data in the window")
            st.table(
                pd.DataFrame(
                    {
                        "engine": idle["engine_id"],
                        "pool": idle.get("pool"),
                        "status": [
                            engine_status(t, snap.fetched_unix_s)
                            for t in idle.get("last_step_unix_s", [None] * len(idle))
                        ],
                    }
                ).set_index("engine")
            )

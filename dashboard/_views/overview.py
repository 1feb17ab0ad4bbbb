"""Fleet overview: every pool and engine, the ones needing attention first; every engine
the source knows is listed, those without data in the window too (idle or DOWN)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvscope.advisor import EngineVerdict
from kvscope.dashboard._format import NONE, knee, num, pct, tok
from kvscope.dashboard._status import (
    DOWN_S,
    LIVE_S,
    Attention,
    engine_attention,
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


def _silent_row(snap: Snapshot, eid: str) -> dict[str, str]:
    """A known engine without windows in the window: who it is and when last seen."""
    cfg = snap.engine_config(eid)
    seqs = cfg.get("max_num_seqs")
    row = dict.fromkeys(_COLUMNS, NONE)
    row.update(
        engine=eid,
        pool=str(cfg.get("pool")),
        status=snap.engine_state(eid).text,
        verdict="no data in the window",
    )
    row["batch / max_num_seqs"] = f"{NONE} / {num(seqs, '.0f')}"
    return row


_COLUMNS = (
    "engine",
    "pool",
    "status",
    "batch / max_num_seqs",
    "KV used",
    "waiting",
    "preemptions/s",
    "generated",
    "prefix hit rate",
    "verdict",
    "knee (in flight)",
    "plateau",
    "cap",
)


def _engine_table(snap: Snapshot) -> pd.DataFrame:
    """Every engine the source knows: those with data in the window by attention, then
    those without (DOWN or idle), by id."""
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
                "status": snap.engine_state(v.engine_id).text,
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
    analyzed = {v.engine_id for v in snap.report.engines}
    rows += [_silent_row(snap, e) for e in snap.known_engine_ids if e not in analyzed]
    return pd.DataFrame(rows, columns=list(_COLUMNS))


def render(snap: Snapshot) -> None:
    report = snap.report
    assert report is not None
    ranked = pools_by_attention(report)
    known = snap.known_engine_ids
    states = [snap.engine_state(e).state for e in known]
    saturated = sum(v.saturated for v in report.engines)
    c = st.columns(6)
    c[0].metric(
        "engines known",
        f"{len(known)}",
        help=f"{states.count('live')} live (a step in the last {LIVE_S:.0f} s), "
        f"{states.count('idle')} idle (heard from, no recent step), "
        f"{states.count('DOWN')} DOWN (not heard from for {DOWN_S:.0f} s); known to the "
        f"{'Prometheus' if snap.from_prometheus else 'collector'}",
    )
    c[1].metric("engines DOWN", f"{states.count('DOWN')}")
    c[2].metric(
        "engines analyzed", f"{len(report.engines)}", help="engines with data in the window"
    )
    c[3].metric("saturated", f"{saturated} of {len(report.engines)}")
    c[4].metric(
        "pools needing attention", f"{sum(a.score > 0 for _, a in ranked)} of {len(ranked)}"
    )
    c[5].metric("recommendations", f"{len(report.recommendations)}")

    for pv, att in ranked:
        if att.score > 0:
            _callout(snap, pv.pool, att)

    if ranked:
        st.subheader("Pools, the ones needing attention first")
        st.table(_pool_table(snap).set_index("pool"))
    st.subheader("Engines")
    st.caption(
        "every engine the "
        f"{'Prometheus' if snap.from_prometheus else 'collector'} knows. status: live (a "
        f"step in the last {LIVE_S:.0f} s), idle (heard from, no recent step) or DOWN "
        f"(not heard from for {DOWN_S:.0f} s, with when it was last seen); batch, KV "
        "used, waiting, preemptions and generated tokens over each engine's last 60 s "
        "with data; prefix hit rate, verdict, knee, plateau and cap from the advisor over "
        "the window"
    )
    st.table(_engine_table(snap).set_index("engine"))

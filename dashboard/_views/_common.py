"""Pieces shared by the engine and plateau pages: the engine selector, the verdict line."""

from __future__ import annotations

import streamlit as st

from kvscope.advisor import EngineVerdict, Report
from kvscope.dashboard._status import engine_attention, engines_by_attention

_ENGINE = "kvscope_engine"
"""Session-state key of the engine last picked (kept from one page to the other)."""


def pick_engine(report: Report, key: str) -> EngineVerdict:
    """A select box over the report's engines, the one needing attention most first;
    ``?engine=ID`` in the URL preselects one (else the engine picked on another page),
    and the pick is written back to the URL, so a link opens the same engine."""
    ordered = engines_by_attention(report)
    ids = [v.engine_id for v in ordered]
    wanted = st.query_params.get("engine") or st.session_state.get(_ENGINE)
    index = ids.index(wanted) if wanted in ids else 0

    def label(eid: str) -> str:
        v = report.engine(eid)
        att = engine_attention(v)
        return f"{eid}  (pool {v.pool}; {v.bottleneck}{'; ' + att.text if att.score else ''})"

    eid = st.selectbox("Engine", ids, index=index, format_func=label, key=key)
    st.session_state[_ENGINE] = eid
    if st.query_params.get("engine") != eid:
        st.query_params["engine"] = str(eid)
    return report.engine(str(eid))


_COLORS = {
    "kv_cache_bound": "red",
    "max_num_seqs_bound": "orange",
    "token_budget_bound": "orange",
    "compute_bound": "violet",
    "frontend_bound": "blue",
    "unexplained": "gray",
    "not_saturated": "green",
}


def verdict_headline(v: EngineVerdict) -> None:
    """``kv_cache_bound``, saturated (or headroom, approaching ...), thrash."""
    color = _COLORS.get(v.bottleneck, "gray")
    text = f"#### :{color}-background[{v.bottleneck}] "
    if v.bottleneck == "insufficient_data":
        text += v.headroom
    else:
        text += "saturated" if v.saturated else "headroom"
        if not v.saturated and v.approaching:
            text += f", approaching {v.approaching}"
        if v.preemption_thrash:
            text += ", :red[preemption thrash]"
        text += f"  (confidence {v.confidence:.2f})"
    st.markdown(text)

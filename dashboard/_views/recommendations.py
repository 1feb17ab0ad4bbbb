"""Recommendations, grouped by the kind of their gain: evidence, expected effect, the change to copy."""

from __future__ import annotations

import json
from typing import Any

import streamlit as st

from kvscope.advisor import Recommendation
from kvscope.advisor.gateways import gateway_blocks
from kvscope.advisor.render import gain_text
from kvscope.dashboard._format import EFFECT_LABELS, facts
from kvscope.dashboard.data import Snapshot

_TEXT_KEYS = {
    "router_policy": ("router policy", "text"),
    "production_stack": ("vLLM production-stack router", "bash"),
    "llm_d": ("llm-d", "text"),
    "load_bound": ("load bound", "text"),
    "router_options": ("routers", "text"),
}


def change_blocks(change: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(label, text to copy, language)`` for each part of a recommendation's change."""
    out: list[tuple[str, str, str]] = []
    for key, val in change.items():
        if key == "concurrency_cap":
            continue  # the number is in the summary and in each gateway block
        if key == "vllm_flags":
            out.append(("vLLM flags", " ".join(map(str, val)), "bash"))
        elif key == "gateway" and isinstance(val, dict):
            out.extend(gateway_blocks(val))
        elif key == "per_engine_caps" and isinstance(val, dict):
            out.append(
                (
                    "cap per engine (in flight)",
                    "\n".join(f"{k}: {c}" for k, c in val.items()),
                    "yaml",
                )
            )
        elif key in _TEXT_KEYS:
            label, lang = _TEXT_KEYS[key]
            out.append((label, str(val), lang))
        else:
            text = val if isinstance(val, str) else json.dumps(val, indent=2)
            out.append((key.replace("_", " "), str(text), "text"))
    return out


def _scope(r: Recommendation) -> str:
    if r.scope.engine_id:
        return f"engine {r.scope.engine_id} (pool {r.scope.pool})"
    return f"pool {r.scope.pool}" if r.scope.pool is not None else "fleet"


def recommendation_card(i: int, r: Recommendation) -> None:
    with st.container(border=True):
        st.markdown(f"#### {i}. {r.summary}")
        st.caption(
            f"{_scope(r)}; `{r.kind}`; confidence {r.confidence:.2f}; expected {gain_text(r)}"
        )
        effect = facts(r.expected_effect, EFFECT_LABELS)
        if effect:
            st.markdown("**Expected effect:** " + "; ".join(f"{k} {v}" for k, v in effect))
        if r.tradeoff:
            st.markdown(f"**Trade-off:** {r.tradeoff}")
        evidence = facts(r.evidence)
        if evidence:
            st.markdown("**Evidence:** " + "; ".join(f"{k} {v}" for k, v in evidence))
        blocks = change_blocks(r.change)
        if blocks:
            st.markdown("**Change to apply:**")
            for label, text, lang in blocks:
                st.caption(label)
                st.code(text, language=lang, wrap_lines=True)


def render(snap: Snapshot) -> None:
    report = snap.report
    assert report is not None
    if not report.recommendations:
        st.success("No recommendations: nothing to change on this data.")
        return
    st.caption(
        f"{len(report.recommendations)} recommendation(s): throughput gains, then latency "
        "cuts, each by size (gains of different kinds are not on one scale)"
    )
    for i, r in enumerate(report.recommendations, start=1):
        recommendation_card(i, r)

"""The engine page's per-step view: batch, waiting queue and KV usage of each engine
step, for the last seconds before the newest step or any range of the window."""

from __future__ import annotations

import dataclasses
import math

import streamlit as st

from kvscope.advisor import SourceError
from kvscope.dashboard._charts import step_chart, step_kv_chart
from kvscope.dashboard._status import utc_text
from kvscope.dashboard._steps import MAX_PLOTTED, StepPlan, every_kth, plan_steps
from kvscope.dashboard.data import Snapshot, read_steps

SPANS: dict[str, float | None] = {
    "last 30 s": 30.0,
    "last 5 min": 300.0,
    "last 1 h": 3600.0,
    "the whole window": None,
    "a range": None,
}
"""The choices of steps to show; the ``last ...`` ones end at the engine's newest step."""


def _range(snap: Snapshot, start: float, end: float) -> tuple[float, float] | None:
    """The range the user picked, within the window; None (with a message) when the
    range cannot be read."""
    from kvscope.args import ParamError, parse_time

    choice = st.radio(
        "Steps shown", list(SPANS), index=0, horizontal=True, key="kvscope_steps_span"
    )
    if choice == "the whole window":
        return start, end
    if choice != "a range":
        return max(start, end - float(SPANS[choice] or 0.0)), end
    left, right = st.columns(2)
    a = left.text_input(
        "from (UTC)", placeholder="e.g. 2026-11-30 08:00 or -10m", key="kvscope_steps_from"
    )
    b = right.text_input("to (UTC)", placeholder="now", key="kvscope_steps_to")
    try:
        since = parse_time("from", a, snap.fetched_unix_s) if a.strip() else start
        until = parse_time("to", b, snap.fetched_unix_s) if b.strip() else end
    except ParamError as exc:
        st.warning(f"Steps range: {exc}")
        return None
    if until <= since:
        st.warning("Steps range: its end must come after its start.")
        return None
    return max(start, since), min(end, until)


def _caption(plan: StepPlan, shown: int) -> str:
    where = f"{utc_text(plan.since_unix_s)} to {utc_text(plan.until_unix_s)}"
    if plan.k == 1:
        return f"{where}: {plan.text}."
    return (
        f"{where}: showing {plan.text} ({shown:,} drawn); the per-second series above "
        "hold every second's mean and maximum."
    )


STEPS_PARAM = "steps"
"""``?steps=1`` in the page's link opens the per-step view."""


def _shown() -> bool:
    """The per-step switch, off unless the link says ``?steps=1``; written back to the link,
    so a shared link opens the same view. Off by default: its two charts cost the engine
    page's first load 0.8-1.1 s on a 2-core machine (docs/benchmarks.md)."""
    show = st.toggle(
        "Show each engine step",
        value=st.query_params.get(STEPS_PARAM) == "1",
        key="kvscope_steps_show",
        help="Batch, waiting queue and KV usage of every step, from the collector's raw steps.",
    )
    if show and st.query_params.get(STEPS_PARAM) != "1":
        st.query_params[STEPS_PARAM] = "1"
    elif not show and STEPS_PARAM in st.query_params:
        del st.query_params[STEPS_PARAM]
    return bool(show)


def steps_section(snap: Snapshot, engine_id: str, max_num_seqs: float | None) -> None:
    """The per-step charts of ``engine_id`` (behind a switch), or why there are none."""
    st.subheader("Engine steps")
    if not snap.has_steps:
        st.info(
            "Per-step series need kvscope's plugin and a collector: Prometheus holds one "
            f"sample per scrape ({snap.window_s:g} s here), not every engine step. Start "
            "the dashboard on a collector (`kvscope dashboard --collector URL`) to see them."
        )
        return
    windows = snap.engine_windows(engine_id)
    if not len(windows) or not _shown():
        return
    cfg = snap.engine_config(engine_id)
    first = float(windows["ts_s"].min())
    last = float(cfg.get("last_step_unix_s") or windows["ts_s"].max() + 1.0)
    end = min(last, snap.until_unix_s) if snap.until_unix_s is not None else last
    picked = _range(snap, max(first, snap.since_unix_s or first), end + 1e-3)
    if picked is None:
        return
    plan = plan_steps(windows, *picked)
    if plan.n_steps == 0:
        st.caption("No engine steps of this engine in that range.")
        return
    try:
        steps = read_steps(
            snap.settings, engine_id, plan.since_unix_s, plan.until_unix_s, every=plan.k
        )
    except SourceError as exc:
        st.warning(f"Could not read the raw steps: {exc}")
        return
    if not len(steps):
        st.caption(
            "The collector holds no raw steps of this engine in that range (it keeps "
            "them for its raw retention, a day by default)."
        )
        return
    if plan.k == 1:
        # Count what was read (the collector may have dropped steps past its retention).
        k = max(1, math.ceil(len(steps) / MAX_PLOTTED))
        plan = dataclasses.replace(plan, n_steps=len(steps), k=k)
        shown = every_kth(steps, plan.k)
    else:  # the collector sampled them
        shown = steps.reset_index(drop=True)
    note = "" if plan.k == 1 else plan.text
    st.altair_chart(step_chart(shown, max_num_seqs, subtitle=note), width="stretch")
    if "kv_usage_ratio" in shown:
        st.altair_chart(step_kv_chart(shown, subtitle=note), width="stretch")
    st.caption(_caption(plan, len(shown)))

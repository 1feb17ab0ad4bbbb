"""Saturation from the engine's own evidence: the batch stopped growing while requests
waited, even when one noisy load level measured higher throughput.

A real overload run of the KV-starved engine (48 blocks; clients 1-32) measured, at 16 and
32 clients, 1,134 and 1,401 generated tok/s with the batch at 12.3 both times, KV 96-97%,
3.5 and 19.5 requests waiting and 13.8 preemptions/s: throughput "grew" 24% over the last
doubling although the engine admitted not one more sequence. The curve rule alone then put
the knee at 22 and called the engine not saturated; the advisor gave no cap.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvscope.advisor import FrameSource, analyze
from kvscope.advisor.curve import ThroughputCurve
from kvscope.advisor.datasets import make_engine


def _top_level_faster(windows: pd.DataFrame, factor: float) -> pd.DataFrame:
    """The windows with the highest load level's throughput scaled by ``factor``."""
    w = windows.copy()
    top = w["waiting_mean"] + w["batch_mean"] > 0.75 * (w["waiting_mean"] + w["batch_mean"]).max()
    for col in ("generation_tokens", "prompt_tokens", "prefix_queries", "n_steps"):
        w.loc[top, col] = np.round(w.loc[top, col] * factor).astype(int)
    w.loc[top, "batch_sum"] = np.round(w.loc[top, "batch_mean"] * w.loc[top, "n_steps"]).astype(int)
    return w


def test_a_flat_batch_with_a_queue_is_saturated_despite_a_fast_top_level() -> None:
    eng = make_engine("kv_cache_bound", seed=3)
    windows = _top_level_faster(eng.windows, 1.25)
    by_throughput = ThroughputCurve(ceiling_min_waiting=math.inf).fit(windows)
    assert not by_throughput.saturated_, "the top level should push the knee out of range"
    curve = ThroughputCurve().fit(windows)
    assert curve.saturated_ and curve.ceiling_
    assert curve.batch_growth_last_doubling_ is not None
    assert curve.batch_growth_last_doubling_ <= 0.1
    assert curve.waiting_at_max_load_ >= 1
    # The knee stops where the batch stopped growing, so the load went past it.
    assert curve.batch_ceiling_load_ is not None and curve.past_knee_
    assert curve.knee_load_ <= curve.batch_ceiling_load_ < by_throughput.knee_load_
    report = analyze(FrameSource(eng.engines, windows, eng.requests))
    (v,) = report.engines
    assert v.saturated and v.bottleneck == "kv_cache_bound"
    assert v.recommended_concurrency_cap is not None


def test_no_ceiling_without_a_queue_or_while_the_batch_grows() -> None:
    """The controls: an engine with room (batch grows, nobody waits) is not saturated
    however its throughput moves; a flat batch without a queue is not a ceiling either."""
    eng = make_engine("not_saturated", seed=3)
    curve = ThroughputCurve().fit(_top_level_faster(eng.windows, 0.8))
    assert not curve.ceiling_ and not curve.saturated_
    assert curve.batch_growth_last_doubling_ is not None
    assert curve.batch_growth_last_doubling_ > 0.5
    flat = eng.windows.assign(waiting_mean=0.0, batch_mean=eng.windows["batch_mean"].clip(upper=4))
    assert not ThroughputCurve().fit(flat).ceiling_


def _drifting(windows: pd.DataFrame, total: float) -> pd.DataFrame:
    """The windows as a machine speeding up over the sweep: each second's steps and
    tokens scaled by a factor rising linearly from 1 to ``total``."""
    w = windows.copy()
    f = 1.0 + (total - 1.0) * np.linspace(0.0, 1.0, len(w))
    for col in ("generation_tokens", "prompt_tokens", "prefix_queries", "n_steps"):
        w[col] = np.round(w[col] * f).astype(int)
    w["batch_sum"] = np.round(w["batch_mean"] * w["n_steps"]).astype(int)
    return w


def test_the_knee_and_cap_stop_where_the_batch_stopped_growing() -> None:
    """A ``--max-num-seqs 6`` engine on a machine speeding up 80% over the sweep: the
    throughput still rises past 8 in flight with the batch at 6 and a queue (as a real
    sweep measured it: 754 tok/s at 8 clients, 903 at 24, the batch 6 throughout). The
    knee and the cap stay at the first load level where the batch is full."""
    eng = make_engine("max_num_seqs_bound", seed=5, levels=(1, 2, 4, 8, 16, 32))
    windows = _drifting(eng.windows, 1.8)
    curve = ThroughputCurve().fit(windows)
    full = curve.bins_[curve.bins_["batch"] >= 0.95 * 6]  # the engine's --max-num-seqs
    first_full = float(full["load"].min())
    assert first_full < 12
    by_fraction = ThroughputCurve(ceiling_min_waiting=math.inf).fit(windows)
    assert by_fraction.knee_load_ > 1.5 * first_full, "the drift should push that knee out"
    assert curve.batch_ceiling_load_ is not None
    assert curve.knee_load_ <= first_full + 1e-9
    report = analyze(FrameSource(eng.engines, windows, eng.requests))
    (v,) = report.engines
    assert v.bottleneck == "max_num_seqs_bound" and v.saturated
    # vLLM runs at most 6; a seventh request in flight waits for a slot.
    assert v.recommended_concurrency_cap is not None
    assert v.recommended_concurrency_cap <= 6 < math.ceil(first_full)


def test_no_batch_ceiling_while_the_batch_grows() -> None:
    """The control: an engine with room keeps its fraction-rule knee."""
    eng = make_engine("not_saturated", seed=5)
    curve = ThroughputCurve().fit(_drifting(eng.windows, 1.8))
    assert curve.batch_ceiling_load_ is None

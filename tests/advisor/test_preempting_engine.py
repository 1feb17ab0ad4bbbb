"""The advisor on a real KV-starved engine that preempts: two runs of one configuration.

``tests/fixtures/kv_starved_preempting.json.gz`` holds what a kvscope collector stored
of two real vLLM 0.32 CPU runs (``--num-gpu-blocks-override 128``), each a closed-loop
sweep of 2 to 32 clients: the engines, their 1-second windows and finished requests
(see ``tests/fixtures/README.md``). From 12 clients on the cache is full, requests wait
and vLLM preempts; the clients measured the generated tokens/s of every level, flat
from 12 clients up (632, 641, 620 and 638 tok/s in the median of the two runs), so the
expected answer is the clients' figure, not the advisor's.

On these runs, the curve's top bin once read 743 tok/s (the median of the fast seconds
a bin edge through the 24-client level left it, next to seconds of a stalled batch
recomputing preempted requests: 222 to 1,111 tok/s) and called the engine not saturated.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from kvscope.advisor import FrameSource, analyze
from kvscope.advisor.curve import ThroughputCurve
from kvscope.advisor.frames import load_bins

FIXTURE = Path(__file__).parents[1] / "fixtures" / "kv_starved_preempting.json.gz"


def _runs() -> dict[str, Any]:
    with gzip.open(FIXTURE, "rt") as f:
        runs: dict[str, Any] = json.load(f)["runs"]
    return runs


RUNS = _runs()


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_full_cache_is_the_ceiling_and_the_plateau_is_the_clients(name: str) -> None:
    run = RUNS[name]
    report = analyze(
        FrameSource(
            pd.DataFrame(run["engines"]),
            pd.DataFrame(run["windows"]),
            pd.DataFrame(run["requests"]),
        )
    )
    v = report.engines[0]
    assert v.bottleneck == "kv_cache_bound" and v.saturated, v
    measured = run["client_plateau_tokens_per_s"]  # the clients' mean over 24 and 32
    assert v.plateau_tokens_per_s == pytest.approx(measured, rel=0.12)
    # 90% of the plateau lies between the 8-client level (542 tok/s) and the 12-client one.
    assert 6 <= (v.knee_concurrency or 0) <= 14
    assert v.recommended_concurrency_cap is not None and 6 <= v.recommended_concurrency_cap <= 16


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_top_bin_holds_the_clients_plateau(name: str) -> None:
    """The 24-client level ran at 21-24 requests in flight, its slowest seconds (requests
    turning over) at the low end: a bin edge at 22.6 once split it, leaving the fast
    seconds to the top bin."""
    curve = ThroughputCurve().fit(pd.DataFrame(RUNS[name]["windows"]))
    top = float(curve.bins_["gen_tokens_per_s"].iloc[-1])
    assert top == pytest.approx(RUNS[name]["client_plateau_tokens_per_s"], rel=0.08)
    assert curve.saturated_ and curve.kv_ceiling_


def test_bin_edges_fall_between_load_levels() -> None:
    """Loads as a sweep's levels spread them at the engine (the ranges of the run above):
    no edge inside a level."""
    levels = [(7.5, 7.8), (11.4, 12.0), (13.8, 16.0), (21.3, 23.9), (30.1, 32.0)]
    rng = np.random.default_rng(1)
    load = np.concatenate([rng.uniform(lo, hi, 13) for lo, hi in levels])
    edges = load_bins(load, bins_per_doubling=2, min_count=3)
    assert edges[0] < load.min() and edges[-1] > load.max()
    for e in edges[1:-1]:
        assert not any(lo <= e <= hi for lo, hi in levels), (e, edges)

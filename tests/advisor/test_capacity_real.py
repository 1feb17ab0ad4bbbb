"""The KV capacity model's plateau against what real KV-starved engines then delivered.

``tests/fixtures/kv_starved_avx2_closed_loop.json.gz``: one run of the engine tier's
KV-starved vLLM 0.32 CPU engine on an AVX2 machine (48 blocks of 32 tokens, 128-token
outputs), as its collector stored it: the sweep of 1 to 32 clients the advisor reads, then
the closed loop's five uncapped runs at 32 clients (between runs capped at 14). The
expected answer is what the engine generated in those five runs, which the model never
sees. On this machine a prompt token costs about what a decode step's sequence does, so
the recomputation of preempted requests weighs: 1.4 preemptions a second over the
windows past the knee, 3.5 at 32 clients, where the engine ran 14% below its
throughput at the knee. Predicted at the first rate, with the cache's batch read from
the highest loads' waves (13.1 sequences where the engine held 11.8), the plateau read
370 tok/s: the five runs measured a median 323 (0.87 of it), and with the sweep's
saturated levels the engine tier's check read 0.75 and failed in CI. It reads 313 now.

``tests/fixtures/kv_starved_preempting.json.gz``: two runs of another KV-starved engine
(128 blocks) on another machine, each with the clients' plateau (see
``test_preempting_engine.py``).
"""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pandas as pd
import pytest

from kvscope.advisor import FrameSource, analyze
from kvscope.advisor.frames import prepare_windows

FIXTURES = Path(__file__).parents[1] / "fixtures"
TOLERANCE = 0.12
"""Measured over predicted within 12%: both recordings are fixed, so this is the model's
error on them (the engine tier's band over noisy live runs is 0.83-1.25)."""


def _kv_capacity(engines: pd.DataFrame, windows: pd.DataFrame, requests: pd.DataFrame) -> dict:
    report = analyze(FrameSource(engines, windows, requests))
    (found,) = report.findings_of("kv_capacity")
    return dict(found.evidence)


def _from_the_sweep(name: str) -> tuple[dict, dict]:
    """A recording of the engine tier's KV-starved engine, and the capacity model's
    evidence from its sweep alone (the windows and the requests finished in its range)."""
    with gzip.open(FIXTURES / name, "rt") as f:
        d = json.load(f)
    since, until = d["sweep"]["since"], d["sweep"]["until"]
    windows = pd.DataFrame(d["windows"])
    requests = pd.DataFrame(d["requests"])
    kv = _kv_capacity(
        pd.DataFrame(d["engines"]),
        windows[windows["ts_s"].between(since, until)],
        requests[requests["finished_unix_s"].between(since, until)],
    )
    return d, kv


def test_the_plateau_predicted_from_the_sweep_is_what_the_closed_loop_then_ran() -> None:
    d, kv = _from_the_sweep("kv_starved_avx2_closed_loop.json.gz")
    windows = pd.DataFrame(d["windows"])
    assert kv["kv_limited"] and kv["footprint_from"] == "plateau", kv
    # The five uncapped runs after the sweep: each a stretch of seconds with 32 in flight.
    later = prepare_windows(windows[windows["ts_s"] > d["sweep"]["until"]])
    over = later["load"] >= 20
    run_id = (over != over.shift()).cumsum()[over]
    runs = later[over].groupby(run_id)["gen_tokens_per_s"].mean()
    assert len(runs) == 5, runs
    measured = float(runs.median())
    ratio = measured / kv["predicted_plateau_tokens_per_s"]
    assert abs(ratio - 1.0) <= TOLERANCE, (ratio, list(runs), kv)
    # The preemptions priced are those of the top load, not those just past the knee.
    assert kv["preemptions_per_s"] > 3, kv


@pytest.mark.parametrize("name", ["baseline", "baseline-r1"])
def test_the_plateau_predicted_is_the_clients_on_another_engine(name: str) -> None:
    with gzip.open(FIXTURES / "kv_starved_preempting.json.gz", "rt") as f:
        run = json.load(f)["runs"][name]
    kv = _kv_capacity(
        pd.DataFrame(run["engines"]), pd.DataFrame(run["windows"]), pd.DataFrame(run["requests"])
    )
    measured = run["client_plateau_tokens_per_s"]
    ratio = measured / kv["predicted_plateau_tokens_per_s"]
    assert abs(ratio - 1.0) <= TOLERANCE, (ratio, kv)
    # The cache's batch is the one the engine held at the plateau.
    assert kv["kv_batch"] == pytest.approx(kv["observed_batch"], rel=0.02)


def test_the_preemptions_priced_are_those_of_the_highest_load_when_its_bin_spans_levels() -> None:
    """``kv_starved_avx2_merged_top.json.gz``: another run of the same engine whose sweep
    went up to 32 clients once and came back down through 24: the top load bin holds the
    seconds of both 24-client levels (vLLM preempting 0.3 times a second) with the one
    32-client level's. Priced at the bin's mean (1.6 a second) the plateau read 326 tok/s;
    the three uncapped closed-loop runs at 32 clients that followed, which the model never
    sees, measured 273-297 tok/s at the clients and 4.4-4.7 preemptions a second."""
    d, kv = _from_the_sweep("kv_starved_avx2_merged_top.json.gz")
    assert kv["kv_limited"], kv
    measured = statistics.median(d["closed_loop_client_tokens_per_s"])
    ratio = measured / kv["predicted_plateau_tokens_per_s"]
    assert abs(ratio - 1.0) <= TOLERANCE, (ratio, kv)
    # The rate priced is the 32-client level's, not the bin's: at least half the closed
    # loop's at that load (the sweep's level is short, and a preemption is counted when
    # the request resumes).
    assert kv["preemptions_per_s"] >= 0.5 * min(d["closed_loop_preemptions_per_s"]), kv

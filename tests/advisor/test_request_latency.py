"""kvscope.advisor.request_latency on constructed requests whose answers are known by
construction (counted by hand below), and its place in the advisor's report."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pandas as pd
import pytest

from kvscope.advisor import FrameSource, Report, analyze
from kvscope.advisor.datasets import make_engine
from kvscope.advisor.findings import JSON_SCHEMA_PATH
from kvscope.advisor.render_latency import latency_rows, latency_text, slo_rows, slo_text
from kvscope.advisor.request_latency import (
    Quantiles,
    RequestLatency,
    SloTargets,
    latency_over_time,
    length_histogram,
    request_itl_s,
    request_latency,
)

T0 = 1_800_000_000.0  # a multiple of 60: minute bins start on it


def constructed(engine_id: str = "a:8000:0") -> pd.DataFrame:
    """100 requests, i = 1..100.

    * TTFT ``i / 100`` s (0.01 ... 1.00), queue and prefill half of it each;
    * i a multiple of 10 (10 requests): 1 output token, no decode, finish ``stop``;
      otherwise 11 output tokens (10 gaps), finish ``length``, and an ITL of 0.02 s for
      odd i (50 requests), 0.06 s for even i (40 requests): decode 0.2 s or 0.6 s;
    * e2e = TTFT + decode + 0.01 s (the front end's share);
    * prompt ``100 i`` tokens.
    """
    i = np.arange(1, 101)
    one = i % 10 == 0
    itl = np.where(i % 2 == 1, 0.02, 0.06)
    decode = np.where(one, 0.0, 10 * itl)
    ttft = i / 100
    return pd.DataFrame(
        {
            "engine_id": engine_id,
            "finished_unix_s": T0 + i,
            "ttft_s": ttft,
            "queue_s": ttft / 2,
            "prefill_s": ttft / 2,
            "decode_s": decode,
            "e2e_s": ttft + decode + 0.01,
            "prompt_tokens": 100 * i,
            "generation_tokens": np.where(one, 1, 11),
            "cached_tokens": 0,
            "preemptions": 0,
            "finish_reason": np.where(one, "stop", "length"),
        }
    )


def test_itl_is_decode_over_the_gaps_and_only_with_two_tokens_or_more() -> None:
    r = pd.DataFrame({"decode_s": [0.5, 0.0, 0.3, 1.0], "generation_tokens": [11, 1, 2, 0]})
    itl = request_itl_s(r)
    assert itl[0] == pytest.approx(0.05)  # 10 gaps
    assert itl[2] == pytest.approx(0.3)  # 1 gap
    assert np.isnan(itl[1]) and np.isnan(itl[3])


def test_percentiles_counts_and_breakdown_are_the_constructed_ones() -> None:
    lat = request_latency(constructed())
    assert lat.n_requests == 100
    # Linear interpolation between order statistics of 0.01 ... 1.00: P50 sits halfway
    # between the 50th and 51st values, P90 at 0.9 of the way from the 90th to the
    # 91st, P99 at 0.01 of the way from the 99th to the 100th.
    assert lat.ttft_s.n == 100
    assert lat.ttft_s.p50 == pytest.approx(0.505)
    assert lat.ttft_s.p90 == pytest.approx(0.901)
    assert lat.ttft_s.p99 == pytest.approx(0.9901)
    assert lat.ttft_s.max == pytest.approx(1.0)
    assert lat.ttft_s.mean == pytest.approx(0.505)
    # 90 requests have an ITL: 50 at 0.02 s, 40 at 0.06 s.
    assert lat.itl_s.n == 90
    assert lat.itl_s.p50 == pytest.approx(0.02)
    assert lat.itl_s.p90 == pytest.approx(0.06)
    assert lat.itl_s.mean == pytest.approx((50 * 0.02 + 40 * 0.06) / 90)
    assert lat.finish_reasons == {"length": 90, "stop": 10}
    assert list(lat.finish_reasons) == ["length", "stop"]  # most frequent first
    # Means add up: queue and prefill 0.2525 s each, decode (50 x 0.2 + 40 x 0.6) / 100.
    b = lat.breakdown_mean_s
    assert b["queue"] == pytest.approx(0.2525)
    assert b["prefill"] == pytest.approx(0.2525)
    assert b["decode"] == pytest.approx(0.34)
    assert b["other"] == pytest.approx(0.01)
    assert lat.generation_tokens.p50 == 11 and lat.generation_tokens.max == 11
    assert lat.prompt_tokens.max == 10_000
    assert lat.slo == {} and not lat.weighted  # no targets: nothing judged


def test_slo_attainment_against_the_constructed_answer() -> None:
    lat = request_latency(constructed(), SloTargets(ttft_s=0.5, itl_s=0.05, e2e_s=0.505))
    # TTFT <= 0.5 s: i = 1..50 (the target itself is met).
    assert (lat.slo["ttft"].n_met, lat.slo["ttft"].n, lat.slo["ttft"].share) == (50, 100, 0.5)
    # ITL <= 0.05 s: the 50 odd i, of the 90 with an ITL.
    assert (lat.slo["itl"].n_met, lat.slo["itl"].n) == (50, 90)
    assert lat.slo["itl"].share == pytest.approx(50 / 90)
    # e2e <= 0.505 s: odd i up to 29 (i/100 + 0.21), multiples of 10 up to 40
    # (i/100 + 0.01); no even i with 0.6 s of decode.
    assert (lat.slo["e2e"].n_met, lat.slo["e2e"].n) == (15 + 4, 100)
    # Every target: the odd i up to 29 (15), and 10, 20, 30, 40 (one output token: no
    # ITL to miss; e2e 0.11 ... 0.41 s): 15 + 4.
    assert (lat.slo["all"].n_met, lat.slo["all"].n, lat.slo["all"].target_s) == (19, 100, None)


def test_all_targets_counts_one_token_requests_as_meeting_the_itl() -> None:
    lat = request_latency(constructed(), SloTargets(ttft_s=0.5, itl_s=0.05))
    # i <= 50 and (odd, or a multiple of 10): 25 + 5.
    assert (lat.slo["all"].n_met, lat.slo["all"].n) == (30, 100)
    assert set(lat.slo) == {"ttft", "itl", "all"}


def test_weights_count_as_repeated_rows() -> None:
    r = constructed()
    w = r.assign(weight=np.where(np.arange(100) % 3 == 0, 3.0, 1.0))
    repeated = pd.concat([r, *(r.iloc[::3] for _ in range(2))], ignore_index=True)
    targets = SloTargets(ttft_s=0.5, itl_s=0.05)
    a, b = request_latency(w, targets), request_latency(repeated, targets)
    assert a.weighted and not b.weighted
    assert a.n_requests == b.n_requests == 100 + 2 * 34
    assert a.finish_reasons == b.finish_reasons
    assert a.slo == b.slo
    assert a.ttft_s.mean == pytest.approx(b.ttft_s.mean)
    assert a.breakdown_mean_s == pytest.approx(b.breakdown_mean_s)
    # Unequal weights: the weighted inverted CDF. Values 1 and 2 weighing 3 and 1: three
    # quarters of the mass at 1, so P50 is 1 and P90 is 2.
    q = Quantiles.of(np.array([1.0, 2.0]), np.array([3.0, 1.0]))
    assert (q.n, q.p50, q.p90, q.p99) == (4, 1.0, 2.0, 2.0)
    assert q.mean == pytest.approx(1.25)


def test_empty_and_missing_columns() -> None:
    assert request_latency(pd.DataFrame()) == RequestLatency()
    lat = request_latency(pd.DataFrame({"e2e_s": [1.0, 2.0]}), SloTargets(ttft_s=1.0))
    assert lat.n_requests == 2 and lat.ttft_s.n == 0 and lat.itl_s.n == 0
    assert lat.finish_reasons == {"unknown": 2}
    assert lat.slo["ttft"].n == 0 and lat.slo["ttft"].share is None


def test_round_trip_through_json() -> None:
    lat = request_latency(constructed(), SloTargets(ttft_s=0.5))
    again = RequestLatency.from_dict(json.loads(json.dumps(lat.to_dict())))
    assert again == lat


def test_over_time_bins_and_length_histogram() -> None:
    r = pd.DataFrame(
        {
            "finished_unix_s": [T0 + 1, T0 + 20, T0 + 59, T0 + 61],
            "ttft_s": [0.1, 0.2, 0.3, 1.0],
            "e2e_s": [1.0, 2.0, 3.0, 4.0],
            "decode_s": [0.2, 0.2, 0.2, 0.2],
            "generation_tokens": [3, 3, 1, 3],
        }
    )
    s = latency_over_time(r, 60)
    ttft = s[s["measure"] == "ttft_s"].reset_index(drop=True)
    assert list(ttft["bin_start_unix_s"]) == [T0, T0 + 60]
    assert list(ttft["n"]) == [3, 1]
    assert ttft["p50"].tolist() == pytest.approx([0.2, 1.0])
    itl = s[s["measure"] == "itl_s"]
    assert list(itl["n"]) == [2, 1]  # the one-token request has none
    assert itl["p50"].tolist() == pytest.approx([0.1, 0.1])
    assert set(s["bin_s"]) == {60}
    # A week of requests: bins of an hour or more keep at most 240 of them.
    long = pd.DataFrame({"finished_unix_s": T0 + np.arange(0, 7 * 86400, 600), "ttft_s": 0.1})
    wk = latency_over_time(long, measures=("ttft_s",))
    assert wk["bin_s"].iloc[0] == 3600 and len(wk) == 7 * 24

    h = length_histogram(constructed(), "prompt_tokens", n_bins=10)
    assert h["n"].sum() == 100
    # 100 ... 10,000 in bins 991 tokens wide from 100: the first holds 100 ... 1,000.
    assert (h["lo"].iloc[0], h["hi"].iloc[0], h["n"].iloc[0]) == (100, 1091, 10)
    assert length_histogram(pd.DataFrame(), "prompt_tokens").empty


def test_renderings_show_the_numbers() -> None:
    lat = request_latency(constructed(), SloTargets(ttft_s=0.5, itl_s=0.05))
    text = latency_text(lat)
    assert "TTFT 505 ms / 901 ms / 990 ms" in text and "(100 requests)" in text
    assert "ITL 20 ms / 60 ms / 60 ms" in text
    assert slo_text(lat) == (
        "TTFT <= 500 ms: 50.0% (50 of 100); ITL <= 50 ms: 55.6% (50 of 90); "
        "every target: 30.0% (30 of 100)"
    )
    assert latency_rows(lat)[0] == ("TTFT", "100", "505 ms", "901 ms", "990 ms", "505 ms")
    assert slo_rows(lat)[-1] == ("every target", "30", "100", "30.0%")


def test_the_report_carries_a_latency_block_per_engine_and_pool() -> None:
    a = make_engine("kv_cache_bound", seed=0, engine_id="h1:8000:0", pool="p")
    b = make_engine("not_saturated", seed=1, engine_id="h2:8000:0", pool="p")
    engines, windows, requests = (
        pd.concat([x, y], ignore_index=True)
        for x, y in ((a.engines, b.engines), (a.windows, b.windows), (a.requests, b.requests))
    )
    off = analyze(FrameSource(engines, windows, requests))
    on = analyze(FrameSource(engines, windows, requests), slo_ttft_s=0.5, slo_e2e_s=2.0)
    targets = SloTargets(ttft_s=0.5, e2e_s=2.0)
    for eng in (a, b):
        eid = str(eng.engines["engine_id"].iloc[0])
        assert off.engine(eid).latency == request_latency(eng.requests)
        assert on.engine(eid).latency == request_latency(eng.requests, targets)
    assert off.pools[0].latency == request_latency(requests)
    assert on.pools[0].latency == request_latency(requests, targets)
    assert off.pools[0].latency is not None and off.pools[0].latency.slo == {}
    assert on.parameters["slo_ttft_s"] == 0.5 and on.parameters["slo_itl_s"] is None
    # JSON: valid against the shipped schema, and read back the same.
    on.generated_unix_s, on.kvscope_version = 1_764_430_000.0, "0.0.0"
    on.source = {"kind": "collector", "url": "http://c:8844"}
    d = json.loads(on.to_json())
    jsonschema.validate(d, json.loads(JSON_SCHEMA_PATH.read_text()))
    assert d["engines"][0]["latency"]["slo"]["ttft"]["target_s"] == 0.5
    assert Report.from_dict(d).to_dict() == d
    assert Report.from_dict(d).pools[0].latency == on.pools[0].latency

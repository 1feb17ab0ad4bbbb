"""kvscope.advisor.actions and gpu_hours on hand-built weeks whose answers follow from
their construction, and every recommendation's gain kind."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kvscope.advisor.actions import action_list, flags_applied
from kvscope.advisor.findings import (
    EngineVerdict,
    PoolVerdict,
    Recommendation,
    Report,
    Scope,
    gain_kind_of,
)
from kvscope.advisor.gpu_hours import gpu_hours
from kvscope.advisor.usage import DAY_COLUMNS, usage_from_days

E1, E2 = "e1:8000:0", "e2:8000:0"


def _rec(kind: str, eid: str, gain: float, flags: list[str] | None = None) -> Recommendation:
    return Recommendation(
        kind=kind,
        scope=Scope(eid, "p"),
        summary=f"{kind} on {eid}",
        change={"vllm_flags": flags or []},
        expected_effect={},
        expected_gain=gain,
    )


def _report(recs: list[Recommendation], engines: tuple[str, ...] = (E1, E2)) -> Report:
    return Report(
        0.0,
        7 * 86400.0,
        engines=[
            EngineVerdict(e, "p", "kv_cache_bound", True, knee_concurrency=8.0) for e in engines
        ],
        pools=[PoolVerdict("p", list(engines), {"kv_cache_bound": len(engines)})],
        recommendations=recs,
        coverage={"n_engines_analyzed": len(engines)},
    )


def test_gain_kinds() -> None:
    assert gain_kind_of("concurrency_cap") == "latency"
    assert gain_kind_of("pool_concurrency_cap") == "latency"
    assert gain_kind_of("prefix_aware_routing") == "latency"
    assert gain_kind_of("whatif_kv_cache_dtype_fp8") == "throughput"
    assert gain_kind_of("raise_max_num_seqs") == "throughput"
    r = _rec("concurrency_cap", E1, 0.61)
    assert r.gain_kind == "latency"
    again = Recommendation.from_dict(r.to_dict())
    assert again.gain_kind == "latency" and again.id == r.id
    assert r.to_dict()["gain_kind"] == "latency"


def test_statuses_against_last_week() -> None:
    raise_seqs = _rec("raise_max_num_seqs", E1, 0.4, ["--max-num-seqs 32"])
    cap = _rec("concurrency_cap", E1, 0.61, ["--max-num-seqs 6"])
    fp8 = _rec("whatif_kv_cache_dtype_fp8", E2, 0.3, ["--kv-cache-dtype fp8"])
    budget = _rec("raise_max_num_batched_tokens", E2, 0.2, ["--max-num-batched-tokens 4096"])
    api = _rec("scale_api_server", E2, 0.0, ["--api-server-count 2"])
    previous = _report([raise_seqs, cap, fp8])
    current = _report([cap, budget, api])
    before = {E1: {"max_num_seqs": 6}, E2: {"kv_cache_dtype": "auto"}}
    now = {E1: {"max_num_seqs": 256}, E2: {"kv_cache_dtype": "auto"}}
    got = action_list(current, previous, now, previous_configs=before)
    assert [(a.kind, a.status) for a in got] == [
        ("raise_max_num_batched_tokens", "new"),  # throughput first
        ("concurrency_cap", "open"),  # then latency: never ranked against throughput
        ("scale_api_server", "new"),  # then what the advisor does not quantify
        ("raise_max_num_seqs", "done"),  # 6 -> 256 went past the 32 asked for
        ("whatif_kv_cache_dtype_fp8", "gone"),  # the cache is still 16-bit
    ]
    assert got[2].expected_gain is None and got[2].gain_kind == "unquantified"
    assert got[1].gain_kind == "latency" and got[1].expected_gain == pytest.approx(0.61)


def test_flags_applied() -> None:
    assert flags_applied(["--kv-cache-dtype fp8"], {"kv_cache_dtype": "FP8"})
    assert flags_applied(["--max-num-seqs 32"], {"max_num_seqs": 32})
    assert flags_applied(["--max-num-seqs 32"], {"max_num_seqs": 64}, {"max_num_seqs": 6})
    assert not flags_applied(["--max-num-seqs 32"], {"max_num_seqs": 16}, {"max_num_seqs": 6})
    assert not flags_applied(["--max-num-seqs 4"], {"max_num_seqs": 64}, {"max_num_seqs": 6})
    assert not flags_applied(["--max-num-seqs 32"], {"max_num_seqs": 64})  # no before: not sure
    assert not flags_applied(["--max-num-queued-reqs 9"], {"max_num_seqs": 6})
    assert not flags_applied([], {"max_num_seqs": 6})


def _usage(report: Report, spans_s: dict[str, tuple[float, float]]) -> object:
    rows = []
    for eid, (first, last) in spans_s.items():
        row = dict.fromkeys(DAY_COLUMNS, 0.0)
        row.update(
            engine_id=eid,
            day_start_unix_s=0.0,
            active_s=3600.0,
            first_window_s=first,
            last_window_s=last,
            gen_tokens_per_s_peak=None,
            load_max=None,
        )
        rows.append(row)
    return usage_from_days(pd.DataFrame(rows), report, 0.0, 86400.0)


def test_gpu_hours_and_what_throughput_advice_is_worth() -> None:
    fp8 = _rec("whatif_kv_cache_dtype_fp8", E1, 0.25, ["--kv-cache-dtype fp8"])
    tp = _rec("whatif_tensor_parallel_2", E1, 0.5, ["--tensor-parallel-size 4"])
    cap = _rec("concurrency_cap", E2, 0.6)
    report = _report([fp8, tp, cap])
    # E1 up 10 h (first to last second with steps), E2 up 5 h
    usage = _usage(report, {E1: (1000.0, 1000.0 + 36000 - 1), E2: (0.0, 18000.0 - 1)})
    configs = {E1: {"tensor_parallel_size": 2}, E2: {"tensor_parallel_size": 1}}
    (pool,), values = gpu_hours(usage, report, configs, gpu_hour_cost=2.5)  # type: ignore[arg-type]
    assert pool.engine_hours == pytest.approx(15.0)
    assert pool.active_hours == pytest.approx(2.0)
    assert pool.gpu_hours == pytest.approx(10 * 2 + 5 * 1)
    assert pool.cost_usd == pytest.approx(25 * 2.5)
    # +25% throughput: the same load on 1/1.25 = 80% of the engine: 20% of 20 GPU-hours
    assert values[fp8.id] == pytest.approx((4.0, 10.0))
    # tensor parallel 2 -> 4 doubles the GPUs for +50%: 2 / 1.5 of them, a third more
    saved, usd = values[tp.id]
    assert saved == pytest.approx(-20.0 / 3) and usd == pytest.approx(-50.0 / 3)
    assert cap.id not in values  # latency advice is not valued in GPU-hours
    assert pool.saving_gpu_hours == pytest.approx(4.0)  # the better of E1's two, not the sum
    assert pool.saving_usd == pytest.approx(10.0)
    (unpriced,), _ = gpu_hours(usage, report, {})  # type: ignore[arg-type]
    assert unpriced.cost_usd is None and not unpriced.gpus_per_engine_known
    assert unpriced.gpu_hours == pytest.approx(15.0)
    assert math.isclose(unpriced.saving_gpu_hours or 0.0, 10 * 0.2)

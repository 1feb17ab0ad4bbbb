"""The advisor on real vLLM runs, replayed into a real collector and read over HTTP."""

from __future__ import annotations

from typing import Any

import pytest

from kvscope.advisor import CollectorSource, analyze

ENGINE = "demo-host:8000:0"


def _report(replayed: dict[str, Any], name: str) -> Any:
    if name not in replayed:
        pytest.fail(f"recording {name} missing from lab/recordings")
    return analyze(CollectorSource(replayed[name].url))


def test_kv_starved_is_kv_bound_with_knee_8_to_16(replayed: dict[str, Any]) -> None:
    rep = _report(replayed, "overload_kv_starved")
    v = rep.engine(ENGINE)
    assert v.bottleneck == "kv_cache_bound" and v.saturated
    assert 6 <= (v.knee_concurrency or 0) <= 16
    assert 1_100 <= (v.plateau_tokens_per_s or 0) <= 1_400
    assert v.recommended_concurrency_cap is not None and 6 <= v.recommended_concurrency_cap <= 16
    assert v.predicted_p99_e2e_s_at_cap < 0.5 * v.p99_e2e_s_at_max_load
    kv = rep.findings_of("kv_capacity", ENGINE)[0].evidence
    assert abs(kv["prediction_error_ratio"]) < 0.2  # the capacity model within 20%
    assert 10 <= kv["kv_batch"] <= 13 and 10 <= kv["observed_batch"] <= 13
    assert any(r.kind == "whatif_kv_cache_dtype_fp8" for r in rep.recommendations)


def test_seq_capped_is_max_num_seqs_bound(replayed: dict[str, Any]) -> None:
    rep = _report(replayed, "seq_capped")
    v = rep.engine(ENGINE)
    assert v.bottleneck == "max_num_seqs_bound" and v.saturated
    assert 5 <= (v.knee_concurrency or 0) <= 9
    raise_seqs = next(r for r in rep.recommendations if r.kind == "raise_max_num_seqs")
    assert raise_seqs.expected_effect["gain_ratio"] > 0.3


def test_ample_kv_is_compute_limited_not_memory(replayed: dict[str, Any]) -> None:
    rep = _report(replayed, "ample_kv")
    v = rep.engine(ENGINE)
    # Throughput grew only ~12% over the last doubling of load while steps/s fell ~4x.
    assert v.bottleneck in ("compute_bound", "not_saturated")
    assert (v.bottleneck == "compute_bound") == v.saturated
    if not v.saturated:
        assert v.approaching == "compute_bound"
    ev = rep.findings_of("bottleneck", ENGINE)[0].evidence
    assert ev["kv_usage_median"] < 0.1


def test_collector_source_reads_what_was_stored(replayed: dict[str, Any]) -> None:
    src = CollectorSource(replayed["overload_kv_starved"].url, page_rows=25)
    w = src.windows()
    assert len(w) == 80 and w["ts_s"].is_unique  # paged in pieces of 25 rows
    assert len(src.requests(engine=ENGINE)) == 454
    assert list(src.engines()["engine_id"]) == [ENGINE]

"""Prefix-cache reuse and routing on synthetic pools whose answers are known."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvscope.advisor import FrameSource, PrefixRouting, Report, analyze
from kvscope.advisor.datasets import make_prefix_pool
from kvscope.advisor.prefix import KV_EVENTS_FLAG, PREFIX_CACHING_FLAG

T0 = 1_700_000_000


def _pool(
    per_engine: dict[str, dict[str, int]],
    seconds: int = 10,
    block_size: int = 16,
    events_from: int = 0,
    **event_extra: int,
) -> tuple[list[dict], pd.DataFrame, pd.DataFrame]:
    """Windows with ``q``/``x`` per second and events with ``dup``/``reseen`` per second."""
    configs, windows, events = [], [], []
    for eid, v in per_engine.items():
        configs.append(
            {"engine_id": eid, "pool": "p", "block_size": block_size, "enable_prefix_caching": True}
        )
        for t in range(seconds):
            windows.append(
                {"engine_id": eid, "ts_s": T0 + t, "prefix_queries": v["q"], "prefix_hits": v["x"]}
            )
            if t >= events_from:
                events.append(
                    {
                        "engine_id": eid,
                        "ts_s": T0 + t,
                        "stored_blocks": v.get("stored", 40),
                        "dup_blocks": v["dup"],
                        "reseen_blocks": v["reseen"],
                        "orphan_blocks": 0,
                        "removed_blocks": 0,
                        "cleared_events": 0,
                        "missed_batches": 0,
                        "held_blocks": 100,
                        "held_shared_blocks": 25,
                        "block_size": block_size,
                        **event_extra,
                    }
                )
    return configs, pd.DataFrame(windows), pd.DataFrame(events)


def test_reuse_decomposition_has_the_exact_ratios() -> None:
    # Q = 20,000 tokens, X = 6,000 -> H 0.30; D = 25 blocks/s x 16 x 10 s = 4,000 -> L 0.20;
    # R = 35 blocks/s x 16 x 10 s = 5,600 -> A = (6,000 + 5,600) / 20,000 = 0.58.
    configs, w, ev = _pool(
        {
            "a:1:0": {"q": 1000, "x": 400, "dup": 10, "reseen": 15},
            "b:1:0": {"q": 1000, "x": 200, "dup": 15, "reseen": 20},
        }
    )
    pr = PrefixRouting().fit(configs, w, pd.DataFrame(), ev)
    assert pr.hit_rate_ == pytest.approx(0.30)
    assert pr.routing_loss_ == pytest.approx(0.20)
    assert pr.eviction_loss_ == pytest.approx(0.08)
    assert pr.captured_ == pytest.approx(0.38)
    assert pr.available_ == pytest.approx(0.58)
    assert pr.predicted_hit_rate_affine_ == pytest.approx(0.50)
    assert pr.predicted_hit_rate_affine_max_ == pytest.approx(0.58)
    assert pr.duplicated_cache_ratio_ == pytest.approx(0.25)
    assert dict(zip(pr.engines_["engine_id"], pr.engines_["hit_rate"], strict=True)) == {
        "a:1:0": pytest.approx(0.4),
        "b:1:0": pytest.approx(0.2),
    }
    assert pr.recommend_  # 800 stored blocks >= 200, L 0.20 >= 0.05, two engines


def test_ratios_are_clamped_in_order() -> None:
    # Duplicates claimed beyond every token computed, and reseen below dup (inconsistent
    # counts): L stops at 1 - H, the eviction loss at 0, and A <= 1.
    configs, w, ev = _pool(
        {
            "a:1:0": {"q": 160, "x": 80, "dup": 50, "reseen": 10},
            "b:1:0": {"q": 160, "x": 80, "dup": 50, "reseen": 10},
        }
    )
    pr = PrefixRouting().fit(configs, w, pd.DataFrame(), ev)
    assert pr.hit_rate_ == pytest.approx(0.5)
    assert pr.routing_loss_ == pytest.approx(0.5)
    assert pr.eviction_loss_ == 0.0
    assert pr.events_hit_rate_ <= pr.captured_ <= pr.available_ <= 1.0
    assert pr.available_ == pytest.approx(1.0)


def test_events_starting_late_compare_with_the_same_span() -> None:
    # Events only for the last 5 of 10 seconds: L is over those 5 seconds' queries.
    configs, w, ev = _pool(
        {
            "a:1:0": {"q": 1000, "x": 0, "dup": 10, "reseen": 10},
            "b:1:0": {"q": 1000, "x": 0, "dup": 10, "reseen": 10},
        },
        events_from=5,
    )
    pr = PrefixRouting().fit(configs, w, pd.DataFrame(), ev)
    assert pr.events_queries_ == 10_000
    assert pr.routing_loss_ == pytest.approx(2 * 5 * 10 * 16 / 10_000)


def test_confidence_falls_with_orphans_missed_batches_and_few_blocks() -> None:
    engines = {
        "a:1:0": {"q": 1000, "x": 0, "dup": 10, "reseen": 10, "stored": 600},
        "b:1:0": {"q": 1000, "x": 0, "dup": 10, "reseen": 10, "stored": 600},
    }
    configs, w, ev = _pool(engines)
    clean = PrefixRouting(full_confidence_blocks=1000).fit(configs, w, pd.DataFrame(), ev)
    assert clean.confidence_ == pytest.approx(0.5)  # no requests: no TTFT fit halves it
    _, _, ev_orphans = _pool(engines, orphan_blocks=300)
    half = PrefixRouting(full_confidence_blocks=1000).fit(configs, w, pd.DataFrame(), ev_orphans)
    assert half.orphan_share_ == pytest.approx(0.5)
    assert half.confidence_ == pytest.approx(clean.confidence_ * 0.5)
    _, _, ev_missed = _pool(engines, missed_batches=1, n_batches=3)
    missed = PrefixRouting(full_confidence_blocks=1000).fit(configs, w, pd.DataFrame(), ev_missed)
    assert missed.missed_share_ == pytest.approx(0.25)
    assert missed.confidence_ == pytest.approx(clean.confidence_ * 0.75)
    few = PrefixRouting(full_confidence_blocks=100_000).fit(configs, w, pd.DataFrame(), ev)
    assert few.confidence_ < clean.confidence_
    assert (
        not PrefixRouting(min_stored_blocks=20_000).fit(configs, w, pd.DataFrame(), ev).recommend_
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pool_recovers_truth_and_predicts_the_ttft_gain(seed: int) -> None:
    s = make_prefix_pool(seed=seed)
    pr = PrefixRouting().fit(s.engines.to_dict("records"), s.windows, s.requests, s.kv_events)
    t = s.truth
    for attr, key in (
        ("hit_rate_", "hit_rate"),
        ("routing_loss_", "routing_loss"),
        ("eviction_loss_", "eviction_loss"),
        ("captured_", "captured"),
        ("available_", "available"),
        ("predicted_hit_rate_affine_", "predicted_hit_rate_affine"),
    ):
        assert getattr(pr, attr) == pytest.approx(t[key], abs=1e-9), attr
    slope = pr.prefill_.slope_s_per_token_
    assert slope == pytest.approx(t["prefill_s_per_token"], rel=0.05)
    saved = t["routing_loss"] * t["prefix_queries"] / t["n_requests"]
    assert pr.tokens_saved_per_request_ == pytest.approx(saved)
    assert pr.ttft_change_s_ == pytest.approx(-slope * saved)
    rec = pr.recommendation("px")
    assert rec is not None and rec.kind == "prefix_aware_routing"
    assert rec.change["router_policy"] == "prefix-aware"
    assert rec.expected_effect["predicted_hit_rate"] == pytest.approx(
        t["predicted_hit_rate_affine"]
    )
    assert "30% -> 50%" in rec.summary and "mean TTFT -" in rec.summary
    assert rec.expected_gain == pytest.approx(-pr.ttft_change_s_ / pr.mean_ttft_s_events_)
    assert 0 < rec.expected_gain < 0.2 and rec.confidence > 0.9


def test_small_routing_loss_is_reported_not_recommended() -> None:
    s = make_prefix_pool(dup_ratios=(0.01, 0.01))
    rep = analyze(FrameSource(s.engines, s.windows, s.requests, s.kv_events))
    assert not [r for r in rep.recommendations if r.kind == "prefix_aware_routing"]
    (f,) = rep.findings_of("prefix_routing")
    assert f.severity == "info" and f.evidence["routing_loss"] == pytest.approx(0.01, abs=2e-3)


def test_without_events_the_finding_names_the_flag_and_the_spread() -> None:
    s = make_prefix_pool(with_events=False)
    rep = analyze(FrameSource(s.engines, s.windows, s.requests))
    assert not [r for r in rep.recommendations if r.kind == "prefix_aware_routing"]
    assert not rep.findings_of("prefix_routing")
    (f,) = rep.findings_of("kv_events_missing")
    assert KV_EVENTS_FLAG in f.summary and f.evidence["vllm_flag"] == KV_EVENTS_FLAG
    assert KV_EVENTS_FLAG == (
        '--kv-events-config \'{"enable_kv_cache_events":true,'
        '"publisher":"zmq","endpoint":"tcp://*:5557"}\''
    )
    assert "px0:8000:0 40%, px1:8000:0 20%" in f.summary
    assert "differ by 20%" in f.summary and f.severity == "warning"
    (pool,) = rep.pools
    assert pool.prefix_hit_rate == pytest.approx(s.truth["hit_rate"])
    assert pool.predicted_prefix_hit_rate_affine is None and pool.prefix_routing_loss is None
    even = make_prefix_pool(hit_rates=(0.3, 0.3), with_events=False)
    (g,) = analyze(FrameSource(even.engines, even.windows, even.requests)).findings_of(
        "kv_events_missing"
    )
    assert "differ" not in g.summary and g.severity == "info"


def test_single_engine_pool_gets_no_routing_recommendation() -> None:
    s = make_prefix_pool(hit_rates=(0.4,), dup_ratios=(0.2,), evict_ratios=(0.05,), loads=(4.0,))
    rep = analyze(FrameSource(s.engines, s.windows, s.requests, s.kv_events))
    assert not [
        r for r in rep.recommendations if r.kind in ("prefix_aware_routing", "least_loaded_routing")
    ]
    assert not rep.findings_of("kv_events_missing") and not rep.findings_of("load_imbalance")
    (f,) = rep.findings_of("prefix_routing")
    assert f.evidence["predicted_hit_rate_affine"] is None
    (pool,) = rep.pools
    assert pool.predicted_prefix_hit_rate_affine is None and pool.load_imbalance is None
    assert pool.prefix_hit_rate == pytest.approx(s.truth["hit_rate"])


def test_prefix_caching_off_is_a_finding_with_the_flag() -> None:
    s = make_prefix_pool(with_events=False)
    engines = s.engines.assign(enable_prefix_caching=[True, False])
    rep = analyze(FrameSource(engines, s.windows, s.requests))
    (f,) = rep.findings_of("prefix_caching_off")
    assert f.scope.engine_id == "px1:8000:0" and f.scope.pool == "px"
    assert PREFIX_CACHING_FLAG in f.summary and f.evidence["vllm_flag"] == "--enable-prefix-caching"
    # One engine with caching on left: duplication across replicas is not the question.
    assert not rep.findings_of("kv_events_missing")


def test_analyze_end_to_end_json_carries_the_new_fields() -> None:
    s = make_prefix_pool(seed=3)
    rep = analyze(FrameSource(s.engines, s.windows, s.requests, s.kv_events))
    d = json.loads(rep.to_json())
    assert d["schema_version"] == 1
    (pool,) = d["pools"]
    assert pool["prefix_hit_rate"] == pytest.approx(s.truth["hit_rate"])
    assert pool["prefix_routing_loss"] == pytest.approx(s.truth["routing_loss"])
    assert pool["predicted_prefix_hit_rate_affine"] == pytest.approx(
        s.truth["predicted_hit_rate_affine"]
    )
    assert pool["load_imbalance"] == pytest.approx(s.truth["imbalance"], rel=0.05)
    rates = {e["engine_id"]: e["prefix_hit_rate"] for e in d["engines"]}
    assert rates == {
        "px0:8000:0": pytest.approx(0.4, abs=1e-3),
        "px1:8000:0": pytest.approx(0.2, abs=1e-3),
    }
    kinds = {f["kind"] for f in d["findings"]}
    assert {"prefix_cache", "prefix_routing", "load_imbalance"} <= kinds
    routing = next(f for f in d["findings"] if f["kind"] == "prefix_routing")
    assert routing["scope"] == {"engine_id": None, "pool": "px"}
    assert set(routing["frame"]["engine_id"]) == {"px0:8000:0", "px1:8000:0"}
    rec = next(r for r in d["recommendations"] if r["kind"] == "prefix_aware_routing")
    assert rec["change"]["router_policy"] == "prefix-aware"
    assert rec["expected_effect"]["mean_ttft_change_s"] < 0
    assert d["parameters"]["min_routing_loss"] == 0.05
    assert Report.from_json(rep.to_json()).to_dict() == d


def test_a_source_without_kv_events_still_analyses() -> None:
    s = make_prefix_pool(with_events=False)

    class OldSource:
        def engines(self) -> pd.DataFrame:
            return s.engines

        def windows(self, since=None, until=None, engine=None, pool=None) -> pd.DataFrame:
            return s.windows

        def requests(self, since=None, until=None, engine=None, pool=None) -> pd.DataFrame:
            return s.requests

    rep = analyze(OldSource())  # type: ignore[arg-type]
    assert rep.findings_of("kv_events_missing")

"""Detectors on seeded synthetic engines whose true answers are known."""

from __future__ import annotations

import pytest

from kvscope.advisor import FrameSource, ThroughputCurve, analyze
from kvscope.advisor.cap import ConcurrencyCap
from kvscope.advisor.datasets import REGIMES, _steady, make_engine
from kvscope.advisor.findings import Scope
from kvscope.advisor.frames import prepare_windows
from kvscope.advisor.latency import LatencyVsLoad

SEEDS = (0, 1, 2)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_bottleneck_matches_truth(regime: str, seed: int) -> None:
    s = make_engine(regime, seed=seed)
    v = analyze(FrameSource(s.engines, s.windows, s.requests)).engines[0]
    assert v.bottleneck == s.truth["bottleneck"]
    assert v.saturated == s.truth["saturated"]
    assert v.preemption_thrash == s.truth["thrash"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("regime", sorted(set(REGIMES) - {"preemption_thrash"}))
def test_knee_and_plateau_near_truth(regime: str, seed: int) -> None:
    s = make_engine(regime, seed=seed)
    c = ThroughputCurve().fit(s.windows)
    # Levels are a factor of 2 apart: the knee is interpolated between them.
    assert c.knee_load_ == pytest.approx(s.truth["knee"], rel=0.35)
    assert c.plateau_tokens_per_s_ == pytest.approx(s.truth["plateau_tokens_per_s"], rel=0.08)


def test_prefill_bound_queue_at_low_kv_is_not_called_kv_bound() -> None:
    s = make_engine("token_budget_bound", seed=3)
    rep = analyze(FrameSource(s.engines, s.windows, s.requests))
    ev = rep.findings_of("bottleneck")[0].evidence
    assert ev["kv_usage_median"] < 0.5 and ev["waiting_median"] > 1
    assert rep.engines[0].bottleneck == "token_budget_bound"


@pytest.mark.parametrize("seed", SEEDS)
def test_preempting_below_the_cap_is_kv_bound_whatever_the_sampled_usage(seed: int) -> None:
    """A gauge sampled once per scrape can read the cache below "full" while the engine
    preempts between samples: with a queue, the batch below the cap and preemptions
    running, the verdict stays KV-bound. Without the preemptions the evidence contradicts
    itself (requests wait while the cache reads as having room for them, and the steps
    do not say compute): the verdict is ``unexplained``, never a guess."""
    s = make_engine("kv_cache_bound", seed=seed)
    w = s.windows.copy()
    w["kv_usage_mean"] = w["kv_usage_mean"].clip(upper=0.85)  # as a low-reading gauge
    w["kv_usage_max"] = w["kv_usage_mean"]
    rep = analyze(FrameSource(s.engines, w, s.requests))
    ev = rep.findings_of("bottleneck")[0].evidence
    assert ev["kv_usage_median"] < 0.9 and ev["preemptions_per_s"] >= 1.0, ev
    assert ev["waiting_median"] > 0 and ev["batch_median"] < 0.9 * ev["max_num_seqs"], ev
    assert rep.engines[0].bottleneck == "kv_cache_bound"
    found = rep.findings_of("bottleneck")[0]
    assert found.confidence > 0.5 and found.evidence["kv_full_from_preemptions"] is True
    assert "full between the sampled usage readings" in found.summary
    calm = analyze(FrameSource(s.engines, w.assign(preemptions=0.0), s.requests))
    assert calm.engines[0].bottleneck == "unexplained"
    found = calm.findings_of("bottleneck")[0]
    assert "requests wait while the KV cache" in found.summary
    assert found.evidence["free_blocks_median"] > found.evidence["admission_need_blocks"]


def test_kv_model_predicts_the_kv_bound_plateau() -> None:
    s = make_engine("kv_cache_bound", seed=4)
    kv = analyze(FrameSource(s.engines, s.windows, s.requests)).findings_of("kv_capacity")[0]
    # The batch the simulated scheduler held at the top load, measured, not derived.
    assert kv.evidence["kv_batch"] == pytest.approx(s.truth["kv_batch"], rel=0.05)
    assert abs(kv.evidence["prediction_error_ratio"]) < 0.15
    assert kv.evidence["footprint_from"] == "plateau" and kv.evidence["kv_fill"] < 1


def test_the_fp8_what_if_predicts_the_batch_twice_the_blocks_hold() -> None:
    """The what-if's batch against the simulated scheduler run with twice the blocks at
    the same top load (its batch measured): within 10%."""
    s = make_engine("kv_cache_bound", seed=4)
    kv = analyze(FrameSource(s.engines, s.windows, s.requests)).findings_of("kv_capacity")[0]
    assert kv.frame is not None
    fp8 = kv.frame["kv_batch"][kv.frame["what_if"].index("kv_cache_dtype_fp8")]
    p = {**REGIMES["kv_cache_bound"]}
    p["num_gpu_blocks"] *= 2
    held = _steady(p, 32)["batch"]
    assert fp8 == pytest.approx(held, rel=0.1), (fp8, held)


def test_cap_keeps_the_fraction_and_cuts_the_tail() -> None:
    """KV-bound: the 90% crossing (11.4 in flight) lies above the sequences the cache holds
    through their lives (requests of 40-60 + 120-136 tokens in 48 blocks of 32), so the cap
    is that."""
    s = make_engine("kv_cache_bound", seed=5)
    rep = analyze(FrameSource(s.engines, s.windows, s.requests))
    v = rep.engines[0]
    assert v.recommended_concurrency_cap is not None
    assert v.predicted_throughput_fraction_at_cap is not None
    rec = next(r for r in rep.recommendations if r.kind == "concurrency_cap")
    cap = v.recommended_concurrency_cap
    kv = rep.findings_of("kv_capacity")[0].evidence
    assert cap == kv["kv_sequences_held"] == rec.evidence["kv_sequences_held"]
    assert cap < rec.evidence["point_load"] < cap + 2, rec.evidence
    # The requests end at 5-7 blocks: a dozen at their ends would overflow the 48.
    assert 8 <= cap < 12
    assert 0.8 <= v.predicted_throughput_fraction_at_cap < 0.9
    assert "KV cache holds about" in rec.tradeoff, rec.tradeoff
    # Latency ~ load / throughput (Little's law): the cap at ~10 of 32 in flight.
    assert v.predicted_p99_e2e_s_at_cap < 0.8 * v.p99_e2e_s_at_max_load
    # vLLM runs at most the cap's sequences; the admission limit and the gateway take it.
    assert rec.change["vllm_flags"] == [
        f"--max-num-seqs {cap}",
        f"--max-num-queued-reqs {cap + -(-cap // 4)}",
    ]
    # A pool of one: the replica's cap is the pool's, per server and for the whole upstream.
    nginx = rec.change["gateway"]["nginx"]["config"]
    assert f"max_conns={cap};" in nginx and f"limit_conn vllm_synth_inflight {cap};" in nginx
    assert f"--max-concurrent-requests {cap}" in rec.change["gateway"]["vllm_router"]["config"]


def test_slo_lowers_the_cap() -> None:
    s = make_engine("kv_cache_bound", seed=6)
    src = FrameSource(s.engines, s.windows, s.requests)
    free = analyze(src).engines[0]
    assert free.recommended_concurrency_cap is not None
    slo = 0.6 * (free.predicted_p99_e2e_s_at_cap or 0)
    tight = analyze(src, slo_e2e_p99_s=slo).engines[0]
    assert tight.recommended_concurrency_cap is not None
    assert tight.recommended_concurrency_cap < free.recommended_concurrency_cap


def test_deterministic() -> None:
    s = make_engine("compute_bound", seed=7)
    src = FrameSource(s.engines, s.windows, s.requests)
    assert analyze(src).to_json() == analyze(src).to_json()


def test_the_flags_run_at_most_the_sequences_the_cache_holds_under_a_higher_cap() -> None:
    """A cap not bound by the cache (a caller that gives no sequences held, or an engine
    not KV-bound): vLLM's ``--max-num-seqs`` is still at most
    the cache's batch, and the admission limit and the gateway take the cap."""
    s = make_engine("kv_cache_bound", seed=5)
    cfg = s.engines.iloc[0].to_dict()
    curve = ThroughputCurve().fit(prepare_windows(s.windows))
    cap = ConcurrencyCap().fit(curve, LatencyVsLoad().fit(s.requests, curve))
    assert not cap.bounded_by_kv_
    c = cap.cap_
    rec = cap.recommendation(Scope(engine_id="synth:8000:0"), cfg, kv_fit_sequences=c - 1.5)
    assert rec.change["vllm_flags"] == [
        f"--max-num-seqs {c - 2}",
        f"--max-num-queued-reqs {c + -(-c // 4)}",
    ]
    nginx = rec.change["gateway"]["nginx"]["config"]
    assert f"max_conns={c};" in nginx

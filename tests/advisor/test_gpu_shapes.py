"""The bottleneck classes on GPU-shaped engines, near each threshold on both sides.

Each case is an engine described from first principles: its configuration, the requests
it serves, and what one step costs (a fixed part per step, a part per running sequence,
a part per prefill token computed: the cost of a forward pass on a GPU). From those the
test builds the 1-second windows and finished requests the collector would hold for a
closed-loop sweep, and argues the expected class from the engine itself (what the free
blocks hold, what the scheduler may admit, what a larger budget would buy), never from
the advisor's code. The scale is a GPU's: 30,000 blocks of 16 tokens, ``max_num_seqs``
256, budgets of 2,048-8,192 tokens, steps of 20-100 ms.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pytest

from kvscope.advisor import FrameSource, ThroughputCurve, analyze
from kvscope.advisor.bottleneck import BottleneckClassifier
from kvscope.advisor.steptime import StepTimeModel

T0 = 1_750_000_000
ENGINE = "gpu-0:8000:0"


@dataclass(frozen=True)
class Level:
    """One load level of a closed-loop sweep: the engine's state while it holds."""

    load: float
    """Requests in flight at the engine (running + waiting)."""
    batch: float
    kv_usage: float
    step_s: float
    computed_prompt_per_step: float = 0.0
    cached_prompt_per_step: float = 0.0
    preemptions_per_s: float = 0.0
    decoding: float | None = None
    """Sequences that decode a token each step (the rest of the batch is prefilling);
    the whole batch when None."""
    frontend_s: float = 0.0
    """Seconds each request spends outside the engine core (in the API server), added to
    its end-to-end latency and to none of vLLM's engine-side intervals."""


def gpu_config(**kw: Any) -> dict[str, Any]:
    cfg = {
        "engine_id": ENGINE,
        "pool": "gpu",
        "model": "llama-70b",
        "num_gpu_blocks": 30_000,
        "block_size": 16,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "max_model_len": 32768,
        "enable_prefix_caching": True,
        "kv_cache_dtype": "auto",
        "gpu_memory_utilization": 0.9,
        "tensor_parallel_size": 4,
    }
    cfg.update(kw)
    return cfg


def frames(
    levels: list[Level],
    config: dict[str, Any],
    *,
    prompt: int,
    gen: int,
    cached: int = 0,
    seconds: int = 12,
    seed: int = 0,
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Engines, windows and requests of a sweep through ``levels``: each running sequence
    decodes one token per step; requests of ``prompt`` tokens (``cached`` of them from the
    prefix cache) and ``gen`` output tokens finish at the rate tokens are generated."""
    rng = np.random.default_rng(seed)
    rows, reqs = [], []
    t = T0
    for lv in levels:
        for _ in range(seconds):
            jitter = 1 + rng.normal(0, 0.01)
            n_steps = max(1, round(jitter / lv.step_s))
            gen_tokens = round((lv.batch if lv.decoding is None else lv.decoding) * n_steps)
            prompt_tokens = round(
                (lv.computed_prompt_per_step + lv.cached_prompt_per_step) * n_steps
            )
            waiting = max(lv.load - lv.batch, 0.0)
            rows.append(
                {
                    "engine_id": ENGINE,
                    "ts_s": t,
                    "n_steps": n_steps,
                    "n_parts": 1,
                    "first_step_unix_s": t + 0.001,
                    "last_step_unix_s": t + 1.0 - lv.step_s,
                    "batch_sum": round(lv.batch * n_steps),
                    "batch_mean": lv.batch,
                    "batch_min": math.floor(lv.batch),
                    "batch_max": math.ceil(lv.batch),
                    "batch_p50": lv.batch,
                    "batch_p90": lv.batch,
                    "batch_p99": math.ceil(lv.batch),
                    "kv_usage_mean": lv.kv_usage,
                    "kv_usage_max": min(1.0, lv.kv_usage + 0.002),
                    "kv_blocks_max": math.ceil(lv.kv_usage * config["num_gpu_blocks"]),
                    "waiting_mean": waiting,
                    "waiting_max": math.ceil(waiting),
                    "deferred_mean": 0.0,
                    "deferred_max": 0,
                    "preemptions": int(rng.poisson(lv.preemptions_per_s)),
                    "prompt_tokens": prompt_tokens,
                    "generation_tokens": gen_tokens,
                    "prefix_queries": prompt_tokens,
                    "prefix_hits": round(lv.cached_prompt_per_step * n_steps),
                    "iteration_s_mean": lv.step_s,
                    "pool": config["pool"],
                    "model": config["model"],
                }
            )
            finished = gen_tokens / gen
            e2e = lv.load / max(finished, 1e-9)  # Little's law
            for _ in range(int(rng.poisson(finished))):
                reqs.append(
                    {
                        "engine_id": ENGINE,
                        "boot_id": "b",
                        "finished_unix_s": t + rng.random(),
                        "e2e_s": e2e + lv.frontend_s,
                        "queue_s": e2e * waiting / lv.load,
                        "prefill_s": lv.step_s,
                        "decode_s": gen * lv.step_s,
                        "ttft_s": e2e * waiting / lv.load + lv.step_s,
                        "prompt_tokens": prompt,
                        "generation_tokens": gen,
                        "cached_tokens": cached,
                        "preemptions": 0,
                        "finish_reason": "length",
                    }
                )
            t += 1
    return pd.DataFrame([config]), pd.DataFrame(rows), pd.DataFrame(reqs)


def verdict(levels: list[Level], config: dict[str, Any], **kw: Any) -> tuple[Any, dict[str, Any]]:
    engines, windows, requests = frames(levels, config, **kw)
    rep = analyze(FrameSource(engines, windows, requests))
    return rep.engines[0], rep.findings_of("bottleneck")[0].evidence


def decode_sweep(
    limit: float,
    *,
    kv_per_seq: float,
    kv_extra: float = 0.0,
    step: tuple[float, float] = (0.025, 0.0001),
    loads: tuple[float, ...] = (8, 16, 32, 64, 128, 256, 512),
    preemptions_at_limit: float = 0.0,
) -> list[Level]:
    """A decode-heavy sweep whose batch stops at ``limit``: the rest waits. A step costs
    ``step[0] + step[1] x batch`` seconds; KV usage is ``kv_extra + kv_per_seq x batch``."""
    out = []
    for load in loads:
        b = min(load, limit)
        out.append(
            Level(
                load=load,
                batch=b,
                kv_usage=min(1.0, kv_extra + kv_per_seq * b),
                step_s=step[0] + step[1] * b,
                preemptions_per_s=preemptions_at_limit if load > limit else 0.0,
            )
        )
    return out


# -- kv_cache_bound: the free blocks cannot hold the next waiting request ---------------------


def test_long_context_fills_the_cache_below_ninety_percent() -> None:
    """256 blocks of 16 tokens (4,096 tokens); prompts of 1,700 tokens, 100 generated.
    A request holds about 1,750 tokens (110 blocks): two run (220 blocks, 86%), the third
    needs 107 blocks to be admitted and 36 are free. The cache is full at 86%: a fixed
    "90% is full" rule would miss it."""
    cfg = gpu_config(num_gpu_blocks=256, max_num_batched_tokens=8192)
    levels = decode_sweep(2, kv_per_seq=110 / 256, loads=(1, 2, 4, 8, 16))
    v, ev = verdict(levels, cfg, prompt=1700, gen=100)
    assert ev["kv_usage_median"] < 0.9
    assert ev["admission_need_blocks"] == math.ceil(1701 / 16)  # 107
    assert ev["free_blocks_median"] < ev["admission_need_blocks"]
    assert v.bottleneck == "kv_cache_bound" and v.saturated, ev


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        # 30,000 blocks, 2,000-token prompts: a waiting request needs 126 blocks.
        (0.9975, "kv_cache_bound"),  # 75 free: it cannot be admitted
        (0.95, "unexplained"),  # 1,500 free: room for eleven more, yet requests wait
    ],
)
def test_large_cache_is_full_only_when_the_next_request_does_not_fit(
    usage: float, expected: str
) -> None:
    """The batch stops at 180 of 256 slots with a queue and the budget far from full.
    At 99.75% the free blocks (75) cannot hold a 2,000-token prompt (126 blocks): the
    cache limits. At 95% 1,500 blocks are free: vLLM would admit the waiting requests,
    so the cache is not what holds them, and nothing else in the evidence is: a fixed
    90% rule would have called this KV-bound."""
    cfg = gpu_config()
    levels = decode_sweep(180, kv_per_seq=usage / 180)
    v, ev = verdict(levels, cfg, prompt=2000, gen=300)
    assert ev["admission_need_blocks"] == math.ceil(2001 / 16)
    assert v.bottleneck == expected, ev
    if expected == "unexplained":
        assert ev["free_blocks_median"] > 10 * ev["admission_need_blocks"]
        assert v.approaching is None
        assert "requests wait while the KV cache" in ev["why"]


# -- preemptions, per finished request ------------------------------------------------------


@pytest.mark.parametrize(
    ("gen", "expected"),
    [
        # 180 sequences at ~30 ms steps: 6,000 tokens/s.
        (30, "unexplained"),  # 200 requests/s finish: 2 preemptions/s is 1 in 100
        (1500, "kv_cache_bound"),  # 4 requests/s finish: 2 preemptions/s is 1 in 2
    ],
)
def test_preemptions_count_per_finished_request_not_per_second(gen: int, expected: str) -> None:
    """The sampled KV usage reads 92% (a gauge between steps), and vLLM preempts twice a
    second with a queue and the batch below the cap. Whether that shows a full cache
    depends on the engine's size: one preemption in a hundred requests is a rare event on
    a large engine; one in two means the cache runs out all the time."""
    cfg = gpu_config()
    levels = decode_sweep(180, kv_per_seq=0.92 / 180, preemptions_at_limit=2.0)
    v, ev = verdict(levels, cfg, prompt=200, gen=gen)
    assert ev["kv_usage_median"] < ev["kv_full_threshold"]
    assert v.bottleneck == expected, ev
    if expected == "kv_cache_bound":
        assert ev["kv_full_from_preemptions"] and ev["preemptions_per_request"] > 0.3
    else:
        assert ev["preemptions_per_request"] < 0.02


def test_preemptions_with_a_queue_past_the_knee_count_though_most_seconds_have_none() -> None:
    """Load rises through many levels just below the batch's limit (150-180 in flight:
    nobody waits yet) and two past it (256, 512: a queue, two preemptions a second, one
    per two finished requests). The seconds past the knee are mostly queue-free, so their
    median queue is zero; but the preemptions came with a queue, and vLLM preempts only
    when a running request finds no free block: the cache is full (the sampled gauge
    reads 92%). Seen on vLLM's own series from VictoriaMetrics: the median queue over the
    seconds past the knee was 0 and the verdict was ``compute_bound``."""
    cfg = gpu_config()
    levels = decode_sweep(
        180,
        kv_per_seq=0.92 / 180,
        loads=(8, 16, 32, 64, 128, 150, 160, 170, 180, 256, 512),
        preemptions_at_limit=2.0,
    )
    v, ev = verdict(levels, cfg, prompt=200, gen=1500)
    assert ev["waiting_median"] == 0 and ev["kv_usage_median"] < ev["kv_full_threshold"], ev
    assert ev["preemptions_per_request"] >= 0.05, ev
    assert v.bottleneck == "kv_cache_bound" and ev["kv_full_from_preemptions"], ev


# -- max_num_seqs_bound, and cached prompt tokens that use no budget --------------------------


def test_prefix_heavy_engine_pinned_at_the_cap_is_not_blamed_on_the_budget() -> None:
    """``max_num_seqs`` 64, budget 2,048. Prompts of 8,000 tokens, 7,900 of them from the
    prefix cache, 100 generated. At the cap, 0.64 requests start per step: 5,120 prompt
    tokens per step, but only 64 are computed, plus 64 decode tokens: 128 of the 2,048
    budget. Counting cached tokens would call the steps full and ask for a larger budget;
    the batch is pinned at the cap."""
    cfg = gpu_config(max_num_seqs=64, max_num_batched_tokens=2048)
    levels = []
    for load in (8, 16, 32, 64, 128, 256):
        b = min(load, 64)
        starts = b / 100  # requests admitted per step = finishing per step
        levels.append(
            Level(
                load=load,
                batch=b,
                kv_usage=0.05 + 0.002 * b,
                step_s=0.02 + 0.0002 * b,
                computed_prompt_per_step=starts * 100,
                cached_prompt_per_step=starts * 7900,
            )
        )
    v, ev = verdict(levels, cfg, prompt=8000, gen=100, cached=7900)
    assert ev["tokens_per_step_median"] > 0.7 * 2048  # with the cached tokens: "full"
    assert ev["computed_tokens_per_step_median"] < 0.1 * 2048
    assert v.bottleneck == "max_num_seqs_bound", ev


# -- token_budget_bound only where a larger budget pays ---------------------------------------


def _profiled_steps(fixed: float, per_seq: float, per_token: float) -> StepTimeModel:
    """A step-time model fitted on windows of varied composition whose steps cost what
    the engine's do (as profiling would measure them)."""
    rng = np.random.default_rng(1)
    rows = []
    for i in range(40):
        batch = float(rng.uniform(4, 64))
        prefill = float(rng.uniform(0, 4000))
        step = fixed + per_seq * batch + per_token * prefill
        n = 1.0 / step
        rows.append(
            {
                "engine_id": ENGINE,
                "ts_s": T0 + i,
                "n_steps": n,
                "batch_mean": batch,
                "batch_sum": batch * n,
                "prompt_tokens": prefill * n,
                "prefix_hits": 0,
                "generation_tokens": batch * n,
                "preemptions": 0,
                "first_step_unix_s": T0 + i,
                "last_step_unix_s": T0 + i + 1 - step,
                "waiting_mean": 0.0,
                "deferred_mean": 0.0,
                "kv_usage_mean": 0.1,
                "kv_usage_max": 0.1,
            }
        )
    return StepTimeModel().fit(pd.DataFrame(rows))


def _budget_sweep(fixed: float, per_seq: float, per_token: float) -> list[Level]:
    """Budget 2,048, prompts of 4,000 tokens, 50 generated. Once the budget binds, each
    step carries P prefill tokens and B decode tokens with P + B = 2,048 and, in steady
    state, B = 50 x P / 4,000 (requests finish as fast as they start): P = 2,023, B = 25."""
    out = []
    for load in (8, 16, 32, 64, 128, 256):
        p = min(2023.0, 2023.0 * load / 32)
        b = p * 50 / 4000
        out.append(
            Level(
                load=max(load, b),
                batch=b,
                kv_usage=0.02 + 0.0002 * load,
                step_s=fixed + per_seq * b + per_token * p,
                computed_prompt_per_step=p,
            )
        )
    return out


def _classify(levels: list[Level], cfg: dict[str, Any], steps: StepTimeModel, **kw: Any) -> Any:
    _, windows, requests = frames(levels, cfg, **kw)
    w = windows.assign(**{"engine_id": ENGINE})
    curve = ThroughputCurve().fit(w)
    return BottleneckClassifier().fit(curve, cfg, requests, steps)


@pytest.mark.parametrize(
    ("physics", "expected"),
    [
        # 25 ms per step whatever it holds: doubling the budget carries twice the prefill
        # and decode work for 5 ms more (30 -> 36 ms): +70% prefill rate.
        ((0.025, 0.00005, 0.000002), "token_budget_bound"),
        # Prefill-bound (a CPU, or a GPU on long prompts): 0.05 ms per prefill token, the
        # step grows in proportion to the tokens in it: doubling gains ~1%.
        ((0.001, 0.00005, 0.00005), "compute_bound"),
    ],
)
def test_full_steps_are_the_budget_only_when_bigger_steps_pay(
    physics: tuple[float, float, float], expected: str
) -> None:
    cfg = gpu_config(max_num_batched_tokens=2048)
    fixed, per_seq, per_token = physics
    steps = _profiled_steps(fixed, per_seq, per_token)
    bn = _classify(_budget_sweep(*physics), cfg, steps, prompt=4000, gen=50)
    ev = bn.evidence_
    assert ev["budget_fill_median"] >= 0.7, ev
    # The gain the engine's own physics gives for twice the budget: requests start as fast
    # as their prompts are prefilled, so twice the prefill per step (P 2,023 -> 4,046)
    # brings twice the decoding sequences (B 25.3 -> 50.6) into each step.
    t1 = fixed + per_seq * 25.3 + per_token * 2023
    t2 = fixed + per_seq * 50.6 + per_token * 4046
    truth = 2 * t1 / t2 - 1
    assert ev["budget_doubling_gain_ratio"] == pytest.approx(truth, abs=0.05)
    assert bn.label_ == expected, ev
    assert ev["prefill_bound"] == (expected == "compute_bound")


def test_budget_advice_carries_the_predicted_gain() -> None:
    cfg = gpu_config(max_num_batched_tokens=2048)
    physics = (0.025, 0.00005, 0.000002)
    engines, windows, requests = frames(_budget_sweep(*physics), cfg, prompt=4000, gen=50)
    rep = analyze(FrameSource(engines, windows, requests))
    ev = rep.findings_of("bottleneck")[0].evidence
    if rep.engines[0].bottleneck != "token_budget_bound":
        pytest.fail(f"the sweep's own step fit did not show the budget: {ev}")
    rec = next(r for r in rep.recommendations if r.kind == "raise_max_num_batched_tokens")
    assert rec.expected_gain == pytest.approx(ev["budget_doubling_gain_ratio"])
    assert rec.expected_gain > 0.3
    assert "--max-num-batched-tokens 4096" in rec.change["vllm_flags"]


# -- compute_bound from step time, unexplained from contradictions ----------------------------


def test_compute_bound_needs_steps_that_slow_with_the_batch() -> None:
    """Ample KV and slots (up to 128 of 256 sequences), no queue: the batch follows the
    load; each step costs 20 ms + 0.3 ms per sequence, so steps/s fall from 47 to 17 while
    throughput grows ever slower (1,230 -> 1,630 -> 2,190 tokens/s over the last two
    doublings)."""
    cfg = gpu_config()
    levels = [
        Level(load=L, batch=L, kv_usage=0.0005 * L, step_s=0.02 + 0.0003 * L)
        for L in (4, 8, 16, 32, 64, 128)
    ]
    v, ev = verdict(levels, cfg, prompt=100, gen=200)
    assert ev["waiting_median"] < 1 and ev["step_slowdown_ratio"] > 1.0
    assert v.bottleneck in ("compute_bound", "not_saturated"), ev
    assert (v.bottleneck if v.saturated else v.approaching) == "compute_bound"


def test_a_queue_with_every_limit_at_room_is_unexplained_not_compute() -> None:
    """Requests wait (20 in the queue) while the KV cache is 30% used, 50 of 256 slots run
    and steps carry a tenth of the budget: vLLM's scheduler would admit them. Something
    outside the engine's limits holds them (a front end that cannot hand requests over
    fast enough looks like this). Steps also slow with the batch here; that does not make
    it compute-bound."""
    cfg = gpu_config()
    levels = decode_sweep(50, kv_per_seq=0.3 / 50, step=(0.02, 0.0008))
    v, ev = verdict(levels, cfg, prompt=300, gen=300)
    assert ev["waiting_median"] > 10 and ev["kv_usage_median"] < 0.4
    assert v.bottleneck == "unexplained", ev
    assert "front end" in rep_summary(levels, cfg)


def front_end_sweep(step_s: Callable[[float], float], frontend_s: float) -> list[Level]:
    """2 to 32 in flight with room everywhere (KV 0.3% a sequence, no queue), steps of
    ``step_s(load)``; from 16 in flight on each request spends ``frontend_s`` in the API
    server (0.05 s below)."""
    return [
        Level(
            load=L,
            batch=L,
            kv_usage=0.003 * L,
            step_s=step_s(L),
            frontend_s=frontend_s if L >= 16 else 0.05,
        )
        for L in (2, 4, 8, 16, 24, 32)
    ]


@pytest.mark.parametrize(("frontend_s", "expected"), ((4.0, "frontend_bound"), (2.0, None)))
def test_the_front_end_is_named_when_requests_spend_their_life_outside_the_engine(
    frontend_s: float, expected: str | None
) -> None:
    """A GPU engine with room everywhere (KV 10%, 32 of 256 slots, no queue, steps of
    ~28 ms carrying a few hundred of 8,192 tokens) whose load stops at 32 in flight. Each
    request spends 300 x 28 ms = 8.4 s in the engine core. With 4 s more in the API server
    (a third of its life) the front end is what the clients wait for; with 2 s (a fifth)
    it is a slow front end, not the limit, and nothing else shows either."""
    cfg = gpu_config()
    levels = front_end_sweep(lambda L: 0.025 + 0.0001 * L, frontend_s)
    v, ev = verdict(levels, cfg, prompt=300, gen=300)
    assert ev["waiting_median"] < 1 and ev["kv_usage_median"] < 0.2
    share = frontend_s / (frontend_s + 300 * 0.028)
    assert ev["frontend_share_median"] == pytest.approx(share, abs=0.03)
    if expected:
        assert v.bottleneck == "frontend_bound", ev
        assert v.recommended_concurrency_cap is None and v.knee_concurrency is None
        engines, windows, requests = frames(levels, cfg, prompt=300, gen=300)
        rep = analyze(FrameSource(engines, windows, requests))
        assert "outside the engine core" in rep.findings_of("bottleneck")[0].summary
        assert [r.kind for r in rep.recommendations] == ["scale_api_server"]
    else:
        assert v.bottleneck != "frontend_bound" and v.approaching != "frontend_bound", ev


def test_a_front_end_that_flattens_the_curve_gives_no_knee_or_cap() -> None:
    """The same engine, but from 8 in flight on its throughput stops growing (each step
    lengthens with the batch, as when the API server, sharing the engine's host, takes its
    cycles): the curve saturates at the engine while requests spend a third of their life
    in the API server. The engine's in-flight count is what the front end hands it, not
    what the clients send; a cap read from it would cap the wrong thing, and vLLM's own
    answer is more API server processes."""
    cfg = gpu_config()
    levels = front_end_sweep(lambda L: 0.025 * max(1.0, L / 8), 12.0)
    engines, windows, requests = frames(levels, cfg, prompt=300, gen=300)
    rep = analyze(FrameSource(engines, windows, requests))
    v = rep.engines[0]
    assert v.bottleneck == "frontend_bound" and v.saturated
    assert v.knee_concurrency is None and v.recommended_concurrency_cap is None
    assert "no knee or cap" in v.headroom
    assert [r.kind for r in rep.recommendations] == ["scale_api_server"]


def rep_summary(levels: list[Level], cfg: dict[str, Any]) -> str:
    engines, windows, requests = frames(levels, cfg, prompt=300, gen=300)
    return analyze(FrameSource(engines, windows, requests)).findings_of("bottleneck")[0].summary


def test_without_requests_the_fixed_share_is_used_and_said() -> None:
    cfg = gpu_config()
    levels = decode_sweep(180, kv_per_seq=0.97 / 180)
    engines, windows, _ = frames(levels, cfg, prompt=2000, gen=300)
    rep = analyze(FrameSource(engines, windows, pd.DataFrame()))
    ev = rep.findings_of("bottleneck")[0].evidence
    assert ev["kv_full_from"] == "fallback_share" and ev["kv_full_threshold"] == 0.9
    assert rep.engines[0].bottleneck == "kv_cache_bound"
    assert "a fixed share" in rep.findings_of("bottleneck")[0].summary


def test_every_threshold_is_in_the_reports_parameters() -> None:
    cfg = gpu_config()
    engines, windows, requests = frames(
        decode_sweep(180, kv_per_seq=0.99 / 180), cfg, prompt=2000, gen=300
    )
    rep = analyze(FrameSource(engines, windows, requests))
    params = rep.to_dict()["parameters"]
    assert params["kvscope_version"]
    assert params["bottleneck"] == BottleneckClassifier().parameters()
    assert set(params["bottleneck"]) >= {"seq_cap_ratio", "budget_fill", "min_budget_gain"}


# -- passive mode: a mix shift is not a knee ---------------------------------------------------


def test_a_request_mix_shift_at_the_peak_is_not_a_knee() -> None:
    """Production traffic: in-flight requests rise from 8 to 256 over the day, and at the
    peak the prompts get long, so a growing share of the batch is prefilling (chunks of
    long prompts) rather than decoding: generated tokens/s flatten above 32 in flight.
    Nothing at the engine limits: no queue, no preemptions, the cache at most a third used,
    every step 30 ms. The curve bends, but the engine is not saturated: no knee, no cap."""
    cfg = gpu_config()
    levels = [
        Level(
            load=L,
            batch=L,
            kv_usage=0.001 * L,
            step_s=0.03,
            decoding=min(L, 32 + 0.02 * (L - 32)),
            computed_prompt_per_step=20.0 * L,
        )
        for L in (8, 16, 32, 64, 128, 256)
    ]
    engines, windows, requests = frames(levels, cfg, prompt=3000, gen=300)
    rep = analyze(FrameSource(engines, windows, requests))
    v = rep.engines[0]
    curve = rep.findings_of("throughput_curve")[0].evidence
    assert curve["growth_last_doubling_ratio"] < 0.1  # the curve is flat...
    assert curve["flat_without_evidence"] and not curve["limit_evidence"]
    assert not v.saturated and v.bottleneck == "not_saturated"  # ...but nothing limits
    assert v.knee_concurrency is None and v.recommended_concurrency_cap is None
    assert not any(r.kind == "concurrency_cap" for r in rep.recommendations)
    assert "a change in the request mix" in v.headroom
    pool = rep.pools[0]
    assert pool.plateau_tokens_per_s is None and pool.engines_not_saturated == [ENGINE]


def test_a_mix_shift_that_slows_the_steps_is_not_a_knee_while_the_work_grows() -> None:
    """The same day, but the long prompts' prefill chunks cost step time: each step takes
    30 ms plus 1 ms per 1,000 prompt tokens computed in it, so steps at the peak are
    slower (30 ms -> 60 ms at 256 in flight), and generated tokens/s flatten and fall.
    Still no queue, no preemptions, the cache a third used; and per second the engine
    computes more tokens at every higher load (prompt + generated: about 5,600 at 16 in
    flight, 85,000 at 256). It did more work when asked: not saturated, no knee, no cap."""
    cfg = gpu_config()
    levels = []
    for L in (8, 16, 32, 64, 128, 256):
        prompt_per_step = 120.0 * L
        levels.append(
            Level(
                load=L,
                batch=L,
                kv_usage=0.001 * L,
                step_s=0.03 + prompt_per_step / 1e6,
                decoding=min(L, 32 + 0.02 * (L - 32)),
                computed_prompt_per_step=prompt_per_step,
            )
        )
    steps = [lv.step_s for lv in levels]
    assert steps[-1] / steps[0] - 1 >= 0.25  # the steps slowed by more than a quarter
    work = [(lv.computed_prompt_per_step + (lv.decoding or lv.batch)) / lv.step_s for lv in levels]
    assert all(b > a for a, b in itertools.pairwise(work))  # the work kept growing
    engines, windows, requests = frames(levels, cfg, prompt=3000, gen=300)
    rep = analyze(FrameSource(engines, windows, requests))
    v = rep.engines[0]
    curve = rep.findings_of("throughput_curve")[0].evidence
    assert curve["step_slowdown_ratio"] >= 0.25 and not curve["work_past_knee"]
    assert not v.saturated and v.bottleneck == "not_saturated", v
    assert v.knee_concurrency is None and v.recommended_concurrency_cap is None
    assert "the work done" in v.headroom


def test_the_same_slow_steps_with_the_work_flat_are_a_limit() -> None:
    """The control: the same slowing steps, but no mix shift; every step does the same
    work per sequence and step time grows with the batch (30 ms + 0.5 ms per sequence),
    so tokens computed per second stop growing past ~64 in flight: the engine is at its
    compute limit there (saturated), not merely serving longer prompts."""
    cfg = gpu_config()
    levels = [
        Level(
            load=L,
            batch=L,
            kv_usage=0.001 * L,
            step_s=0.03 + 0.0005 * L,
            computed_prompt_per_step=10.0 * L,
        )
        for L in (8, 16, 32, 64, 128, 256)
    ]
    engines, windows, requests = frames(levels, cfg, prompt=1000, gen=100)
    rep = analyze(FrameSource(engines, windows, requests))
    v = rep.engines[0]
    curve = rep.findings_of("throughput_curve")[0].evidence
    assert curve["work_past_knee"] and curve["limit_evidence"]
    assert v.saturated and v.knee_concurrency is not None


# -- the cap where the cache holds a few long requests ---------------------------------------


def test_the_cap_admits_no_more_than_the_cache_holds() -> None:
    """340 blocks of 16 tokens (5,440 tokens); prompts of 1,700 tokens and 64 generated:
    a request holds up to 111 blocks, three hold 333 and the fourth waits for blocks (7
    free). The levels past three ran on a faster host (steps 20% shorter, as on the real
    long-context engine: 2.9 running gave 103 tok/s at 3 clients, 125 at 4), so the
    throughput still "grows" where only the queue did; the cap must not follow it: a
    fourth request in flight only waits behind the three, for about a third of a request's
    life. The first level with a queue lies at 4 in flight; the cap is the 3 the cache
    holds."""
    cfg = gpu_config(num_gpu_blocks=340)
    levels = [
        Level(
            load=load,
            batch=min(load, 3),
            kv_usage=111 * min(load, 3) / 340,
            step_s=(0.030 if load <= 3 else 0.024) + 0.002 * min(load, 3),
        )
        for load in (1, 2, 3, 4, 6, 8)
    ]
    rep = analyze(FrameSource(*frames(levels, cfg, prompt=1700, gen=64)))
    v, ev = rep.engines[0], rep.findings_of("bottleneck")[0].evidence
    assert v.bottleneck == "kv_cache_bound" and v.saturated, ev
    assert v.recommended_concurrency_cap == 3, v
    (rec,) = [r for r in rep.recommendations if r.kind == "concurrency_cap"]
    assert "the engine ran 3.0 requests while others waited" in rec.tradeoff
    # The engine runs the same three there as under overload.
    assert v.predicted_throughput_fraction_at_cap is not None
    assert v.predicted_throughput_fraction_at_cap >= 0.9

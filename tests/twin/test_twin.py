"""The engine twin: vLLM's own scheduler on a simulated clock.

Every expected value here comes from vLLM's rules and arithmetic on the configuration
(blocks per request, chunks per prompt, the step costs given), not from the twin's code:
the scheduler decides, the test checks the decision against what vLLM's rules imply.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvscope.twin.shape import EngineShape, TwinConfigError, blocks_for, model_shape
from kvscope.twin.sim import Twin
from kvscope.twin.steptime import GPUS, LinearStepCost, RooflineStepCost, StepLoad
from kvscope.twin.streams import (
    ClosedLoop,
    StreamError,
    TwinRequest,
    from_trace,
    synthetic,
    with_poisson_arrivals,
)
from kvscope.twin.sweep import sweep

MODEL = model_shape("llama-3.1-8b")
COST = LinearStepCost(0.010, 0.001, 1e-5)


def _shape(**kw: object) -> EngineShape:
    base: dict[str, object] = {"num_gpu_blocks": 10_000, "max_model_len": 4096}
    base.update(kw)
    return EngineShape(MODEL, **base)  # type: ignore[arg-type]


def _same(n: int, prompt: int, output: int) -> list[TwinRequest]:
    return [TwinRequest(prompt, output, key=i) for i in range(n)]


def test_kv_cache_bounds_the_batch_and_twice_the_blocks_doubles_it() -> None:
    # A 240-token prompt takes 15 blocks of 16; growing to 240 + 32 tokens takes 17.
    # 170 blocks hold 10 such requests at their end and 11 at their start; vLLM admits
    # by free blocks, so the batch of 64 clients' requests sits between 10 and 11.
    reqs = _same(600, 240, 32)
    small = Twin(_shape(num_gpu_blocks=170), COST, start_unix_s=1e9).run(ClosedLoop(reqs, 64))
    big = Twin(_shape(num_gpu_blocks=340), COST, start_unix_s=1e9).run(ClosedLoop(reqs, 64))
    s, b = small.summary(), big.summary()
    assert small.steps["running"].max() <= 170 // 15
    assert 9.0 <= s["mean_running"] <= 170 / 15
    assert s["kv_usage_mean"] > 0.9 and s["mean_waiting"] > 40
    assert 1.8 <= b["mean_running"] / s["mean_running"] <= 2.2
    assert small.unfinished == 0 and len(small.requests) == 600


def test_max_num_seqs_caps_the_batch_and_the_rest_waits() -> None:
    r = Twin(_shape(max_num_seqs=4), COST, start_unix_s=1e9).run(
        ClosedLoop(_same(200, 100, 50), 16)
    )
    s = r.summary()
    a, b = r.window()
    steady = r.steps[(r.steps["t_end"] > a) & (r.steps["t_end"] <= b)]
    assert r.steps["running"].max() == 4
    assert (steady["scheduled_requests"] == 4).all()
    # vLLM reports the batch after the step: a request of 50 tokens holds its seat for
    # 50 steps and leaves at the end of its last, so 4/50 of a seat reads empty.
    assert s["mean_running"] == pytest.approx(4 - 4 / 50, abs=0.01)
    assert s["mean_waiting"] == pytest.approx(12, abs=0.5)
    assert r.requests["preemptions"].sum() == 0  # seats, not memory, are short


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks() -> None:
    # 2,000 prompt tokens with a 512-token budget: chunks of 512, 512, 512, 464, one per
    # step; the first token comes with the last chunk. With a = 10 ms per step and
    # c = 10 us per computed token, TTFT = 4 * 10 ms + 2,000 * 10 us = 60 ms.
    cost = LinearStepCost(0.010, 0.0, 1e-5)
    r = Twin(_shape(max_num_batched_tokens=512), cost, start_unix_s=1e9).run(
        ClosedLoop(_same(3, 2000, 5), 1)
    )
    assert r.requests["ttft_s"].to_numpy() == pytest.approx([0.060] * 3, abs=1e-6)
    # Then 4 decode steps of 10 ms each for the remaining 4 tokens.
    assert r.requests["e2e_s"].to_numpy() == pytest.approx([0.100] * 3, abs=1e-6)
    prefill_steps = r.steps[r.steps["prompt_computed"] > 0]
    assert sorted(prefill_steps["prompt_computed"].unique()) == [464, 512]


def test_vllms_latency_parts_add_up_and_the_clock_is_the_sum_of_steps() -> None:
    r = Twin(_shape(num_gpu_blocks=400), COST, start_unix_s=1e9).run(
        ClosedLoop(synthetic(300, prompt_tokens=(50, 400), output_tokens=(5, 80)), 24)
    )
    q = r.requests
    parts = q["queued_s"] + q["prefill_s"] + q["decode_s"]
    # vLLM's e2e runs from arrival, its parts from the first QUEUED event (same instant here).
    assert np.allclose(parts, q["e2e_s"], atol=1e-6)
    assert (q["queued_s"] >= 0).all() and (q["prefill_s"] > 0).all()
    assert (q["ttft_s"] <= q["e2e_s"] + 1e-12).all()
    # A closed loop never idles the engine: simulated time is the steps' time (to the
    # float resolution of Unix times, ~1e-7 s).
    assert r.steps["step_s"].sum() == pytest.approx(r.sim_s, rel=1e-6)
    assert r.steps["generated"].sum() == q["output_tokens"].sum()


def test_a_shared_prefix_is_found_in_the_cache_block_aligned() -> None:
    # One 512-token shared block (32 KV blocks of 16) then 100 tokens of each request's own.
    reqs = [TwinRequest(612, 4, None, (7,), 512, i) for i in range(10)]
    on = Twin(_shape(), COST, start_unix_s=1e9).run(ClosedLoop(reqs, 1))
    off = Twin(_shape(enable_prefix_caching=False), COST, start_unix_s=1e9).run(ClosedLoop(reqs, 1))
    assert on.requests["cached_tokens"].tolist() == [0] + [512] * 9
    assert off.requests["cached_tokens"].sum() == 0
    assert off.steps["prompt_computed"].sum() - on.steps["prompt_computed"].sum() == 9 * 512


def test_open_loop_follows_the_arrivals_when_the_engine_keeps_up() -> None:
    reqs = with_poisson_arrivals(_same(400, 100, 50), rate_per_s=2.0, seed=3)
    r = Twin(_shape(), COST, start_unix_s=1e9).run(reqs)
    assert r.requests["arrival"].min() == pytest.approx(1e9)
    assert r.summary()["output_tokens_per_s"] == pytest.approx(2.0 * 50, rel=0.15)
    assert r.requests["queued_s"].max() < 0.05
    # It idles between arrivals: simulated time is well beyond the steps' time.
    assert r.steps["step_s"].sum() < 0.8 * r.sim_s


def test_overload_preempts_newest_first_and_recomputes() -> None:
    # Outputs far longer than prompts in a small cache: admitted requests outgrow the
    # cache and vLLM preempts (recompute); the recomputed tokens are scheduled again.
    r = Twin(_shape(num_gpu_blocks=96), COST, start_unix_s=1e9).run(
        ClosedLoop(_same(80, 64, 400), 16)
    )
    assert r.requests["preemptions"].sum() > 0
    computed = r.steps["prompt_computed"].sum()
    assert computed > 80 * 64  # more than the prompts: the preempted work again
    assert r.unfinished == 0


def test_phases_run_on_one_engine_in_order() -> None:
    reqs = synthetic(2000, prompt_tokens=(100, 200), output_tokens=(20, 60))
    r = Twin(_shape(), COST, start_unix_s=1e9).run(
        ClosedLoop(reqs[:1000], 2, duration_s=20), ClosedLoop(reqs[1000:], 8, duration_s=20)
    )
    first, second = r.extra["phase_starts"]
    assert first == 1e9 and 1e9 + 20 <= second < 1e9 + 25
    s = r.steps
    assert s.loc[s["t_end"] < second, "running"].max() == 2
    assert s.loc[s["t_end"] > second + 1, "running"].max() == 8


def test_a_steady_state_sweep_level_measures_the_queue_a_fixed_one_cuts_off() -> None:
    """Sixteen clients on an engine that runs four sequences at a time (max_num_seqs 4),
    200 output tokens each. A step of four costs 10 ms + 4 x 1 ms, so a request is
    served in 200 x 14 ms = 2.8 s, and in steady state each waits for three services
    before its own: e2e 16 / 4 x 2.8 = 11.2 s. The clients start together, so the first
    wave is served over those 11.2 s: a fixed 6-second level (measured after 1.5 s) sees
    only the wave's first two rounds (2.8 and 5.6 s)."""
    cost = LinearStepCost(0.010, 0.001, 0.0)
    shape = _shape(max_num_seqs=4)
    reqs = _same(64, 16, 200)
    service_s = 200 * (0.010 + 4 * 0.001)
    truth_s = 16 / 4 * service_s
    (fixed,) = sweep(shape, cost, reqs, [16], seconds_per_level=6.0, steady_state=False).levels
    (steady,) = sweep(shape, cost, reqs, [16], seconds_per_level=6.0).levels
    assert fixed.window_s == pytest.approx(4.5) and fixed.e2e_p99_s < 0.55 * truth_s
    # the warm-up waited for the whole first wave; the window lasts a cycle
    assert steady.warmup_s == pytest.approx(truth_s, rel=0.05)
    assert steady.window_s == pytest.approx(truth_s, rel=0.05)
    assert steady.e2e_p50_s == pytest.approx(truth_s, rel=0.05)
    assert steady.e2e_p99_s == pytest.approx(truth_s, rel=0.05)
    assert steady.output_tokens_per_s == pytest.approx(4 / 0.014, rel=0.05)
    with pytest.raises(StreamError, match="needs a duration"):
        ClosedLoop(reqs, 4, steady_state=True)


def test_bad_streams_and_shapes_say_what_to_change() -> None:
    with pytest.raises(StreamError, match="arrival times"):
        Twin(_shape(), COST).run(_same(3, 10, 10))
    with pytest.raises(StreamError, match="at least one client"):
        ClosedLoop(_same(3, 10, 10), 0)
    with pytest.raises(TwinConfigError, match="chunked prefill"):
        _shape(enable_chunked_prefill=False, max_num_batched_tokens=512)
    with pytest.raises(TwinConfigError, match="does not fit"):
        blocks_for(model_shape("llama-3.1-70b"), 48e9)
    with pytest.raises(ValueError, match="non-negative"):
        LinearStepCost(-1.0, 0.0, 0.0)


def test_prompts_longer_than_the_context_are_refused_as_vllm_does() -> None:
    r = Twin(_shape(max_model_len=1024), COST, start_unix_s=1e9).run(
        ClosedLoop([TwinRequest(2000, 5, key=0), TwinRequest(100, 2000, key=1)], 1)
    )
    assert r.rejected == 1
    assert r.requests["output_tokens"].tolist() == [1024 - 100]  # cut at the context


def test_blocks_for_an_8b_model_on_an_80gb_gpu() -> None:
    # 80 GB x 0.9 - 16 GB of weights - 2 GB reserve = 54 GB; a token's KV is
    # 2 * 32 layers * 8 heads * 128 * 2 bytes = 128 KiB; a block of 16 is 2 MiB.
    n = blocks_for(MODEL, GPUS["a100-80gb"].memory_bytes)
    assert n == math.floor((72e9 - 8.03e9 * 2 - 2e9) / (131_072 * 16))
    assert 25_000 < n < 27_000
    assert blocks_for(MODEL, 80e9, kv_bytes_per_value=1.0) == pytest.approx(2 * n, abs=1)


def test_roofline_decode_is_memory_bound_and_long_prefill_compute_bound() -> None:
    cost = RooflineStepCost(MODEL, GPUS["a100-80gb"])
    one = cost.step_s(StepLoad(1, 1, 0, 500))
    # One decode step reads the 16 GB of weights at 80% of 2.04 TB/s: ~9.8 ms + 4 ms.
    assert one == pytest.approx(0.004 + 16.06e9 / (0.8 * 2.039e12), rel=0.01)
    big = cost.step_s(StepLoad(1, 0, 8192, 8192, 8192 * 4096.5))
    # 8,192 prompt tokens: 2 * 8e9 * 8192 FLOPs (+ attention) at 50% of 312 TFLOPS.
    assert big > 0.004 + 2 * 8.03e9 * 8192 / (0.5 * 312e12)


def test_trace_replay_shares_mooncake_prefix_blocks(repo_root: object = None) -> None:
    from pathlib import Path

    trace = Path(__file__).resolve().parents[2] / "traces" / "mooncake_conversation_trace.jsonl"
    reqs = from_trace(trace, limit=60)
    assert reqs[0].arrival_s == 0.0 and all(r.arrival_s is not None for r in reqs)
    shape = _shape(num_gpu_blocks=30_000, max_model_len=32_768, max_num_batched_tokens=8192)
    r = Twin(shape, RooflineStepCost(MODEL, GPUS["a100-80gb"]), start_unix_s=1e9).run(reqs)
    assert r.requests["cached_tokens"].sum() > 0
    hits = r.steps["prefix_hits"].sum() / max(1, r.steps["prefix_queries"].sum())
    assert 0.05 < hits < 0.95


def test_building_a_twin_leaves_the_environment_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    # Anything started later (a real vLLM server) inherits the environment: a twin must not
    # leave vLLM switches behind (a leaked VLLM_LOGGING_LEVEL once silenced a server's log).
    for name in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    import os

    def vllm_switches() -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}

    before = vllm_switches()
    # A context beyond the model's 32,768 positions needs vLLM's switch while it builds.
    shape = EngineShape(model_shape("qwen2.5-7b"), num_gpu_blocks=1000, max_model_len=65_536)
    Twin(shape, COST, start_unix_s=1e9).run(ClosedLoop(_same(4, 100, 5), 2))
    assert vllm_switches() == before


def test_a_step_fit_on_vllms_per_step_accounting_recovers_the_step_time() -> None:
    # What the plugin stores per step (vLLM's running count after the step, prompt
    # tokens counted when the prompt completes, the iteration time) from a twin whose
    # step time is known: the fit must find it again despite vLLM's accounting.
    from kvscope.twin.steptime import fit_steps

    truth = LinearStepCost(0.006, 0.0005, 0.0002)
    reqs = synthetic(3000, prompt_tokens=(20, 300), output_tokens=(16, 96), seed=5)
    r = Twin(_shape(num_gpu_blocks=600), truth, start_unix_s=1e9).run(
        *(
            ClosedLoop(reqs[i * 500 : (i + 1) * 500], c, duration_s=30)
            for i, c in enumerate((2, 4, 8, 16, 32))
        )
    )
    steps = r.steps.rename(columns={"step_s": "iteration_s", "running": "batch_size"})
    fit = fit_steps(steps)
    assert fit.a_s == pytest.approx(truth.a_s, rel=0.15)
    assert fit.b_s == pytest.approx(truth.b_s, rel=0.15)
    assert fit.c_s == pytest.approx(truth.c_s, rel=0.15)
    # The step cycle (time between consecutive steps' stats) is the same here: a closed
    # loop never idles the twin's engine.
    by_cycle = fit_steps(steps.assign(ts_unix_s=steps["t_end"]), cycle=True)
    assert by_cycle.b_s == pytest.approx(truth.b_s, rel=0.15)
    assert by_cycle.c_s == pytest.approx(truth.c_s, rel=0.15)
    with pytest.raises(ValueError, match="enable-logging-iteration-details"):
        fit_steps(steps.assign(iteration_s=float("nan")))

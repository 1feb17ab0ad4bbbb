"""Whether a larger token budget pays, on engines simulated step by step from first
principles: a chunked-prefill scheduler (decodes first, then prompt chunks up to the
budget), a closed loop of clients, and vLLM's way of counting prompt tokens (all of a
prompt's tokens in the step that completes its prefill, none in the chunks before).

The ground truth is measured, not derived: the same workload is simulated again with
twice the budget, and the prefill rate of the two runs compared. The step-time model is
fitted only on the first run's one-second windows, as the collector stores them."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest

from kvscope.advisor import StepTimeModel
from kvscope.advisor.bottleneck import BottleneckClassifier
from kvscope.advisor.curve import ThroughputCurve
from kvscope.collector._windows import aggregate

T0 = 1_700_000_000.0


@dataclass
class Physics:
    """Seconds per step: ``fixed`` + ``per_decode`` x decoding sequences + ``per_prompt``
    x prompt tokens computed in the step."""

    fixed: float
    per_decode: float
    per_prompt: float


def simulate(
    phys: Physics, budget: int, clients: list[int], prompt: int, output: int, level_s: float
) -> tuple[pd.DataFrame, list[float]]:
    """Raw step rows of a closed-loop sweep over ``clients`` (``level_s`` seconds each)
    and the prompt tokens per second each level prefilled."""
    rows: list[dict[str, float]] = []
    rates = []
    t = T0
    rng = np.random.default_rng(7)

    def new_request() -> dict[str, int]:
        length = prompt + int(rng.integers(-prompt // 10, prompt // 10 + 1))
        return {"prompt": length, "left": length, "out": output, "started": 0}

    for n in clients:
        reqs = [new_request() for _ in range(n)]  # each client's request in flight
        end, prefilled = t + level_s, 0
        while t < end:
            decoding = [r for r in reqs if r["left"] == 0]
            room = budget - len(decoding)
            chunk = completed_tokens = completed = 0
            for r in reqs:  # prompt chunks in arrival order, up to the budget
                if r["left"] > 0 and room > 0:
                    take = min(r["left"], room)
                    r["left"] -= take
                    r["started"] = 1
                    room -= take
                    chunk += take
                    if r["left"] == 0:  # its first token comes out of this step
                        completed += 1
                        completed_tokens += r["prompt"]
                        r["out"] -= 1
            for r in decoding:
                r["out"] -= 1
            t += phys.fixed + phys.per_decode * len(decoding) + phys.per_prompt * chunk
            prefilled += chunk
            running = sum(r["started"] for r in reqs)
            rows.append(
                {
                    "ts_unix_s": t,
                    "step": len(rows),
                    "batch_size": running,
                    "waiting": n - running,
                    "deferred": 0,
                    "kv_usage_ratio": 0.05,
                    "kv_blocks_used": 10,
                    "prefix_queries": completed_tokens,
                    "prefix_hits": 0,
                    "preemptions": 0,
                    # vLLM counts a prompt's tokens in the step that completes its prefill.
                    "prompt_tokens": completed_tokens,
                    "generation_tokens": len(decoding) + completed,
                    "iteration_s": math.nan,
                }
            )
            reqs = [r if r["left"] > 0 or r["out"] > 0 else new_request() for r in reqs]
        rates.append(prefilled / level_s)
        t = math.floor(t) + 2.0  # a gap between levels
    return pd.DataFrame(rows), rates


def windows(steps: pd.DataFrame) -> pd.DataFrame:
    cols = {c: steps[c].to_numpy(float) for c in steps.columns}
    _, w = aggregate(np.zeros(len(steps), dtype=np.int64), cols)
    return pd.DataFrame(w).assign(engine_id="e0")


SWEEP = [1, 2, 4, 8, 16, 32, 64, 128]
LEVEL_S = 15.0
CASES = {
    # A CPU: 8 ms per step, 0.1 ms per token whether prompt or decode; budget 256, prompts of
    # ~1,000 tokens, 16 out: a full step is ~34 ms, 26 of them tokens.
    "prefill-bound": (Physics(0.008, 0.0001, 0.0001), 256, 1000, 16),
    # The same CPU with a budget of 64 and prompts of ~300: a full step is 14 ms, 8 of
    # them the step's own.
    "step-overhead": (Physics(0.008, 0.0001, 0.0001), 64, 300, 16),
    # A GPU: 25 ms per step, 0.2 ms per decoding sequence (its KV reads), 2 us per prompt
    # token; budget 2,048, prompts of ~4,000, 50 out.
    "gpu-small-budget": (Physics(0.025, 0.0002, 0.000002), 2048, 4000, 50),
}


@functools.cache
def _run(case: str) -> tuple[pd.DataFrame, float, StepTimeModel]:
    """The case's windows, the measured gain of twice the budget at the top load, and the
    step-time model fitted on the windows."""
    phys, budget, prompt, output = CASES[case]
    steps, rates = simulate(phys, budget, SWEEP, prompt, output, LEVEL_S)
    _, doubled = simulate(phys, 2 * budget, SWEEP[-1:], prompt, output, LEVEL_S)
    w = windows(steps)
    return w, doubled[0] / rates[-1] - 1.0, StepTimeModel().fit(w)


def _top(w: pd.DataFrame) -> tuple[float, float]:
    """Median computed prompt and generated tokens per step over the top load's seconds."""
    top = w[w["waiting_mean"] >= 1].tail(int(LEVEL_S) - 2)
    n = top["n_steps"].astype(float)
    return float((top["prompt_tokens"] / n).median()), float(
        (top["generation_tokens"] / n).median()
    )


@pytest.mark.parametrize("case", list(CASES))
def test_the_budget_gain_is_what_twice_the_budget_measures(case: str) -> None:
    w, truth, model = _run(case)
    gain = model.budget_gain(*_top(w))
    # Measured: +13.7%, +38.6% and +59.6%; predicted +13.9%, +38.5% and +58.2%.
    assert gain.ratio == pytest.approx(truth, abs=0.03), (truth, gain)
    assert gain.low - 0.02 <= truth <= gain.high + 0.02, (truth, gain)
    assert gain.high - gain.low < 0.1, gain


EXPECTED = {
    # Twice the budget measured +13.7%: under the classifier's min_budget_gain (a quarter),
    # so full steps are not the limit: the steps' own tokens are (prefill-bound).
    "prefill-bound": "compute_bound",
    # +38.6% and +59.6%: bigger steps amortise the per-step cost.
    "step-overhead": "token_budget_bound",
    "gpu-small-budget": "token_budget_bound",
}


@pytest.mark.parametrize("case", list(CASES))
def test_full_steps_are_the_budget_only_where_twice_the_budget_pays(case: str) -> None:
    w, truth, model = _run(case)
    _, budget, _, _ = CASES[case]
    cfg = {
        "max_num_seqs": 256,
        "max_num_batched_tokens": budget,
        "num_gpu_blocks": 100_000,
        "block_size": 16,
    }
    classifier = BottleneckClassifier()
    # The expectation follows what twice the budget measured, against the threshold.
    assert (truth >= classifier.min_budget_gain) == (EXPECTED[case] == "token_budget_bound")
    bn = classifier.fit(ThroughputCurve().fit(w), cfg, None, model)
    ev = bn.evidence_
    assert ev["budget_fill_median"] >= 0.7, ev
    assert bn.label_ == EXPECTED[case], ev
    assert ev["prefill_bound"] == (EXPECTED[case] == "compute_bound")
    assert ev["budget_doubling_gain_low"] <= ev["budget_doubling_gain_ratio"]
    assert ev["budget_doubling_gain_ratio"] <= ev["budget_doubling_gain_high"]


def test_an_interval_across_the_threshold_is_unexplained_not_a_guess() -> None:
    """The step-overhead engine judged against a threshold inside its gain's interval:
    the classifier names no class."""
    w, _, model = _run("step-overhead")
    gain = model.budget_gain(*_top(w))
    cfg = {"max_num_seqs": 256, "max_num_batched_tokens": 64, "num_gpu_blocks": 100_000}
    cfg["block_size"] = 16
    mid = (gain.low + gain.high) / 2
    bn = BottleneckClassifier(min_budget_gain=mid).fit(ThroughputCurve().fit(w), cfg, None, model)
    assert bn.label_ == "unexplained", bn.evidence_
    assert "cannot tell" in bn.evidence_["why"]

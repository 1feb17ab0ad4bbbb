"""The advisor on live telemetry of the real vLLM CPU engine, read through a real collector.

Three engine regimes (``bench/advisor_scenarios.py``, "mid" lab model, a closed-loop
sweep of 1 to 32 clients, 5 s per level and 10 s at 32) must each get the right
verdict; on the KV-starved engine the recommended cap is applied and measured (as
client concurrency, and as the recommendation's vLLM flags ``--max-num-seqs C
--max-num-queued-reqs C+Q`` on a restarted engine, each set against the uncapped overload
in steady-state runs), and the KV capacity model's plateau is checked against the measured
one. The KV-starved engine runs in the default engine tier; the sequence-capped and
ample-KV engines (three minutes each on a slow machine) run with the long matrices, as the
advisor's other regimes do::

    scripts/test -m matrix tests/integration/test_advisor_real.py -s

The measured figures appear in the terminal summary and in ``advisor_real.json`` under
pytest's base temp dir.

Each closed-loop comparison is made on repeated runs: the cap as client concurrency and
the uncapped overload alternate on the same engine (three rounds, more while a setting's
runs are noisier than ``MAX_RELATIVE_ERROR``); the flags' engine is set against the
uncapped overload measured before it and again on a restarted uncapped engine after it.
Each property (a throughput kept, a tail cut, a predicted plateau) is a ratio of the
runs with its 95% confidence interval (``bench/noise.py``): a test fails when the whole
interval lies on the wrong side of the bound, i.e. when the runs show the property does
not hold; an interval that straddles the bound is reported as "within noise" in the
terminal summary, with every run's figure. The bounds and their reasons are in
``bench/advisor_scenarios.py``.

Throughput and e2e P99 are the load generator's; preemptions per second, batch and
queue come from the collector's 1-second windows inside each level's measurement
window. A level in which the engine did not see the clients' load (vLLM's API server
stalled) is run once more; the summary's "runs" column shows where that happened.
"""

from __future__ import annotations

import statistics

import pytest

from bench.advisor_scenarios import (
    CapRun,
    Check,
    RegimeRun,
    cap_checks,
    plateau_checks,
)

pytestmark = pytest.mark.engine

MAX_PREEMPTION_RATIO = 0.5
"""Preemptions per second with ``--max-num-seqs cap`` over the uncapped overload's, at
most. They do not vanish: the cap (chosen for throughput) admits more sequences than
48 blocks hold at their longest (~6 blocks each)."""
MAX_STEP_RATE_RATIO = 0.8
"""Engine steps per second at the ample-KV plateau over those at low load, at most: a
step of 32 sequences takes at least a quarter longer than a step of one or two, i.e. the
batch costs compute (0.27 and 0.58 in two runs: the low-load step rate varies more
than the plateau's, 276 and 120 steps/s)."""


def _no_errors(run: RegimeRun) -> None:
    """Every level ran without an error and streamed tokens. Not that requests completed
    within it: a level can be shorter than one request (the ample-KV engine on an AVX2
    machine steps 18 times a second at 24 clients, so a 128-token output takes 7 s, and
    the 5-second level completed none while it streamed 474 tok/s)."""
    for lv in run.levels:
        assert lv.errors == 0 and lv.client_tokens_per_s > 0, lv
        assert lv.n_windows >= 3, f"the collector holds too few windows for {lv}"


def _ev(run: RegimeRun) -> dict[str, float]:
    return run.evidence("bottleneck")


def test_kv_starved_engine_is_kv_cache_bound(kv_starved_run: RegimeRun) -> None:
    run = kv_starved_run
    _no_errors(run)
    v, ev = run.verdict, _ev(run)
    assert v.bottleneck == "kv_cache_bound" and v.saturated, (v, ev)
    # What the engine did at the overload level (the collector's windows inside it): a
    # full cache, a queue, preemptions, and a batch far below max_num_seqs (256). (The
    # advisor's evidence takes the median over every second past the knee, and those
    # just past it have a cache not yet full: 0.898 in one run with the knee at 7.7.)
    top = run.top
    assert top.kv_usage_median >= 0.9 and top.waiting_median > 1, top
    assert top.preemptions_per_s > 1 and top.batch_median < 32, top
    # Past the knee requests wait while vLLM preempts. Per second this scales with the
    # engine's speed (3-4 past an AVX-512 machine's knee; 0.26 on an AVX2 machine's
    # float32 engine, knee 15, 4.8 at its top level), so only its sign is asserted.
    assert ev["waiting_median"] > 0 and ev["preemptions_per_s"] > 0, ev
    assert v.knee_concurrency is not None and 4 <= v.knee_concurrency <= 16, v
    # The overload level the caps are measured against reached the engine in full.
    assert run.top.delivered, run.top


@pytest.mark.matrix
def test_seq_capped_engine_is_max_num_seqs_bound(seq_capped_run: RegimeRun) -> None:
    run = seq_capped_run
    _no_errors(run)
    v, ev = run.verdict, _ev(run)
    assert v.bottleneck == "max_num_seqs_bound" and v.saturated, (v, ev)
    assert ev["batch_median"] >= 0.9 * 6 and ev["kv_usage_median"] < 0.1, ev
    assert ev["waiting_median"] > 1 and ev["preemptions_per_s"] == 0, ev
    assert v.knee_concurrency is not None and 4 <= v.knee_concurrency <= 12, v


@pytest.mark.matrix
def test_ample_kv_engine_is_compute_limited(ample_kv_run: RegimeRun) -> None:
    """At 32 clients the ample-KV engine is near its compute ceiling but still climbing
    (by +12% to +32% over the last doubling, by the advisor's fit, in the runs seen): the advisor may call it
    ``compute_bound`` or ``not_saturated`` approaching ``compute_bound``, never a memory
    or sequence-cap limit, and the evidence must show why."""
    run = ample_kv_run
    _no_errors(run)
    v, ev = run.verdict, _ev(run)
    assert run.correct, (v, ev)
    if v.bottleneck == "not_saturated":
        assert v.approaching == "compute_bound", v
    # Nothing else limits: KV nearly empty, no queue, no preemptions, batch = load...
    assert ev["kv_usage_median"] < 0.1 and ev["preemptions_per_s"] == 0, ev
    assert ev["waiting_median"] < 1 and ev["batch_median"] >= 0.9 * ev["load_median"], ev
    # ...while every step slows as the batch grows.
    assert ev["steps_per_s_plateau"] <= MAX_STEP_RATE_RATIO * ev["steps_per_s_low_load"], ev
    # It sustains the largest batches of the three regimes.
    assert run.top.batch_median >= 0.9 * run.top.concurrency, run.top


def _hold(judged: list[Check], context: str) -> None:
    """Fail on every check the runs refute; the others held or were within noise."""
    assert judged, f"nothing to judge: {context}"
    refuted = [c.describe() for c in judged if c.failed]
    assert not refuted, "\n".join([*refuted, context])


def test_capacity_model_predicts_the_kv_bound_plateau(kv_starved_run: RegimeRun) -> None:
    run = kv_starved_run
    kv = run.evidence("kv_capacity")
    assert kv.get("kv_limited") and 8 <= kv["kv_batch"] <= 20, kv
    # The prediction against every run at the plateau (the sweep's saturated levels and
    # the closed loop's uncapped runs), client side and engine side.
    judged = plateau_checks(run)
    assert len(judged) == 2, (kv, run.plateau_runs)
    _hold(
        judged,
        f"plateau runs: {', '.join(f'{lv.client_tokens_per_s:,.0f}' for lv in run.plateau_runs)} "
        f"tok/s (client); {kv}",
    )


def _delivered(cap: CapRun) -> None:
    """Every run reached the engine."""
    for lv in cap.capped.runs + cap.reference.runs:
        assert lv.completed > 0, lv
        # with admission control, the excess is rejected (503); without, nothing may fail
        assert lv.delivered and lv.clean, (
            f"{lv.concurrency} clients ({'admit ' + str(lv.admit_limit) if lv.admit_limit else 'uncapped'}): "
            f"{lv.trouble()}, in each of {lv.attempts} run(s); the engine saw "
            f"{lv.load_mean:.1f} of {lv.offered} requests in flight (mean)"
        )


def test_cap_as_client_concurrency_keeps_throughput_and_cuts_the_tail(
    kv_starved_run: RegimeRun,
) -> None:
    """Throughput kept (at least ``MIN_THROUGHPUT_FRACTION`` of the uncapped overload's)
    and vLLM's e2e P99 cut (below ``MAX_P99_RATIO`` of it), runs interleaved."""
    cap = kv_starved_run.client_cap
    assert cap is not None
    _delivered(cap)
    judged = cap_checks(kv_starved_run, cap)
    assert len(judged) == 2, judged  # throughput and P99
    _hold(judged, cap.noise())


def test_cap_as_vllm_flags_keeps_throughput_and_cuts_the_tail(
    kv_starved_run: RegimeRun, kv_engine_cap_run: CapRun
) -> None:
    """The recommendation's vLLM flags (``--max-num-seqs C --max-num-queued-reqs C+Q``) on a
    restarted engine at the overload concurrency: the engine admits ``C + Q`` requests
    and rejects the rest with 503 (for the gateway to retry on another replica).
    Throughput stays near the uncapped engine's, the admitted requests' e2e P99 falls
    (and stays within ``MAX_FLAGS_OVER_PREDICTED`` of the advisor's prediction),
    preemptions fall (not to zero, see ``MAX_PREEMPTION_RATIO``)."""
    run, cap = kv_starved_run, kv_engine_cap_run
    _delivered(cap)
    assert cap.level.concurrency == cap.uncapped.concurrency
    assert cap.flags and f"--max-num-seqs {cap.cap}" in cap.flags, cap.flags
    c = run.verdict.recommended_concurrency_cap
    assert c is not None and cap.cap <= c  # at most the sequences the KV cache holds
    capped_pre = statistics.median(lv.preemptions_per_s for lv in cap.capped.runs)
    uncapped_pre = statistics.median(lv.preemptions_per_s for lv in cap.reference.runs)
    assert capped_pre <= MAX_PREEMPTION_RATIO * uncapped_pre, (capped_pre, uncapped_pre)
    # The engine honours the cap and the admission limit (running and waiting together:
    # when the cache holds fewer than the cap, more of the admitted requests wait); the
    # excess was rejected.
    for lv in cap.capped.runs:
        assert lv.admit_limit is not None and lv.admit_limit > c, lv
        assert lv.batch_median <= cap.cap + 0.01, lv
        assert lv.load_median <= lv.admit_limit + 0.01, lv
        assert lv.errors > 0, lv
    assert 0 < cap.rejected_share < 1, cap.rejected_share
    judged = cap_checks(run, cap)
    assert len(judged) == 3, judged  # throughput, P99, P99 against the prediction
    _hold(judged, cap.noise())

"""The closed loop's comparison of repeated runs (``bench/advisor_scenarios.py``), on
made-up levels: medians, spread, and the not-judged rule."""

from __future__ import annotations

import statistics

import pytest

from bench.advisor_scenarios import MAX_SPREAD, MAX_START_SPREAD, CapRun, LevelMeasure, Repeated


def level(tps: float, p99: float | None, *, clients: int = 32, errors: int = 0) -> LevelMeasure:
    return LevelMeasure(
        concurrency=clients,
        client_tokens_per_s=tps,
        e2e_p99_s=p99,
        ttft_p99_s=None,
        completed=10,
        errors=errors,
        engine_tokens_per_s=tps,
        preemptions_per_s=0.0,
        batch_median=8.0,
        waiting_median=0.0,
        load_median=8.0,
        load_mean=8.0,
        kv_usage_median=0.5,
        n_windows=10,
        engine_e2e_p99_s=p99,
    )


def test_medians_and_spread_of_repeated_runs() -> None:
    rep = Repeated("cap", [level(900, 1.0), level(1000, 3.0), level(1100, 2.0)])
    assert rep.tokens_per_s == 1000 and rep.engine_e2e_p99_s == 2.0
    assert rep.spread == pytest.approx(0.2)
    assert rep.typical.client_tokens_per_s == 1000
    assert Repeated("one", [level(500, None)]).spread == 0.0


def test_cap_run_compares_medians_and_refuses_noisy_runs() -> None:
    capped = Repeated(
        "cap 8",
        [level(880, 1.0, clients=8), level(900, 1.2, clients=8), level(910, 1.1, clients=8)],
    )
    quiet = Repeated("32", [level(1000, 3.0), level(990, 3.2), level(1010, 3.1)])
    run = CapRun(how="client", cap=8, capped=capped, reference=quiet, peak_tokens_per_s=1100)
    assert run.plateau_fraction == pytest.approx(0.9)
    assert run.p99_ratio == pytest.approx(1.1 / 3.1)
    assert run.client_p99_ratio == pytest.approx(1.1 / 3.1)
    assert run.judged and run.level.client_tokens_per_s == 900
    noisy = Repeated("32", [level(700, 3.0), level(1000, 3.2), level(1010, 3.1)])
    assert noisy.spread > MAX_SPREAD
    assert not CapRun(
        how="client", cap=8, capped=capped, reference=noisy, peak_tokens_per_s=1100
    ).judged


def test_a_reference_over_two_engine_starts_is_judged_within_each_start() -> None:
    """Engine restarts differ by up to 10%: the flags' reference brackets the capped start
    with an uncapped start before and after, and the runs of each start are held to
    MAX_SPREAD, the two starts to MAX_START_SPREAD (the figures of a real run)."""
    capped = Repeated("flags", [level(1124, 1.9), level(1110, 1.9), level(1121, 1.9)])
    before = Repeated("first start", [level(1283, 3.9), level(1272, 3.8), level(1256, 3.7)])
    after = Repeated("restart", [level(1393, 3.7), level(1389, 3.7), level(1465, 3.3)])
    both = Repeated("32", [*before.runs, *after.runs])
    assert both.spread > MAX_SPREAD  # taken as one setting, the starts look like noise
    run = CapRun(
        how="engine",
        cap=8,
        capped=capped,
        reference=both,
        peak_tokens_per_s=1424,
        reference_start_runs=(before, after),
    )
    assert run.reference_starts == (1272, 1393)
    assert run.start_spread == pytest.approx((1393 - 1272) / statistics.median([1272, 1393]))
    assert run.judged and run.plateau_fraction == pytest.approx(1121 / both.tokens_per_s)
    far = Repeated("restart", [level(1700, 3.0), level(1710, 3.0), level(1690, 3.0)])
    assert (1700 - 1272) / statistics.median([1272, 1700]) > MAX_START_SPREAD
    assert not CapRun(
        how="engine",
        cap=8,
        capped=capped,
        reference=both,
        peak_tokens_per_s=1424,
        reference_start_runs=(before, far),
    ).judged
    shaky = Repeated("restart", [level(1100, 3.7), level(1389, 3.7), level(1465, 3.3)])
    assert not CapRun(
        how="engine",
        cap=8,
        capped=capped,
        reference=both,
        peak_tokens_per_s=1424,
        reference_start_runs=(before, shaky),
    ).judged


def test_rejected_share_counts_every_capped_run() -> None:
    capped = Repeated("flags", [level(900, 1.0, errors=30), level(900, 1.0, errors=10)])
    run = CapRun(how="engine", cap=8, capped=capped, reference=capped, peak_tokens_per_s=900)
    assert run.rejected_share == pytest.approx(40 / 60)

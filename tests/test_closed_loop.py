"""The closed loop's comparison of repeated runs (``bench/advisor_scenarios.py``), on
made-up levels: medians, spread, and the not-judged rule."""

from __future__ import annotations

import pytest

from bench.advisor_scenarios import MAX_SPREAD, CapRun, LevelMeasure, Repeated


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


def test_rejected_share_counts_every_capped_run() -> None:
    capped = Repeated("flags", [level(900, 1.0, errors=30), level(900, 1.0, errors=10)])
    run = CapRun(how="engine", cap=8, capped=capped, reference=capped, peak_tokens_per_s=900)
    assert run.rejected_share == pytest.approx(40 / 60)

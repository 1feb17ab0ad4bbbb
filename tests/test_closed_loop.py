"""The closed loop's comparison of repeated runs (``bench/advisor_scenarios.py``), on
made-up levels: medians, spread, and the verdict of each property."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from bench.advisor_scenarios import (
    SCENARIOS,
    AdvisorLab,
    CapRun,
    LevelMeasure,
    RegimeRun,
    Repeated,
    cap_checks,
    checks,
    checks_table,
    format_all,
    plateau_checks,
    summary,
)
from bench.noise import FAILS, HOLDS, WITHIN_NOISE


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
        load_median=float(clients),
        load_mean=float(clients),
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


def _run(predicted_p99_s: float | None = None) -> Any:
    """What :func:`cap_checks` reads of the uncapped regime run: the advisor's prediction."""
    return SimpleNamespace(verdict=SimpleNamespace(predicted_p99_e2e_s_at_cap=predicted_p99_s))


def test_client_cap_checks_throughput_and_tail_on_the_runs() -> None:
    capped = Repeated(
        "cap 8",
        [level(880, 1.0, clients=8), level(900, 1.2, clients=8), level(910, 1.1, clients=8)],
    )
    quiet = Repeated("32", [level(1000, 3.0), level(990, 3.2), level(1010, 3.1)])
    run = CapRun(how="client", cap=8, capped=capped, reference=quiet, peak_tokens_per_s=1100)
    assert run.plateau_fraction == pytest.approx(0.9)
    assert run.p99_ratio == pytest.approx(1.1 / 3.1)
    assert run.client_p99_ratio == pytest.approx(1.1 / 3.1)
    assert run.level.client_tokens_per_s == 900
    throughput, tail = cap_checks(_run(), run)
    assert throughput.verdict == HOLDS and throughput.ratio.low > 0.85
    assert tail.verdict == HOLDS and tail.ratio.high < 0.6
    # The same medians from noisier runs: the interval straddles 0.85, no verdict.
    noisy = Repeated("32", [level(800, 3.0), level(1000, 3.2), level(1200, 3.1)])
    throughput, _ = cap_checks(
        _run(), CapRun(how="client", cap=8, capped=capped, reference=noisy, peak_tokens_per_s=1100)
    )
    assert throughput.verdict == WITHIN_NOISE
    # A cap that keeps two thirds of the throughput, measured quietly: refuted.
    low = Repeated("cap 5", [level(660, 1.0), level(670, 1.0), level(650, 1.0)])
    throughput, _ = cap_checks(
        _run(), CapRun(how="client", cap=5, capped=low, reference=quiet, peak_tokens_per_s=1100)
    )
    assert throughput.verdict == FAILS and throughput.failed
    assert "throughput / uncapped >= 0.85" in throughput.describe()


def test_flags_are_judged_against_both_uncapped_starts_and_the_prediction() -> None:
    """Engine restarts differ by up to 10%: the flags' reference brackets the capped start
    with an uncapped start before and after (the figures of a real run); the admitted
    requests' P99 is also held to the advisor's predicted P99 at the cap."""
    capped = Repeated("flags", [level(1124, 1.9), level(1110, 1.9), level(1121, 1.9)])
    before = Repeated("first start", [level(1283, 3.9), level(1272, 3.8), level(1256, 3.7)])
    after = Repeated("restart", [level(1393, 3.7), level(1389, 3.7), level(1465, 3.3)])
    both = Repeated("32", [*before.runs, *after.runs])
    run = CapRun(
        how="engine",
        cap=8,
        capped=capped,
        reference=both,
        peak_tokens_per_s=1424,
        flags=["--max-num-seqs 8", "--max-num-queued-reqs 11"],
        reference_start_runs=(before, after),
    )
    assert run.reference_starts == (1272, 1393)
    assert run.start_spread == pytest.approx((1393 - 1272) / statistics.median([1272, 1393]))
    assert run.plateau_fraction == pytest.approx(1121 / both.tokens_per_s)
    throughput, tail, predicted = cap_checks(_run(predicted_p99_s=1.0), run)
    # 0.84 of the pooled starts, bound 0.80: the starts 9% apart widen the interval
    # across the bound; the runs cannot tell.
    assert throughput.verdict == WITHIN_NOISE
    assert throughput.ratio.low < 0.80 < 0.84 < throughput.ratio.high
    assert "--max-num-seqs 8" in throughput.name
    assert tail.verdict == HOLDS
    assert predicted.verdict == HOLDS and predicted.ratio.estimate == pytest.approx(1.9)
    _, _, predicted = cap_checks(_run(predicted_p99_s=0.5), run)
    assert predicted.verdict == FAILS  # 3.8x the prediction
    # Without a prediction there is nothing to hold the P99 to.
    assert len(cap_checks(_run(), run)) == 2


def test_rejected_share_counts_every_capped_run() -> None:
    capped = Repeated("flags", [level(900, 1.0, errors=30), level(900, 1.0, errors=10)])
    run = CapRun(how="engine", cap=8, capped=capped, reference=capped, peak_tokens_per_s=900)
    assert run.rejected_share == pytest.approx(40 / 60)


def _report(verdict: Any, evidence: dict[str, dict[str, Any]]) -> Any:
    """A stand-in for the advisor's report: one engine's verdict and findings' evidence."""
    return SimpleNamespace(
        engine=lambda _eid: verdict,
        findings_of=lambda kind, _eid: (
            [SimpleNamespace(evidence=evidence[kind])] if kind in evidence else []
        ),
    )


def test_the_summary_and_the_tables_carry_every_verdict() -> None:
    """What the engine tier prints and writes (terminal summary, ``advisor_real.json``),
    on made-up runs and a stand-in for the advisor's report."""
    verdict = SimpleNamespace(
        bottleneck="kv_cache_bound",
        saturated=True,
        approaching=None,
        knee_concurrency=9.5,
        plateau_tokens_per_s=950.0,
        recommended_concurrency_cap=10,
        predicted_throughput_fraction_at_cap=0.9,
        predicted_p99_e2e_s_at_cap=1.0,
        p99_e2e_s_at_max_load=4.0,
        to_dict=lambda: {"bottleneck": "kv_cache_bound"},
    )
    evidence = {"kv_capacity": {"predicted_plateau_tokens_per_s": 1000.0, "kv_batch": 14.0}}
    report = _report(verdict, evidence)
    levels = [level(t, 1.0, clients=c) for c, t in ((4, 500), (8, 800), (16, 960), (32, 940))]
    run = RegimeRun(
        scenario=SCENARIOS["kv-starved"],
        engine_id="e0",
        startup_s=40.0,
        since_unix_s=0.0,
        until_unix_s=100.0,
        levels=levels,
        report=report,  # type: ignore[arg-type]
    )
    reference = Repeated("32 clients", [level(t, 3.0) for t in (950, 1000, 970)])
    run.client_cap = CapRun(
        how="client",
        cap=10,
        capped=Repeated("cap 10", [level(t, 1.0, clients=10) for t in (900, 880, 910)]),
        reference=reference,
        peak_tokens_per_s=960,
    )
    flags = CapRun(
        how="engine",
        cap=10,
        capped=Repeated("flags", [level(t, 2.0) for t in (930, 900, 940)]),
        reference=Repeated("32 uncapped", [*reference.runs, level(990, 3.0)]),
        peak_tokens_per_s=960,
        flags=["--max-num-seqs 10", "--max-num-queued-reqs 13"],
        reference_start_runs=(reference, Repeated("again", [level(990, 3.0)])),
    )
    # The plateau runs: the levels at >= 1.5x the knee (16, 32) and the loop's uncapped runs.
    assert [lv.client_tokens_per_s for lv in run.plateau_runs] == [960, 940, 950, 1000, 970]
    judged = checks([run], flags)
    assert [c.name for c in judged] == [
        "capacity model (client)",
        "capacity model (engine)",
        "(a) client cap 10",
        "(a) client cap 10",
        "(b) --max-num-seqs 10 --max-num-queued-reqs 13",
        "(b) --max-num-seqs 10 --max-num-queued-reqs 13",
        "(b) --max-num-seqs 10 --max-num-queued-reqs 13",
    ]
    assert not any(c.failed for c in judged)
    text = format_all([run], flags)
    for c in judged:
        assert c.what[:40] in text
    assert "holds" in text and "within noise" not in text.split("verdict: holds")[0][-200:]
    data = json.loads(json.dumps(summary([run], flags)))
    assert len(data["checks"]) == len(judged)
    assert {c["verdict"] for c in data["checks"]} <= {HOLDS, WITHIN_NOISE}
    assert data["closed_loop"]["kv-starved/engine"]["capped_relative_error"] > 0


class _FlagsLab(AdvisorLab):
    """The lab's flags comparison with the engines and the load replaced by given runs:
    each engine start's throughput comes from ``speeds`` in start order."""

    def __init__(self, tmp: Any, speeds: list[float]) -> None:
        super().__init__(tmp)
        self.speeds = list(speeds)
        self.pools: list[str] = []

    @contextlib.contextmanager
    def engine(self, pool: str, **_: Any) -> Iterator[Any]:
        self.pools.append(pool)
        yield SimpleNamespace(startup_s=1.0)

    def _warm(self, server: Any) -> None:
        pass

    def _engine_id(self, pool: str) -> str:
        return pool

    def _repeated(
        self, server: Any, engine_id: str, settings: Any, seed: int, rounds: int = 3
    ) -> Any:
        tps = self.speeds.pop(0)
        ((label, clients, _admit),) = settings
        return [Repeated(label, [level(tps * f, 2.0, clients=clients) for f in (0.99, 1.0, 1.01)])]


def _uncapped_run(top_tps: float) -> Any:
    rec = SimpleNamespace(
        kind="concurrency_cap",
        scope=SimpleNamespace(engine_id="e0"),
        change={"vllm_flags": ["--max-num-seqs 10", "--max-num-queued-reqs 13"]},
    )
    top = level(top_tps, 3.0)
    return SimpleNamespace(
        scenario=SCENARIOS["kv-starved"],
        engine_id="e0",
        report=SimpleNamespace(recommendations=[rec]),
        top=top,
        peak=top,
        client_cap=SimpleNamespace(reference=Repeated("32", [top, level(top_tps, 3.0)])),
        measured_plateau_tokens_per_s=top_tps,
        verdict=SimpleNamespace(predicted_p99_e2e_s_at_cap=None),
    )


def test_flags_measured_again_when_one_pair_of_starts_refutes(tmp_path: Any) -> None:
    """A capped start that ran slow (0.6 of the uncapped starts around it) is not judged
    alone: a second pair of starts is measured and the verdict taken on all runs."""
    lab = _FlagsLab(tmp_path, [600.0, 1000.0, 980.0, 1000.0])
    cap = lab.run_engine_cap(_uncapped_run(1000.0))
    assert lab.pools == [
        "advisor-kv-starved-capped",
        "advisor-kv-starved-again",
        "advisor-kv-starved-capped-2",
        "advisor-kv-starved-again-2",
    ]
    assert cap.capped_starts == 2 and len(cap.capped.runs) == 6
    assert len(cap.reference_start_runs) == 3 and len(cap.reference.runs) == 2 + 3 + 3
    assert not any(c.failed for c in cap_checks(_uncapped_run(1000.0), cap))


def test_flags_judged_on_one_pair_when_it_does_not_refute(tmp_path: Any) -> None:
    lab = _FlagsLab(tmp_path, [980.0, 1000.0])
    cap = lab.run_engine_cap(_uncapped_run(1000.0))
    assert lab.pools == ["advisor-kv-starved-capped", "advisor-kv-starved-again"]
    assert cap.capped_starts == 1 and len(cap.capped.runs) == 3


def test_flags_that_break_throughput_fail_on_both_pairs(tmp_path: Any) -> None:
    lab = _FlagsLab(tmp_path, [600.0, 1000.0, 610.0, 1000.0])
    cap = lab.run_engine_cap(_uncapped_run(1000.0))
    assert cap.capped_starts == 2
    assert any(c.failed for c in cap_checks(_uncapped_run(1000.0), cap))


class _LevelLab(AdvisorLab):
    """The lab's level runner with the load and the collector replaced by given runs."""

    def __init__(self, tmp: Any, runs: list[LevelMeasure]) -> None:
        self.said: list[str] = []
        super().__init__(tmp, log=self.said.append)
        self.runs = list(runs)

    def _sweep(self, *_: Any, **__: Any) -> Any:
        return SimpleNamespace(levels=[None])

    def _drain(self, server: Any, engine_id: str, timeout_s: float = 30.0) -> None:
        pass

    def _measure(self, engine_id: str, levels: Any) -> list[LevelMeasure]:
        return [self.runs.pop(0)]


def _failing(errors: dict[str, int]) -> LevelMeasure:
    lv = level(900, 2.0, errors=sum(errors.values()))
    lv.error_kinds = dict(errors)
    return lv


def test_an_uncapped_run_with_failed_requests_is_run_again(tmp_path: Any) -> None:
    """Without admission control every request should be answered: a run with failures is
    run again, and the log says which failed and what vLLM logged."""
    server = SimpleNamespace(log_errors=lambda: ["ERROR 12-03 engine hiccup"])
    lab = _LevelLab(tmp_path, [_failing({"connection": 3}), level(950, 2.0)])
    kept, _ = lab._level(server, "e0", 32, 10.0, 3.0, seed=1)  # type: ignore[arg-type]
    assert kept.attempts == 2 and kept.errors == 0 and kept.client_tokens_per_s == 950
    assert any("3 requests failed (3 connection)" in s for s in lab.said), lab.said
    assert any("engine hiccup" in s for s in lab.said), lab.said


def test_refusals_under_admission_control_are_not_run_again(tmp_path: Any) -> None:
    server = SimpleNamespace(log_errors=lambda: [])
    lab = _LevelLab(tmp_path, [_failing({"http_503": 40}), level(950, 2.0)])
    kept, _ = lab._level(server, "e0", 32, 10.0, 3.0, seed=1, admit_limit=20)  # type: ignore[arg-type]
    assert kept.attempts == 1 and kept.error_kinds == {"http_503": 40}
    assert lab.said == []


def test_failures_that_persist_are_kept_and_said(tmp_path: Any) -> None:
    server = SimpleNamespace(log_errors=lambda: [])
    lab = _LevelLab(tmp_path, [_failing({"timeout": 1}) for _ in range(3)])
    kept, _ = lab._level(server, "e0", 32, 10.0, 3.0, seed=1)  # type: ignore[arg-type]
    assert kept.attempts == 3 and not kept.clean
    assert "1 requests failed (1 timeout)" in kept.trouble()
    assert len(lab.said) == 3 and "again" not in lab.said[-1]


def _stalled() -> LevelMeasure:
    lv = level(400, 2.0)
    lv.load_mean = 20.0  # of 32 clients: the front end stalled
    return lv


def test_a_run_that_stalls_on_every_attempt_is_left_out_and_replaced(tmp_path: Any) -> None:
    """A machine too slow for one run's every attempt measured the machine, not the
    setting: the run is left out and another round stands in for it."""
    server = SimpleNamespace(log_errors=lambda: [])
    feed = [level(950, 2.0), _stalled(), _stalled(), _stalled(), level(950, 2.0), level(950, 2.0)]
    lab = _LevelLab(tmp_path, feed)
    (rep,) = lab._repeated(server, "e0", [("32 clients", 32, None)], seed=1)  # type: ignore[arg-type]
    assert [lv.client_tokens_per_s for lv in rep.runs] == [950, 950, 950]
    assert len(rep.left_out) == 1 and rep.left_out[0].attempts == 3
    assert "1 run(s) left out (the engine saw 20.0 requests in flight" in rep.describe()
    assert not lab.runs  # four rounds: the stalled one did not count


def test_a_setting_that_never_delivers_keeps_its_runs_for_the_verdict(tmp_path: Any) -> None:
    server = SimpleNamespace(log_errors=lambda: [])
    lab = _LevelLab(tmp_path, [_stalled() for _ in range(3 * 5)])
    (rep,) = lab._repeated(server, "e0", [("32 clients", 32, None)], seed=1)  # type: ignore[arg-type]
    assert len(rep.runs) == 5 and not rep.left_out
    assert not any(lv.delivered for lv in rep.runs)


def test_the_prediction_follows_a_machine_that_slowed_down() -> None:
    """The figures of a real run: the machine ran the uncapped engine at 1,174 tok/s when the
    advisor predicted, then at 439 and 433 around the flags' start: the predicted P99 is
    held in seconds of the slower machine (scaled by 2.7), not of the faster one."""
    capped = Repeated("flags", [level(450, 6.6), level(452, 6.5), level(447, 6.6)])
    first = Repeated("first", [level(1199, 9.0), level(1174, 9.0), level(1138, 9.0)])
    again = Repeated("again", [level(452, 20.0), level(439, 20.0), level(428, 20.0)])
    again2 = Repeated("again 2", [level(437, 20.0), level(433, 20.0), level(420, 20.0)])
    run = CapRun(
        how="engine",
        cap=12,
        capped=capped,
        reference=Repeated("32", [*first.runs, *again.runs, *again2.runs]),
        peak_tokens_per_s=1200,
        flags=["--max-num-seqs 12", "--max-num-queued-reqs 15"],
        reference_start_runs=(first, again, again2),
    )
    assert run.machine_slowdown == pytest.approx(1174 / 436)
    *_, predicted = cap_checks(_run(predicted_p99_s=2.03), run)
    assert predicted.verdict == HOLDS and "x 2.69" in predicted.what
    assert predicted.ratio.estimate == pytest.approx(6.6 / (2.03 * 1174 / 436), rel=0.02)
    # on a steady machine (starts within 1.5x) the prediction is taken as it is
    steady = dataclasses.replace(run, reference_start_runs=(again, again2))
    assert steady.machine_slowdown == 1.0
    *_, predicted = cap_checks(_run(predicted_p99_s=2.03), steady)
    assert predicted.verdict == FAILS and predicted.ratio.estimate == pytest.approx(
        6.6 / 2.03, rel=0.02
    )


def _kv_starved(
    up: list[tuple[int, float]],
    down: list[tuple[int, float]],
    uncapped: list[float],
    predicted: float,
) -> RegimeRun:
    """A KV-starved run with a knee of 10 (plateau levels: 16 clients and more), its way
    back down, and a closed loop whose uncapped runs made ``uncapped`` tok/s."""
    verdict = SimpleNamespace(knee_concurrency=10.0, saturated=True)
    evidence = {"kv_capacity": {"predicted_plateau_tokens_per_s": predicted}}
    report = _report(verdict, evidence)
    run = RegimeRun(
        scenario=SCENARIOS["kv-starved"],
        engine_id="e0",
        startup_s=40.0,
        since_unix_s=0.0,
        until_unix_s=100.0,
        levels=[level(t, 1.0, clients=c) for c, t in up],
        report=report,  # type: ignore[arg-type]
        return_levels=[level(t, 1.0, clients=c) for c, t in down],
    )
    run.client_cap = CapRun(
        how="client",
        cap=10,
        capped=Repeated("cap 10", [level(t, 1.0, clients=10) for t in uncapped]),
        reference=Repeated("32 clients", [level(t, 3.0) for t in uncapped]),
        peak_tokens_per_s=max(t for _, t in up),
    )
    return run


UP = [(4, 500), (8, 800), (12, 900), (16, 960), (24, 950), (32, 940)]
DOWN = [(24, 970), (16, 950), (12, 910), (8, 790)]


def test_the_capacity_model_fails_when_a_steady_machine_refutes_it() -> None:
    run = _kv_starved(UP, DOWN, [950, 930, 960, 940, 955], predicted=1400)
    assert run.sweep_drift == pytest.approx(1.0, abs=0.03)
    assert run.closed_loop_drift == pytest.approx(940 / 950)
    client, engine = plateau_checks(run)
    assert client.verdict == FAILS and engine.verdict == FAILS and not client.note
    assert client.ratio.n_a == 5 + 5  # 16, 24, 32 and back at 24, 16 (>= 1.5 x the knee)


def test_a_sweep_whose_speed_moved_does_not_judge_the_capacity_model() -> None:
    """Fast on the way up, two thirds of that on the way back down: the prediction, made on
    windows of both speeds, is said not judged rather than failed."""
    down = [(c, t / 1.5) for c, t in DOWN]
    run = _kv_starved(UP, down, [t / 1.5 for t in (950, 930, 960, 940, 955)], predicted=1400)
    assert run.sweep_drift == pytest.approx(1.5, rel=0.01)
    client, engine = plateau_checks(run)
    assert client.verdict == WITHIN_NOISE == engine.verdict
    assert "not judged: the machine's speed moved 1.50x within the sweep" in client.note
    assert "24: 950/647" in client.note
    assert "not judged" in checks_table([client, engine])


def test_closed_loop_runs_at_another_speed_are_left_out_of_the_capacity_model() -> None:
    run = _kv_starved(UP, DOWN, [560, 570, 580, 575, 565], predicted=950)
    assert run.closed_loop_drift == pytest.approx(940 / 570)
    client, _ = plateau_checks(run)
    assert client.ratio.n_a == 5  # the sweep's levels only
    assert client.verdict == HOLDS
    assert "5 uncapped runs left out: the sweep's top level ran 1.65x their speed" in client.note

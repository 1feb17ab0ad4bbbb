"""The gateway loops' bookkeeping (``bench/gateway_loops.py``): the pool's in-flight count
from the engines' steps, the rendered texts made runnable, the verdicts. The loops run on
real engines behind real gateways (``tests/integration/test_gateway_loops.py``)."""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest

from bench.gateway_loops import (
    LoopResult,
    Run,
    _listen_local,
    gateway_checks,
    pool_in_flight_max,
    replica_flags,
    server_name_form,
    table,
)
from bench.noise import FAILS, HOLDS, WITHIN_NOISE
from kvscope.advisor.gateways import ReplicaCap, pool_renderings
from kvscope.lab.gateway import router_args

A, B = "127.0.0.1:1:0", "127.0.0.1:2:0"


def _steps(rows: list[tuple[float, str, int, int]]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"ts_unix_s": t, "engine_id": e, "batch_size": b, "waiting": w, "deferred": 0}
            for t, e, b, w in rows
        ]
    )


def test_the_pools_in_flight_is_summed_at_each_step_not_over_separate_maxima() -> None:
    # A peaks at 5 while B holds 1, then B peaks at 6 while A holds 2: the pool never held
    # more than 8, though the maxima add up to 11.
    steps = _steps([(0.0, A, 3, 2), (0.1, B, 1, 0), (0.2, A, 2, 0), (0.3, B, 4, 2), (0.4, A, 1, 0)])
    assert pool_in_flight_max(steps, [A, B]) == 8
    assert pool_in_flight_max(steps, [A]) == 5
    assert pool_in_flight_max(steps.iloc[:0], [A, B]) == 0


def _run(setting: str, tok: float, p99: float, in_flight: dict[str, int], **kw: Any) -> Run:
    return Run(
        setting=setting, clients=32, tokens_per_s=tok, e2e_p99_s=p99, completed=100,
        errors=kw.get("errors", {}), in_flight_max=in_flight,
        in_flight_mean={k: float(v) for k, v in in_flight.items()},
        pool_in_flight_max=kw.get("pool", sum(in_flight.values())), engine_e2e_p99_s=p99,
        queue_p50_s=None, queue_p99_s=None, started_unix_s=0.0, finished_unix_s=1.0,
    )  # fmt: skip


def _caps() -> dict[str, ReplicaCap]:
    return {
        A: ReplicaCap(address="127.0.0.1:1", cap=10, max_num_seqs=9, queue=3),
        B: ReplicaCap(address="127.0.0.1:2", cap=12, max_num_seqs=11, queue=3),
    }


def _loop(runs: list[Run]) -> LoopResult:
    return LoopResult(
        loop="nginx-pool", caps={"127.0.0.1:1": 10, "127.0.0.1:2": 12}, gateway_config="",
        excess_says="", predicted_p99_e2e_s=1.0, predicted_throughput_fraction=0.9, runs=runs,
    )  # fmt: skip


def _verdicts(checks: list[Any]) -> dict[str, str]:
    return {c.name: c.verdict for c in checks}


def test_a_gateway_that_holds_each_replica_keeps_throughput_and_cuts_the_tail_holds() -> None:
    ok = {"http_503": 40}
    runs = [_run("nginx", t, 1.0, {A: 10, B: 12}, errors=ok) for t in (1000.0, 1010.0, 990.0)] + [
        _run("uncapped", t, 4.0, {A: 30, B: 34}) for t in (1050.0, 1040.0, 1060.0)
    ]
    v = _verdicts(gateway_checks(_loop(runs), "nginx", _caps()))
    assert set(v.values()) == {HOLDS}, v


def test_one_step_past_a_replicas_cap_or_a_status_the_rendering_does_not_name_fails() -> None:
    runs = [
        _run("nginx", 1000.0, 1.0, {A: 11, B: 12}, errors={"http_503": 5, "http_502": 1}),
        _run("nginx", 1000.0, 1.0, {A: 10, B: 12}, errors={"http_503": 5}),
    ] + [_run("uncapped", t, 4.0, {A: 30, B: 34}) for t in (1000.0, 1010.0)]
    v = _verdicts(gateway_checks(_loop(runs), "nginx", _caps()))
    assert v["127.0.0.1:1 in flight <= cap 10"] == FAILS
    assert v["127.0.0.1:2 in flight <= cap 12"] == HOLDS
    assert v["the excess gets 503, nothing else"] == FAILS


def test_under_the_router_a_replica_may_hold_its_vllm_queue_too() -> None:
    ok = {"http_429": 30, "http_503": 2}
    runs = [
        _run("vllm-router", t, 1.5, {A: 13, B: 15}, errors=ok) for t in (1000.0, 990.0, 1005.0)
    ] + [_run("uncapped", t, 4.0, {A: 30, B: 34}) for t in (1050.0, 1040.0, 1060.0)]
    bound = {eid: c.max_num_queued_reqs for eid, c in _caps().items()}
    checks = gateway_checks(_loop(runs), "vllm-router", _caps(), bound)
    assert all(c.verdict == HOLDS for c in checks), [(c.name, c.verdict) for c in checks]
    # 14 in flight at a replica admitting 10 + 3 is one too many.
    runs[0].in_flight_max[A] = 14
    assert gateway_checks(_loop(runs), "vllm-router", _caps(), bound)[0].verdict == FAILS


def test_the_old_server_name_form_is_shown_to_hold_the_pool_to_one_cap() -> None:
    nginx = [
        _run("nginx", t, 1.0, {A: 10, B: 12}, errors={"http_503": 9}) for t in (1000.0, 1010.0)
    ]
    uncapped = [_run("uncapped", t, 4.0, {A: 30, B: 34}) for t in (1050.0, 1040.0)]
    old = [
        _run("nginx $server_name", t, 0.8, {A: 6, B: 7}, errors={"http_503": 20}, pool=10)
        for t in (480.0, 500.0)
    ]

    def verdicts() -> tuple[str, str, str]:
        checks = gateway_checks(_loop(nginx + uncapped + old), "nginx", _caps())
        held, tp = (c for c in checks if "$server_name" in c.name)
        return held.verdict, tp.verdict, held.figure

    assert verdicts() == (HOLDS, HOLDS, "pool in flight max 10 (the rendered form: 22)")
    # Half the rendered form's throughput in one round, nine tenths in the other: the
    # loss is within noise, reported, not failed.
    old[1].tokens_per_s = 910.0
    assert verdicts()[:2] == (HOLDS, WITHIN_NOISE)
    # No loss at all refutes it.
    old[0].tokens_per_s, old[1].tokens_per_s = 1000.0, 1010.0
    assert verdicts()[1] == FAILS
    # A pool that went past one replica's cap refutes the mechanism, whatever the throughput.
    for r in old:
        r.pool_in_flight_max = 13
    assert verdicts()[0] == FAILS
    assert "nginx $server_name" in table([_loop(nginx + uncapped + old)])


def test_the_rendered_nginx_text_listens_locally_and_the_old_form_parses() -> None:
    site = pool_renderings("p", list(_caps().values()))["nginx"]["config"]
    local = _listen_local(site, 8123)
    assert "listen 127.0.0.1:8123;" in local and "listen 80;" not in local
    assert local.replace("listen 127.0.0.1:8123;", "listen 80;") == site
    with pytest.raises(ValueError, match="listen 80"):
        _listen_local("server { listen 8080; }", 1)
    old = server_name_form({"127.0.0.1:1": 10, "127.0.0.1:2": 12}, 10, 8124)
    assert "limit_conn_zone $server_name" in old and "limit_conn vllm_conn 10;" in old
    assert "server_name vllm.local;" in old  # a non-empty key, else nothing is limited


def test_the_rendered_router_command_becomes_the_routers_arguments() -> None:
    command = pool_renderings("p", list(_caps().values()))["vllm_router"]["config"]
    args = router_args(command)
    assert args[:3] == ["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert "--max-concurrent-requests" in args and args[-1] == "--disable-circuit-breaker"
    with pytest.raises(ValueError, match="not a vllm-router command"):
        router_args("nginx -s reload")


def test_a_restarted_engine_gets_the_flags_of_the_cap_measured_at_its_port() -> None:
    from types import SimpleNamespace

    def rec(eid: str, seqs: int, queued: int) -> Any:
        return SimpleNamespace(
            kind="concurrency_cap",
            scope=SimpleNamespace(engine_id=eid),
            change={"vllm_flags": [f"--max-num-seqs {seqs}", f"--max-num-queued-reqs {queued}"]},
        )

    report: Any = SimpleNamespace(recommendations=[rec(A, 9, 13), rec(B, 11, 15)])
    # the engines listed port 2 first: ids sort the other way
    assert replica_flags(report, _caps(), [2, 1], None) == [
        {"--max-num-seqs": 11, "--max-num-queued-reqs": 15},
        {"--max-num-seqs": 9, "--max-num-queued-reqs": 13},
    ]
    assert replica_flags(report, _caps(), [1, 2], 0)[0]["--max-num-queued-reqs"] == 10
    # Behind the router: the flags its rendering gives each replica (its cap, no vLLM queue).
    router = pool_renderings("p", list(_caps().values()))["vllm_router"]
    assert replica_flags(report, _caps(), [2, 1], None, router) == [
        {"--max-num-seqs": 11, "--max-num-queued-reqs": 12},
        {"--max-num-seqs": 9, "--max-num-queued-reqs": 10},
    ]

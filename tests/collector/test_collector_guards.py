"""Unit tests of the collector's overload guards (clock injected for the minute window)."""

from __future__ import annotations

import pytest

from kvscope.collector._guards import ByteBudget, NewEngineGate, Overbudget


def test_byte_budget_refuses_past_the_limit_and_leases_give_back() -> None:
    budget = ByteBudget(100)
    a, b = budget.lease(), budget.lease()
    a.take(60)
    with pytest.raises(Overbudget):
        b.take(41)
    assert budget.used == 60 and b.held == 0  # a refused take holds nothing
    b.take(40)
    assert budget.used == budget.peak == 100
    a.release()
    a.release()  # idempotent
    assert budget.used == 40
    b.release()
    assert budget.used == 0 and budget.peak == 100


def test_new_engine_gate_admits_a_rate_and_never_limits_known_engines() -> None:
    now = [1000.0]
    known = {"old"}
    gate = NewEngineGate(3, known.__contains__, clock=lambda: now[0])
    assert [gate.admit(f"e{i}") for i in range(5)] == [True, True, True, False, False]
    assert gate.admit("old") and gate.admit("e1")  # known, or admitted already
    now[0] += 59.9
    assert not gate.admit("e9")
    now[0] += 0.2  # the first admissions left the sliding minute
    assert [gate.admit(f"n{i}") for i in range(4)] == [True, True, True, False]

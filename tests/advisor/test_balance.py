"""Load balance across the replicas of a pool."""

from __future__ import annotations

import pandas as pd
import pytest

from kvscope.advisor import LoadBalance
from kvscope.advisor.findings import Scope

T0 = 1_700_000_000


def _windows(
    loads: dict[str, float], seconds: int = 60, every: dict[str, int] | None = None
) -> pd.DataFrame:
    rows = []
    for eid, load in loads.items():
        step = (every or {}).get(eid, 1)
        for t in range(0, seconds, step):
            rows.append(
                {
                    "engine_id": eid,
                    "ts_s": T0 + t,
                    "n_steps": 20,
                    "batch_mean": load,
                    "waiting_mean": 0.0,
                    "deferred_mean": 0.0,
                }
            )
    return pd.DataFrame(rows)


def _requests(counts: dict[str, int]) -> pd.DataFrame:
    return pd.DataFrame({"engine_id": [e for e, n in counts.items() for _ in range(n)]})


def test_imbalance_is_flagged_with_a_least_loaded_recommendation() -> None:
    lb = LoadBalance().fit(
        _windows({"h1:8000:0": 8.0, "h2:8000:0": 2.0}),
        _requests({"h1:8000:0": 75, "h2:8000:0": 25}),
        ["h1:8000:0", "h2:8000:0"],
    )
    assert lb.imbalance_ == pytest.approx(1.6)
    assert lb.flagged_ and lb.busiest_ == "h1:8000:0"
    assert lb.request_share_ == {"h1:8000:0": 0.75, "h2:8000:0": 0.25}
    f = lb.finding(Scope(pool="p"))
    assert f.severity == "warning" and f.evidence["load_imbalance"] == pytest.approx(1.6)
    idle = lb.recommendation(Scope(pool="p"), busiest_saturated=False)
    assert idle is not None and idle.expected_gain == 0.0
    rec = lb.recommendation(Scope(pool="p"), busiest_saturated=True)
    assert rec is not None and rec.kind == "least_loaded_routing"
    assert rec.expected_gain == pytest.approx(1 - 5.0 / 8.0)
    assert rec.change["router_policy"] == "least-loaded"
    assert rec.change["gateway"]["nginx_upstream"] == (
        "upstream p { least_conn; server h1:8000; server h2:8000; }"
    )


def test_even_or_idle_pools_are_not_flagged() -> None:
    even = LoadBalance().fit(_windows({"a": 5.0, "b": 5.0}), pd.DataFrame(), ["a", "b"])
    assert even.imbalance_ == pytest.approx(1.0) and not even.flagged_
    assert even.recommendation(Scope(pool="p"), busiest_saturated=True) is None
    idle = LoadBalance().fit(_windows({"a": 0.4, "b": 0.1}), pd.DataFrame(), ["a", "b"])
    assert idle.imbalance_ == pytest.approx(1.6) and not idle.flagged_  # mean load 0.25 < 1
    assert (
        LoadBalance(threshold=2.0)
        .fit(_windows({"a": 8.0, "b": 2.0}), pd.DataFrame(), ["a", "b"])
        .flagged_
        is False
    )


def test_seconds_without_windows_count_as_idle() -> None:
    # Engine b works every other second at 4 in flight: its mean over the span is 2.
    lb = LoadBalance().fit(
        _windows({"a": 2.0, "b": 4.0}, every={"b": 2}), pd.DataFrame(), ["a", "b"]
    )
    assert lb.mean_load_["b"] == pytest.approx(2.0)
    assert lb.imbalance_ == pytest.approx(1.0)
    # An engine of the pool with no window at all carries no load.
    lb = LoadBalance().fit(_windows({"a": 4.0}), pd.DataFrame(), ["a", "b"])
    assert lb.mean_load_["b"] == 0.0 and lb.imbalance_ == pytest.approx(2.0)

"""The read API over real HTTP: filters, shapes, limits and parameter errors."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from _collector_helpers import batch, get_json, hello, http, post_batch

NOW = time.time()
T0 = float(int(NOW) - 600)  # ten minutes ago: inside the default since=1h


@pytest.fixture
def fleet(collector: Any) -> Any:
    """Three engines in two pools; e3 never sent a hello."""
    for i, (eid, pool) in enumerate((("e1", "pool-a"), ("e2", "pool-a"), ("e3", None))):
        b = batch(
            engine_id=eid,
            seq=0,
            step_ts=[T0 + s + 0.5 for s in range(5)],
            req_ts=[T0 + 1 + i, T0 + 3 + i],
        )
        if pool:
            b["hello"] = hello(eid, "boot-1", pool=pool, model=f"m-{i}")
        assert post_batch(collector.url, b)[0] == 200
    # Old data, outside the default window.
    assert post_batch(collector.url, batch(engine_id="e1", seq=1, step_ts=[T0 - 86400]))[0] == 200
    return collector


def test_engines(fleet: Any) -> None:
    status, body = get_json(fleet.url, "/v1/engines")
    assert status == 200
    assert body["n_rows"] == 3 and body["truncated"] is False
    rows = {r["engine_id"]: r for r in body["rows"]}
    assert rows["e1"]["pool"] == "pool-a" and rows["e1"]["max_num_seqs"] == 256
    assert rows["e3"]["has_hello"] is False and rows["e3"]["pool"] is None


def test_engine_configs(fleet: Any) -> None:
    status, body = get_json(fleet.url, "/v1/engines/e2/configs")
    assert status == 200
    assert [r["boot_id"] for r in body["rows"]] == ["boot-1"]
    assert body["rows"][0]["model"] == "m-1"
    status, body = get_json(fleet.url, "/v1/engines/nope/configs")
    assert status == 404 and "nope" in body["error"]


def test_windows_filters(fleet: Any) -> None:
    status, body = get_json(fleet.url, "/v1/windows")
    assert status == 200
    assert body["n_rows"] == 15  # default since=1h excludes the old step
    _, body = get_json(fleet.url, "/v1/windows?since=2d")
    assert body["n_rows"] == 16
    _, body = get_json(fleet.url, "/v1/windows?engine=e1")
    assert {r["engine_id"] for r in body["rows"]} == {"e1"} and body["n_rows"] == 5
    _, body = get_json(fleet.url, "/v1/windows?pool=pool-a&format=columns")
    assert set(body["columns"]["engine_id"]) == {"e1", "e2"}
    assert body["columns"]["pool"] == ["pool-a"] * 10
    _, body = get_json(fleet.url, f"/v1/windows?since={T0 + 1}&until={T0 + 3}&engine=e2")
    assert [r["ts_s"] for r in body["rows"]] == [int(T0) + 1, int(T0) + 2]
    r = body["rows"][0]
    assert {"n_steps", "batch_mean", "batch_p99", "kv_usage_max", "prefix_hits"} <= set(r)


def test_steps_and_limit(fleet: Any) -> None:
    _, body = get_json(fleet.url, "/v1/steps?engine=e1&since=2d")
    assert body["n_rows"] == 6
    _, body = get_json(fleet.url, "/v1/steps?limit=4")
    assert body["n_rows"] == 4 and body["truncated"] is True
    assert [r["ts_unix_s"] for r in body["rows"]] == sorted(r["ts_unix_s"] for r in body["rows"])
    _, body = get_json(fleet.url, "/v1/steps?limit=15")
    assert body["n_rows"] == 15 and body["truncated"] is False


def test_steps_sampled_every_kth(fleet: Any) -> None:
    _, every = get_json(fleet.url, "/v1/steps?engine=e1&since=2d&format=columns")
    ts = every["columns"]["ts_unix_s"]
    _, body = get_json(fleet.url, "/v1/steps?engine=e1&since=2d&every=2&format=columns")
    assert body["columns"]["ts_unix_s"] == ts[::2]  # the 1st, 3rd, 5th of the 6
    assert "_n" not in body["columns"]
    _, body = get_json(fleet.url, "/v1/steps?every=4&limit=2")
    assert body["n_rows"] == 2 and body["truncated"] is True  # 15 steps: the 1st, 5th, 9th, 13th
    for bad in ("0", "-3", "x"):
        status, body = get_json(fleet.url, f"/v1/steps?every={bad}")
        assert status == 400 and "every" in body["error"]


def test_requests_and_stats(fleet: Any) -> None:
    _, body = get_json(fleet.url, "/v1/requests?pool=pool-a")
    assert body["n_rows"] == 4
    assert {r["finish_reason"] for r in body["rows"]} <= {"stop", "length"}
    _, body = get_json(fleet.url, "/v1/request_stats")
    assert [r["engine_id"] for r in body["rows"]] == ["e1", "e2", "e3"]
    assert all(r["n_requests"] == 2 for r in body["rows"])
    _, body = get_json(fleet.url, "/v1/request_stats?group_by=pool")
    by_pool = {r["pool"]: r["n_requests"] for r in body["rows"]}
    assert by_pool == {"pool-a": 4, None: 2}
    _, body = get_json(fleet.url, "/v1/request_stats?group_by=all")
    assert body["rows"][0]["n_requests"] == 6
    assert "e2e_s_p99" in body["rows"][0]


def test_totals(fleet: Any) -> None:
    _, w = get_json(fleet.url, "/v1/totals")
    _, s = get_json(fleet.url, "/v1/totals?source=steps")
    assert w["rows"] == s["rows"]
    assert {r["engine_id"]: r["n_steps"] for r in w["rows"]} == {"e1": 6, "e2": 5, "e3": 5}


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("/v1/windows?since=yesterday", "since"),
        ("/v1/windows?until=-5", "until"),
        ("/v1/windows?since=10&until=5", "until"),
        ("/v1/steps?limit=0", "limit"),
        ("/v1/steps?limit=many", "limit"),
        ("/v1/steps?limit=99999999", "limit"),
        ("/v1/windows?format=xml", "format"),
        ("/v1/windows?engin=e1", "engin"),
        ("/v1/windows?engine=", "engine"),
        ("/v1/request_stats?group_by=model", "group_by"),
        ("/v1/totals?source=raw", "source"),
        ("/v1/engines?since=1h", "since"),
        ("/v1/windows?fields=ts_s,nonsense", "nonsense"),
        ("/v1/windows?fields=,", "fields"),
    ],
)
def test_bad_params_400(fleet: Any, path: str, needle: str) -> None:
    status, body = get_json(fleet.url, path)
    assert status == 400
    assert needle in body["error"]


def test_fields(fleet: Any) -> None:
    _, body = get_json(fleet.url, "/v1/windows?engine=e1&fields=ts_s,batch_max&format=columns")
    assert set(body["columns"]) == {"ts_s", "batch_max"}
    assert len(body["columns"]["ts_s"]) == 5


def test_healthz(collector: Any) -> None:
    status, body = get_json(collector.url, "/healthz")
    assert status == 200
    assert body["status"] == "ok" and body["writer_alive"] is True


def test_empty_store_answers(collector: Any) -> None:
    for path in (
        "/v1/engines",
        "/v1/windows",
        "/v1/steps",
        "/v1/requests",
        "/v1/request_stats",
        "/v1/totals",
    ):
        status, body = get_json(collector.url, path)
        assert status == 200, path
        assert body["n_rows"] == 0, path
    status, _, _ = http("GET", collector.url + "/v1/windows?format=columns")
    assert status == 200


def test_runbooks_are_served_without_the_token(make_collector: Any) -> None:
    """The alert rules' runbook_url is http://<instance>/runbooks/<alert>: every alert of
    deploy/prometheus/kvscope-alerts.yml has its page there, even with a read token set."""
    rules = Path(__file__).parents[2] / "deploy" / "prometheus" / "kvscope-alerts.yml"
    alerts = re.findall(r"- alert: (\w+)", rules.read_text())
    assert len(alerts) >= 10
    c = make_collector(token="s3cret-token-for-reads")
    for name in alerts:
        status, headers, data = http("GET", f"{c.url}/runbooks/{name}")
        assert status == 200, name
        assert {k.lower(): v for k, v in headers.items()}["content-type"].startswith("text/plain")
        assert data.decode().startswith(f"# {name}\n"), name
    status, _, data = http("GET", f"{c.url}/runbooks/")
    assert status == 200 and all(name in data.decode() for name in alerts)
    for bad in ("KvscopeNoSuchAlert", "..%2Fsettings", "Kvscope.Absent"):
        status, _, data = http("GET", f"{c.url}/runbooks/{bad}")
        assert status == 404 and b"known: KvscopeAdvisorRunsFailing" in data, (bad, data)
    assert http("GET", f"{c.url}/v1/engines")[0] == 401  # the rest still needs the token

"""The dashboard and the alert rules on a real Prometheus scraping a real collector
while it receives real vLLM runs at their recorded pace.

The fleet: pool ``demo`` with two replicas, the bundled KV-starved recording
(``demo-host:8000:0``) and the seq-capped one renamed ``demo-host:8001:0``, each
beside vLLM's own KV-event publisher sending prefixes that the other replica holds
(so duplication, routing loss and load balance have data). The recordings up to the
KV-starved engine's overload (its 16- and 32-client levels) are sent at once, moved
so that the overload starts now; then Prometheus starts (1 s scrapes, the rules
evaluated every second) and scrapes that state once, and the overload follows at its
recorded pace, about 30 s, from then on (the seconds spent starting Prometheus delay it).
So Prometheus's rates cover the overload only, as they would a minute into a real one.
A few malformed batches are sent meanwhile, as a misconfigured engine would.

Then every dashboard query and every rule selector must return data, the overload
alerts must be active (pending: their ``for:`` is minutes) for the KV-starved
engine, and the data-path alerts must stay quiet except the rejection one.
"""

from __future__ import annotations

import gzip
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from _deploy_fleet import (
    KvPublisher,
    SharedPrefixTraffic,
    Stream,
    first_step_unix_s,
    last_sent_unix_s,
)
from _prom import (
    ALERTS,
    MULTI_ENGINE_KV_EVENT_METRICS,
    OVERLOAD_ALERTS,
    Prometheus,
    dashboard_queries,
    describe,
    finite,
    load_dashboard,
    rule_queries,
    selectors,
)

from kvscope.collector.process import CollectorProcess
from kvscope.lab.recording import BUNDLED_RECORDING

pytestmark = pytest.mark.promtool

RECORDINGS = BUNDLED_RECORDING.parent
STARVED = "demo-host:8000:0"
CAPPED = "demo-host:8001:0"
POOL = "demo"
OVERLOAD_AFTER_S = 52.0
"""Where the KV-starved recording's overload begins (its 16-client level), from its
first step."""
QUIET_ALERTS = (
    "KvscopeEngineNotReporting",
    "KvscopeExporterDroppingData",
    "KvscopePluginRecordErrors",
    "KvscopeCollectorStoreFailing",
    "KvscopeAdvisorRunsFailing",
    "KvscopeCollectorAbsent",
    "KvscopeKvEventsNotSubscribed",
    "KvscopeKvEventsMissed",
    "KvscopePrefixHitRateCollapse",
)


@dataclass
class LiveFleet:
    collector: CollectorProcess
    prometheus: Prometheus
    at: float
    """Evaluation time: the end of the overload."""
    rejected: int


def _metrics_value(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def _wait(cond: Any, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _post_malformed(url: str) -> int:
    req = urllib.request.Request(
        url + "/v1/ingest",
        data=gzip.compress(b'{"schema_version": 1}'),
        method="POST",
        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveFleet]:
    work = tmp_path_factory.mktemp("live-prom")
    collector = CollectorProcess(
        work / "kvscope.duckdb", extra_args=["--advise-interval-s", "2", "--advise-window-s", "900"]
    ).start()
    pubs: list[KvPublisher] = []
    prom: Prometheus | None = None
    traffic: SharedPrefixTraffic | None = None
    try:
        pubs = [KvPublisher(10_000_000), KvPublisher(20_000_000)]
        starved_path = RECORDINGS / "overload_kv_starved.jsonl.gz"
        capped_path = RECORDINGS / "seq_capped.jsonl.gz"
        overload_at = time.time()
        shift = overload_at - (first_step_unix_s(starved_path) + OVERLOAD_AFTER_S)
        starved = Stream.from_recording(
            starved_path, shift_s=shift, kv_events_endpoint=pubs[0].endpoint
        )
        capped = Stream.from_recording(
            capped_path,
            shift_s=starved.end_unix_s - last_sent_unix_s(capped_path),
            engine_id=CAPPED,
            port=8001,
            kv_events_endpoint=pubs[1].endpoint,
        )
        streams = [starved, capped]
        for s in streams:
            s.send_due(collector.url, overload_at)
        assert all(s.sent for s in streams) and not any(s.done for s in streams)

        # The collector subscribes to both publishers; ZMQ drops what is published
        # before the connection is up, so publish empty batches until they arrive.
        def subscribed() -> bool:
            text = collector.get_text("/metrics")
            return all(
                _metrics_value(text, "kvscope_kv_events_subscribed", engine=e) == 1
                for e in (STARVED, CAPPED)
            )

        _wait(subscribed, "the KV-event subscriptions", 20)

        def events_arrive() -> bool:
            for p in pubs:
                p.publish([])
            rows = collector.get_json("/v1/kv_events", params={"since": "0"})["rows"]
            return {r["engine_id"] for r in rows} >= {STARVED, CAPPED}

        _wait(events_arrive, "the first KV events", 20)

        prom = Prometheus(
            work, targets=[f"{collector.host}:{collector.port}"], rule_files=[ALERTS]
        ).start()
        prom.wait_for('up{job="kvscope"} == 1', "the first scrape of the collector", 30)
        traffic = SharedPrefixTraffic(pubs).start()
        # The overload is replayed at its recorded pace from here on, however long the
        # set-up took: sent at once, its ~30 s would fall between two scrapes on a slow
        # machine (once, 6 s of it were scraped, and the 10-minute load average stayed
        # under 1.5 x the knee).
        lag = max(0.0, time.time() - overload_at)
        rejected = 0
        next_bad = time.time() + 5
        while not all(s.done for s in streams):
            now = time.time()
            for s in streams:
                s.send_due(collector.url, now - lag)
            if rejected < 4 and now >= next_bad:
                assert _post_malformed(collector.url) == 400
                rejected += 1
                next_bad = now + 3
            time.sleep(0.05)
        traffic.stop()
        # The replay's remainder can be shorter than 4 x 3 s on a slow machine (its setup
        # ate into it): the malformed batches the data-path alert needs are sent anyway.
        while rejected < 4:
            assert _post_malformed(collector.url) == 400
            rejected += 1
            time.sleep(0.5)
        # The advisor reads up to 5 s before now, every 2 s: let it see the end.
        time.sleep(8)
        yield LiveFleet(collector, prom, time.time(), rejected)
    finally:
        if traffic is not None:
            traffic.stop()
        if prom is not None:
            prom.stop()
        for p in pubs:
            p.close()
        collector.stop()


def test_the_advisor_saw_the_overload(live: LiveFleet) -> None:
    p = live.prometheus
    b = p.query(f'kvscope_advisor_bottleneck{{engine="{STARVED}"}}', live.at)
    assert [s["metric"]["bottleneck"] for s in b] == ["kv_cache_bound"], describe(b)
    assert p.query(f'kvscope_advisor_saturated{{engine="{STARVED}"}} == 1', live.at)
    for name in (
        "kvscope_advisor_pool_prefix_routing_loss_ratio",
        "kvscope_advisor_pool_predicted_prefix_hit_ratio_affine",
        "kvscope_advisor_pool_load_imbalance_ratio",
    ):
        assert p.query(f'{name}{{pool="{POOL}"}}', live.at), name


def test_template_variables_resolve(live: LiveFleet) -> None:
    p = live.prometheus
    assert p.api("/api/v1/label/pool/values", **{"match[]": "kvscope_engine_info"}) == [POOL]
    engines = p.api(
        "/api/v1/label/engine/values", **{"match[]": f'kvscope_engine_info{{pool=~"{POOL}"}}'}
    )
    assert sorted(engines) == [STARVED, CAPPED]


@pytest.mark.parametrize("engine", [".*", STARVED], ids=["all engines", "one engine"])
def test_every_dashboard_query_returns_data(live: LiveFleet, engine: str) -> None:
    empty = []
    for q in dashboard_queries(load_dashboard(), pool=POOL, engine=engine, rate_interval="30s"):
        res = live.prometheus.query(q.expr, live.at)
        if not finite(res):
            empty.append(f"{q.where}: {q.expr} -> {describe(res)}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_every_rule_selector_returns_data(live: LiveFleet) -> None:
    empty = []
    for q in rule_queries():
        for sel in selectors(q.expr):
            if not live.prometheus.query(sel, live.at):
                empty.append(f"{q.where}: {sel}")
    assert not empty, "selectors without series:\n" + "\n".join(empty)
    # The KV-event and pool metrics are among them (they need this two-replica pool).
    used = {n for q in rule_queries() for n in MULTI_ENGINE_KV_EVENT_METRICS if n in q.expr}
    assert used, "the rules read no KV-event metric"


def test_rules_evaluate_without_errors(live: LiveFleet) -> None:
    bad = [(n, h, e) for n, h, e in live.prometheus.rule_health() if h != "ok"]
    assert not bad, bad


def test_overload_alerts_are_active_for_the_starved_engine(live: LiveFleet) -> None:
    p = live.prometheus
    exprs = {q.where: q.expr for q in rule_queries()}
    for name in OVERLOAD_ALERTS:
        res = p.query(exprs[name], live.at)
        assert STARVED in {s["metric"].get("engine") for s in res}, f"{name}: {describe(res)}"
        # Prometheus's own rule evaluation agrees: the alert is pending (its for: is
        # minutes long) or firing.
        alerts = p.query(f'ALERTS{{alertname="{name}", engine="{STARVED}"}}', live.at)
        assert {s["metric"]["alertstate"] for s in alerts} & {"pending", "firing"}, name
    # The seq-capped replica queues too (past its knee) but its KV cache has room and it
    # does not preempt: those two alerts tell the bottlenecks apart.
    active = {s["metric"]["alertname"] for s in p.query(f'ALERTS{{engine="{CAPPED}"}}', live.at)}
    assert active == {"KvscopeLoadPastKnee"}, active


def test_data_path_alerts(live: LiveFleet) -> None:
    p = live.prometheus
    exprs = {q.where: q.expr for q in rule_queries()}
    assert live.rejected >= 3
    res = p.query(exprs["KvscopeCollectorRejectingBatches"], live.at)
    assert res and float(res[0]["value"][1]) > 0, describe(res)
    for name in QUIET_ALERTS:
        res = p.query(exprs[name], live.at)
        assert not res, f"{name} on a healthy fleet: {describe(res)}"


def test_configuration_gauges_carry_the_hellos_numbers(live: LiveFleet) -> None:
    """kvscope_engine_max_num_seqs & co., which the batch and KV panels compare with."""
    want = {
        STARVED: {"max_num_seqs": 256, "kv_capacity_blocks": 48},
        CAPPED: {"max_num_seqs": 6, "kv_capacity_blocks": 4096},
    }
    for engine, values in want.items():
        for name, value in {
            **values,
            "kv_block_size_tokens": 32,
            "max_num_batched_tokens": 2048,
        }.items():
            res = live.prometheus.query(f'kvscope_engine_{name}{{engine="{engine}"}}', live.at)
            assert [float(s["value"][1]) for s in res] == [value], (engine, name, describe(res))

"""KV-cache events end to end: vLLM's real ZMQ publisher -> a real collector -> the
store, ``/v1/kv_events`` and ``/metrics``.

Every engine is a real ``vllm.distributed.kv_events.ZmqEventPublisher`` on a free
loopback port, publishing real ``KVEventBatch`` / ``BlockStored`` / ``BlockRemoved``
objects; its hello goes over HTTP, and its endpoint is the one the plugin computes
from a real ``KVEventsConfig``. Engines of one pool store the same prefixes under
different local hashes, as vLLM's per-process random hash seeds make them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _collector_helpers import batch, get_json, hello, http, post_batch
from prometheus_client.parser import text_string_to_metric_families
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from kvscope.collector.process import CollectorProcess, free_port
from kvscope.engine_plugins.plugin import kv_events_endpoint

PROMTOOL = "/usr/bin/promtool"
BS = 4
P1, P2, P3, X = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]


class Engine:
    """One engine's KV-event publisher (vLLM's own class) and the endpoint it advertises."""

    def __init__(
        self, engine_id: str, pool: str, *, dp_rank: int = 0, advertise: bool = True
    ) -> None:
        self.engine_id, self.pool = engine_id, pool
        base = free_port() - dp_rank  # vLLM publishes on base + the data-parallel rank
        cfg = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{base}",
            topic="kv-events",
        )
        self.pub = ZmqEventPublisher(dp_rank, endpoint=cfg.endpoint, topic=cfg.topic)
        self.advertised = kv_events_endpoint(cfg, dp_rank)
        assert self.advertised == f"tcp://*:{base + dp_rank}"
        self.port = base + dp_rank
        self.advertise = advertise

    def hello(self, boot_id: str = "boot-1", **over: Any) -> dict[str, Any]:
        h = hello(self.engine_id, boot_id, pool=self.pool, block_size=BS, **over)
        if self.advertise:
            h["kv_events_endpoint"] = self.advertised
        return h

    def publish(self, events: list[Any]) -> None:
        self.pub.publish(KVEventBatch(ts=time.time(), events=events))

    def close(self) -> None:
        self.pub.shutdown()


def stored(hashes: list[Any], parent: Any, tokens: list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def removed(h: Any) -> BlockRemoved:
    return BlockRemoved(block_hashes=[h], medium="GPU")


def rows(url: str, **params: Any) -> list[dict[str, Any]]:
    q = "&".join(f"{k}={v}" for k, v in {"since": 0, **params}.items())
    status, body = get_json(url, f"/v1/kv_events?{q}")
    assert status == 200, body
    return list(body["rows"])


def totals(url: str, engine_id: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows(url, engine_id=engine_id):
        for k, v in r.items():
            if k.endswith(("_blocks", "_batches", "_events")) and not k.startswith("held"):
                out[k] = out.get(k, 0) + int(v)
    return out


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def connect(url: str, e: Engine) -> None:
    """Publish empty batches until the collector receives them (ZMQ joins late), then
    wait until nothing more is in flight."""
    base = totals(url, e.engine_id).get("n_batches", 0)

    def arrived() -> bool:
        e.publish([])
        return totals(url, e.engine_id).get("n_batches", 0) > base

    wait_for(arrived, f"{e.engine_id}'s first KV events")
    last = -1
    while (n := totals(url, e.engine_id)["n_batches"]) != last:
        last = n
        time.sleep(0.4)


def send(url: str, e: Engine, events: list[Any]) -> None:
    """Publish one batch and wait until the collector has stored it."""
    before = totals(url, e.engine_id).get("n_batches", 0)
    e.publish(events)
    wait_for(
        lambda: totals(url, e.engine_id).get("n_batches", 0) > before,
        f"{e.engine_id}'s batch to be stored",
    )


def scrape(url: str) -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    status, _, body = http("GET", url + "/metrics")
    assert status == 200
    text = body.decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, samples


def promtool_ok(text: str) -> None:
    if not shutil.which(PROMTOOL):
        pytest.fail(f"{PROMTOOL} is missing: install the Debian 'prometheus' package")
    res = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30
    )
    assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()
    assert not res.stdout.strip() and not res.stderr.strip(), res.stdout + res.stderr


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


def _kv(make_collector: Any, **over: Any) -> Any:
    over.setdefault("kv_events_flush_interval_s", 0.1)
    over.setdefault("advise_interval_s", 0)
    return make_collector(**over)


def test_duplication_measured_within_a_pool(make_collector: Any, engines: list[Engine]) -> None:
    a = Engine("node-a:8000:1", "pool-p", dp_rank=1)
    b = Engine("node-b:8000:0", "pool-p")
    # c runs an older plugin (no kv_events_endpoint in its hello): the operator names
    # its endpoint on the collector's command line instead.
    c = Engine("node-c:8000:0", "pool-q", advertise=False)
    engines += [a, b, c]
    lc = _kv(make_collector, kv_events_endpoints=((c.engine_id, f"tcp://127.0.0.1:{c.port}"),))
    for e in engines:
        assert post_batch(lc.url, batch(engine_id=e.engine_id, hello=e.hello()))[0] == 200
        connect(lc.url, e)
    _, eng = get_json(lc.url, "/v1/engines")
    endpoints = {r["engine_id"]: r["kv_events_endpoint"] for r in eng["rows"]}
    assert endpoints == {a.engine_id: a.advertised, b.engine_id: b.advertised, c.engine_id: None}

    # a: P1 P2 P3 under its own hashes.
    send(lc.url, a, [stored([101, 102, 103], None, P1 + P2 + P3)])
    # b: P1 P2 (other hashes, 32-byte as sha256 gives), then X after P2. P1 and P2 are
    # held by a: 2 duplicates, both seen before.
    b1, b2, bx = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    send(lc.url, b, [stored([b1, b2], None, P1 + P2), stored([bx], b2, X)])
    # c, another pool, stores what a holds: no duplicate, nothing seen before there.
    send(lc.url, c, [stored([7001, 7002, 7003], None, P1 + P2 + P3)])
    # a evicts P2 and P3, then stores P2 again (b holds it: 1 duplicate, reseen) and P3
    # again (only a itself had it: no duplicate, reseen).
    send(lc.url, a, [removed(102), removed(103)])
    send(lc.url, a, [stored([202], 101, P2), stored([203], 202, P3)])
    # Three batches of a are lost in transit: the next one shows the gap.
    for _ in range(3):
        next(a.pub._seq_gen)
    send(lc.url, a, [])
    # b receives a block whose parent it never reported (an orphan): P1's tokens, but
    # it never counts as a duplicate.
    send(lc.url, b, [stored([b"\x09" * 32], b"\x77" * 32, P1)])
    # c drops its whole prefix cache.
    send(lc.url, c, [AllBlocksCleared()])

    ta, tb, tc = (totals(lc.url, e.engine_id) for e in (a, b, c))
    assert {
        k: ta[k]
        for k in (
            "stored_blocks",
            "dup_blocks",
            "reseen_blocks",
            "orphan_blocks",
            "removed_blocks",
            "missed_batches",
            "cleared_events",
        )
    } == {
        "stored_blocks": 5,
        "dup_blocks": 1,
        "reseen_blocks": 2,
        "orphan_blocks": 0,
        "removed_blocks": 2,
        "missed_batches": 3,
        "cleared_events": 0,
    }
    assert (
        tb["stored_blocks"],
        tb["dup_blocks"],
        tb["reseen_blocks"],
        tb["orphan_blocks"],
        tb["missed_batches"],
    ) == (4, 2, 2, 1, 0)
    assert (tc["stored_blocks"], tc["dup_blocks"], tc["reseen_blocks"], tc["cleared_events"]) == (
        3,
        0,
        0,
        1,
    )
    last = {e.engine_id: rows(lc.url, engine_id=e.engine_id)[-1] for e in engines}
    # At a's last batch: P1 (b has it), P2 (b has it), P3: 3 held, 2 shared.
    assert (last[a.engine_id]["held_blocks"], last[a.engine_id]["held_shared_blocks"]) == (3, 2)
    assert (last[b.engine_id]["held_blocks"], last[b.engine_id]["held_shared_blocks"]) == (4, 2)
    assert (last[c.engine_id]["held_blocks"], last[c.engine_id]["held_shared_blocks"]) == (0, 0)
    assert last[a.engine_id]["pool"] == "pool-p"
    sizes = {r["block_size"] for r in rows(lc.url) if r["stored_blocks"]}
    assert sizes == {BS}

    # The read API filters like /v1/windows.
    assert {r["engine_id"] for r in rows(lc.url, pool="pool-q")} == {c.engine_id}
    assert {r["engine_id"] for r in rows(lc.url, engine=b.engine_id)} == {b.engine_id}
    assert rows(lc.url, until=1) == []
    status, body = get_json(
        lc.url, f"/v1/kv_events?since=0&engine={a.engine_id}&engine_id={b.engine_id}"
    )
    assert status == 400 and "engine" in body["error"]
    status, body = get_json(lc.url, "/v1/kv_events?since=soon")
    assert status == 400 and "since" in body["error"]
    status, body = get_json(lc.url, "/v1/kv_events?since=0&limit=2&format=columns")
    assert status == 200 and body["truncated"] and len(body["columns"]["stored_blocks"]) == 2

    # /metrics: the same numbers, and promtool accepts the exposition.
    wait_for(
        lambda: (
            scrape(lc.url)[1].get(("kvscope_pool_kv_distinct_blocks", (("pool", "pool-q"),))) == 0
        ),
        "the gauges",
    )
    text, m = scrape(lc.url)
    promtool_ok(text)

    def lab(e: Engine) -> tuple[tuple[str, str], ...]:
        return (("engine", e.engine_id), ("pool", e.pool))

    for e, t in ((a, ta), (b, tb), (c, tc)):
        assert m[("kvscope_kv_events_blocks_stored_total", lab(e))] == t["stored_blocks"]
        assert m[("kvscope_kv_events_blocks_duplicated_total", lab(e))] == t["dup_blocks"]
        assert m[("kvscope_kv_events_blocks_removed_total", lab(e))] == t["removed_blocks"]
        assert m[("kvscope_kv_events_missed_batches_total", lab(e))] == t["missed_batches"]
        assert m[("kvscope_kv_events_held_blocks", lab(e))] == last[e.engine_id]["held_blocks"]
        endpoint = f"tcp://127.0.0.1:{e.port}"
        key = tuple(sorted((*lab(e), ("endpoint", endpoint))))
        assert m[("kvscope_kv_events_subscribed", key)] == 1
    # pool-p holds P1, P2, P3, X and b's orphan block.
    assert m[("kvscope_pool_kv_distinct_blocks", (("pool", "pool-p"),))] == 5


def test_new_boot_resubscribes_and_starts_afresh(
    make_collector: Any, engines: list[Engine]
) -> None:
    a, b = Engine("a:8000:0", "p"), Engine("b:8000:0", "p")
    engines += [a, b]
    lc = _kv(make_collector)
    for e in (a, b):
        post_batch(lc.url, batch(engine_id=e.engine_id, hello=e.hello()))
        connect(lc.url, e)
    send(lc.url, a, [stored([1, 2], None, P1 + P2)])
    # a restarts: a new process, a new publisher (on a new port), a new hello.
    a2 = Engine("a:8000:0", "p")
    engines.append(a2)
    a.close()
    post_batch(
        lc.url,
        batch(
            engine_id=a2.engine_id,
            boot_id="boot-2",
            hello=a2.hello("boot-2", started_unix_s=1_700_000_500.0),
        ),
    )
    connect(lc.url, a2)
    # a's old blocks are gone: b storing P1 P2 finds no duplicate.
    send(lc.url, b, [stored([11, 12], None, P1 + P2)])
    tb = totals(lc.url, b.engine_id)
    assert (tb["stored_blocks"], tb["dup_blocks"], tb["reseen_blocks"]) == (2, 0, 2)
    # The new boot's publisher starts at seq 0 again: no gap, no restart counted.
    send(lc.url, a2, [stored([5], None, P1)])
    ta = totals(lc.url, a.engine_id)
    assert (ta["stored_blocks"], ta["dup_blocks"], ta["missed_batches"]) == (3, 1, 0)
    wait_for(
        lambda: (
            scrape(lc.url)[1].get(
                ("kvscope_kv_events_held_blocks", (("engine", a.engine_id), ("pool", "p")))
            )
            == 1
        ),
        "a's held gauge to restart at 1",
    )
    _, m = scrape(lc.url)
    sub = {k[1]: v for k, v in m.items() if k[0] == "kvscope_kv_events_subscribed"}
    assert sub == {
        (("endpoint", f"tcp://127.0.0.1:{a2.port}"), ("engine", a.engine_id), ("pool", "p")): 1,
        (("endpoint", f"tcp://127.0.0.1:{b.port}"), ("engine", b.engine_id), ("pool", "p")): 1,
    }


def test_silent_engine_is_unsubscribed_until_it_sends_again(
    make_collector: Any, engines: list[Engine]
) -> None:
    a = Engine("a:8000:0", "p")
    engines.append(a)
    lc = _kv(make_collector, kv_events_idle_s=2.0)
    post_batch(lc.url, batch(engine_id=a.engine_id, hello=a.hello()))
    connect(lc.url, a)
    send(lc.url, a, [stored([1], None, P1)])
    key = (
        "kvscope_kv_events_subscribed",
        (("endpoint", f"tcp://127.0.0.1:{a.port}"), ("engine", a.engine_id), ("pool", "p")),
    )
    unsub = (
        "kvscope_kv_events_subscribed",
        (("endpoint", a.advertised), ("engine", a.engine_id), ("pool", "p")),
    )
    wait_for(lambda: scrape(lc.url)[1].get(unsub) == 0, "the silent engine to be dropped")
    assert key not in scrape(lc.url)[1]
    held = ("kvscope_kv_events_held_blocks", (("engine", a.engine_id), ("pool", "p")))
    assert held not in scrape(lc.url)[1]
    # It sends a batch again: subscribed again, starting from an empty cache picture.
    post_batch(lc.url, batch(engine_id=a.engine_id, seq=1))
    wait_for(lambda: scrape(lc.url)[1].get(key) == 1, "the engine to be subscribed again")


def test_kv_events_off_never_subscribes(make_collector: Any, engines: list[Engine]) -> None:
    a = Engine("a:8000:0", "p")
    engines.append(a)
    lc = _kv(make_collector, kv_events="off")
    assert post_batch(lc.url, batch(engine_id=a.engine_id, hello=a.hello()))[0] == 200
    for _ in range(20):
        a.publish([stored([1], None, P1)])
        time.sleep(0.05)
    assert rows(lc.url) == []
    text, _ = scrape(lc.url)
    assert "kvscope_kv_events" not in text and "kvscope_pool_kv" not in text
    assert lc.running.ctx.kv_events is None


def test_read_api_needs_the_token(make_collector: Any) -> None:
    lc = _kv(make_collector, token="s3cret")
    status, _, _ = http("GET", lc.url + "/v1/kv_events")
    assert status == 401
    status, _, body = http(
        "GET", lc.url + "/v1/kv_events?since=0", headers={"Authorization": "Bearer s3cret"}
    )
    assert status == 200 and json.loads(body)["rows"] == []


def test_collector_process_with_an_override_keeps_counters_over_restarts(
    tmp_path: Path, engines: list[Engine]
) -> None:
    """``kvscope collector --kv-events-endpoint``: an engine whose hello has no endpoint
    (an older plugin) is subscribed where the operator says; its counters survive a
    restart of the collector."""
    a = Engine("old-plugin:8000:0", "p", advertise=False)
    engines.append(a)
    args = [
        "--kv-events-endpoint",
        f"{a.engine_id}=tcp://127.0.0.1:{a.port}",
        "--advise-interval-s",
        "0",
        "--raw-retention-s",
        "0",
    ]
    store = tmp_path / "kv.duckdb"
    with CollectorProcess(store, extra_args=args) as c:
        status, _ = post_batch(c.url, batch(engine_id=a.engine_id, hello=a.hello()))
        assert status == 200
        connect(c.url, a)
        send(c.url, a, [stored([1, 2, 3], None, P1 + P2 + P3)])
        assert totals(c.url, a.engine_id)["stored_blocks"] == 3
        assert c.get_json("/v1/engines")["rows"][0]["kv_events_endpoint"] is None
    with CollectorProcess(store, extra_args=args) as c:
        _, m = scrape(c.url)
        lab = (("engine", a.engine_id), ("pool", "p"))
        assert m[("kvscope_kv_events_blocks_stored_total", lab)] == 3
        # Subscribed again at start, from the store's engines and the override.
        connect(c.url, a)
        send(c.url, a, [stored([1], None, P1)])  # a new process's view: not held yet
        wait_for(
            lambda: scrape(c.url)[1].get(("kvscope_kv_events_blocks_stored_total", lab)) == 4,
            "the counter to reach 4",
        )


def test_endpoint_resolution() -> None:
    from kvscope.collector.kv_endpoints import resolve_endpoint

    assert resolve_endpoint("tcp://*:5557", "10.1.2.3") == "tcp://10.1.2.3:5557"
    assert resolve_endpoint("tcp://0.0.0.0:5557", "10.1.2.3") == "tcp://10.1.2.3:5557"
    assert resolve_endpoint("tcp://[::]:5557", "fd00::7") == "tcp://[fd00::7]:5557"
    assert resolve_endpoint("tcp://*:5557", "::ffff:10.1.2.3") == "tcp://10.1.2.3:5557"
    assert resolve_endpoint("tcp://*:5557", None) is None  # wait for an ingest request
    assert resolve_endpoint("tcp://gpu-node-4:5558", "10.1.2.3") == "tcp://gpu-node-4:5558"
    assert resolve_endpoint("ipc:///tmp/kv", None) == "ipc:///tmp/kv"
    for unreachable in ("tcp://*:0", "inproc://kv", "tcp://*", "5557", "tcp://*:99999"):
        assert resolve_endpoint(unreachable, "10.1.2.3") is None, unreachable


def test_cli_flags_build_the_settings() -> None:
    from kvscope.cli.collector import collector_settings
    from kvscope.cli.main import build_parser

    args = build_parser().parse_args(
        [
            "collector",
            "--kv-events",
            "off",
            "--kv-events-endpoint",
            "e1=tcp://h:5557",
            "--kv-events-endpoint",
            "e2=tcp://*:6000",
            "--kv-events-seen-capacity",
            "1_000",
        ]
    )
    s = collector_settings(args)
    assert s.kv_events == "off" and s.kv_events_seen_capacity == 1000
    assert s.kv_events_endpoints == (("e1", "tcp://h:5557"), ("e2", "tcp://*:6000"))
    default = collector_settings(build_parser().parse_args(["collector"]))
    assert (default.kv_events, default.kv_events_endpoints) == ("auto", ())
    for bad in (
        ["--kv-events-endpoint", "tcp://h:1"],
        ["--kv-events", "on"],
        ["--kv-events-endpoint", "e=udp://h:1"],
        ["--kv-events-seen-capacity", "1"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["collector", *bad])


def _cpu_seconds(pid: int) -> float:
    import os

    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_collector_does_not_spin(tmp_path: Path) -> None:
    """With KV events on (the default) but no engine publishing, the subscriber thread
    must wait, not poll an empty socket set in a loop."""
    with CollectorProcess(tmp_path / "idle.duckdb") as c:
        assert c.proc is not None
        time.sleep(2.0)
        before, t0 = _cpu_seconds(c.proc.pid), time.monotonic()
        time.sleep(3.0)
        share = (_cpu_seconds(c.proc.pid) - before) / (time.monotonic() - t0)
    assert share < 0.25, f"an idle collector used {share:.0%} of a core"

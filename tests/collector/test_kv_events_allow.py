"""Which KV-event endpoints the collector subscribes to (issue 44, finding 4).

A hello names the endpoint its engine publishes on. The collector subscribes only on the
host the hello came from (vLLM's default ``tcp://*:5557``), on hosts or networks the
operator allows, ``ipc://`` only when allowed, at most ``kv_events_max_sockets`` at
once; a refusal is logged once per engine and counted; ZMQ's "Too many open files"
never stops the subscriber thread. The policy is tested as a pure function with a fake
resolver, the manager in a live collector against vLLM's real ZMQ publishers.
"""

from __future__ import annotations

import ipaddress
import logging
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from _collector_helpers import batch, post_batch
from test_kv_events import P1, Engine, _kv, connect, scrape, send, stored, totals, wait_for

from kvscope.collector import kv_events
from kvscope.collector.kv_endpoints import (
    EndpointPolicy,
    parse_allow,
    resolve_endpoint,
    socket_budget,
)

LOGGER = "kvscope.collector.kv_events"
REFUSED = "kvscope_kv_events_refused_endpoints_total"
FOREIGN = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never a real host


class FakeDns:
    """A resolver answering from a table; remembers the names it was asked."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table, self.calls = table, []

    def __call__(self, name: str) -> frozenset[Any]:
        self.calls.append(name)
        return frozenset(ipaddress.ip_address(a) for a in self.table.get(name, []))


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


def check(policy: EndpointPolicy, advertised: str, remote: str | None) -> str | None:
    """The refusal reason for an advertised endpoint (None: subscribed), as the manager
    asks: the wildcard resolved to the hello's source address first."""
    want = resolve_endpoint(advertised, remote)
    assert want is not None
    refusal = policy.check(want, remote)
    return None if refusal is None else refusal.reason


# -- the policy ------------------------------------------------------------------------


def test_wildcard_endpoint_means_the_hellos_own_host() -> None:
    p = EndpointPolicy(resolve=FakeDns({}))
    assert check(p, "tcp://*:5557", "10.0.0.7") is None
    assert check(p, "tcp://0.0.0.0:5557", "10.0.0.7") is None
    assert check(p, "tcp://[::]:5557", "fd00::7") is None
    assert check(p, "tcp://*:5557", "::ffff:10.0.0.7") is None
    # The same host named explicitly, and as the IPv4-mapped address aiohttp may report.
    assert check(p, "tcp://10.0.0.7:5557", "10.0.0.7") is None
    assert check(p, "tcp://10.0.0.7:5557", "::ffff:10.0.0.7") is None


def test_foreign_host_is_refused_naming_the_flags_that_allow_it() -> None:
    p = EndpointPolicy(resolve=FakeDns({}))
    refusal = p.check(f"tcp://{FOREIGN}:5557", "10.0.0.7")
    assert refusal is not None and refusal.reason == "not_allowed"
    assert f"--kv-events-allow {FOREIGN}" in refusal.detail
    assert "--kv-events-endpoint" in refusal.detail
    assert check(p, "tcp://10.0.0.8:5557", "10.0.0.7") == "not_allowed"  # the neighbour
    assert check(p, "tcp://[fd00::8]:5557", "fd00::7") == "not_allowed"


def test_loopback_counts_only_for_a_hello_from_loopback() -> None:
    p = EndpointPolicy(resolve=FakeDns({"localhost": ["127.0.0.1"]}))
    for endpoint in (
        "tcp://127.0.0.1:1",
        "tcp://127.0.0.2:1",
        "tcp://[::1]:1",
        "tcp://localhost:1",
    ):
        assert check(p, endpoint, "127.0.0.1") is None, endpoint
        assert check(p, endpoint, "::1") is None, endpoint
        # From another host, loopback is the collector's own host: refused.
        assert check(p, endpoint, "10.0.0.7") == "not_allowed", endpoint


def test_host_name_must_resolve_to_the_source_address() -> None:
    dns = FakeDns({"node-7": ["10.0.0.7"], "mixed": ["10.0.0.7", FOREIGN], "elsewhere": [FOREIGN]})
    p = EndpointPolicy(resolve=dns)
    assert check(p, "tcp://node-7:5557", "10.0.0.7") is None
    assert check(p, "tcp://NODE-7.:5557", "10.0.0.7") is None
    assert check(p, "tcp://elsewhere:5557", "10.0.0.7") == "not_allowed"
    # Every address a name resolves to must be allowed: ZMQ may connect to any of them.
    assert check(p, "tcp://mixed:5557", "10.0.0.7") == "not_allowed"
    refusal = p.check("tcp://nowhere:5557", "10.0.0.7")
    assert refusal is not None and refusal.reason == "not_allowed"
    assert "does not resolve" in refusal.detail
    # Resolved once per name while the answer is fresh.
    p.check("tcp://node-7:5558", "10.0.0.7")
    assert dns.calls.count("node-7") == 1


def test_allowed_hosts_and_networks() -> None:
    dns = FakeDns({"vllm-0.prod": ["10.5.5.5"], "vllm-1.prod": ["10.5.5.6"]})
    p = EndpointPolicy(allow=["10.9.0.0/16", "vllm-0.prod", "fd00::/8", "10.1.1.1"], resolve=dns)
    assert check(p, "tcp://10.9.3.4:5557", "10.0.0.7") is None
    assert check(p, "tcp://10.1.1.1:5557", "10.0.0.7") is None
    assert check(p, "tcp://[fd00::9]:5557", "10.0.0.7") is None
    assert check(p, "tcp://vllm-0.prod:5557", "10.0.0.7") is None  # by name
    assert check(p, "tcp://10.5.5.5:5557", "10.0.0.7") is None  # by the name's address
    assert check(p, "tcp://vllm-1.prod:5557", "10.0.0.7") == "not_allowed"
    assert check(p, "tcp://10.8.0.1:5557", "10.0.0.7") == "not_allowed"
    assert check(p, "tcp://10.1.1.2:5557", "10.0.0.7") == "not_allowed"
    # Before the engine's first ingest (no source address yet), only the list allows.
    assert p.check("tcp://10.9.3.4:5557", None) is None
    refusal = p.check("tcp://10.0.0.7:5557", None)
    assert refusal is not None and refusal.reason == "not_allowed"


def test_ipc_only_when_allowed() -> None:
    refusal = EndpointPolicy().check("ipc:///tmp/kv-events", "127.0.0.1")
    assert refusal is not None and refusal.reason == "ipc"
    assert "--kv-events-allow-ipc" in refusal.detail
    assert EndpointPolicy(allow_ipc=True).check("ipc:///tmp/kv-events", "127.0.0.1") is None


def test_allow_entries_are_checked() -> None:
    assert parse_allow("10.0.0.0/8") == ipaddress.ip_network("10.0.0.0/8")
    assert parse_allow("10.0.0.7") == ipaddress.ip_network("10.0.0.7/32")
    assert parse_allow("[fd00::1]") == ipaddress.ip_network("fd00::1/128")
    assert parse_allow("VLLM-0.Prod.") == "vllm-0.prod"
    for bad in ("*", "a b", "10.0.0.0/33", "x/8", "a..b", "-a", "", "tcp://h:1"):
        with pytest.raises(ValueError):
            parse_allow(bad)
    with pytest.raises(ValueError):
        EndpointPolicy(allow=["not a host"])


def test_socket_budget_fits_the_open_file_limit() -> None:
    # A subscription holds two files (the ZMQ socket's mailbox, its TCP connection;
    # measured with /proc/self/fd) and the subscriptions get half the limit: 1,024
    # files leave 512 for them, 256 subscriptions.
    assert socket_budget(512, 1024) == 256
    assert socket_budget(512, 4096) == 512
    assert socket_budget(512, None) == 512
    assert socket_budget(512, 3) == 1


def test_cli_flags_build_the_settings() -> None:
    from kvscope.cli.collector import collector_settings
    from kvscope.cli.main import build_parser

    args = build_parser().parse_args(
        [
            "collector",
            "--kv-events-allow",
            "10.0.0.0/8",
            "--kv-events-allow",
            "vllm-0.prod",
            "--kv-events-allow-ipc",
            "--kv-events-max-sockets",
            "64",
        ]
    )
    s = collector_settings(args)
    assert s.kv_events_allow == ("10.0.0.0/8", "vllm-0.prod")
    assert s.kv_events_allow_ipc is True and s.kv_events_max_sockets == 64
    default = collector_settings(build_parser().parse_args(["collector"]))
    assert (default.kv_events_allow, default.kv_events_allow_ipc) == ((), False)
    assert default.kv_events_max_sockets == 512
    for bad in (["--kv-events-allow", "a b"], ["--kv-events-max-sockets", "many"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["collector", *bad])
    with pytest.raises(ValueError, match="kv_events_max_sockets"):
        collector_settings(build_parser().parse_args(["collector", "--kv-events-max-sockets", "0"]))


# -- the manager in a live collector -----------------------------------------------------


def now_batch(e: Engine, seq: int = 0, hello: bool = True, **over: Any) -> dict[str, Any]:
    """A batch of ``e`` dated now (with its hello, advertising ``over`` if given)."""
    t = time.time()
    h = e.hello(started_unix_s=t, **over) if hello else None
    return batch(engine_id=e.engine_id, seq=seq, sent_unix_s=t, hello=h)


def refused(url: str, reason: str) -> float:
    return scrape(url)[1].get((REFUSED, (("reason", reason),)), -1.0)


def subscribed(url: str, engine_id: str) -> float | None:
    for (name, labels), v in scrape(url)[1].items():
        if name == "kvscope_kv_events_subscribed" and ("engine", engine_id) in labels:
            return v
    return None


def refusal_lines(caplog: pytest.LogCaptureFixture, engine_id: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER
        and r.getMessage().startswith(f"not subscribing to the KV events of {engine_id} ")
    ]


def test_foreign_and_ipc_endpoints_are_refused_once_and_counted(
    make_collector: Any, engines: list[Engine], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    ok = Engine("ok:8000:0", "p")
    foreign = Engine("foreign:8000:0", "p", advertise=False)
    ipc = Engine("ipc:8000:0", "p", advertise=False)
    # An older plugin's engine whose endpoint the operator names: never checked.
    named = Engine("named:8000:0", "p", advertise=False)
    engines += [ok, foreign, ipc, named]
    lc = _kv(make_collector, kv_events_endpoints=((named.engine_id, f"tcp://{FOREIGN}:5557"),))
    adverts = {foreign: f"tcp://{FOREIGN}:5557", ipc: "ipc:///tmp/kvscope-test-kv"}
    for seq in range(2):  # a second hello does not log or count again
        assert post_batch(lc.url, now_batch(ok, seq))[0] == 200
        for e, endpoint in adverts.items():
            b = now_batch(e, seq, kv_events_endpoint=endpoint)
            assert post_batch(lc.url, b)[0] == 200
    connect(lc.url, ok)
    wait_for(lambda: refused(lc.url, "ipc") == 1, "the ipc refusal to be counted")
    assert refused(lc.url, "not_allowed") == 1
    assert refused(lc.url, "socket_limit") == 0 and refused(lc.url, "connect_error") == 0
    wait_for(lambda: subscribed(lc.url, named.engine_id) == 1, "the override's subscription")
    assert subscribed(lc.url, foreign.engine_id) == 0
    assert subscribed(lc.url, ipc.engine_id) == 0
    assert subscribed(lc.url, ok.engine_id) == 1
    (line,) = refusal_lines(caplog, foreign.engine_id)
    assert f"at tcp://{FOREIGN}:5557 (not_allowed)" in line
    assert f"--kv-events-allow {FOREIGN}" in line
    (line,) = refusal_lines(caplog, ipc.engine_id)
    assert "(ipc)" in line and "--kv-events-allow-ipc" in line
    assert refusal_lines(caplog, ok.engine_id) == []
    send(lc.url, ok, [stored([1], None, P1)])
    assert totals(lc.url, ok.engine_id)["stored_blocks"] == 1


def test_allowed_networks_and_ipc_are_subscribed(
    make_collector: Any, engines: list[Engine]
) -> None:
    foreign = Engine("foreign:8000:0", "p", advertise=False)
    ipc = Engine("ipc:8000:0", "p", advertise=False)
    engines += [foreign, ipc]
    lc = _kv(make_collector, kv_events_allow=("192.0.2.0/24",), kv_events_allow_ipc=True)
    post_batch(lc.url, now_batch(foreign, kv_events_endpoint=f"tcp://{FOREIGN}:5557"))
    post_batch(lc.url, now_batch(ipc, kv_events_endpoint="ipc:///tmp/kvscope-test-kv"))
    for e in (foreign, ipc):
        wait_for(lambda e=e: subscribed(lc.url, e.engine_id) == 1, f"{e.engine_id} subscribed")
    assert refused(lc.url, "not_allowed") == 0 and refused(lc.url, "ipc") == 0


def test_socket_limit_refuses_beyond_and_subscribes_when_one_closes(
    make_collector: Any, engines: list[Engine], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    a, b, c = Engine("a:8000:0", "p"), Engine("b:8000:0", "p"), Engine("c:8000:0", "p")
    engines += [a, b, c]
    lc = _kv(make_collector, kv_events_max_sockets=2, kv_events_idle_s=2.0)
    for e in (a, b, c):
        assert post_batch(lc.url, now_batch(e))[0] == 200
    wait_for(lambda: refused(lc.url, "socket_limit") == 1, "c refused for the socket limit")
    wait_for(
        lambda: [subscribed(lc.url, e.engine_id) for e in (a, b, c)] == [1, 1, 0],
        "a and b subscribed, c not",
    )
    (line,) = refusal_lines(caplog, c.engine_id)
    assert "(socket_limit)" in line and "--kv-events-max-sockets" in line
    connect(lc.url, a)
    send(lc.url, a, [stored([1], None, P1)])
    # a falls silent: after kv_events_idle_s its socket closes and c, still sending
    # batches, takes its place.
    seq = 1
    while subscribed(lc.url, c.engine_id) != 1:
        assert seq < 200, "c was never subscribed"
        for e in (b, c):
            post_batch(lc.url, now_batch(e, seq, hello=False))
        seq += 1
        time.sleep(0.1)
    connect(lc.url, c)
    send(lc.url, c, [stored([7], None, P1)])
    assert totals(lc.url, c.engine_id)["dup_blocks"] == 0  # a's blocks were forgotten
    assert refused(lc.url, "socket_limit") == 1


class _TinyContext(zmq.Context):
    """ZMQ's own socket cap lowered to 3: its "Too many open files" (EMFILE), as the
    collector met it at 1,023 sockets, at a test's scale."""

    def set(self, option: int, optval: Any) -> None:
        super().set(option, 3 if option == zmq.MAX_SOCKETS else optval)


def test_subscriber_survives_too_many_open_files(
    make_collector: Any,
    engines: list[Engine],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    made = [Engine(f"e{i}:8000:0", "p") for i in range(5)]
    engines += made
    tiny = types.SimpleNamespace(**{k: getattr(zmq, k) for k in dir(zmq) if not k.startswith("__")})
    tiny.Context = _TinyContext
    monkeypatch.setattr(kv_events, "zmq", tiny)
    lc = _kv(make_collector)
    for e in made:
        assert post_batch(lc.url, now_batch(e))[0] == 200
    wait_for(lambda: refused(lc.url, "socket_limit") == 2, "two engines refused")
    for e in made[3:]:
        (line,) = refusal_lines(caplog, e.engine_id)
        assert "Too many open files" in line
    assert lc.running.ctx.kv_events._thread.is_alive()
    assert not [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.ERROR]
    # The engines it has are still served.
    connect(lc.url, made[0])
    send(lc.url, made[0], [stored([1], None, P1)])
    assert totals(lc.url, made[0].engine_id)["stored_blocks"] == 1

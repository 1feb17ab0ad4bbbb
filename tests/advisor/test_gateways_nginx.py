"""The nginx rendering in a real nginx (Debian's package; ``scripts/test`` installs it) in
front of two real HTTP upstreams that hold every request open until released.

Known answers, from nginx's documentation and argued per test: each upstream sees at most
its ``max_conns``; past the pool's sum the excess gets the ``limit_conn_status`` the
rendering states; without the pool limit it gets 502 (no upstream queue in open-source
nginx); the old ``$server_name``-keyed ``limit_conn`` of one replica's cap holds the whole
pool to that cap.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvscope.advisor.gateways import ReplicaCap, pool_renderings, replica_renderings
from kvscope.collector.process import free_port
from kvscope.lab.gateway import Nginx
from tests.advisor._upstreams import Burst, Upstream, settle

CAP = 3
"""Each replica's cap: small, so a burst of four times it is quick."""
BURST = 4 * CAP


@pytest.fixture
def upstreams() -> Iterator[tuple[Upstream, Upstream]]:
    a, b = Upstream(), Upstream()
    yield a, b
    a.stop()
    b.stop()


def _replicas(a: Upstream, b: Upstream) -> list[ReplicaCap]:
    return [ReplicaCap(address=u.address, cap=CAP, max_num_seqs=CAP, queue=1) for u in (a, b)]


def _run(
    tmp: Path, site: str, port: int, a: Upstream, b: Upstream
) -> tuple[Counter[int], int, str]:
    """Send a burst of BURST requests through nginx, wait until each is either answered or
    held by an upstream, and return (statuses so far, requests held, nginx's error log);
    then release the held ones and check they succeed."""
    nginx = Nginx(tmp, site, port).start()
    try:
        burst = Burst(port, BURST)
        settle(lambda: burst.answered() + a.now + b.now == BURST)
        early = Counter(burst.statuses)
        held = a.now + b.now
        a.release.set()
        b.release.set()
        final = Counter(burst.join())
        assert final[200] == held and sum(final.values()) == BURST, final
        return early, held, nginx.log()
    finally:
        nginx.stop()


def test_rendered_pool_holds_each_replica_and_rejects_the_excess_with_503(
    tmp_path: Path, upstreams: tuple[Upstream, Upstream]
) -> None:
    a, b = upstreams
    port = free_port()
    site = pool_renderings("t", _replicas(a, b), listen=f"127.0.0.1:{port}")["nginx"]["config"]
    early, held, log = _run(tmp_path, site, port, a, b)
    # Each replica at its cap, the pool at the sum, the excess rejected by limit_conn.
    assert (a.peak, b.peak) == (CAP, CAP)
    assert held == 2 * CAP
    assert early == Counter({503: BURST - 2 * CAP})
    assert 'limiting connections by zone "vllm_t_inflight"' in log
    assert "no live upstreams" not in log


def test_without_the_pool_limit_a_burst_past_every_max_conns_gets_502(
    tmp_path: Path, upstreams: tuple[Upstream, Upstream]
) -> None:
    a, b = upstreams
    port = free_port()
    lines = [replica_renderings(r)["nginx"]["config"] for r in _replicas(a, b)]
    site = (
        "upstream u {\n    zone u 1m;\n"
        + "".join(f"    {ln}\n" for ln in lines)
        + f"}}\nserver {{ listen 127.0.0.1:{port}; location / {{ proxy_pass http://u; }} }}"
    )
    early, held, log = _run(tmp_path, site, port, a, b)
    # max_conns alone still holds each replica; no queue: the rest fails at once with 502.
    assert (a.peak, b.peak) == (CAP, CAP) and held == 2 * CAP
    assert early == Counter({502: BURST - 2 * CAP})
    assert "no live upstreams" in log


@pytest.mark.parametrize("server_name", ["pool.example", None])
def test_the_old_server_name_limit_holds_the_pool_to_one_replicas_cap(
    tmp_path: Path, upstreams: tuple[Upstream, Upstream], server_name: str | None
) -> None:
    a, b = upstreams
    port = free_port()
    # The old rendering: limit_conn keyed on $server_name at one replica's cap.
    name = f"server_name {server_name}; " if server_name else ""
    site = (
        f"upstream u {{ server {a.address}; server {b.address}; }}\n"
        "limit_conn_zone $server_name zone=vllm_conn:1m;\n"
        f"server {{ listen 127.0.0.1:{port}; {name}"
        f"location / {{ limit_conn vllm_conn {CAP}; proxy_pass http://u; }} }}"
    )
    early, held, _ = _run(tmp_path, site, port, a, b)
    if server_name:
        # Two replicas with room for 2 x CAP get CAP between them: the pool is held to one
        # replica's cap.
        assert held == CAP and a.peak + b.peak == CAP
        assert early == Counter({503: BURST - CAP})
    else:
        # No server_name: the key is empty, nothing is counted, no replica is held.
        assert held == BURST and max(a.peak, b.peak) > CAP
        assert not early


def test_the_ingress_retry_passes_a_replicas_503_on_only_with_non_idempotent(
    tmp_path: Path,
) -> None:
    """The ingress-nginx rendering's annotation becomes nginx's ``proxy_next_upstream``: one
    replica answering every POST 503 (at its admission limit), the other serving."""
    full, free = Upstream(reject_all=True), Upstream(hold_s=0.0)
    port = free_port()
    replicas = [
        ReplicaCap(address=u.address, cap=CAP, max_num_seqs=CAP, queue=1) for u in (full, free)
    ]
    ingress = yaml.safe_load(pool_renderings("r", replicas)["ingress_nginx"]["config"])
    value = ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-next-upstream"]
    try:
        got = {}
        for retry in (f"proxy_next_upstream {value};", ""):
            site = (
                f"upstream u {{ server {full.address}; server {free.address}; }}\n"
                f"server {{ listen 127.0.0.1:{port}; "
                f"location / {{ {retry} proxy_pass http://u; }} }}"
            )
            nginx = Nginx(tmp_path, site, port).start()
            try:
                got[bool(retry)] = Counter(Burst(port, 2 * CAP, gap_s=0.02).join())
            finally:
                nginx.stop()
        assert got[True] == Counter({200: 2 * CAP}), got
        assert got[False][503] > 0, got  # by default a POST's 503 goes back to the client
    finally:
        full.stop()
        free.stop()

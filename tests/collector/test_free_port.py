"""`free_port` keeps a port it handed out from other kvscope processes for a while: two
pytest-xdist workers (or a demo beside the tests) asking at once must not both be given a
port the kernel re-issues as soon as the first caller closed its probe socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvscope.collector import process
from kvscope.collector.process import PORT_HOLD_S, free_port


@pytest.fixture()
def ports_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(process.tempfile, "tempdir", str(tmp_path))
    return tmp_path / "kvscope-ports"


def test_a_claimed_port_is_refused_until_its_hold_ends(ports_dir: Path) -> None:
    now = time.time()
    assert process._claim_port(45678, now)
    assert not process._claim_port(45678, now + 1.0)
    assert not process._claim_port(45678, now + PORT_HOLD_S - 5.0)
    mark = ports_dir / "45678"
    os.utime(mark, (now - PORT_HOLD_S - 1.0, now - PORT_HOLD_S - 1.0))
    assert process._claim_port(45678, now)  # an old claim: free again, and claimed anew
    assert not process._claim_port(45678, now + 1.0)


def test_free_port_skips_ports_another_process_holds(
    ports_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed = iter([41001, 41001, 41002])

    class Probe:
        def __init__(self, *_: object) -> None:
            self.port = next(handed)

        def __enter__(self) -> Probe:
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def bind(self, _: object) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(process.socket, "socket", Probe)
    # no room below the ephemeral range: the kernel's bind(0) picks
    monkeypatch.setattr(process, "ephemeral_ports", lambda: (process.PORT_FLOOR + 10, 60999))
    assert free_port() == 41001
    assert free_port() == 41002  # the kernel offered 41001 again: held, so skipped


def test_free_port_picks_below_the_ephemeral_range_and_skips_held_or_bound_ports(
    ports_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    low = 32768  # Linux's default start of the range, whatever this machine's setting
    monkeypatch.setattr(process, "ephemeral_ports", lambda: (low, 60999))
    held = free_port()  # handed out: another caller must not get it
    assert process.PORT_FLOOR <= held < low
    candidates = (p for p in range(process.PORT_FLOOR, low) if p != held)
    with socket.socket() as busy:
        busy_port = next(p for p in candidates if _bind(busy, p))  # a server's port
        fresh = next(p for p in candidates if process.port_problem("127.0.0.1", p) is None)
        offered = iter([held, busy_port, held, fresh])

        class Rng:
            def randrange(self, start: int, stop: int) -> int:
                assert (start, stop) == (process.PORT_FLOOR, low)
                return next(offered)

        monkeypatch.setattr(process.random, "Random", Rng)
        assert free_port() == fresh


def _bind(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def test_ephemeral_ports_read_the_kernel_setting(tmp_path: Path) -> None:
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t50000\n")
    assert process.ephemeral_ports(setting) == (40000, 50000)
    assert process.ephemeral_ports(tmp_path / "missing") == (32768, 60999)


def test_ports_handed_to_two_processes_differ_and_bind(ports_dir: Path) -> None:
    code = (
        "import tempfile, sys; tempfile.tempdir = sys.argv[1]\n"
        "from kvscope.collector.process import free_port\n"
        "print(' '.join(str(free_port()) for _ in range(50)))\n"
    )
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(ports_dir.parent)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    ports = [int(p) for r in runs for p in r.communicate(timeout=60)[0].split()]
    assert len(ports) == 100
    assert len(set(ports)) == 100, "a port was handed to two callers within its hold"
    assert {int(m.name) for m in ports_dir.iterdir()} >= set(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # a handed-out port is free to bind

"""Run a collector as its own process and talk to it over HTTP.

Used by ``kvscope demo``, the integration tests and the benchmarks, so that each of
them exercises the real service: a separate process, a real socket, the real store.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

PORT_HOLD_S = 120.0
"""How long a port handed out by `free_port` is kept from other kvscope processes: the
time a child process may take to bind it (an engine's start on a slow machine)."""


def _claim_port(port: int, now: float) -> bool:
    """Record ``port`` as handed out, unless another kvscope process did so in the last
    `PORT_HOLD_S`: the kernel may hand a just-closed port to the next caller, and two
    processes (pytest-xdist's workers, a demo beside the tests) would then start two
    servers on one port. Best effort: a folder that cannot be written claims nothing."""
    folder = Path(tempfile.gettempdir()) / "kvscope-ports"
    mark = folder / str(port)
    try:
        folder.mkdir(exist_ok=True)
        try:
            os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            if now - mark.stat().st_mtime < PORT_HOLD_S:
                return False
            os.utime(mark, (now, now))  # an old claim: the port is free again
            return True
    except OSError:
        return True


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORT_FLOOR = 20000
"""The lowest port `free_port` hands out."""


def ephemeral_ports(path: Path | None = None) -> tuple[int, int]:
    """The kernel's range of ephemeral ports (Linux's default if it cannot be read)."""
    try:
        low, high = (int(v) for v in (path or EPHEMERAL_RANGE_FILE).read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now, that no other kvscope process was
    handed in the last `PORT_HOLD_S`, and that lies below the kernel's ephemeral range
    when there is room there. A port the kernel would pick for ``bind(0)`` or as an
    outgoing connection's source may be taken by anyone before a child process binds
    it (a vLLM engine binds its KV-events socket a minute or more after its launch,
    while the engine beside it opens its own sockets); below the range only an
    explicit bind takes it."""
    low, _ = ephemeral_ports()
    rng = random.Random()
    if low - PORT_FLOOR >= 1000:
        for _ in range(64):
            port = rng.randrange(PORT_FLOOR, low)
            if port_problem(host, port) is None and _claim_port(port, time.time()):
                return port
    port = 0
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if _claim_port(port, time.time()):
            return port
    return port


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on right now (``Address already in use``, ...),
    or None when it can. Binds as servers do (``SO_REUSEADDR``), so a port in TIME_WAIT
    counts as free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


class CollectorError(RuntimeError):
    """The collector process failed to start or answered with an error."""


class CollectorProcess:
    """``kvscope collector`` in a child process, stopped on exit.

    >>> with CollectorProcess(store_path="x.duckdb") as c:   # doctest: +SKIP
    ...     c.get_json("/v1/engines")
    """

    def __init__(
        self,
        store_path: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        token: str | None = None,
        log_path: str | Path | None = None,
        extra_args: list[str] | None = None,
        startup_timeout_s: float = 30.0,
        ca_file: str | Path | None = None,
    ) -> None:
        self.store_path = Path(store_path)
        self.host = host
        self.port = port or free_port(host)
        self.token = token
        self.log_path = Path(log_path) if log_path else self.store_path.with_suffix(".log")
        self.extra_args = list(extra_args or [])
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.tls = "--tls-cert" in self.extra_args
        """Served over HTTPS (``--tls-cert`` given); verified against ``ca_file``."""
        self._ssl = ssl.create_default_context(cafile=ca_file) if self.tls else None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def start(self) -> CollectorProcess:
        cmd = [
            sys.executable,
            "-m",
            "kvscope.cli.main",
            "collector",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--store",
            str(self.store_path),
            *self.extra_args,
        ]
        if self.token:
            cmd += ["--token", self.token]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child process
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise CollectorError(
                    f"the collector exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                self.get_json("/healthz", timeout_s=1.0)
                return self
            except (OSError, CollectorError):
                time.sleep(0.1)
        self.stop()
        raise CollectorError(f"the collector did not answer /healthz in time:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int | None:
        """Stop the process (SIGTERM, then SIGKILL after ``timeout_s``)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        try:
            os.killpg(self.proc.pid, sig)
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()
        except ProcessLookupError:
            return self.proc.wait()

    def request(
        self, path: str, *, params: dict[str, Any] | None = None, timeout_s: float = 30.0
    ) -> tuple[int, bytes]:
        url = self.url + path
        if params:
            url += "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        req = urllib.request.Request(url)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s, context=self._ssl) as resp:
                return int(resp.status), resp.read()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read()

    def get_json(
        self, path: str, *, params: dict[str, Any] | None = None, timeout_s: float = 30.0
    ) -> Any:
        status, body = self.request(path, params=params, timeout_s=timeout_s)
        if status != 200:
            raise CollectorError(f"GET {path} answered {status}: {body[:300]!r}")
        return json.loads(body)

    def get_text(self, path: str, **kw: Any) -> str:
        status, body = self.request(path, **kw)
        if status != 200:
            raise CollectorError(f"GET {path} answered {status}: {body[:300]!r}")
        return body.decode()

    def __enter__(self) -> CollectorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

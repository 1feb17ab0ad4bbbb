"""Real gateways in front of the lab's engines: nginx and vLLM's router, as processes.

The advisor renders its cap and routing advice as gateway configuration
(:mod:`kvscope.advisor.gateways`); the closed loops of ``bench/gateway_loops.py`` load that
configuration into the real gateway and drive traffic through it, so what the rendering
says happens to the excess is measured, not assumed.

- :class:`Nginx`: Debian's nginx (1.22; ``scripts/test`` installs it) serving one ``http``
  block's worth of configuration (a ``conf.d`` file, as the advisor renders it) on a
  prefix directory of its own, with ``worker_processes`` workers (two by default: the
  rendering's shared ``zone`` is what makes the workers' counts one).
- :class:`VllmRouter`: vLLM's router (PyPI ``vllm-router``, a Rust binary behind
  ``python -m vllm_router.launch_router``) with the rendered flags.

Both are context managers; both raise :class:`GatewayError` with the gateway's own words
when it refuses the configuration or does not come up.
"""

from __future__ import annotations

import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from kvscope.collector.process import free_port

__all__ = [
    "GatewayError",
    "Nginx",
    "VllmRouter",
    "nginx_binary",
    "router_args",
    "wait_listening",
]


class GatewayError(RuntimeError):
    """A gateway refused its configuration or did not start."""


def nginx_binary() -> str:
    """The nginx executable; :class:`GatewayError` saying how to get it when missing."""
    found = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if not found:
        raise GatewayError(
            "nginx is missing: install Debian's nginx (apt-get install nginx; "
            "scripts/test installs it)"
        )
    return found


def wait_listening(
    port: int, timeout_s: float = 20.0, alive: Callable[[], bool] | None = None
) -> None:
    """Return once something accepts connections on 127.0.0.1:``port``; :class:`GatewayError`
    if ``alive`` says the process exited or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise GatewayError(f"the process meant to listen on {port} exited")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise GatewayError(f"nothing listens on 127.0.0.1:{port} after {timeout_s:g} s")


_G = TypeVar("_G", bound="_Gateway")


class _Gateway:
    """A gateway process: :meth:`start` it (subclasses), :meth:`stop` it, or use it as a
    context manager."""

    proc: subprocess.Popen[bytes] | None = None

    def start(self: _G) -> _G:
        raise NotImplementedError

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def __enter__(self: _G) -> _G:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class Nginx(_Gateway):
    """A real nginx serving ``site`` (the text of a ``conf.d`` file: ``upstream``,
    ``limit_conn_zone``, ``server`` blocks) that listens on ``port``, in ``workdir``.

    >>> with Nginx(tmp, site, port) as gw:   # doctest: +SKIP
    ...     urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models")
    """

    def __init__(self, workdir: str | Path, site: str, port: int, *, workers: int = 2) -> None:
        self.dir = Path(workdir)
        self.site = site
        self.port = port
        self.workers = workers
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> str:
        """The whole nginx.conf: the site inside an ``http`` block, every path in ``dir``."""
        d = self.dir
        return f"""worker_processes {self.workers};
pid {d}/nginx.pid;
error_log {d}/error.log info;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
{self.site}
}}
"""

    def start(self) -> Nginx:
        self.dir.mkdir(parents=True, exist_ok=True)
        for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.dir / sub).mkdir(exist_ok=True)
        conf = self.dir / "nginx.conf"
        conf.write_text(self.config())
        args = [nginx_binary(), "-p", str(self.dir), "-c", str(conf)]
        check = subprocess.run([*args, "-t"], capture_output=True, text=True)
        if check.returncode != 0:
            raise GatewayError(f"nginx refuses {conf}:\n{check.stderr.strip()}")
        self.proc = subprocess.Popen([*args, "-g", "daemon off;"], stderr=subprocess.DEVNULL)
        proc = self.proc
        wait_listening(self.port, alive=lambda: proc.poll() is None)
        return self

    def log(self) -> str:
        """nginx's error log (``limiting connections by zone``, ``no live upstreams``...)."""
        path = self.dir / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""


def router_args(command: str) -> list[str]:
    """The arguments after ``launch_router`` of a router command as the advisor renders it
    (``python -m vllm_router.launch_router \\`` and one flag per continued line)."""
    words = shlex.split(command.replace("\\\n", " "))
    if "vllm_router.launch_router" not in words:
        raise ValueError(f"not a vllm-router command: {command!r}")
    return words[words.index("vllm_router.launch_router") + 1 :]


class VllmRouter(_Gateway):
    """vLLM's router on ``port`` (a free one by default) with ``args`` (the rendering's
    flags after ``launch_router``: ``--worker-urls ... --policy ...``), logging to
    ``log_path``."""

    def __init__(
        self,
        args: Sequence[str],
        log_path: str | Path,
        *,
        port: int | None = None,
        startup_timeout_s: float = 60.0,
    ) -> None:
        self.args = list(args)
        self.log_path = Path(log_path)
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-port",
            str(free_port()),
            *self.args,
        ]

    def start(self) -> VllmRouter:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        proc = self.proc
        try:
            wait_listening(
                self.port, timeout_s=self.startup_timeout_s, alive=lambda: proc.poll() is None
            )
        except GatewayError as exc:
            self.stop()
            raise GatewayError(f"{exc}; the router's log:\n{self.log_tail()}") from exc
        return self

    def log_tail(self, max_lines: int = 20) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-max_lines:])

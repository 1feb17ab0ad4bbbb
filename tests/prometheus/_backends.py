"""Real PromQL backends for the tests: Prometheus and VictoriaMetrics (Debian packages),
each in a child process with a temporary config, data directory and free port.
:class:`SecuredPrometheusServer` is Prometheus behind its own ``--web.config.file``:
HTTPS with a self-signed certificate and basic auth (a bcrypt hash).

Used by ``tests/prometheus``, ``tests/integration/test_prometheus_source.py`` and, through
``tests/deploy/_prom.py`` (which adds rules and query helpers), by ``tests/deploy`` and
``tests/integration/test_grafana_prometheus.py``: the one place that starts them.
"""

from __future__ import annotations

import base64
import os
import shutil
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvscope.collector.process import free_port

PROMETHEUS = "/usr/bin/prometheus"
VICTORIA_METRICS = "/usr/bin/victoria-metrics"


def require(path: str, package: str) -> str:
    """The binary's path, or a test failure naming the Debian package (scripts/test
    installs both)."""
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"{path} is missing: install the Debian package {package!r} (scripts/test does it)"
        )
    return path


def _dur(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"


class Backend:
    """A PromQL server in a child process scraping ``targets`` every ``scrape_interval_s``
    (none: no scrape job)."""

    name = "backend"

    def __init__(
        self,
        workdir: Path,
        targets: list[str],
        *,
        scrape_interval_s: float = 1.0,
        metrics_path: str = "/metrics",
        job: str = "vllm",
        extra_labels: dict[str, str] | None = None,
        fresh: bool = True,
    ) -> None:
        self.workdir = workdir / self.name
        if fresh:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.workdir / "server.log"
        sc: dict[str, Any] = {"targets": targets}
        if extra_labels:
            sc["labels"] = dict(extra_labels)
        self.config = {
            "global": {
                "scrape_interval": _dur(scrape_interval_s),
                "scrape_timeout": _dur(min(scrape_interval_s, 10)),
            },
            "scrape_configs": [
                {"job_name": job, "metrics_path": metrics_path, "static_configs": [sc]}
            ]
            if targets
            else [],
        }
        self.config_path = self.workdir / "scrape.yml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.proc: subprocess.Popen[bytes] | None = None

    auth: Any = None
    """The :class:`~kvscope.sources.prometheus.auth.PromAuth` a client needs (None: none)."""

    def command(self) -> list[str]:
        raise NotImplementedError

    def _ready_request(self) -> tuple[urllib.request.Request, ssl.SSLContext | None]:
        return urllib.request.Request(self.url + self.ready_path()), None

    def ready_path(self) -> str:
        return "/-/ready"

    def start(self, timeout_s: float = 30.0) -> Backend:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.proc.returncode}):\n{self.log_tail()}"
                )
            req, ctx = self._ready_request()
            try:
                with urllib.request.urlopen(req, timeout=1, context=ctx) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} not ready in {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def __enter__(self) -> Backend:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PrometheusServer(Backend):
    """Prometheus; ``rule_files`` are evaluated every ``evaluation_interval_s``."""

    name = "prometheus"

    def __init__(
        self,
        workdir: Path,
        targets: list[str],
        *,
        rule_files: list[Path] | None = None,
        evaluation_interval_s: float = 1.0,
        **kw: Any,
    ) -> None:
        super().__init__(workdir, targets, **kw)
        self.config["global"]["evaluation_interval"] = _dur(evaluation_interval_s)
        self.config["rule_files"] = [str(p) for p in rule_files or []]
        self.config_path.write_text(yaml.safe_dump(self.config))

    def command(self) -> list[str]:
        return [
            require(PROMETHEUS, "prometheus"),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1d",
            "--log.level=warn",
        ]


class SecuredPrometheusServer(PrometheusServer):
    """Prometheus serving HTTPS (a self-signed certificate for 127.0.0.1, made with
    ``openssl``; :attr:`ca_file` trusts it) and asking basic auth of ``user`` with
    ``password`` (stored as a bcrypt hash in the web config, as Prometheus wants)."""

    name = "prometheus-secured"

    def __init__(
        self,
        workdir: Path,
        targets: list[str],
        *,
        user: str = "kvscope",
        password: str = "s3cret-Pa55",
        **kw: Any,
    ) -> None:
        import bcrypt

        from kvscope.sources.prometheus.auth import PromAuth

        super().__init__(workdir, targets, **kw)
        self.url = f"https://127.0.0.1:{self.port}"
        self.user, self.password = user, password
        self.ca_file = self.workdir / "cert.pem"
        key = self.workdir / "key.pem"
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "2",
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
                "-keyout",
                str(key),
                "-out",
                str(self.ca_file),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        # Cost 4, the lowest bcrypt allows: Prometheus checks the hash on every request.
        hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
        self.web_config_path = self.workdir / "web.yml"
        self.web_config_path.write_text(
            yaml.safe_dump(
                {
                    "tls_server_config": {"cert_file": str(self.ca_file), "key_file": str(key)},
                    "basic_auth_users": {user: hashed},
                }
            )
        )
        self.auth = PromAuth(username=user, password=password, ca_file=str(self.ca_file))

    def command(self) -> list[str]:
        return [*super().command(), f"--web.config.file={self.web_config_path}"]

    def _ready_request(self) -> tuple[urllib.request.Request, ssl.SSLContext | None]:
        pair = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        req = urllib.request.Request(
            self.url + self.ready_path(), headers={"Authorization": f"Basic {pair}"}
        )
        return req, ssl.create_default_context(cafile=str(self.ca_file))


class VictoriaMetricsServer(Backend):
    """Single-node VictoriaMetrics scraping itself (``-promscrape.config``); its query
    results are not delayed (``-search.latencyOffset=0s``) nor cached, so a test can
    read what was just scraped."""

    name = "victoria-metrics"

    def command(self) -> list[str]:
        return [
            require(VICTORIA_METRICS, "victoria-metrics"),
            f"-promscrape.config={self.config_path}",
            f"-storageDataPath={self.workdir / 'data'}",
            f"-httpListenAddr=127.0.0.1:{self.port}",
            "-search.latencyOffset=0s",
            "-search.disableCache",
            "-retentionPeriod=1d",
            "-loggerLevel=WARN",
        ]

    def ready_path(self) -> str:
        return "/health"


BACKENDS = {"prometheus": PrometheusServer, "victoria-metrics": VictoriaMetricsServer}

"""Prometheus behind authentication and TLS, for every client path (advise, report, lint;
the dashboard in test_prom_dashboard.py), against real servers holding the replayed run:

* basic auth over HTTPS: Prometheus' own ``--web.config.file`` (a bcrypt hash, a
  self-signed certificate), see ``_backends.SecuredPrometheusServer``;
* a bearer token: Prometheus has no bearer check of its own, so a small reverse proxy
  in front of the plain server checks ``Authorization: Bearer ...`` and forwards.

Right credentials give the verdicts; missing or wrong ones a clear exit 2 that never
shows the secret.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from _promfleet import Fleet

from kvscope.collector.process import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "tok-8f1e2d3c4b5a"
RULES = ROOT / "tests" / "prometheus" / "data" / "old_vllm_rules.yml"


class BearerProxy:
    """Forwards to ``upstream`` what carries ``Authorization: Bearer <token>``; 401 else."""

    def __init__(self, upstream: str, token: str) -> None:
        self.seen: list[str] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self) -> None:
                got = self.headers.get("Authorization", "")
                proxy.seen.append(got.split(" ", 1)[0])
                if got != f"Bearer {token}":
                    body = b"unauthorized: bad or missing bearer token\n"
                    self.send_response(401)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                n = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(n) if n else None
                req = urllib.request.Request(upstream + self.path, data=data, method=self.command)
                if self.headers.get("Content-Type"):
                    req.add_header("Content-Type", self.headers["Content-Type"])
                try:
                    with urllib.request.urlopen(req, timeout=60) as r:
                        status, body = r.status, r.read()
                except urllib.error.HTTPError as e:
                    status, body = e.code, e.read()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _forward

            def log_message(self, *args: object) -> None:
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> BearerProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def proxy(fleet: Fleet) -> Iterator[BearerProxy]:
    with BearerProxy(fleet.backends["prometheus"].url, TOKEN) as p:
        yield p


@pytest.fixture
def secrets(tmp_path: Path, fleet: Fleet) -> dict[str, str]:
    b = fleet.backends["prometheus-secured"]
    files = {
        "token": TOKEN,
        "wrong_token": "tok-WRONG-0000",
        "password": b.password,
        "wrong_password": "not-the-Pa55word",
    }
    out = {}
    for name, text in files.items():
        path = tmp_path / name
        path.write_text(text + "\n")
        out[name] = str(path)
    return out


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_PROMETHEUS")}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "kvscope.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=full,
    )


def _window(fleet: Fleet) -> list[str]:
    return ["--since", f"{fleet.since:.3f}", "--until", f"{fleet.until:.3f}"]


def _no_secret(p: subprocess.CompletedProcess[str], *secret: str) -> None:
    for s in secret:
        assert s not in p.stdout and s not in p.stderr


def test_basic_auth_over_https_gives_the_verdicts(fleet: Fleet, secrets: dict[str, str]) -> None:
    b = fleet.backends["prometheus-secured"]
    p = _cli(
        "advise",
        "--prometheus",
        b.url,
        *_window(fleet),
        "--json",
        "--prometheus-user",
        b.user,
        "--prometheus-password-file",
        secrets["password"],
        "--prometheus-ca-file",
        str(b.ca_file),
        "--pool",
        "kvscope-demo",
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["coverage"]["source"] == "prometheus" and doc["coverage"]["resolution_s"] == 1
    [engine] = doc["engines"]
    assert engine["engine_id"] == fleet.engine_id(fleet.new)
    assert engine["bottleneck"] == "kv_cache_bound" and engine["saturated"]
    _no_secret(p, b.password)
    # The password from the environment works the same.
    env = {"KVSCOPE_PROMETHEUS_USER": b.user, "KVSCOPE_PROMETHEUS_PASSWORD": b.password}
    q = _cli(
        "advise",
        "--prometheus",
        b.url,
        *_window(fleet),
        "--json",
        "--prometheus-ca-file",
        str(b.ca_file),
        "--pool",
        "kvscope-demo",
        env=env,
    )
    assert q.returncode == 0, q.stderr
    assert json.loads(q.stdout)["engines"][0]["bottleneck"] == "kv_cache_bound"


def test_missing_or_wrong_basic_auth_is_a_clear_error(
    fleet: Fleet, secrets: dict[str, str]
) -> None:
    b = fleet.backends["prometheus-secured"]
    tls = ["--prometheus-ca-file", str(b.ca_file)]
    none = _cli("advise", "--prometheus", b.url, *_window(fleet), *tls)
    assert none.returncode == 2
    assert "answered 401" in none.stderr and "--prometheus-password-file" in none.stderr
    wrong = _cli(
        "advise",
        "--prometheus",
        b.url,
        *_window(fleet),
        *tls,
        "--prometheus-user",
        b.user,
        "--prometheus-password-file",
        secrets["wrong_password"],
    )
    assert wrong.returncode == 2
    assert "answered 401" in wrong.stderr and "user and password sent were refused" in wrong.stderr
    _no_secret(wrong, "not-the-Pa55word", b.password)
    lint = _cli(
        "lint",
        str(RULES),
        "--prometheus",
        b.url,
        *tls,
        "--prometheus-user",
        b.user,
        "--prometheus-password-file",
        secrets["wrong_password"],
    )
    assert lint.returncode == 2 and "401" in lint.stderr
    _no_secret(lint, "not-the-Pa55word")
    half = _cli("advise", "--prometheus", b.url, "--prometheus-user", b.user)
    assert half.returncode == 2 and "needs --prometheus-password-file" in half.stderr
    in_url = _cli(
        "advise", "--prometheus", b.url.replace("https://", f"https://{b.user}:{b.password}@")
    )
    assert in_url.returncode == 2 and "credentials in the URL" in in_url.stderr
    _no_secret(in_url, b.password)


def test_tls_needs_the_ca_or_an_explicit_skip(fleet: Fleet, secrets: dict[str, str]) -> None:
    b = fleet.backends["prometheus-secured"]
    login = ["--prometheus-user", b.user, "--prometheus-password-file", secrets["password"]]
    untrusted = _cli("lint", str(RULES), "--prometheus", b.url, *login)
    assert untrusted.returncode == 2
    assert "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
    assert "--prometheus-ca-file" in untrusted.stderr
    skipped = _cli(
        "lint",
        str(RULES),
        "--prometheus",
        b.url,
        *login,
        "--prometheus-insecure-skip-verify",
        "--json",
    )
    # 1: the old rules file names metrics the fleet has renamed; it was read and checked.
    assert skipped.returncode == 1, skipped.stderr
    assert json.loads(skipped.stdout)["problems"]


def test_bearer_token_through_a_checking_proxy(
    fleet: Fleet, proxy: BearerProxy, secrets: dict[str, str]
) -> None:
    ok = _cli(
        "advise",
        "--prometheus",
        proxy.url,
        *_window(fleet),
        "--json",
        "--prometheus-bearer-token-file",
        secrets["token"],
    )
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert {e["bottleneck"] for e in doc["engines"]} == {"kv_cache_bound"}
    assert len(doc["engines"]) == 3
    assert "Bearer" in proxy.seen
    env_ok = _cli(
        "lint",
        str(RULES),
        "--prometheus",
        proxy.url,
        "--json",
        env={"KVSCOPE_PROMETHEUS_BEARER_TOKEN": TOKEN},
    )
    assert env_ok.returncode == 1, env_ok.stderr  # read and checked (old names found)
    wrong = _cli(
        "advise",
        "--prometheus",
        proxy.url,
        *_window(fleet),
        "--prometheus-bearer-token-file",
        secrets["wrong_token"],
    )
    assert wrong.returncode == 2
    assert "answered 401" in wrong.stderr and "the bearer token sent was refused" in wrong.stderr
    _no_secret(wrong, "tok-WRONG-0000", TOKEN)
    missing = _cli("advise", "--prometheus", proxy.url, *_window(fleet))
    assert missing.returncode == 2 and "--prometheus-bearer-token-file" in missing.stderr
    both = _cli(
        "advise",
        "--prometheus",
        proxy.url,
        "--prometheus-bearer-token-file",
        secrets["token"],
        "--prometheus-user",
        "u",
        "--prometheus-password-file",
        secrets["password"],
    )
    assert both.returncode == 2 and "not both" in both.stderr
    _no_secret(both, TOKEN)

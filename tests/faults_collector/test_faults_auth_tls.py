"""Authentication and TLS of a real collector process.

With a token: ingest, every read route and /metrics answer 401 to a missing or wrong
token (the advisor's and dashboard's reader too), /healthz stays open, and the token
never reaches the log. Without a token the collector refuses a non-loopback address
unless ``--allow-unauthenticated``. With ``--tls-cert/--tls-key`` it serves HTTPS that
the engine plugin's client (``KVSCOPE_CA_FILE``) and the reader verify.
"""

from __future__ import annotations

import datetime
import gzip
import http.client
import ipaddress
import json
import os
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from _faults_collector_helpers import QUIET, batch, counter, post, request, start_collector
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvscope.advisor.sources import CollectorSource, SourceError
from kvscope.collector.process import free_port
from kvscope.engine_plugins._config import load_settings
from kvscope.engine_plugins._http import IngestClient

TOKEN = "kvs-test-token-7f3a9c"

READ_ROUTES = [
    "/metrics",
    "/v1/engines",
    "/v1/engines/auth-host:8000:0/configs",
    "/v1/windows",
    "/v1/steps",
    "/v1/requests",
    "/v1/kv_events",
    "/v1/request_stats",
    "/v1/totals",
]


def test_token_guards_every_route_but_healthz(tmp_path: Path) -> None:
    c = start_collector(tmp_path / "auth.duckdb", token=TOKEN)
    try:
        b = batch("auth-host:8000:0", "boot-1", 0, with_hello=True, step_ts=[1.7e9])
        bad_auth = [
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {TOKEN}"},
            {"Authorization": f"Bearer {TOKEN}x"},
            {"Authorization": "Bearer"},
        ]
        body = gzip.compress(json.dumps(b).encode())
        for h in bad_auth:
            status, headers, _ = request(
                c.url, "POST", "/v1/ingest", body, {"Content-Encoding": "gzip", **h}
            )
            assert status == 401 and headers["www-authenticate"].startswith("Bearer"), h
            for route in READ_ROUTES:
                assert request(c.url, "GET", route, headers=h)[0] == 401, (route, h)
        assert request(c.url, "GET", "/healthz")[0] == 200  # open for liveness probes
        status, _, answer = post(c.url, b, token=TOKEN)
        assert status == 200 and json.loads(answer)["status"] == "stored"
        for route in READ_ROUTES:
            assert c.request(route)[0] == 200, route  # CollectorProcess sends the token
        # The readers (kvscope advise, report, dashboard) go through CollectorSource.
        assert list(CollectorSource(c.url, token=TOKEN).engines()["engine_id"]) == [b["engine_id"]]
        with pytest.raises(SourceError) as err:
            CollectorSource(c.url, token="nope").engines()
        assert err.value.status == 401
        metrics = c.get_text("/metrics")
    finally:
        c.stop()
    n_bad = len(bad_auth)
    assert (
        counter(metrics, "kvscope_collector_rejected_batches_total", reason="unauthorized") == n_bad
    )
    assert (
        counter(metrics, "kvscope_collector_rejected_reads_total", reason="unauthorized")
        == n_bad * len(READ_ROUTES) + 1
    )
    assert TOKEN not in c.log_path.read_text()


def _cli(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvscope.cli.main",
        "collector",
        "--kv-events",
        "off",
        "--advise-interval-s",
        "0",
        *args,
    ]


def test_non_loopback_without_token_refuses_unless_allowed(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVSCOPE_TOKEN"}
    store = tmp_path / "open.duckdb"
    res = subprocess.run(
        _cli("--host", "0.0.0.0", "--port", str(free_port()), "--store", str(store)),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert "refusing to listen on 0.0.0.0 without a token" in res.stderr
    assert "--allow-unauthenticated" in res.stderr and "--token" in res.stderr
    assert not store.exists()
    # Allowed explicitly: it starts and says so loudly. Traffic stays on loopback.
    port = free_port()
    c = start_collector(store, "--host", "0.0.0.0", "--allow-unauthenticated", port=port)
    try:
        assert request(f"http://127.0.0.1:{port}", "GET", "/v1/engines")[0] == 200
    finally:
        c.stop()
    assert "WITHOUT AUTHENTICATION" in c.log_path.read_text()


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvscope-test-collector")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "collector.crt", tmp / "collector.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls_serves_https_to_the_plugin_and_the_readers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = _self_signed(tmp_path)
    port = free_port()
    from kvscope.collector.process import CollectorProcess

    c = CollectorProcess(
        tmp_path / "tls.duckdb",
        port=port,
        token=TOKEN,
        ca_file=cert,
        extra_args=[
            *QUIET,
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
        ],
    ).start()
    url = f"https://127.0.0.1:{port}"
    try:
        assert c.url == url
        # The engine plugin's own settings and client, as vLLM's process would build them.
        s = load_settings(
            env={
                "KVSCOPE_COLLECTOR_URL": url,
                "KVSCOPE_TOKEN": TOKEN,
                "KVSCOPE_CA_FILE": str(cert),
            },
            argv=[],
        )
        b = batch("tls-host:8000:0", "boot-1", 0, with_hello=True, step_ts=[1.7e9, 1.7e9 + 1])
        resp = IngestClient(s.collector_url or "", s.token, s.ca_file).post(
            gzip.compress(json.dumps(b).encode()), 10.0
        )
        assert resp.status == 200 and resp.json()["status"] == "stored"
        # Without the CA the certificate is not trusted; plain HTTP gets no answer.
        with pytest.raises(ssl.SSLCertVerificationError):
            IngestClient(url, TOKEN).post(gzip.compress(json.dumps(b).encode()), 10.0)
        with pytest.raises((http.client.HTTPException, OSError)):
            request(f"http://127.0.0.1:{port}", "GET", "/healthz", timeout_s=5)
        # The readers: an explicit CA file, or KVSCOPE_CA_FILE.
        assert list(
            CollectorSource(url, token=TOKEN, ca_file=str(cert)).engines()["engine_id"]
        ) == [b["engine_id"]]
        monkeypatch.setenv("KVSCOPE_CA_FILE", str(cert))
        assert len(CollectorSource(url, token=TOKEN).windows(since=0)) == 2
        assert c.get_json("/healthz")["status"] == "ok"
    finally:
        c.stop()
    print(
        f"\n[auth/tls] HTTPS on {url}: plugin client and reader verified the self-signed "
        "certificate via KVSCOPE_CA_FILE"
    )

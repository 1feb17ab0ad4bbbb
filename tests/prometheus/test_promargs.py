"""The shared Prometheus options (kvscope.sources.prometheus.target) and the credentials object
(kvscope.sources.prometheus.auth): parsing, precedence, and secrets kept out of reprs and messages."""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

import pytest

from kvscope.dashboard.settings import parse_settings, to_argv
from kvscope.sources.prometheus.auth import PromAuth
from kvscope.sources.prometheus.target import (
    ENV_BEARER,
    ENV_HEADERS,
    ENV_PASSWORD,
    PromArgError,
    add_prometheus_arguments,
    prometheus_target,
)


def _parse(*argv: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    p = argparse.ArgumentParser()
    add_prometheus_arguments(p)
    return prometheus_target(p.parse_args(list(argv)), env or {})


def _file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_no_prometheus_no_target() -> None:
    assert _parse() is None


def test_bearer_token_from_file_or_environment(tmp_path: Path) -> None:
    t = _parse(
        "--prometheus",
        "prom:9090",
        "--prometheus-bearer-token-file",
        _file(tmp_path, "t", "  abc123\n"),
    )
    assert t is not None and t.url == "http://prom:9090" and t.auth is not None
    assert t.auth.request_headers() == {"Authorization": "Bearer abc123"}
    e = _parse("--prometheus", "https://prom", env={ENV_BEARER: "fromenv"})
    assert e is not None and e.auth is not None
    assert e.auth.request_headers()["Authorization"] == "Bearer fromenv"


def test_basic_auth_and_headers(tmp_path: Path) -> None:
    t = _parse(
        "--prometheus",
        "http://p",
        "--prometheus-user",
        "ops",
        "--prometheus-password-file",
        _file(tmp_path, "pw", "pa:ss\n"),
        "--prometheus-header",
        "X-Scope-OrgID: team-a",
        env={ENV_HEADERS: "X-Extra: 1"},
    )
    assert t is not None and t.auth is not None
    h = t.auth.request_headers()
    assert h["Authorization"] == "Basic " + base64.b64encode(b"ops:pa:ss").decode()
    assert h["X-Scope-OrgID"] == "team-a" and h["X-Extra"] == "1"
    assert "pa:ss" not in repr(t) and "team-a" not in repr(t)


def test_inconsistent_options_name_the_option(tmp_path: Path) -> None:
    with pytest.raises(PromArgError, match="needs --prometheus-password-file"):
        _parse("--prometheus", "p", "--prometheus-user", "u")
    with pytest.raises(PromArgError, match="without --prometheus-user"):
        _parse("--prometheus", "p", env={ENV_PASSWORD: "x"})
    with pytest.raises(PromArgError, match="is empty"):
        _parse("--prometheus", "p", "--prometheus-bearer-token-file", _file(tmp_path, "e", "\n"))
    with pytest.raises(PromArgError, match="cannot read"):
        _parse("--prometheus", "p", "--prometheus-bearer-token-file", str(tmp_path / "none"))
    with pytest.raises(PromArgError, match="'Name: value'"):
        _parse("--prometheus", "p", "--prometheus-header", "novalue")
    with pytest.raises(PromArgError, match="no such file"):
        _parse("--prometheus", "p", "--prometheus-ca-file", str(tmp_path / "ca.pem"))
    with pytest.raises(PromArgError, match="cannot load the CA file"):
        _parse("--prometheus", "p", "--prometheus-ca-file", _file(tmp_path, "ca", "not pem"))
    with pytest.raises(PromArgError, match="--step must be at least 1"):
        _parse("--prometheus", "p", "--step", "0.5")
    with pytest.raises(PromArgError, match="credentials in the URL") as e:
        _parse("--prometheus", "http://u:hunter2@p")
    assert "hunter2" not in str(e.value)
    with pytest.raises(PromArgError, match="not both"):
        _parse(
            "--prometheus",
            "p",
            "--prometheus-bearer-token-file",
            _file(tmp_path, "t", "x"),
            "--prometheus-user",
            "u",
            "--prometheus-password-file",
            _file(tmp_path, "w", "y"),
        )


def test_auth_repr_masks_secrets() -> None:
    a = PromAuth(username="u", password="hunter2", headers=(("X-Key", "k3y"),))
    assert "hunter2" not in repr(a) and "k3y" not in repr(a) and "u" in repr(a)
    assert "tok" not in repr(PromAuth(bearer_token="tok"))
    with pytest.raises(ValueError, match="not both"):
        PromAuth(bearer_token="t", username="u", password="p")


def test_dashboard_settings_round_trip_without_secrets(tmp_path: Path) -> None:
    env = {ENV_PASSWORD: "hunter2"}
    s = parse_settings(
        [
            "--prometheus",
            "p:9090",
            "--prometheus-user",
            "ops",
            "--selector",
            '{job="vllm"}',
            "--step",
            "15",
        ],
        env,
    )
    assert s.prometheus is not None and s.collector_url == ""
    argv = to_argv(s)
    assert "hunter2" not in " ".join(argv) and "hunter2" not in s.cache_key()
    assert s.prometheus.environ() == env
    again = parse_settings(argv, s.prometheus.environ())
    assert again == s
    other = parse_settings(argv, {ENV_PASSWORD: "other"})
    assert other.cache_key() != s.cache_key()


def test_authorization_does_not_follow_a_redirect() -> None:
    """A server redirecting elsewhere does not get the credentials sent on; the client
    reports the other server's answer without them."""
    import http.server
    import threading

    from kvscope.advisor.sources import SourceError
    from kvscope.sources.prometheus.client import PromClient

    seen: list[str | None] = []

    class Capture(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            self.send_response(401)
            self.end_headers()

        def log_message(self, *a: object) -> None:
            return None

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    target = f"http://127.0.0.1:{other.server_address[1]}"

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append("first:" + str(self.headers.get("Authorization")))
            self.send_response(302)
            self.send_header("Location", target + self.path)
            self.end_headers()

        def log_message(self, *a: object) -> None:
            return None

    first = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    for srv in (other, first):
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        client = PromClient(
            f"http://127.0.0.1:{first.server_address[1]}",
            timeout_s=5,
            auth=PromAuth(bearer_token="s3cr3t-token"),
        )
        with pytest.raises(SourceError, match="answered 401") as e:
            client.metadata()
        assert "s3cr3t-token" not in str(e.value)
        assert seen == ["first:Bearer s3cr3t-token", None]
    finally:
        for srv in (other, first):
            srv.shutdown()
            srv.server_close()


def test_dashboard_refuses_prometheus_with_a_collector_or_the_demo(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvscope.cli import dashboard as cli

    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers())
    for extra in (["--demo"], ["--collector", "http://c:8844"]):
        args = p.parse_args(["dashboard", "--prometheus", "http://p:9090", *extra])
        assert cli._run(args) == 2
        assert "leave out --collector and --demo" in capsys.readouterr().err

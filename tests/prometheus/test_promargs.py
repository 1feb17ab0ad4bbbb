"""The shared Prometheus options (collector._promargs) and the credentials object
(advisor._promauth): parsing, precedence, and secrets kept out of reprs and messages."""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

import pytest

from advisor._promauth import PromAuth
from collector._promargs import (
    ENV_BEARER,
    ENV_HEADERS,
    ENV_PASSWORD,
    PromArgError,
    add_prometheus_arguments,
    prometheus_target,
)
from dashboard.settings import parse_settings, to_argv


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
    t = _parse("--prometheus", "prom:9090", "--prometheus-bearer-token-file",
               _file(tmp_path, "t", "  abc123\n"))
    assert t is not None and t.url == "http://prom:9090" and t.auth is not None
    assert t.auth.request_headers() == {"Authorization": "Bearer abc123"}
    e = _parse("--prometheus", "https://prom", env={ENV_BEARER: "fromenv"})
    assert e is not None and e.auth is not None
    assert e.auth.request_headers()["Authorization"] == "Bearer fromenv"


def test_basic_auth_and_headers(tmp_path: Path) -> None:
    t = _parse("--prometheus", "http://p", "--prometheus-user", "ops",
               "--prometheus-password-file", _file(tmp_path, "pw", "pa:ss\n"),
               "--prometheus-header", "X-Scope-OrgID: team-a",
               env={ENV_HEADERS: "X-Extra: 1"})
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
        _parse("--prometheus", "p", "--prometheus-bearer-token-file", _file(tmp_path, "t", "x"),
               "--prometheus-user", "u", "--prometheus-password-file", _file(tmp_path, "w", "y"))


def test_auth_repr_masks_secrets() -> None:
    a = PromAuth(username="u", password="hunter2", headers=(("X-Key", "k3y"),))
    assert "hunter2" not in repr(a) and "k3y" not in repr(a) and "u" in repr(a)
    assert "tok" not in repr(PromAuth(bearer_token="tok"))
    with pytest.raises(ValueError, match="not both"):
        PromAuth(bearer_token="t", username="u", password="p")


def test_dashboard_settings_round_trip_without_secrets(tmp_path: Path) -> None:
    env = {ENV_PASSWORD: "hunter2"}
    s = parse_settings(["--prometheus", "p:9090", "--prometheus-user", "ops", "--selector",
                        '{job="vllm"}', "--step", "15"], env)
    assert s.prometheus is not None and s.collector_url == ""
    argv = to_argv(s)
    assert "hunter2" not in " ".join(argv) and "hunter2" not in s.cache_key()
    assert s.prometheus.environ() == env
    again = parse_settings(argv, s.prometheus.environ())
    assert again == s
    other = parse_settings(argv, {ENV_PASSWORD: "other"})
    assert other.cache_key() != s.cache_key()

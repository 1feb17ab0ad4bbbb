"""KVSCOPE_* settings: defaults, overrides, and bad values that fall back with a message."""

from __future__ import annotations

import logging
from typing import Any

from kvscope.engine_plugins._config import (
    DEFAULT_BUFFER_STEPS,
    DEFAULT_FLUSH_INTERVAL_S,
    DEFAULT_PORT,
    load_settings,
    port_from_argv,
)


def test_defaults_without_environment() -> None:
    s = load_settings(env={}, argv=["vllm"])
    assert not s.enabled
    assert s.collector_url is None and s.token is None
    assert (s.pool, s.port, s.buffer_steps) == ("default", DEFAULT_PORT, DEFAULT_BUFFER_STEPS)
    assert s.flush_interval_s == DEFAULT_FLUSH_INTERVAL_S
    assert s.engine_id(0).endswith(f":{DEFAULT_PORT}:0")


def test_values_from_environment() -> None:
    env = {
        "KVSCOPE_COLLECTOR_URL": "https://collector.example:9000/base/",
        "KVSCOPE_TOKEN": "t0k",
        "KVSCOPE_POOL": "llama-prod",
        "KVSCOPE_HOST": "pod-7",
        "KVSCOPE_PORT": "8001",
        "KVSCOPE_FLUSH_INTERVAL_S": "0.5",
        "KVSCOPE_BUFFER_STEPS": "5_000",
        "KVSCOPE_MAX_PENDING_BATCHES": "7",
        "KVSCOPE_TIMEOUT_S": "3",
        "KVSCOPE_SHUTDOWN_TIMEOUT_S": "1.5",
    }
    s = load_settings(env=env, argv=["x", "--port", "9999"])
    assert s.collector_url == "https://collector.example:9000/base"
    assert (s.token, s.pool, s.host, s.port) == ("t0k", "llama-prod", "pod-7", 8001)
    assert (s.flush_interval_s, s.buffer_steps, s.max_pending_batches) == (0.5, 5000, 7)
    assert (s.timeout_s, s.shutdown_timeout_s) == (3.0, 1.5)
    assert s.engine_id(2) == "pod-7:8001:2"


def test_engine_id_override() -> None:
    s = load_settings(env={"KVSCOPE_ENGINE_ID": "llama-a"}, argv=[])
    assert s.engine_id(0) == "llama-a"
    assert s.engine_id(1, multi_engine=True) == "llama-a:1"


def test_port_from_argv() -> None:
    assert port_from_argv(["api_server", "--model", "m", "--port", "8011"]) == 8011
    assert port_from_argv(["api_server", "--port=8012"]) == 8012
    assert port_from_argv(["api_server", "--port", "x"]) is None
    assert port_from_argv(["api_server"]) is None
    assert load_settings(env={}, argv=["s", "--port=8013"]).port == 8013


def test_bad_values_fall_back_with_one_message_each(log_records: list[Any]) -> None:
    env = {
        "KVSCOPE_FLUSH_INTERVAL_S": "soon",
        "KVSCOPE_BUFFER_STEPS": "-5",
        "KVSCOPE_PORT": "70000",
        "KVSCOPE_TIMEOUT_S": "nan",
    }
    s = load_settings(env=env, argv=[])
    assert s.flush_interval_s == DEFAULT_FLUSH_INTERVAL_S
    assert s.buffer_steps == DEFAULT_BUFFER_STEPS
    assert s.port == DEFAULT_PORT
    assert s.timeout_s == 2.0
    load_settings(env=env, argv=[])
    warnings = [r.getMessage() for r in log_records if r.levelno == logging.WARNING]
    assert len(warnings) == 4
    assert any("KVSCOPE_FLUSH_INTERVAL_S" in w and "'soon'" in w for w in warnings)


def test_invalid_collector_url_leaves_plugin_inert(log_records: list[Any]) -> None:
    for url in ("collector:9000", "ftp://x", "http://", "http://h:99999"):
        assert load_settings(env={"KVSCOPE_COLLECTOR_URL": url}, argv=[]).collector_url is None
    assert any("KVSCOPE_COLLECTOR_URL" in r.getMessage() for r in log_records)

"""The stat logger: inert without a URL, never raises, equals vLLM's own counters."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from _ep_helpers import column_sum, iter_stats, sched_stats
from _plugin_testkit import RecordingServer
from prometheus_client import REGISTRY

from kvscope.engine_plugins import schema
from kvscope.engine_plugins.exporter import Exporter
from kvscope.engine_plugins.plugin import INERT_MESSAGE, KvscopeStatLogger


def test_inert_without_collector_url_logs_once(
    monkeypatch: pytest.MonkeyPatch, light_vllm_config: Any, log_records: list[Any]
) -> None:
    monkeypatch.delenv("KVSCOPE_COLLECTOR_URL", raising=False)
    loggers = [KvscopeStatLogger(light_vllm_config, i) for i in range(3)]
    for lg in loggers:
        lg.record(sched_stats(), iter_stats())
        lg.record("garbage", None)  # inert: not even looked at
        lg.log_engine_initialized()
        lg.log()
        assert lg.record_errors == 0
    notices = [r for r in log_records if r.getMessage() == INERT_MESSAGE]
    assert len(notices) == 1
    assert notices[0].levelno == logging.INFO
    assert "KVSCOPE_COLLECTOR_URL=" in INERT_MESSAGE  # says how to enable it


def test_hello_reads_the_vllm_config(installed_exporter: Exporter, light_vllm_config: Any) -> None:
    lg = KvscopeStatLogger(light_vllm_config, 0)
    assert lg.engine_id == "testhost:8123:0"
    hello = installed_exporter.register(lg.engine_id, lg.build_hello("b")).hello
    assert hello is not None
    assert hello["num_gpu_blocks"] == 48
    assert hello["block_size"] == 32
    assert hello["max_num_seqs"] == 6
    assert hello["max_num_batched_tokens"] == 512
    assert hello["enable_prefix_caching"] is True
    assert hello["kv_cache_dtype"] == "auto"
    assert hello["gpu_memory_utilization"] == 0.5
    assert hello["tensor_parallel_size"] == 1 and hello["data_parallel_size"] == 1
    assert hello["vllm_version"].startswith("0.")
    assert hello["host"] == "testhost" and hello["port"] == 8123 and hello["pool"] == "default"


def test_every_api_server_process_sends_under_the_engines_id(
    installed_exporter: Exporter, light_vllm_config: Any
) -> None:
    # vllm serve --api-server-count 2: vLLM sets these on each API server process's
    # config; each process sees part of the engine's steps and requests.
    par = light_vllm_config.parallel_config
    par._api_process_count = 2
    ids = set()
    for rank in (0, 1):
        par._api_process_rank = rank
        ids.add(KvscopeStatLogger(light_vllm_config, 0).engine_id)
    assert ids == {"testhost:8123:0"}


def test_num_gpu_blocks_known_after_init_sends_a_fresh_hello(
    installed_exporter: Exporter, collector: RecordingServer, light_vllm_config: Any
) -> None:
    light_vllm_config.cache_config.num_gpu_blocks = None
    lg = KvscopeStatLogger(light_vllm_config, 0)
    installed_exporter.tick()
    light_vllm_config.cache_config.num_gpu_blocks = 96
    lg.log_engine_initialized()
    lg.record(sched_stats(kv=0.5), None)
    installed_exporter.tick(final=True)
    hellos = [b["hello"] for b in collector.batches() if b["hello"] is not None]
    assert [h["num_gpu_blocks"] for h in hellos] == [None, 96]
    last = collector.batches()[-1]
    assert last["steps"]["kv_blocks_used"] == [48]
    lg.log_engine_initialized()  # unchanged: no new hello
    lg.record(sched_stats(), None)
    installed_exporter.tick(final=True)
    assert collector.batches()[-1]["hello"] is None


GARBAGE: list[tuple[Any, Any]] = [
    (42, None),
    ("sched", iter_stats()),
    (sched_stats(), "iteration"),
    (None, object()),
    (object(), object()),
    ([1, 2, 3], {"num_generation_tokens": 1}),
]


def test_record_never_raises_and_counts_errors(
    installed_exporter: Exporter, light_vllm_config: Any, log_records: list[Any]
) -> None:
    lg = KvscopeStatLogger(light_vllm_config, 0)
    for sched, it in GARBAGE:
        lg.record(sched, it)
    assert lg.record_errors == len(GARBAGE)
    bad_fins = iter_stats()
    bad_fins.finished_requests = 5  # type: ignore[assignment]
    lg.record(sched_stats(), bad_fins)
    assert lg.record_errors == len(GARBAGE) + 1
    lg.record(None, None)
    lg.record(sched_stats(), iter_stats(fins=2))
    assert lg.record_errors == len(GARBAGE) + 1
    # Logged at most once a minute, however many failures.
    assert sum("record() failed" in r.getMessage() for r in log_records) == 1
    assert installed_exporter.stats()["record_errors"] == len(GARBAGE) + 1


def test_broken_config_does_not_break_vllm(
    installed_exporter: Exporter, log_records: list[Any]
) -> None:
    lg = KvscopeStatLogger(None, 0)  # no config at all: the hello is mostly null
    lg.record(sched_stats(), iter_stats())
    lg.log_engine_initialized()
    lg.log()
    lg.record_sleep_state(1, 1)
    assert lg.record_errors == 0
    installed_exporter.tick(final=True)
    assert installed_exporter.stats()["steps_sent"] == 1


def test_totals_equal_vllm_prometheus_counters(
    installed_exporter: Exporter, collector: RecordingServer, full_vllm_config: Any
) -> None:
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    prom = PrometheusStatLogger(full_vllm_config, [0])
    kv = KvscopeStatLogger(full_vllm_config, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    names = {
        "prefix_queries": "vllm:prefix_cache_queries_total",
        "prefix_hits": "vllm:prefix_cache_hits_total",
        "prompt_tokens": "vllm:prompt_tokens_total",
        "generation_tokens": "vllm:generation_tokens_total",
        "preemptions": "vllm:num_preemptions_total",
    }
    before = {c: REGISTRY.get_sample_value(n, labels) or 0.0 for c, n in names.items()}
    _feed_both(prom, kv)
    installed_exporter.tick(final=True)
    batches = collector.batches()
    for b in batches:
        schema.validate_batch(b)
    for column, name in names.items():
        vllm_total = (REGISTRY.get_sample_value(name, labels) or 0.0) - before[column]
        assert vllm_total > 0, name
        assert column_sum(batches, "steps", column) == vllm_total, column
    success = sum(
        REGISTRY.get_sample_value(
            "vllm:request_success_total", {**labels, "finished_reason": reason}
        )
        or 0.0
        for reason in ("stop", "length", "abort", "error", "repetition")
    )
    assert sum(len(b["requests"].get("e2e_s", [])) for b in batches) == success
    stats = installed_exporter.stats()
    # One step row per record() call with scheduler stats, plus the trailing
    # token-only call that no step followed.
    assert stats["steps_sent"] == 36 + 1
    assert stats["steps_produced"] == stats["steps_sent"] + stats["steps_merged"]


def _feed_both(prom: Any, kv: KvscopeStatLogger) -> None:
    """A step sequence with everything vLLM counts: every record() shape."""
    calls: list[tuple[Any, Any]] = []
    for i in range(40):
        sched = sched_stats(
            running=1 + i % 6,
            queries=10 * i,
            hits=3 * i,
            preempted_queries=7 if i % 5 == 0 else 0,
            connector_queries=11 if i % 7 == 0 else 0,
            elapsed_ms=9.0 if i % 2 else None,
        )
        it = iter_stats(
            gen=i % 8,
            prompt=20 if i % 3 == 0 else 0,
            cached=4,
            preempted=int(i % 4 == 0),
            fins=1 if i % 9 == 0 else 0,
        )
        if i % 10 == 3:
            calls.append((None, it))  # iteration stats without scheduler stats
        elif i % 10 == 6:
            calls.append((sched, None))  # scheduler stats without iteration stats
        else:
            calls.append((sched, it))
    calls.append((None, iter_stats(gen=5, prompt=9)))  # a trailing token-only call
    for sched, it in calls:
        prom.record(sched, it, engine_idx=0)
        kv.record(sched, it, engine_idx=0)


def test_hello_advertises_the_kv_events_endpoint(
    installed_exporter: Exporter, light_vllm_config: Any
) -> None:
    """The endpoint comes from vLLM's real KVEventsConfig, offset per data-parallel
    engine exactly as vLLM's publisher offsets the port it binds."""
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import ZmqEventPublisher

    assert "kv_events_endpoint" not in KvscopeStatLogger(light_vllm_config, 0).build_hello("b")
    light_vllm_config.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:5557"
    )
    for index in (0, 1, 3):
        hello = KvscopeStatLogger(light_vllm_config, index).build_hello("b")
        expected = ZmqEventPublisher.offset_endpoint_port("tcp://*:5557", index)
        assert hello["kv_events_endpoint"] == expected == f"tcp://*:{5557 + index}"
    batch = {
        "schema_version": schema.SCHEMA_VERSION,
        "engine_id": hello["engine_id"],
        "boot_id": "b",
        "seq": 0,
        "sent_unix_s": 1.0,
        "hello": hello,
    }
    schema.validate_batch(batch)
    light_vllm_config.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint="inproc://kv"
    )
    assert KvscopeStatLogger(light_vllm_config, 2).build_hello("b")["kv_events_endpoint"] == (
        ZmqEventPublisher.offset_endpoint_port("inproc://kv", 2)
    )
    # Events off, the null publisher, or a port vLLM picks at bind time: nothing to advertise.
    for cfg in (
        KVEventsConfig(enable_kv_cache_events=False, publisher="zmq"),
        KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:0"),
    ):
        light_vllm_config.kv_events_config = cfg
        assert "kv_events_endpoint" not in KvscopeStatLogger(light_vllm_config, 1).build_hello("b")

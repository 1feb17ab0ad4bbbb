"""GET /metrics: values match the ingested data, promtool accepts it, restarts."""

from __future__ import annotations

import gzip
import math
import shutil
import subprocess
from typing import Any

import numpy as np
import pytest
from _collector_helpers import batch, hello, http, post_batch, steps
from prometheus_client.parser import text_string_to_metric_families

from kvscope.collector.metrics import BATCH_SIZE_BUCKETS, KV_USAGE_BUCKETS

PROMTOOL = "/usr/bin/promtool"
T0 = 1_700_000_000.0
LABELS_E1 = (("engine", "e1"), ("model", "m-1"), ("pool", "pool-a"))


def _scrape(url: str) -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    status, headers, body = http("GET", url + "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    text = body.decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, samples


def _send(url: str) -> dict[str, Any]:
    rng = np.random.default_rng(3)
    n = 120
    b = batch(
        engine_id="e1",
        seq=0,
        req_ts=[T0 + 1, T0 + 2, T0 + 3],
        hello=hello("e1", "boot-1", pool="pool-a", model="m-1", max_num_seqs=64),
        exporter={
            "dropped_steps": 7,
            "dropped_requests": 1,
            "dropped_batches": 2,
            "send_failures": 3,
            "record_errors": 0,
        },
    )
    b["steps"] = steps(
        [T0 + i / 40 for i in range(n)],
        batch=rng.integers(0, 300, n).tolist(),
        kv_usage_ratio=np.round(rng.uniform(0, 1, n), 3).tolist(),
        waiting=rng.integers(0, 50, n).tolist(),
        deferred=rng.integers(0, 3, n).tolist(),
    )
    assert post_batch(url, b)[0] == 200
    return b


def test_values_match_ingested_data(collector: Any) -> None:
    b = _send(collector.url)
    st = b["steps"]
    _, m = _scrape(collector.url)
    L = LABELS_E1
    assert m[("kvscope_engine_batch_size", L)] == st["batch_size"][-1]
    assert m[("kvscope_engine_kv_usage_ratio", L)] == st["kv_usage_ratio"][-1]
    assert m[("kvscope_engine_waiting_requests", L)] == st["waiting"][-1]
    assert m[("kvscope_engine_steps_total", L)] == len(st["ts_unix_s"])
    assert m[("kvscope_engine_prompt_tokens_total", L)] == sum(st["prompt_tokens"])
    assert m[("kvscope_engine_generation_tokens_total", L)] == sum(st["generation_tokens"])
    assert m[("kvscope_engine_preemptions_total", L)] == sum(st["preemptions"])
    assert m[("kvscope_engine_prefix_cache_query_tokens_total", L)] == sum(st["prefix_queries"])
    assert m[("kvscope_engine_prefix_cache_hit_tokens_total", L)] == sum(st["prefix_hits"])
    assert m[("kvscope_engine_prefix_hit_ratio", L)] == pytest.approx(
        sum(st["prefix_hits"]) / sum(st["prefix_queries"])
    )
    assert m[("kvscope_engine_finished_requests_total", L)] == 3
    # The queue summed over steps: over the steps, the mean queue the gauge cannot give.
    assert m[("kvscope_engine_waiting_request_steps_total", L)] == sum(st["waiting"])
    assert m[("kvscope_engine_deferred_request_steps_total", L)] == sum(st["deferred"]) > 0
    assert m[("kvscope_exporter_dropped_steps_total", L)] == 7
    assert m[("kvscope_exporter_send_failures_total", L)] == 3
    # Histograms: cumulative bucket counts against numpy.
    bs = np.array(st["batch_size"])
    for le in BATCH_SIZE_BUCKETS:
        key = ("kvscope_engine_step_batch_size_bucket", tuple(sorted((*L, ("le", f"{float(le)}")))))
        assert m[key] == (bs <= le).sum(), le
    assert m[("kvscope_engine_step_batch_size_count", L)] == len(bs)
    assert m[("kvscope_engine_step_batch_size_sum", L)] == bs.sum()
    inf = ("kvscope_engine_step_batch_size_bucket", tuple(sorted((*L, ("le", "+Inf")))))
    assert m[inf] == len(bs)
    kv = np.array(st["kv_usage_ratio"])
    for le in KV_USAGE_BUCKETS:
        key = ("kvscope_engine_step_kv_usage_ratio_bucket", tuple(sorted((*L, ("le", str(le))))))
        assert m[key] == (kv <= le).sum(), le
    # Info carries the configuration.
    info = [(k, v) for k, v in m.items() if k[0] == "kvscope_engine_info"]
    assert len(info) == 1
    labels = dict(info[0][0][1])
    assert labels["max_num_seqs"] == "64" and labels["vllm_version"] == "0.32.0"
    assert labels["enable_prefix_caching"] == "true" and labels["pool"] == "pool-a"
    assert m[("kvscope_collector_ingest_batches_total", (("result", "stored"),))] == 1


def test_a_restart_under_the_same_id_moves_the_start_time(collector: Any) -> None:
    """An engine restarted under the same id keeps its info labels; its start time is the
    mark Grafana's "Engine restarts" annotation reads."""
    first = hello("e1", "boot-1", pool="pool-a", model="m-1", started_unix_s=T0 - 100)
    assert post_batch(collector.url, batch(engine_id="e1", seq=0, hello=first))[0] == 200
    _, m = _scrape(collector.url)
    assert m[("kvscope_engine_start_time_seconds", LABELS_E1)] == T0 - 100
    info_before = [k for k in m if k[0] == "kvscope_engine_info"]
    again = hello("e1", "boot-2", pool="pool-a", model="m-1", started_unix_s=T0 - 10)
    assert (
        post_batch(collector.url, batch(engine_id="e1", boot_id="boot-2", seq=0, hello=again))[0]
        == 200
    )
    _, m = _scrape(collector.url)
    assert m[("kvscope_engine_start_time_seconds", LABELS_E1)] == T0 - 10
    assert [k for k in m if k[0] == "kvscope_engine_info"] == info_before


def test_rejections_and_duplicates_counted(collector: Any) -> None:
    post_batch(collector.url, batch(step_ts=[T0]))
    post_batch(collector.url, batch(step_ts=[T0]))
    post_batch(collector.url, None, raw=b"{", headers={})
    post_batch(collector.url, batch(schema_version=99))
    post_batch(collector.url, None, raw=b"x", headers={"Content-Encoding": "zstd"})
    _, m = _scrape(collector.url)
    total = "kvscope_collector_ingest_batches_total"
    assert m[(total, (("result", "stored"),))] == 1
    assert m[(total, (("result", "duplicate"),))] == 1
    assert m[(total, (("result", "rejected"),))] == 3
    rej = "kvscope_collector_rejected_batches_total"
    assert m[(rej, (("reason", "bad_json"),))] == 1
    assert m[(rej, (("reason", "schema"),))] == 1
    assert m[(rej, (("reason", "unsupported_encoding"),))] == 1
    assert m[("kvscope_collector_ingest_ack_duration_seconds_count", ())] == 2


def test_engine_without_hello_has_empty_labels(collector: Any) -> None:
    post_batch(collector.url, batch(engine_id='odd"name\\x', step_ts=[T0, T0 + 0.1]))
    _, m = _scrape(collector.url)
    key = ("kvscope_engine_steps_total", (("engine", 'odd"name\\x'), ("model", ""), ("pool", "")))
    assert m[key] == 2
    assert not [k for k in m if k[0] == "kvscope_engine_info"]


def test_promtool_check_metrics(collector: Any) -> None:
    if not shutil.which(PROMTOOL):
        pytest.fail(
            f"{PROMTOOL} is missing: install the Debian 'prometheus' package "
            "(apt-get install prometheus), which provides promtool"
        )
    _send(collector.url)
    post_batch(collector.url, batch(engine_id="e2", step_ts=[T0]))
    post_batch(collector.url, None, raw=gzip.compress(b"[]"), headers={"Content-Encoding": "gzip"})
    text, _ = _scrape(collector.url)
    res = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30
    )
    assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()
    assert not res.stdout.strip() and not res.stderr.strip(), res.stdout + res.stderr


def test_counters_survive_restart(make_collector: Any) -> None:
    lc = make_collector()
    b = _send(lc.url)
    _, before = _scrape(lc.url)
    lc.stop()
    lc2 = make_collector()
    _, after = _scrape(lc2.url)
    keep = [
        k
        for k in before
        if k[0].startswith(("kvscope_engine_", "kvscope_exporter_", "kvscope_request_"))
        and not k[0].endswith(("_ratio", "_size", "_requests", "_blocks"))
    ]
    assert keep
    for k in keep:
        # Sums rebuilt from the store add the same values in another order.
        assert after.get(k) == pytest.approx(before[k], rel=1e-12), k
    # Gauges of the latest step are absent until the engine sends again.
    assert ("kvscope_engine_batch_size", LABELS_E1) not in after
    b2 = batch(engine_id="e1", seq=1, step_ts=[T0 + 10])
    assert post_batch(lc2.url, b2)[0] == 200
    _, again = _scrape(lc2.url)
    assert again[("kvscope_engine_steps_total", LABELS_E1)] == len(b["steps"]["ts_unix_s"]) + 1
    assert (
        again[("kvscope_engine_step_batch_size_count", LABELS_E1)]
        == len(b["steps"]["ts_unix_s"]) + 1
    )
    assert math.isclose(
        again[("kvscope_engine_batch_size", LABELS_E1)], b2["steps"]["batch_size"][0]
    )


def _cum(values: list[float], le: float) -> int:
    return sum(1 for v in values if v <= le)


def test_request_latency_histograms_match_the_requests(make_collector: Any) -> None:
    """Per finished request: TTFT (vLLM's, else queue + prefill), inter-token latency
    (decode / (output tokens - 1), none for a one-token request), e2e, queue, lengths;
    finish reasons with unknown ones as ``other``. The same after a restart, rebuilt
    from the stored requests."""
    reqs = {
        "finished_unix_s": [T0 + 1, T0 + 2, T0 + 3, T0 + 4],
        "e2e_s": [1.5, 0.3, 12.0, 2.0],
        "queue_s": [0.0, 0.1, 4.0, 0.5],
        "prefill_s": [0.15, 0.05, 0.6, 0.3],
        "decode_s": [1.2, 0.0, 7.2, 1.0],
        "ttft_s": [0.2, None, None, 0.9],
        "prompt_tokens": [100, 20, 3000, 700],
        "generation_tokens": [61, 1, 145, 11],
        "cached_tokens": [0, 0, 16, 0],
        "preemptions": [0, 0, 2, 0],
        "finish_reason": ["stop", "length", "abort", "repetition"],
    }
    # By hand from the definitions (not the code's helpers).
    expected = {
        "kvscope_request_ttft_seconds": [0.2, 0.15, 4.6, 0.9],
        "kvscope_request_inter_token_latency_seconds": [0.02, 0.05, 0.1],
        "kvscope_request_e2e_seconds": [1.5, 0.3, 12.0, 2.0],
        "kvscope_request_queue_seconds": [0.0, 0.1, 4.0, 0.5],
        "kvscope_request_prefill_seconds": [0.15, 0.05, 0.6, 0.3],
        "kvscope_request_decode_seconds": [1.2, 0.0, 7.2, 1.0],
        "kvscope_request_prompt_tokens": [100, 20, 3000, 700],
        "kvscope_request_generation_tokens": [61, 1, 145, 11],
    }
    lc = make_collector()
    b = batch(engine_id="e1", seq=0, hello=hello("e1", "boot-1", pool="pool-a", model="m-1"))
    b["requests"] = reqs
    assert post_batch(lc.url, b)[0] == 200
    L = LABELS_E1

    def check(m: dict[Any, float]) -> None:
        for name, values in expected.items():
            assert m[(f"{name}_count", L)] == len(values), name
            assert m[(f"{name}_sum", L)] == pytest.approx(sum(values)), name
            buckets = {
                dict(k[1])["le"]: v
                for k, v in m.items()
                if k[0] == f"{name}_bucket" and dict(k[1])["engine"] == "e1"
            }
            assert len(buckets) >= 10 and buckets.pop("+Inf") == len(values), name
            for le, n in buckets.items():
                assert n == _cum(values, float(le)), (name, le)
        # The SLO buckets the alert rules read exist.
        for name, le in (
            ("kvscope_request_ttft_seconds", "2.0"),
            ("kvscope_request_inter_token_latency_seconds", "0.1"),
        ):
            assert (f"{name}_bucket", tuple(sorted((*L, ("le", le))))) in m, (name, le)
        reasons = {
            dict(k[1])["reason"]: v
            for k, v in m.items()
            if k[0] == "kvscope_request_finished_by_reason_total"
        }
        assert reasons == {"stop": 1, "length": 1, "abort": 1, "error": 0, "other": 1}

    text, before = _scrape(lc.url)
    check(before)
    if shutil.which(PROMTOOL):
        res = subprocess.run(
            [PROMTOOL, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30
        )
        assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()
    lc.stop()
    lc2 = make_collector()
    _, after = _scrape(lc2.url)
    check(after)
    # Later requests add to the rebuilt histograms.
    b2 = batch(engine_id="e1", seq=1, req_ts=[T0 + 10])
    assert post_batch(lc2.url, b2)[0] == 200
    _, again = _scrape(lc2.url)
    assert again[("kvscope_request_e2e_seconds_count", L)] == 5

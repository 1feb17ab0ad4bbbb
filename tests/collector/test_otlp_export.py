"""OTLP export: a real collector process, fed a real vLLM recording, pushes to a real
OTLP/HTTP receiver on loopback; what the SDK sends is decoded with the OTLP protobuf
definitions and compared with the same collector's /metrics. A receiver answering 503
or not listening costs nothing to ingest; a clean stop flushes once."""

from __future__ import annotations

import gzip
import json
import re
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality
from prometheus_client.parser import text_string_to_metric_families

from kvscope.cli import checks, main
from kvscope.cli.collector import collector_settings
from kvscope.collector._exposition import fmt
from kvscope.collector.metrics import REQUEST_HISTOGRAMS
from kvscope.collector.otlp import metrics_url
from kvscope.collector.process import CollectorProcess, free_port
from kvscope.collector.settings import Settings
from kvscope.lab.recording import load_recording, post_batch, rebased, replay

RECORDINGS = Path(__file__).resolve().parents[2] / "lab" / "recordings"
CHANGING = (
    "kvscope_advisor_runs_total",
    "kvscope_advisor_last_run_timestamp_seconds",
    "kvscope_advisor_last_success_timestamp_seconds",
    "kvscope_advisor_last_run_duration_seconds",
)
"""Families that move with every advisor run: checked for presence, not value."""

Key = tuple[str, tuple[tuple[str, str], ...]]


# -- a real OTLP/HTTP receiver ---------------------------------------------------------


class _Receiver(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.status = 200
        self.lock = threading.Lock()
        self.received: list[tuple[float, dict[str, str], ExportMetricsServiceRequest]] = []
        self.refused = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/metrics"

    def since(self, t: float) -> list[tuple[float, dict[str, str], ExportMetricsServiceRequest]]:
        with self.lock:
            return [r for r in self.received if r[0] > t]


class _Handler(BaseHTTPRequestHandler):
    server: _Receiver

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        encoding = self.headers.get("Content-Encoding", "")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        if (
            self.path != "/v1/metrics"
            or self.headers.get("Content-Type") != "application/x-protobuf"
        ):
            self._answer(400, b"expected protobuf on /v1/metrics")
            return
        if self.server.status != 200:
            with self.server.lock:
                self.server.refused += 1
            self._answer(self.server.status, b"unavailable")
            return
        req = ExportMetricsServiceRequest()
        req.ParseFromString(body)
        with self.server.lock:
            self.server.received.append(
                (time.time(), {k.lower(): v for k, v in self.headers.items()}, req)
            )
        self._answer(200, ExportMetricsServiceResponse().SerializeToString())

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    r = _Receiver()
    t = threading.Thread(target=r.serve_forever, name="otlp-receiver", daemon=True)
    t.start()
    yield r
    r.shutdown()
    r.server_close()


# -- decoding ------------------------------------------------------------------------


def _value(v: AnyValue) -> Any:
    return getattr(v, v.WhichOneof("value"))


def _attrs(kvs: Any) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((kv.key, str(_value(kv.value))) for kv in kvs))


def _decode(
    req: ExportMetricsServiceRequest,
) -> tuple[dict[str, Any], dict[Key, float], dict[str, str], dict[Key, Any]]:
    """(resource attributes, samples as /metrics names them, kind per name, histograms)."""
    assert len(req.resource_metrics) == 1
    rm = req.resource_metrics[0]
    resource = {kv.key: _value(kv.value) for kv in rm.resource.attributes}
    samples: dict[Key, float] = {}
    kinds: dict[str, str] = {}
    hists: dict[Key, Any] = {}
    for sm in rm.scope_metrics:
        assert sm.scope.name == "kvscope.collector"
        for m in sm.metrics:
            kind = m.WhichOneof("data")
            if kind == "sum":
                assert m.sum.is_monotonic
                assert (
                    m.sum.aggregation_temporality
                    == AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
                )
            if kind == "histogram":
                assert (
                    m.histogram.aggregation_temporality
                    == AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
                )
                for p in m.histogram.data_points:
                    hists[(m.name, _attrs(p.attributes))] = (
                        list(p.bucket_counts),
                        list(p.explicit_bounds),
                        p.sum,
                        p.count,
                    )
            else:
                for p in getattr(m, kind).data_points:
                    v = p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                    samples[(m.name, _attrs(p.attributes))] = float(v)
            kinds[m.name] = kind
    return resource, samples, kinds, hists


def _prom(text: str) -> tuple[dict[Key, float], dict[str, str]]:
    samples: dict[Key, float] = {}
    kinds: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
            kinds[s.name] = fam.type
    return samples, kinds


def _pushed(name: str) -> bool:
    return name.startswith(
        ("kvscope_engine_", "kvscope_exporter_", "kvscope_advisor_", "kvscope_request_")
    )


def _wait(what: str, check: Callable[[], Any], timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return found


def _exports(c: CollectorProcess) -> dict[str, float]:
    m, _ = _prom(c.get_text("/metrics"))
    return {
        r: m.get(("kvscope_collector_otlp_exports_total", (("result", r),)), -1.0)
        for r in ("success", "failure")
    }


def _second_engine_batch() -> dict[str, Any]:
    """The first batch of another real recording, as a second engine, sent now."""
    rec = load_recording(RECORDINGS / "seq_capped.jsonl.gz")
    first = rec.batches[0]
    assert first.get("hello"), "the recording's first batch carries the hello"
    shift = time.time() - 1 - max(first["steps"]["ts_unix_s"])
    b = next(rebased([first], shift_s=shift, boot_ids={}))
    b["engine_id"] = b["hello"]["engine_id"] = "otlp-second:8000:0"
    return b


# -- the tests -----------------------------------------------------------------------


def test_export_equals_metrics_and_survives_a_failing_receiver(
    receiver: _Receiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Standard variables reach the SDK: a resource attribute, and a short export timeout
    # (with the SDK's retries) so the 503 phase fails within the test's budget.
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=otlp-test")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "1")
    c = CollectorProcess(
        tmp_path / "kvscope.duckdb",
        extra_args=[
            "--otlp-endpoint",
            receiver.url,
            "--otlp-interval",
            "1",
            "--otlp-header",
            "Authorization: Bearer otlp-secret",
            "--raw-retention-s",
            "0",
            "--advise-interval-s",
            "1",
            "--advise-window-s",
            "900",
            "--kv-events",
            "off",
        ],
    ).start()
    try:
        replay(
            load_recording(RECORDINGS / "overload_kv_starved.jsonl.gz"),
            c.url,
            end_at_unix_s=time.time() - 120,
            progress=False,
        )
        done = time.time()

        # Once the advisor has run over the whole replay, /metrics holds still (apart from
        # the advisor's own run counters); an export collected after this read equals it.
        def verdicts() -> Any:
            m, kinds = _prom(c.get_text("/metrics"))
            ran = m.get(("kvscope_advisor_last_run_timestamp_seconds", ()), 0.0) > done
            has = any(k[0] == "kvscope_advisor_bottleneck" for k in m)
            return (m, kinds, time.time()) if ran and has else None

        prom, prom_kinds, read_at = _wait("the advisor's verdicts on /metrics", verdicts)
        _, headers, req = _wait(
            "an export after the /metrics read", lambda: receiver.since(read_at + 1.2)
        )[0]
        resource, otlp, otlp_kinds, hists = _decode(req)

        assert headers.get("authorization") == "Bearer otlp-secret"
        assert headers.get("content-encoding") == "gzip"  # kvscope's default
        assert resource["service.name"] == "kvscope-collector"
        assert resource["service.instance.id"].endswith(f":{c.port}")
        assert resource["deployment.environment"] == "otlp-test"
        assert resource["service.version"] and resource["process.pid"] == c.proc.pid

        # Gauges and counters: the same names, labels and values, both ways.
        plain = {
            k: v
            for k, v in prom.items()
            if _pushed(k[0]) and prom_kinds[k[0]] in ("gauge", "counter")
        }
        assert {k for k in otlp if k[0] not in CHANGING} == {
            k for k in plain if k[0] not in CHANGING
        }
        for k, v in plain.items():
            if k[0] in CHANGING:
                assert k in otlp, k
            else:
                assert otlp[k] == pytest.approx(v, rel=1e-12), k
        for name in {k[0] for k in otlp}:
            assert otlp_kinds[name] == ("sum" if prom_kinds[name] == "counter" else "gauge"), name
        engine = (("engine", "demo-host:8000:0"), ("model", "kvscope-demo"), ("pool", "demo"))
        assert otlp[("kvscope_engine_steps_total", engine)] > 10_000
        assert otlp[("kvscope_engine_preemptions_total", engine)] > 0
        bottleneck = tuple(sorted((*engine, ("bottleneck", "kv_cache_bound"))))
        assert otlp[("kvscope_advisor_bottleneck", bottleneck)] == 1
        assert ("kvscope_advisor_recommended_concurrency_cap", engine) in otlp
        assert ("kvscope_advisor_pool_plateau_tokens_per_second", (("pool", "demo"),)) in otlp
        info = [dict(k[1]) for k in otlp if k[0] == "kvscope_engine_info"]
        assert len(info) == 1 and info[0]["max_num_seqs"] and info[0]["engine"] == engine[0][1]

        # Histograms: per-bucket counts whose running sums are /metrics' buckets.
        assert {k[0] for k in hists} == {
            "kvscope_engine_step_batch_size",
            "kvscope_engine_step_kv_usage_ratio",
            *(h.name for h in REQUEST_HISTOGRAMS),
        }
        for (name, attrs), (counts, bounds, total, count) in hists.items():
            les = [*(float(b) for b in bounds), float("inf")]
            running = 0
            for le, n in zip(les, counts, strict=True):
                running += n
                labels = tuple(sorted((*attrs, ("le", "+Inf" if le == float("inf") else fmt(le)))))
                assert prom[(f"{name}_bucket", labels)] == running, (name, le)
            # One observation per step, or per finished request (hundreds in the replay).
            least = 10_000 if name.startswith("kvscope_engine_step_") else 100
            assert prom[(f"{name}_count", attrs)] == count == running > least
            assert prom[(f"{name}_sum", attrs)] == pytest.approx(total, rel=1e-12)

        # The receiver answers 503: ingest goes on, the failures are counted and logged once.
        before = _exports(c)
        log_before = c.log_path.read_text()
        assert before["success"] >= 1
        # A working receiver takes every export; on a loaded machine one can still outlast
        # the 1 s timeout, and then the collector must have said so and said it recovered.
        assert before["failure"] == 0 or "works again" in log_before, log_before
        receiver.status = 503
        _wait("a refused export", lambda: receiver.refused >= 1)
        second = _second_engine_batch()
        assert post_batch(c.url, second)["status"] == "stored"
        _wait("two failed exports", lambda: _exports(c)["failure"] >= before["failure"] + 2)
        assert "otlp-second:8000:0" in {e["engine_id"] for e in c.get_json("/v1/engines")["rows"]}
        log = c.log_path.read_text()
        assert log.startswith(log_before)
        outage = log[len(log_before) :]
        # The refusal is logged once, unless an earlier failure of the same kind already was.
        refusal = re.compile(r"OTLP export to \S+ failed \(")
        assert len(refusal.findall(outage)) == (not refusal.search(log_before)), outage
        assert log.count("Failed to export metrics batch") <= 1 + log_before.count(
            "Failed to export metrics batch"
        )

        # It answers again: the next export carries what arrived meanwhile.
        receiver.status = 200
        back_at = time.time()
        _, _, req = _wait("an export after recovery", lambda: receiver.since(back_at))[0]
        _, otlp, _, _ = _decode(req)
        m, _ = _prom(c.get_text("/metrics"))
        second_labels = (
            ("engine", "otlp-second:8000:0"),
            ("model", second["hello"]["model"]),
            ("pool", second["hello"]["pool"]),
        )
        steps = otlp[("kvscope_engine_steps_total", second_labels)]
        assert (
            steps
            == m[("kvscope_engine_steps_total", second_labels)]
            == len(second["steps"]["ts_unix_s"])
        )
        assert _exports(c)["success"] > before["success"]
    finally:
        c.stop()


def test_clean_stop_flushes_once(receiver: _Receiver, tmp_path: Path) -> None:
    c = CollectorProcess(
        tmp_path / "kvscope.duckdb",
        extra_args=[
            "--otlp-endpoint",
            receiver.url.removesuffix("/v1/metrics"),
            "--otlp-interval",
            "3600",
            "--advise-interval-s",
            "0",
            "--kv-events",
            "off",
            "--raw-retention-s",
            "0",
        ],
    ).start()
    batch = _second_engine_batch()
    try:
        assert post_batch(c.url, batch)["status"] == "stored"
        m, _ = _prom(c.get_text("/metrics"))
        assert receiver.since(0) == []  # nothing before the hour is up
    finally:
        t0 = time.monotonic()
        code = c.stop()
        took = time.monotonic() - t0
    assert code == 0 and took < 10
    received = receiver.since(0)
    assert len(received) == 1
    _, otlp, _, hists = _decode(received[0][2])
    labels = (
        ("engine", batch["engine_id"]),
        ("model", batch["hello"]["model"]),
        ("pool", batch["hello"]["pool"]),
    )
    for name in (
        "kvscope_engine_steps_total",
        "kvscope_engine_generation_tokens_total",
        "kvscope_engine_batch_size",
        "kvscope_engine_kv_usage_ratio",
    ):
        assert otlp[(name, labels)] == m[(name, labels)], name
    assert hists[("kvscope_engine_step_batch_size", labels)][3] == len(batch["steps"]["ts_unix_s"])
    assert not any(k[0].startswith("kvscope_advisor_") for k in otlp)  # advisor off


def test_unreachable_endpoint_costs_ingest_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "1")
    down = f"http://127.0.0.1:{free_port()}/v1/metrics"  # nothing listens there
    c = CollectorProcess(
        tmp_path / "kvscope.duckdb",
        extra_args=[
            "--otlp-endpoint",
            down,
            "--otlp-interval",
            "0.5",
            "--advise-interval-s",
            "0",
            "--kv-events",
            "off",
            "--raw-retention-s",
            "0",
        ],
    ).start()
    try:
        batch = _second_engine_batch()
        t0 = time.monotonic()
        assert post_batch(c.url, batch)["status"] == "stored"
        assert time.monotonic() - t0 < 2
        _wait("failed exports", lambda: _exports(c)["failure"] >= 2)
        assert c.get_json("/healthz")["status"] == "ok"
        assert c.get_json("/v1/totals", params={"source": "steps"})["rows"][0]["n_steps"] == len(
            batch["steps"]["ts_unix_s"]
        )
        assert _exports(c)["success"] == 0
    finally:
        assert c.stop() == 0
    assert c.log_path.read_text().count("failed (") == 1


# -- configuration and the missing extra ----------------------------------------------


def test_missing_sdk_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # as if not installed
    with pytest.raises(checks.MissingExtraError) as err:
        main.main(
            [
                "collector",
                "--store",
                str(tmp_path / "k.duckdb"),
                "--otlp-endpoint",
                "http://127.0.0.1:4318/v1/metrics",
            ]
        )
    assert "pip install 'kvscope[otlp]'" in str(err.value)
    assert "--otlp-endpoint" in str(err.value)


def test_collector_without_otlp_never_imports_opentelemetry() -> None:
    import subprocess

    code = (
        "import sys, kvscope.collector.server, kvscope.collector.otlp, kvscope.cli.main; "
        "import json; print(json.dumps([m for m in sys.modules if m.startswith('opentelemetry')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--otlp-endpoint", "otel:4318"],
        ["--otlp-endpoint", "ftp://otel:4318/v1/metrics"],
        ["--otlp-endpoint", "http://otel:4318", "--otlp-interval", "0"],
        ["--otlp-endpoint", "http://otel:4318", "--otlp-header", "no-colon"],
    ],
)
def test_bad_otlp_flags_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main.build_parser().parse_args(["collector", *argv])
    assert exc.value.code == 2
    assert "--otlp" in capsys.readouterr().err


def test_otlp_settings() -> None:
    assert metrics_url("http://otel:4318") == "http://otel:4318/v1/metrics"
    assert metrics_url("https://otel/") == "https://otel/v1/metrics"
    assert metrics_url("http://otel:4318/custom/path") == "http://otel:4318/custom/path"
    s = Settings(otlp_endpoint="http://otel:4318", otlp_headers=(("Authorization", "Bearer x"),))
    assert "Bearer x" not in repr(s)
    with pytest.raises(ValueError, match="otlp_endpoint"):
        Settings(otlp_endpoint="otel:4318")
    with pytest.raises(ValueError, match="otlp_interval_s"):
        Settings(otlp_endpoint="http://otel:4318", otlp_interval_s=0)
    args = main.build_parser().parse_args(
        [
            "collector",
            "--otlp-endpoint",
            "http://otel:4318/v1/metrics",
            "--otlp-interval",
            "5",
            "--otlp-header",
            "Authorization: Bearer T",
            "--otlp-header",
            "X-Scope-OrgID: fleet",
        ]
    )
    s = collector_settings(args)
    assert s.otlp_interval_s == 5.0
    assert s.otlp_headers == (("Authorization", "Bearer T"), ("X-Scope-OrgID", "fleet"))

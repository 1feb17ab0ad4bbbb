"""``kvscope collector``: run the collector service (ingest, store, ``/metrics``, query API)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from kvscope.args import at_least_two, duration, header, positive, positive_duration
from kvscope.cli.checks import MissingExtraError, require

__all__ = ["add_parser", "collector_settings", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "collector",
        help="run the collector: ingest, store, /metrics and the query API",
        description=(
            "Run the kvscope collector. Engines running the kvscope vLLM plugin push "
            "per-step telemetry to POST /v1/ingest; Prometheus scrapes GET /metrics; "
            "the advisor, dashboard and report read GET /v1/*."
        ),
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1); any other address needs "
        "--token or --allow-unauthenticated",
    )
    p.add_argument("--port", type=int, default=8844, help="port to listen on (default: 8844)")
    p.add_argument(
        "--store",
        default="kvscope.duckdb",
        help="DuckDB file holding the data (default: ./kvscope.duckdb)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("KVSCOPE_TOKEN") or None,
        help="bearer token required on every request but /healthz "
        "(default: $KVSCOPE_TOKEN, else none)",
    )
    p.add_argument(
        "--pool-token",
        metavar="POOL=TOKEN",
        type=pool_token,
        action="append",
        default=[],
        help="a token that ingests only as engines of POOL and reads only POOL's data "
        "(repeatable; needs --token, the fleet's token, which /metrics needs too)",
    )
    p.add_argument(
        "--pool-tokens-file",
        metavar="FILE",
        default=None,
        help="read POOL=TOKEN lines from FILE (keeps the tokens out of the process list)",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="listen on a non-loopback address without a token (logs a warning)",
    )
    p.add_argument(
        "--tls-cert",
        metavar="PEM",
        default=None,
        help="serve HTTPS with this certificate (chain); needs --tls-key",
    )
    p.add_argument("--tls-key", metavar="PEM", default=None, help="private key of --tls-cert")
    p.add_argument(
        "--max-inflight-mib",
        type=positive,
        default=256.0,
        metavar="MIB",
        help="ingest bodies held at once (decompressed); past it ingest answers "
        "503 with Retry-After (default: 256)",
    )
    p.add_argument(
        "--store-memory-mib",
        type=int,
        default=2048,
        metavar="MIB",
        help="memory limit of the store (DuckDB); larger queries spill to disk (default: 2048)",
    )
    p.add_argument(
        "--max-exported-engines",
        type=int,
        default=2000,
        metavar="N",
        help="engines with per-engine series on /metrics, the most recently "
        "seen (default: 2000); the rest are counted in "
        "kvscope_collector_engines_not_exported",
    )
    p.add_argument(
        "--max-new-engines-per-minute",
        type=int,
        default=600,
        metavar="N",
        help="new engine ids accepted per minute; beyond, 429 (default: 600)",
    )
    p.add_argument(
        "--max-new-boots-per-engine-per-minute",
        type=int,
        default=10,
        metavar="N",
        help="new boot ids (process starts) accepted per engine per minute; beyond, 429 "
        "(default: 10)",
    )
    p.add_argument(
        "--max-clock-skew",
        type=duration,
        default=300.0,
        metavar="DURATION",
        help="refuse times more than this far ahead of the collector's clock (default: 5m)",
    )
    p.add_argument(
        "--max-backfill",
        type=duration,
        default="15d",
        metavar="DURATION",
        help="refuse step and request times more than this far behind the collector's "
        "clock (default: 15d; 0 accepts any age, e.g. to import old recordings)",
    )
    p.add_argument(
        "--header-timeout",
        "--header-timeout-s",
        dest="header_timeout_s",
        type=positive_duration,
        default=10.0,
        metavar="DURATION",
        help="close connections whose request headers take longer (default: 10s)",
    )
    p.add_argument(
        "--body-timeout",
        "--body-timeout-s",
        dest="body_timeout_s",
        type=positive_duration,
        default=30.0,
        metavar="DURATION",
        help="answer 408 to an ingest whose body takes longer (default: 30s)",
    )
    p.add_argument(
        "--response-timeout",
        dest="response_timeout_s",
        type=positive_duration,
        default=30.0,
        metavar="DURATION",
        help="close connections whose response (/metrics, the read API) is not read "
        "within this long, counted in kvscope_collector_slow_readers_closed_total "
        "(default: 30s)",
    )
    p.add_argument(
        "--raw-retention",
        "--raw-retention-s",
        dest="raw_retention_s",
        type=duration,
        default=24 * 3600,
        metavar="DURATION",
        help="how long to keep raw per-step rows (default: 24h; 0 keeps them forever)",
    )
    p.add_argument(
        "--window-retention",
        type=duration,
        default="15d",
        metavar="DURATION",
        help="how long to keep 1-second windows (what the advisor fits knees on); older "
        "ones are deleted once rolled up into 1-minute windows (default: 15d, the weekly "
        "report's two weeks; 0 keeps them)",
    )
    p.add_argument(
        "--request-retention",
        type=duration,
        default="15d",
        metavar="DURATION",
        help="how long to keep finished requests (default: 15d; 0 keeps them)",
    )
    p.add_argument(
        "--rollup-retention",
        type=duration,
        default="400d",
        metavar="DURATION",
        help="how long to keep 1-minute windows, the downsampled tier long ranges read "
        "(default: 400d; 0 keeps them)",
    )
    p.add_argument(
        "--request-rollup-retention",
        type=duration,
        default="90d",
        metavar="DURATION",
        help="how long to keep request minutes, the per-minute latency histograms SLO "
        "attainment reads past --request-retention (default: 90d; 0 keeps them)",
    )
    p.add_argument(  # hidden: tests and benchmarks run the retention task more often
        "--retention-interval",
        dest="retention_interval_s",
        type=positive_duration,
        default=60.0,
        metavar="DURATION",
        help=argparse.SUPPRESS,
    )
    p.add_argument(
        "--advise-interval",
        "--advise-interval-s",
        dest="advise_interval_s",
        type=duration,
        default=60.0,
        metavar="DURATION",
        help="run the advisor over the recent data this often and publish its "
        "verdicts on /metrics as kvscope_advisor_* gauges "
        "(default: 1m; 0 disables)",
    )
    p.add_argument(
        "--advise-window",
        "--advise-window-s",
        dest="advise_window_s",
        type=positive_duration,
        default=1800.0,
        metavar="DURATION",
        help="how much recent data each advisor run reads (default: 30m)",
    )
    p.add_argument(
        "--kv-events",
        choices=("auto", "off"),
        default="auto",
        help="subscribe to vLLM's KV-cache events (ZMQ) of every engine whose "
        "hello advertises an endpoint (vLLM --kv-events-config with the zmq "
        "publisher) and measure prefix duplication per pool; off never "
        "subscribes (default: auto)",
    )
    p.add_argument(
        "--kv-events-endpoint",
        metavar="ENGINE_ID=tcp://HOST:PORT",
        type=kv_override,
        action="append",
        default=[],
        help="subscribe to this engine's KV events here instead of the "
        "advertised endpoint (repeatable)",
    )
    p.add_argument(
        "--kv-events-seen-capacity",
        type=at_least_two,
        default=2_000_000,
        metavar="N",
        help="block contents each pool remembers for reseen counting "
        "(default: 2000000, about 70 bytes each)",
    )
    p.add_argument(
        "--kv-events-allow",
        metavar="HOST_OR_CIDR",
        type=kv_allow,
        action="append",
        default=[],
        help="also subscribe to KV-event endpoints that hellos advertise on this host or "
        "network, e.g. 10.0.0.0/8 (repeatable; default: only on the host a hello comes "
        "from; --kv-events-endpoint overrides are always used)",
    )
    p.add_argument(
        "--kv-events-allow-ipc",
        action="store_true",
        help="also subscribe to ipc:// (local socket path) endpoints that hellos advertise",
    )
    p.add_argument(
        "--kv-events-max-sockets",
        type=int,
        default=512,
        metavar="N",
        help="most KV-event subscriptions at once, fewer if ulimit -n is low; engines "
        "beyond are refused, logged and counted (default: 512)",
    )
    p.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        type=otlp_url,
        default=None,
        help="also push the fleet metrics and the advisor's verdicts to this "
        "OTLP/HTTP metrics endpoint, e.g. http://otel-collector:4318/v1/metrics "
        "(a URL without a path gets /v1/metrics; needs kvscope[otlp]; "
        "OTEL_EXPORTER_OTLP_* variables apply; default: off)",
    )
    p.add_argument(
        "--otlp-interval",
        metavar="DURATION",
        type=positive_duration,
        default=None,
        help="seconds between OTLP exports (default: $OTEL_METRIC_EXPORT_INTERVAL in ms, else 60)",
    )
    p.add_argument(
        "--otlp-header",
        metavar="'NAME: VALUE'",
        type=header,
        action="append",
        default=[],
        help="HTTP header on every OTLP export, e.g. 'Authorization: Bearer T' "
        "(repeatable; added to $OTEL_EXPORTER_OTLP_HEADERS)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require("collector", "collector", also=("zmq", "msgspec") if args.kv_events != "off" else ())
    if args.otlp_endpoint:
        from kvscope.collector.otlp import MissingOtlpError, require_sdk

        try:
            require_sdk("kvscope collector --otlp-endpoint")
        except MissingOtlpError as exc:
            raise MissingExtraError(str(exc)) from None
    from kvscope.collector.server import is_loopback, serve

    try:
        settings = collector_settings(args)
    except ValueError as exc:
        print(f"kvscope collector: {exc}", file=sys.stderr)
        return 2
    if settings.token is None and not is_loopback(settings.host) and not args.allow_unauthenticated:
        print(
            f"kvscope collector: refusing to listen on {settings.host} without a token: anyone "
            "who can reach it could write and read all data.\n"
            "Give --token (or set KVSCOPE_TOKEN) and the same token to the engines "
            "(KVSCOPE_TOKEN) and readers, or listen on 127.0.0.1, or pass "
            "--allow-unauthenticated if the network is trusted.",
            file=sys.stderr,
        )
        return 2
    for path in (settings.tls_cert_file, settings.tls_key_file):
        if path is not None and not os.path.isfile(path):
            print(f"kvscope collector: TLS file {path} does not exist", file=sys.stderr)
            return 2
    serve(settings)
    return 0


def collector_settings(args: argparse.Namespace) -> Any:
    """The collector's :class:`~kvscope.collector.settings.Settings` from parsed arguments."""
    from kvscope.collector.settings import MIB, Settings

    return Settings(
        host=args.host,
        port=args.port,
        store_path=args.store,
        token=args.token,
        pool_tokens=tuple(args.pool_token) + _pool_tokens_file(args.pool_tokens_file),
        max_new_boots_per_engine_per_minute=args.max_new_boots_per_engine_per_minute,
        max_clock_skew_s=args.max_clock_skew,
        max_backfill_s=args.max_backfill,
        raw_step_retention_s=args.raw_retention_s,
        window_retention_s=args.window_retention,
        request_retention_s=args.request_retention,
        rollup_retention_s=args.rollup_retention,
        request_rollup_retention_s=args.request_rollup_retention,
        retention_interval_s=args.retention_interval_s,
        advise_interval_s=args.advise_interval_s,
        advise_window_s=args.advise_window_s,
        kv_events=args.kv_events,
        kv_events_endpoints=tuple(args.kv_events_endpoint),
        kv_events_seen_capacity=args.kv_events_seen_capacity,
        kv_events_allow=tuple(args.kv_events_allow),
        kv_events_allow_ipc=args.kv_events_allow_ipc,
        kv_events_max_sockets=args.kv_events_max_sockets,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        max_inflight_bytes=int(args.max_inflight_mib * MIB),
        max_exported_engines=args.max_exported_engines,
        max_new_engines_per_minute=args.max_new_engines_per_minute,
        header_timeout_s=args.header_timeout_s,
        otlp_endpoint=args.otlp_endpoint,
        otlp_interval_s=args.otlp_interval,
        otlp_headers=tuple(args.otlp_header),
        body_timeout_s=args.body_timeout_s,
        response_timeout_s=args.response_timeout_s,
        store_memory_limit_mib=args.store_memory_mib,
    )


def pool_token(text: str) -> tuple[str, str]:
    pool, sep, token = text.partition("=")
    if not sep or not pool.strip() or not token.strip():
        raise argparse.ArgumentTypeError("expected POOL=TOKEN with neither empty")
    return pool.strip(), token.strip()


def _pool_tokens_file(path: str | None) -> tuple[tuple[str, str], ...]:
    if path is None:
        return ()
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"--pool-tokens-file: cannot read {path}: {exc.strerror}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            out.append(pool_token(line))
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--pool-tokens-file {path} line {n}: {exc}") from None
    return tuple(out)


def kv_override(text: str) -> tuple[str, str]:
    from kvscope.collector.kv_endpoints import parse_override

    try:
        return parse_override(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kv_allow(text: str) -> str:
    from kvscope.collector.kv_endpoints import parse_allow

    try:
        parse_allow(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def otlp_url(text: str) -> str:
    scheme, sep, rest = text.partition("://")
    if scheme not in ("http", "https") or not sep or not rest.strip("/"):
        raise argparse.ArgumentTypeError(
            f"expected an http(s) URL such as http://otel-collector:4318/v1/metrics, got {text!r}"
        )
    return text

"""The ``kvscope`` command line.

A thin layer: parse arguments into settings objects and hand off to library code.
Subcommands import their dependencies lazily, so ``pip install kvscope`` (the
engine side only) still gives a working ``kvscope --help`` and a clear message
naming the extra to install.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from engine_plugins import __version__

_EXTRA_HINT = (
    "kvscope {cmd}: this command needs the '{extra}' extra ({missing} is not installed).\n"
    "Install it with:  pip install 'kvscope[{extra}]'"
)


class MissingExtraError(SystemExit):
    """Raised when a subcommand's optional dependencies are not installed."""


def _require(cmd: str, extra: str, also: tuple[str, ...] = ()) -> None:
    """Fail with an install hint when an extra's packages (and ``also``) are missing."""
    import importlib.util

    needed = {"collector": ("aiohttp", "duckdb", "pandas", "prometheus_client", "tqdm")}[extra]
    for mod in (*needed, *also):
        if importlib.util.find_spec(mod) is None:
            raise MissingExtraError(_EXTRA_HINT.format(cmd=cmd, extra=extra, missing=mod))


def _cmd_collector(args: argparse.Namespace) -> int:
    _require("collector", "collector",
             also=("zmq", "msgspec") if args.kv_events != "off" else ())
    if args.otlp_endpoint:
        from collector.otlp import MissingOtlpError, require_sdk

        try:
            require_sdk("kvscope collector --otlp-endpoint")
        except MissingOtlpError as exc:
            raise MissingExtraError(str(exc)) from None
    from collector.server import is_loopback, serve

    try:
        settings = collector_settings(args)
    except ValueError as exc:
        print(f"kvscope collector: {exc}", file=sys.stderr)
        return 2
    if settings.token is None and not is_loopback(settings.host) and not args.allow_unauthenticated:
        print(f"kvscope collector: refusing to listen on {settings.host} without a token: anyone "
              "who can reach it could write and read all data.\n"
              "Give --token (or set KVSCOPE_TOKEN) and the same token to the engines "
              "(KVSCOPE_TOKEN) and readers, or listen on 127.0.0.1, or pass "
              "--allow-unauthenticated if the network is trusted.", file=sys.stderr)
        return 2
    for path in (settings.tls_cert_file, settings.tls_key_file):
        if path is not None and not os.path.isfile(path):
            print(f"kvscope collector: TLS file {path} does not exist", file=sys.stderr)
            return 2
    serve(settings)
    return 0


def collector_settings(args: argparse.Namespace) -> Any:
    """The collector's :class:`~collector.settings.Settings` from parsed arguments."""
    from collector.settings import MIB, Settings

    return Settings(
        host=args.host,
        port=args.port,
        store_path=args.store,
        token=args.token,
        raw_step_retention_s=args.raw_retention_s,
        advise_interval_s=args.advise_interval_s,
        advise_window_s=args.advise_window_s,
        kv_events=args.kv_events,
        kv_events_endpoints=tuple(args.kv_events_endpoint),
        kv_events_seen_capacity=args.kv_events_seen_capacity,
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
        store_memory_limit_mib=args.store_memory_mib,
    )


def advise_window(args: argparse.Namespace, now: float) -> tuple[float | None, float | None]:
    """``--since`` / ``--until`` as unix seconds; :class:`ParamError` saying what is wrong."""
    from collector._params import ParamError, parse_time

    since = parse_time("--since", args.since, now) if args.since else None
    until = parse_time("--until", args.until, now) if args.until else None
    if since is not None and since >= now:
        raise ParamError(f"--since {args.since} lies in the future; use a duration such as 30m")
    if since is not None and until is not None and until <= since:
        raise ParamError(f"--until ({args.until}) must be after --since ({args.since})")
    return since, until


def advise_fail(message: str, code: int) -> int:
    """Say why ``kvscope advise`` stops, on stderr; the exit code."""
    print(f"kvscope advise: {message}", file=sys.stderr)
    return code


def analysis_options(args: argparse.Namespace) -> dict[str, Any]:
    """The advisor's tuning options of ``kvscope advise`` as keyword arguments."""
    return {"slo_ttft_p99_s": args.slo_ttft_p99, "slo_e2e_p99_s": args.slo_e2e_p99,
            "cap_fraction": args.cap_fraction, "min_routing_loss": args.min_routing_loss,
            "imbalance_threshold": args.imbalance_threshold}


def write_advice(args: argparse.Namespace, report: Any, since: float | None,
                 until: float | None, source: str, no_data: Callable[[str], str]) -> int:
    """The report to ``--out`` and to stdout (``--json`` or text); exit 3 with no data,
    saying ``no_data(window)``."""
    from rich.console import Console

    from advisor.render import render_report, window_text

    if args.out:
        try:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(report.to_json(indent=2) + "\n")
        except OSError as exc:
            return advise_fail(f"cannot write --out {args.out}: {exc}", 2)
    window = window_text(since, until, args.since, args.until)
    if args.json:
        sys.stdout.write(report.to_json(indent=2) + "\n")
    elif report.has_data:
        render_report(report, Console(highlight=False), source=source, window=window)
    if not report.has_data:
        return advise_fail(no_data(window), 3)
    return 0


def _cmd_advise(args: argparse.Namespace) -> int:
    _require("advise", "collector", also=("rich",))
    if args.prometheus:
        from collector.prom_advise import run

        return run(args)
    if not args.collector:
        print("kvscope advise: give --collector URL (or set KVSCOPE_COLLECTOR_URL) or "
              "--prometheus URL", file=sys.stderr)
        return 2
    import time

    from advisor import CollectorSource, SourceError, analyze
    from advisor.render import no_data_message, source_error_message
    from collector._params import ParamError

    url = args.collector if "://" in args.collector else f"http://{args.collector}"
    url = url.rstrip("/")
    now = time.time()
    try:
        since, until = advise_window(args, now)
    except ParamError as exc:
        return advise_fail(str(exc), 2)
    source = CollectorSource(url, token=args.token, timeout_s=args.timeout)
    try:
        report = analyze(source, since, until, args.pool, **analysis_options(args))
    except SourceError as exc:
        return advise_fail(source_error_message(exc, url), 2)
    return write_advice(args, report, since, until, url,
                        lambda window: no_data_message(report, url, window, now))


def _cmd_report(args: argparse.Namespace) -> int:
    _require("report", "collector", also=("rich",))
    from collector.report.cli import run

    return run(args)


def _cmd_sweep(args: argparse.Namespace) -> int:
    _require("sweep", "collector")
    from collector.sweep import config_from_args, print_table, run_sweep

    config = config_from_args(args)
    result = run_sweep(config)
    print_table(result)
    if config.out:
        print(f"results written to {config.out}")
    errors = sum(lv.error_count for lv in result.levels)
    return 0 if errors == 0 or args.allow_errors else 3


def _cmd_demo(args: argparse.Namespace) -> int:
    _require("demo", "collector")
    from collector.demo import run_demo

    return run_demo(args)


def _cmd_record(args: argparse.Namespace) -> int:
    _require("record", "collector")
    from collector.recording import record_real_run

    return record_real_run(args)


def _add_collector(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "collector",
        help="run the collector: ingest, store, /metrics and the query API",
        description=(
            "Run the kvscope collector. Engines running the kvscope vLLM plugin push "
            "per-step telemetry to POST /v1/ingest; Prometheus scrapes GET /metrics; "
            "the advisor, dashboard and report read GET /v1/*."
        ),
    )
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1); any other address needs "
                        "--token or --allow-unauthenticated")
    p.add_argument("--port", type=int, default=8844, help="port to listen on (default: 8844)")
    p.add_argument("--store", default="kvscope.duckdb",
                   help="DuckDB file holding the data (default: ./kvscope.duckdb)")
    p.add_argument("--token", default=os.environ.get("KVSCOPE_TOKEN") or None,
                   help="bearer token required on every request but /healthz "
                        "(default: $KVSCOPE_TOKEN, else none)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="listen on a non-loopback address without a token (logs a warning)")
    p.add_argument("--tls-cert", metavar="PEM", default=None,
                   help="serve HTTPS with this certificate (chain); needs --tls-key")
    p.add_argument("--tls-key", metavar="PEM", default=None,
                   help="private key of --tls-cert")
    p.add_argument("--max-inflight-mib", type=_positive, default=256.0, metavar="MIB",
                   help="ingest bodies held at once (decompressed); past it ingest answers "
                        "503 with Retry-After (default: 256)")
    p.add_argument("--store-memory-mib", type=int, default=2048, metavar="MIB",
                   help="memory limit of the store (DuckDB); larger queries spill to disk "
                        "(default: 2048)")
    p.add_argument("--max-exported-engines", type=int, default=2000, metavar="N",
                   help="engines with per-engine series on /metrics, the most recently "
                        "seen (default: 2000); the rest are counted in "
                        "kvscope_collector_engines_not_exported")
    p.add_argument("--max-new-engines-per-minute", type=int, default=600, metavar="N",
                   help="new engine ids accepted per minute; beyond, 429 (default: 600)")
    p.add_argument("--header-timeout-s", type=_positive, default=10.0, metavar="S",
                   help="close connections whose request headers take longer (default: 10)")
    p.add_argument("--body-timeout-s", type=_positive, default=30.0, metavar="S",
                   help="answer 408 to an ingest whose body takes longer (default: 30)")
    p.add_argument("--raw-retention-s", type=float, default=24 * 3600,
                   help="seconds of raw per-step rows to keep; 1-second windows and "
                        "requests are kept (default: 86400; 0 keeps them forever)")
    p.add_argument("--advise-interval-s", type=float, default=60.0,
                   help="run the advisor over the recent data this often and publish its "
                        "verdicts on /metrics as kvscope_advisor_* gauges "
                        "(default: 60; 0 disables)")
    p.add_argument("--advise-window-s", type=float, default=1800.0,
                   help="seconds of recent data each advisor run reads (default: 1800)")
    p.add_argument("--kv-events", choices=("auto", "off"), default="auto",
                   help="subscribe to vLLM's KV-cache events (ZMQ) of every engine whose "
                        "hello advertises an endpoint (vLLM --kv-events-config with the zmq "
                        "publisher) and measure prefix duplication per pool; off never "
                        "subscribes (default: auto)")
    p.add_argument("--kv-events-endpoint", metavar="ENGINE_ID=tcp://HOST:PORT",
                   type=_kv_override, action="append", default=[],
                   help="subscribe to this engine's KV events here instead of the "
                        "advertised endpoint (repeatable)")
    p.add_argument("--kv-events-seen-capacity", type=_at_least_two, default=2_000_000,
                   metavar="N",
                   help="block contents each pool remembers for reseen counting "
                        "(default: 2000000, about 70 bytes each)")
    p.add_argument("--otlp-endpoint", metavar="URL", type=_otlp_url, default=None,
                   help="also push the fleet metrics and the advisor's verdicts to this "
                        "OTLP/HTTP metrics endpoint, e.g. http://otel-collector:4318/v1/metrics "
                        "(a URL without a path gets /v1/metrics; needs kvscope[otlp]; "
                        "OTEL_EXPORTER_OTLP_* variables apply; default: off)")
    p.add_argument("--otlp-interval", metavar="S", type=_positive, default=None,
                   help="seconds between OTLP exports (default: $OTEL_METRIC_EXPORT_INTERVAL "
                        "in ms, else 60)")
    p.add_argument("--otlp-header", metavar="KEY=VALUE", type=_header, action="append",
                   default=[],
                   help="HTTP header on every OTLP export, e.g. 'Authorization=Bearer T' "
                        "(repeatable; added to $OTEL_EXPORTER_OTLP_HEADERS)")
    p.set_defaults(func=_cmd_collector)


def _otlp_url(text: str) -> str:
    scheme, sep, rest = text.partition("://")
    if scheme not in ("http", "https") or not sep or not rest.strip("/"):
        raise argparse.ArgumentTypeError(
            f"expected an http(s) URL such as http://otel-collector:4318/v1/metrics, got {text!r}")
    return text


def _header(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key or any(c in key for c in " :\r\n"):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. Authorization=Bearer T), "
                                         f"got {text!r}")
    return key, value.strip()


def _kv_override(text: str) -> tuple[str, str]:
    from collector._kv_endpoints import parse_override

    try:
        return parse_override(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _at_least_two(text: str) -> int:
    try:
        v = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2, got {text!r}")
    return v


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return v


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return v


def _ratio(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}") from None
    if not v >= 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return v


_ADVISE_EPILOG = """\
times: unix seconds, 'now', or a duration ago: 90s, 30m, 2h, 7d, 1w.

exit codes:
  0  verdicts printed (engines with too little data say so in their verdict)
  2  bad arguments, the collector could not be read (unreachable, 401, error),
     or --out could not be written
  3  no data in the window (the message says where the data is and what to try)

examples:
  kvscope advise --collector http://collector:8844
  kvscope advise --collector http://collector:8844 --since 2h --pool llama-70b-prod \\
      --slo-e2e-p99 10 --json --out advice.json
"""


def _add_advise(sub: argparse._SubParsersAction) -> None:
    import os

    p = sub.add_parser(
        "advise",
        help="where each engine's throughput stops growing, why, and what cap and flags to set",
        description=(
            "Read a collector's recent data and answer, per pool and engine: the\n"
            "bottleneck (KV cache, max_num_seqs, token budget or compute), the knee (the\n"
            "load where throughput stops growing), the plateau, whether load went past\n"
            "it, and the recommended concurrency cap with its predicted share of peak\n"
            "throughput and P99; then the ranked recommendations with the exact change\n"
            "(vLLM flags, nginx, Gateway API / llm-d) and the findings."
        ),
        epilog=_ADVISE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    env_url = os.environ.get("KVSCOPE_COLLECTOR_URL")
    p.add_argument("--collector", metavar="URL", default=env_url,
                   help="base URL of the kvscope collector (default: $KVSCOPE_COLLECTOR_URL)")
    p.add_argument("--token", default=os.environ.get("KVSCOPE_TOKEN"),
                   help="the collector's bearer token (default: $KVSCOPE_TOKEN)")
    p.add_argument("--since", default="30m",
                   help="start of the window to analyse (default: 30m, i.e. 30 minutes ago)")
    p.add_argument("--until", default=None, help="end of the window (default: now)")
    p.add_argument("--pool", default=None, help="only the engines of this pool")
    p.add_argument("--slo-ttft-p99", type=_positive, default=None, metavar="S",
                   help="P99 time-to-first-token target in seconds: the cap is lowered to meet it")
    p.add_argument("--slo-e2e-p99", type=_positive, default=None, metavar="S",
                   help="P99 end-to-end latency target in seconds: the cap is lowered to meet it")
    p.add_argument("--cap-fraction", type=_fraction, default=0.9, metavar="F",
                   help="share of the plateau throughput the cap must keep (default: 0.9)")
    p.add_argument("--min-routing-loss", type=_fraction, default=0.05, metavar="F",
                   help="recommend prefix-aware routing when at least this share of the pool's "
                        "prefix lookups were computed on one replica while another held them "
                        "(needs vLLM's KV events; default: 0.05)")
    p.add_argument("--imbalance-threshold", type=_ratio, default=1.25, metavar="R",
                   help="flag a pool whose busiest replica carries R times the mean load "
                        "(default: 1.25)")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON (schema_version'd) instead of the text view")
    p.add_argument("--out", metavar="FILE", default=None,
                   help="also write the JSON report to FILE")
    p.add_argument("--timeout", type=_positive, default=30.0, metavar="S",
                   help="seconds per HTTP request to the collector (default: 30)")
    from collector.prom_advise import add_arguments

    add_arguments(p)
    p.set_defaults(func=_cmd_advise)


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep",
        help="concurrency sweep against an OpenAI-compatible server",
        description=(
            "Closed-loop load generator: for each concurrency level, keep that many "
            "streaming /v1/completions requests in flight for --duration seconds and "
            "measure throughput, TTFT and end-to-end latency."
        ),
    )
    try:
        from collector.sweep import add_sweep_arguments
    except ImportError:  # the collector extra is missing: show a minimal parser
        p.add_argument("rest", nargs=argparse.REMAINDER)
    else:
        add_sweep_arguments(p)
    p.add_argument("--allow-errors", action="store_true",
                   help="exit 0 even when some requests failed")
    p.set_defaults(func=_cmd_sweep)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="start a collector on a local store and feed it a real vLLM overload run",
        description=(
            "Start a collector on a fresh local store and feed it: by default by "
            "replaying a recorded run of the real vLLM CPU engine driven into KV-cache "
            "overload; with --live, by starting the real engine with the kvscope plugin "
            "and running a concurrency sweep against it. Prints what was stored and "
            "where to look."
        ),
    )
    p.add_argument("--live", action="store_true",
                   help="start the real vLLM CPU engine and a sweep instead of replaying")
    p.add_argument("--port", type=int, default=8844, help="collector port (default: 8844)")
    p.add_argument("--store", default=".kvscope/demo.duckdb",
                   help="store file, recreated on each run (default: .kvscope/demo.duckdb)")
    p.add_argument("--recording", default=None,
                   help="recording to replay (default: the bundled real overload run)")
    p.add_argument("--serve", action="store_true",
                   help="keep the collector running after the demo until Ctrl-C")
    p.add_argument("--workdir", default=".kvscope",
                   help="where --live builds its model and keeps logs (default: .kvscope)")
    p.set_defaults(func=_cmd_demo)


def _add_record(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "record",
        help="record a real vLLM run (engine + sweep) as a replayable file",
        description=(
            "Start the real vLLM CPU engine with the kvscope plugin pointed at a "
            "recorder, drive it with a concurrency sweep, and save every ingest batch "
            "plus vLLM's own /metrics before and after, as gzipped JSON lines."
        ),
    )
    p.add_argument("--out", required=True, help="output file (.jsonl.gz)")
    p.add_argument("--regime", default="kv-starved",
                   choices=["kv-starved", "ample-kv", "seq-capped"],
                   help="engine configuration to record (default: kv-starved)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32",
                   help="comma-separated concurrency levels (default: 1,2,4,8,16,32)")
    p.add_argument("--duration", type=float, default=10.0,
                   help="seconds per level (default: 10)")
    p.add_argument("--shared-prefix-words", type=int, default=40,
                   help="words of shared prompt prefix, to exercise the prefix cache (default: 40)")
    p.add_argument("--prefix-groups", type=int, default=4,
                   help="number of distinct shared prefixes (default: 4)")
    p.add_argument("--workdir", default=".kvscope", help="model and log folder")
    p.set_defaults(func=_cmd_record)


def _add_report(sub: argparse._SubParsersAction) -> None:
    from collector.report.cli import add_parser

    add_parser(sub, {"positive": _positive, "fraction": _fraction, "ratio": _ratio})
    sub.choices["report"].set_defaults(func=_cmd_report)


def _add_lint(sub: argparse._SubParsersAction) -> None:
    from collector.lint import add_parser

    add_parser(sub)


def _add_dashboard(sub: argparse._SubParsersAction) -> None:
    from dashboard.cli import add_parser

    add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvscope",
        description=(
            "kvscope: where a vLLM server's throughput stops growing, why, and what "
            "to change."
        ),
    )
    parser.add_argument("--version", action="version", version=f"kvscope {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    adders: Sequence[Callable[[argparse._SubParsersAction], None]] = (
        _add_demo, _add_collector, _add_advise, _add_report, _add_dashboard, _add_sweep,
        _add_record, _add_lint,
    )
    for add in adders:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

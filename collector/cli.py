"""The ``kvscope`` command line.

A thin layer: parse arguments into settings objects and hand off to library code.
Subcommands import their dependencies lazily, so ``pip install kvscope`` (the
engine side only) still gives a working ``kvscope --help`` and a clear message
naming the extra to install.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from engine_plugins import __version__

_EXTRA_HINT = (
    "kvscope {cmd}: this command needs the '{extra}' extra ({missing} is not installed).\n"
    "Install it with:  pip install 'kvscope[{extra}]'"
)


class MissingExtraError(SystemExit):
    """Raised when a subcommand's optional dependencies are not installed."""


def _require(cmd: str, extra: str) -> None:
    """Fail with an install hint when an extra's packages are missing."""
    import importlib.util

    needed = {"collector": ("aiohttp", "duckdb", "pandas", "prometheus_client", "tqdm")}[extra]
    for mod in needed:
        if importlib.util.find_spec(mod) is None:
            raise MissingExtraError(_EXTRA_HINT.format(cmd=cmd, extra=extra, missing=mod))


def _cmd_collector(args: argparse.Namespace) -> int:
    _require("collector", "collector")
    from collector.server import serve
    from collector.settings import Settings

    settings = Settings(
        host=args.host,
        port=args.port,
        store_path=args.store,
        token=args.token,
        raw_step_retention_s=args.raw_retention_s,
    )
    serve(settings)
    return 0


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
                   help="address to listen on (default: 127.0.0.1; use 0.0.0.0 with --token)")
    p.add_argument("--port", type=int, default=8844, help="port to listen on (default: 8844)")
    p.add_argument("--store", default="kvscope.duckdb",
                   help="DuckDB file holding the data (default: ./kvscope.duckdb)")
    p.add_argument("--token", default=None,
                   help="bearer token required on every request (default: none)")
    p.add_argument("--raw-retention-s", type=float, default=24 * 3600,
                   help="seconds of raw per-step rows to keep; 1-second windows and "
                        "requests are kept (default: 86400; 0 keeps them forever)")
    p.set_defaults(func=_cmd_collector)


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
        _add_demo, _add_collector, _add_sweep, _add_record,
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

"""``kvscope sweep``, ``demo`` and ``record``: the lab's commands (:mod:`kvscope.lab`)."""

from __future__ import annotations

import argparse
import sys

from kvscope.args import positive_duration
from kvscope.cli._lifecycle import port_problem
from kvscope.cli.checks import require

__all__ = ["add_demo", "add_record", "add_sweep"]


def add_sweep(sub: argparse._SubParsersAction) -> None:
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
        from kvscope.lab.sweep import add_sweep_arguments
    except ImportError:  # the collector extra is missing: show a minimal parser
        p.add_argument("rest", nargs=argparse.REMAINDER)
    else:
        add_sweep_arguments(p)
    p.add_argument(
        "--allow-errors", action="store_true", help="exit 0 even when some requests failed"
    )
    p.set_defaults(func=run_sweep_command)


def run_sweep_command(args: argparse.Namespace) -> int:
    require("sweep", "collector")
    from kvscope.lab.sweep import config_from_args, print_table, run_sweep

    config = config_from_args(args)
    result = run_sweep(config)
    print_table(result)
    if config.out:
        print(f"results written to {config.out}")
    errors = sum(lv.error_count for lv in result.levels)
    return 0 if errors == 0 or args.allow_errors else 3


def add_demo(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument(
        "--live",
        action="store_true",
        help="start the real vLLM CPU engine and a sweep instead of replaying",
    )
    p.add_argument("--port", type=int, default=8844, help="collector port (default: 8844)")
    p.add_argument(
        "--store",
        default=".kvscope/demo.duckdb",
        help="store file, recreated on each run (default: .kvscope/demo.duckdb)",
    )
    p.add_argument(
        "--recording",
        default=None,
        help="recording to replay (default: the bundled real overload run)",
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="keep the collector running after the demo until Ctrl-C or SIGTERM "
        "(either stops it and frees its port and store)",
    )
    p.add_argument(
        "--workdir",
        default=".kvscope",
        help="where --live builds its model and keeps logs (default: .kvscope)",
    )
    p.set_defaults(func=run_demo_command)


def run_demo_command(args: argparse.Namespace) -> int:
    require("demo", "collector")
    busy = port_problem("127.0.0.1", args.port)
    if busy:
        print(
            f"kvscope demo: cannot listen on 127.0.0.1:{args.port} ({busy}): a collector or "
            "another program holds it; pass another --port",
            file=sys.stderr,
        )
        return 2
    from kvscope.lab.demo import run_demo

    return run_demo(args)


def add_record(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument(
        "--regime",
        default="kv-starved",
        choices=["kv-starved", "ample-kv", "seq-capped"],
        help="engine configuration to record (default: kv-starved)",
    )
    p.add_argument(
        "--concurrency",
        default="1,2,4,8,16,32",
        help="comma-separated concurrency levels (default: 1,2,4,8,16,32)",
    )
    p.add_argument(
        "--duration",
        type=positive_duration,
        default=10.0,
        metavar="DURATION",
        help="seconds per level (default: 10)",
    )
    p.add_argument(
        "--shared-prefix-words",
        type=int,
        default=40,
        help="words of shared prompt prefix, to exercise the prefix cache (default: 40)",
    )
    p.add_argument(
        "--prefix-groups",
        type=int,
        default=4,
        help="number of distinct shared prefixes (default: 4)",
    )
    p.add_argument("--workdir", default=".kvscope", help="model and log folder")
    p.set_defaults(func=run_record_command)


def run_record_command(args: argparse.Namespace) -> int:
    require("record", "collector")
    from kvscope.lab.recording import record_real_run

    return record_real_run(args)

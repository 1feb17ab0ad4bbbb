"""``kvscope advise``: the advisor's verdicts, from a collector (``--collector URL``) or from
vLLM's own series in a Prometheus-compatible server (``--prometheus URL``).

Both print the same report (``--format text|markdown|json``, ``--json``, ``--out``); over
Prometheus it carries the ``scrape_resolution`` finding and confidences scaled to the
resolution (:mod:`kvscope.sources.prometheus.source`). Text is the wrapped terminal layout on
a terminal and unwrapped plain text anywhere else (:mod:`kvscope.advisor.render_text`). The
JSON (``advisor/advise.schema.json``) says when, by which kvscope and from what it was made.

Exit codes: 0 verdicts; 2 bad arguments, the source unreachable or refusing the query
(its own error message is shown); 3 no data in the window (the message says what to try).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from kvscope import __version__
from kvscope.args import TIME_SYNTAX, add_slo_targets, fraction, positive, positive_duration, ratio
from kvscope.cli.checks import require

__all__ = ["add_parser", "advise_fail", "advise_window", "analysis_options", "run", "write_advice"]

EPILOG = f"""\
{TIME_SYNTAX}

output: on a terminal the text wraps to the window; piped or redirected it is plain text,
  unwrapped, one snippet to copy per line. --format markdown for a ticket, --json (or
  --format json) for the report, valid against advisor/advise.schema.json.

exit codes:
  0  verdicts printed (engines with too little data say so in their verdict)
  2  bad arguments, the collector could not be read (unreachable, 401, error),
     or --out could not be written
  3  no data in the window (the message says where the data is and what to try)

examples:
  kvscope advise --collector http://collector:8844
  kvscope advise --collector http://collector:8844 --since 2h --pool llama-70b-prod \\
      --slo-e2e-p99 10 --json --out advice.json
  kvscope advise --collector http://collector:8844 --slo-ttft 0.5 --slo-itl 0.05
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "advise",
        help="where each engine's throughput stops growing, why, and what cap and flags to set",
        description=(
            "Read a collector's recent data and answer, per pool and engine: the\n"
            "bottleneck (KV cache, max_num_seqs, token budget or compute), the knee (the\n"
            "load where throughput stops growing), the plateau, whether load went past\n"
            "it, and the recommended concurrency cap with its predicted share of peak\n"
            "throughput and P99; then the ranked recommendations with the exact change\n"
            "(vLLM flags, nginx, ingress-nginx, vllm-router, the Inference Extension's\n"
            "endpoint picker, llm-d's autoscaler) and the findings."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    env_url = os.environ.get("KVSCOPE_COLLECTOR_URL")
    p.add_argument(
        "--collector",
        metavar="URL",
        default=env_url,
        help="base URL of the kvscope collector (default: $KVSCOPE_COLLECTOR_URL)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("KVSCOPE_TOKEN"),
        help="the collector's bearer token (default: $KVSCOPE_TOKEN)",
    )
    p.add_argument(
        "--since",
        default="30m",
        metavar="TIME",
        help="start of the window to analyse (default: 30m, i.e. 30 minutes ago; see times below)",
    )
    p.add_argument("--until", default=None, metavar="TIME", help="end of the window (default: now)")
    p.add_argument("--pool", default=None, help="only the engines of this pool")
    p.add_argument(
        "--slo-ttft-p99",
        type=positive,
        default=None,
        metavar="S",
        help="P99 time-to-first-token target in seconds: the cap is lowered to meet it",
    )
    p.add_argument(
        "--slo-e2e-p99",
        type=positive,
        default=None,
        metavar="S",
        help="P99 end-to-end latency target in seconds: the cap is lowered to meet it",
    )
    add_slo_targets(p)
    p.add_argument(
        "--cap-fraction",
        type=fraction,
        default=0.9,
        metavar="F",
        help="share of the plateau throughput the cap must keep (default: 0.9)",
    )
    p.add_argument(
        "--min-routing-loss",
        type=fraction,
        default=0.05,
        metavar="F",
        help="recommend prefix-aware routing when at least this share of the pool's "
        "prefix lookups were computed on one replica while another held them "
        "(needs vLLM's KV events; default: 0.05)",
    )
    p.add_argument(
        "--imbalance-threshold",
        type=ratio,
        default=1.25,
        metavar="R",
        help="flag a pool whose busiest replica carries R times the mean load (default: 1.25)",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument(
        "--format",
        choices=("text", "markdown", "json"),
        default="text",
        help="text (wrapped on a terminal, plain when piped), markdown, or the JSON "
        "report (default: text)",
    )
    out.add_argument(
        "--json",
        dest="format",
        action="store_const",
        const="json",
        help="print the report as JSON, the same as --format json",
    )
    p.add_argument("--out", metavar="FILE", default=None, help="also write the JSON report to FILE")
    p.add_argument(
        "--replay",
        action="store_true",
        help="also try each proposed vLLM flag and the cap on a twin of the engine: vLLM's "
        "own scheduler replaying the engine's requests with its fitted step time, next "
        "to the closed-form figure (needs the 'twin' extra; about a second per what-if)",
    )
    p.add_argument(
        "--timeout",
        type=positive_duration,
        default=30.0,
        metavar="DURATION",
        help="seconds per HTTP request to the collector (default: 30)",
    )
    from kvscope.sources.prometheus.target import add_prometheus_arguments

    add_prometheus_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require("advise", "collector", also=("rich",))
    if args.prometheus:
        return _run_prometheus(args)
    if not args.collector:
        print(
            "kvscope advise: give --collector URL (or set KVSCOPE_COLLECTOR_URL) or "
            "--prometheus URL",
            file=sys.stderr,
        )
        return 2
    from kvscope.advisor import CollectorSource, SourceError, analyze
    from kvscope.advisor.render import no_data_message, source_error_message
    from kvscope.args import ParamError

    url = args.collector if "://" in args.collector else f"http://{args.collector}"
    url = url.rstrip("/")
    now = time.time()
    try:
        since, until = advise_window(args, now)
    except ParamError as exc:
        return advise_fail(str(exc), 2)
    source = CollectorSource(url, token=args.token, timeout_s=args.timeout)
    if args.replay:
        require("advise --replay", "twin")
    try:
        report = analyze(source, since, until, args.pool, **analysis_options(args))
        if args.replay and report.has_data:
            from kvscope.twin.whatif import replay_whatifs

            report.findings.extend(replay_whatifs(report, source, since, until))
    except SourceError as exc:
        return advise_fail(source_error_message(exc, url), 2)
    return write_advice(
        args,
        report,
        since,
        until,
        url,
        lambda window: no_data_message(report, url, window, now),
        kind="collector",
    )


def _run_prometheus(args: argparse.Namespace) -> int:
    from kvscope.advisor.sources import SourceError
    from kvscope.args import ParamError
    from kvscope.sources.prometheus.source import (
        analyze_prometheus,
        no_data_message,
        source_error_text,
    )
    from kvscope.sources.prometheus.target import PromArgError, prometheus_target

    if args.replay:
        return advise_fail(
            "--replay needs a collector (--collector URL): the twin replays the engine's "
            "stored requests, which vLLM's Prometheus series do not hold",
            2,
        )
    now = time.time()
    try:
        since, until = advise_window(args, now)
        target = prometheus_target(args)
        assert target is not None
        source = target.source(
            timeout_s=args.timeout, lookback_s=max(7 * 86400.0, now - (since or now))
        )
    except (ParamError, PromArgError) as exc:
        return advise_fail(str(exc), 2)
    url = target.url
    try:
        report = analyze_prometheus(source, since, until, args.pool, **analysis_options(args))
    except SourceError as exc:
        return advise_fail(source_error_text(exc, url), 2)
    return write_advice(
        args,
        report,
        since,
        until,
        f"Prometheus {url}",
        lambda window: no_data_message(source, report, url, window),
        kind="prometheus",
        url=url,
    )


def advise_window(args: argparse.Namespace, now: float) -> tuple[float | None, float | None]:
    """``--since`` / ``--until`` as unix seconds; :class:`ParamError` saying what is wrong."""
    from kvscope.args import ParamError, parse_time

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
    return {
        "slo_ttft_p99_s": args.slo_ttft_p99,
        "slo_e2e_p99_s": args.slo_e2e_p99,
        "slo_ttft_s": args.slo_ttft,
        "slo_itl_s": args.slo_itl,
        "slo_e2e_s": args.slo_e2e,
        "cap_fraction": args.cap_fraction,
        "min_routing_loss": args.min_routing_loss,
        "imbalance_threshold": args.imbalance_threshold,
    }


def write_advice(
    args: argparse.Namespace,
    report: Any,
    since: float | None,
    until: float | None,
    source: str,
    no_data: Callable[[str], str],
    *,
    kind: str,
    url: str | None = None,
) -> int:
    """The report to ``--out`` and to stdout (``--format``); exit 3 with no data, saying
    ``no_data(window)``. The JSON says when and by which kvscope it was written, and what
    was read (``kind``: collector or prometheus, and its ``url``, default ``source``)."""
    from kvscope.advisor.render import window_text
    from kvscope.advisor.render_text import print_report

    report.generated_unix_s = round(time.time(), 3)
    report.kvscope_version = __version__
    report.source = {"kind": kind, "url": url or source}
    if args.out:
        try:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(report.to_json(indent=2) + "\n")
        except OSError as exc:
            return advise_fail(f"cannot write --out {args.out}: {exc}", 2)
    window = window_text(since, until, args.since, args.until)
    if args.format == "json":
        sys.stdout.write(report.to_json(indent=2) + "\n")
    elif report.has_data:
        print_report(report, sys.stdout, fmt=args.format, source=source, window=window)
    if not report.has_data:
        return advise_fail(no_data(window), 3)
    return 0

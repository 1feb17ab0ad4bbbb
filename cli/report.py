"""``kvscope report``: arguments and the command (a thin layer over
:mod:`kvscope.report.build`). Imports only the standard library at the top, so the
``kvscope`` parser builds without the collector extra."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvscope.args import (
    TIME_SYNTAX,
    add_slo_targets,
    count,
    fraction,
    non_negative,
    positive,
    positive_duration,
    ratio,
)
from kvscope.cli.checks import require

EPILOG = f"""\
{TIME_SYNTAX}
The week before is the window of the same length that ends where --since starts.

exit codes:
  0  report written
  2  bad arguments, --out not writable (checked before the analysis: its folder must
     exist), the collector, store or Prometheus could not be read (unreachable, 401,
     store locked by a running collector), or --out could not be written
  3  no data in the window (the message says where the data is and what to try)

examples:
  kvscope report --collector http://collector:8844 --since 7d --out weekly/
  kvscope report --store kvscope.duckdb --since 7d --out weekly/   # collector stopped
  kvscope report --collector http://collector:8844 --gpu-hour-cost 2.50 --out weekly/
  kvscope report --prometheus http://prometheus:9090 --selector '{{namespace="prod"}}' \
      --prometheus-bearer-token-file /var/run/secrets/prom-token --out weekly/
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``report`` to the ``kvscope`` subcommands."""
    p = sub.add_parser(
        "report",
        help="the weekly tuning report: HTML with plots, Markdown and JSON",
        description=(
            "Analyse a week of a collector's data (or of vLLM's series in Prometheus) and\n"
            "the week before it, and write\n"
            "report.html (self-contained: plots inline, opens offline), report.md and\n"
            "report.json: per pool and engine the traffic per day, time spent past the\n"
            "knee, knee and cap, bottleneck, preemptions, prefix reuse; first the action\n"
            "list (what to change, where, its expected effect by kind, new / still open /\n"
            "done / gone against last week), GPU-hours (and cost) per pool, a capacity\n"
            "forecast, the recommendations with the change to copy, and what changed\n"
            "since the week before (configuration, knee and plateau moves, new and\n"
            "resolved problems)."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--collector",
        metavar="URL",
        default=None,
        help="base URL of the kvscope collector (default: $KVSCOPE_COLLECTOR_URL)",
    )
    where.add_argument(
        "--store",
        metavar="PATH",
        default=None,
        help="read a store file offline instead (read-only; not while a collector has it open)",
    )
    from kvscope.sources.prometheus.target import add_prometheus_arguments

    add_prometheus_arguments(p, url_group=where)
    p.add_argument(
        "--token",
        default=os.environ.get("KVSCOPE_TOKEN"),
        help="the collector's bearer token (default: $KVSCOPE_TOKEN)",
    )
    p.add_argument("--since", default="7d", help="start of the week (default: 7d)")
    p.add_argument("--until", default=None, help="end of the week (default: now)")
    p.add_argument("--pool", default=None, help="only the engines of this pool")
    p.add_argument(
        "--out",
        metavar="DIR",
        default="kvscope-report",
        help="folder for report.html, report.md, report.json (default: ./kvscope-report)",
    )
    p.add_argument(
        "--slo-ttft-p99",
        type=positive,
        default=None,
        metavar="S",
        help="P99 time-to-first-token target in seconds (lowers the cap)",
    )
    p.add_argument(
        "--slo-e2e-p99",
        type=positive,
        default=None,
        metavar="S",
        help="P99 end-to-end latency target in seconds (lowers the cap)",
    )
    add_slo_targets(p)
    p.add_argument(
        "--cap-fraction",
        type=fraction,
        default=0.9,
        metavar="F",
        help="share of the plateau the cap must keep (default: 0.9)",
    )
    p.add_argument(
        "--min-routing-loss",
        type=fraction,
        default=0.05,
        metavar="F",
        help="routing loss that calls for prefix-aware routing (default: 0.05)",
    )
    p.add_argument(
        "--imbalance-threshold",
        type=ratio,
        default=1.25,
        metavar="R",
        help="busiest / mean load flagged (default: 1.25)",
    )
    p.add_argument(
        "--max-windows-per-engine",
        type=count,
        default=None,
        metavar="N",
        help="with --store: the advisor's fits read at most about N 1-second "
        "windows per engine, in whole 5-minute blocks (default: 30000; 0 "
        "reads every window into memory); usage per day always counts "
        "every window",
    )
    p.add_argument(
        "--gpu-hour-cost",
        type=positive,
        default=None,
        metavar="USD",
        help="price of one GPU-hour in USD: the report prices each pool's GPU-hours and "
        "what the throughput advice is worth (default: none, GPU-hours only)",
    )
    p.add_argument(
        "--forecast-weeks",
        type=non_negative,
        default=4.0,
        metavar="N",
        help="the capacity forecast's trend also runs through the daily peak load of the N "
        "weeks before this one, from the collector's 1-minute windows (kept for months; "
        "default: 4; 0: this week's days only)",
    )
    p.add_argument(
        "--timeout",
        type=positive_duration,
        default=60.0,
        metavar="DURATION",
        help="seconds per HTTP request to the collector or Prometheus (default: 60)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar on stderr (there is none when stderr is not a terminal)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The command; returns the exit code."""
    require("report", "collector", also=("rich",))
    import time

    from tqdm import tqdm

    from kvscope.advisor import SourceError
    from kvscope.advisor.render import no_data_message, source_error_message, window_text
    from kvscope.args import ParamError, parse_time
    from kvscope.collector.tables import StoreVersionError
    from kvscope.report.build import (
        BUILD_STEPS,
        WRITE_STEPS,
        build_weekly_report,
        out_dir_problem,
        write_report_files,
    )
    from kvscope.report.prometheus import PromReportSource, annotate_weeks
    from kvscope.report.sources import HttpSource, StoreOpenError, StoreSource, open_store
    from kvscope.report.text import render_summary
    from kvscope.sources.prometheus.source import no_data_message as prom_no_data
    from kvscope.sources.prometheus.source import source_error_text
    from kvscope.sources.prometheus.target import PromArgError, prometheus_target

    bar: Any = None

    def fail(message: str, code: int) -> int:
        if bar is not None:  # clear the bar's line first: the message starts a line of its own
            bar.close()
        print(f"kvscope report: {message}", file=sys.stderr)
        return code

    now = time.time()
    try:
        since = parse_time("--since", args.since, now)
        until = parse_time("--until", args.until, now) if args.until else now
    except ParamError as exc:
        return fail(str(exc), 2)
    if since >= until:
        return fail(f"--since ({args.since}) must be before --until ({args.until or 'now'})", 2)
    problem = out_dir_problem(args.out)
    if problem is not None:
        return fail(f"cannot write --out {args.out}: {problem}", 2)
    url = args.collector or (
        None if args.store or args.prometheus else os.environ.get("KVSCOPE_COLLECTOR_URL")
    )
    source: HttpSource | StoreSource | PromReportSource
    prom: PromReportSource | None = None
    if args.prometheus:
        try:
            target = prometheus_target(args)
            assert target is not None
            prom = source = PromReportSource(
                target.source(
                    timeout_s=args.timeout, lookback_s=max(7 * 86400.0, 2 * (until - since))
                )
            )
        except PromArgError as exc:
            return fail(str(exc), 2)
        url = target.url
        label = f"Prometheus {url}"
    elif args.store:
        try:
            source = StoreSource(open_store(args.store))
        except (StoreOpenError, StoreVersionError) as exc:
            return fail(str(exc), 2)
        label = f"store {args.store}"
    elif url:
        url = (url if "://" in url else f"http://{url}").rstrip("/")
        source = HttpSource(url, token=args.token, timeout_s=args.timeout)
        label = f"collector {url}"
    else:
        return fail(
            "give --collector URL (or set KVSCOPE_COLLECTOR_URL), --store PATH or --prometheus URL",
            2,
        )
    bar = tqdm(
        total=BUILD_STEPS + WRITE_STEPS,
        desc="kvscope report",
        unit="step",
        file=sys.stderr,
        # Only on a terminal: a bar's carriage returns in a log or a cron mail run into
        # the error messages.
        disable=args.no_progress or not _is_terminal(sys.stderr),
        leave=False,
    )
    try:
        if prom is not None:
            bar.set_description("reading two weeks from Prometheus")
            prom.read(since - (until - since), until)
        sample_kw: dict[str, Any] = (
            {}
            if args.max_windows_per_engine is None
            else {"max_windows_per_engine": args.max_windows_per_engine or None}
        )
        report = build_weekly_report(
            source,
            since,
            until,
            pool=args.pool,
            source_label=label,
            progress=bar,
            **sample_kw,
            slo_ttft_p99_s=args.slo_ttft_p99,
            slo_e2e_p99_s=args.slo_e2e_p99,
            slo_ttft_s=args.slo_ttft,
            slo_itl_s=args.slo_itl,
            slo_e2e_s=args.slo_e2e,
            cap_fraction=args.cap_fraction,
            min_routing_loss=args.min_routing_loss,
            imbalance_threshold=args.imbalance_threshold,
            gpu_hour_cost=args.gpu_hour_cost,
            forecast_history_weeks=args.forecast_weeks,
        )
        if prom is not None:
            annotate_weeks(report, prom)
        if not report.current.has_data:
            bar.close()
            window = window_text(
                since, None if args.until is None else until, args.since, args.until
            )
            if prom is not None:
                return fail(prom_no_data(prom.source, report.current, str(url), window), 3)
            return fail(no_data_message(report.current, url or str(args.store), window, now), 3)
        try:
            paths = write_report_files(report, args.out, progress=bar)
        except OSError as exc:
            return fail(f"cannot write --out {args.out}: {exc}", 2)
    except SourceError as exc:
        if prom is not None:
            return fail(source_error_text(exc, str(url)), 2)
        return fail(source_error_message(exc, url or ""), 2)
    finally:
        bar.close()
        source.close()
    print(render_summary(report, paths))
    return 0


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except (ValueError, OSError):  # a closed or detached stream
        return False

"""``kvscope dashboard``: run the Streamlit app against a collector, a Prometheus, or on
the demo data.

The app runs as ``python -m streamlit run dashboard/app.py`` in a child process,
headless, bound to 127.0.0.1 unless ``--host`` says otherwise, usage statistics off.
The collector's token reaches it through the environment (``KVSCOPE_TOKEN``), not
the command line; so do Prometheus credentials (``KVSCOPE_PROMETHEUS_*``). ``--demo`` first starts a collector on a temporary store and
replays the bundled real vLLM recordings into it (:mod:`kvscope.dashboard.demo`).
A busy ``--port`` is refused before anything starts; SIGTERM stops the app and the demo's
collector (:mod:`kvscope.cli._lifecycle`).
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import signal
import subprocess
import sys
from pathlib import Path

from kvscope.args import add_slo_targets, duration, positive_duration
from kvscope.cli._lifecycle import Terminated, port_problem, stop_on_sigterm
from kvscope.dashboard.settings import (
    DashboardSettings,
    SettingsError,
    check_since,
    normalize_url,
    to_argv,
)

APP = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"
_NEEDED = ("streamlit", "altair", "pandas", "numpy", "rich", "aiohttp", "duckdb")
INSTALL_HINT = (
    "kvscope dashboard: this command needs the 'dashboard' extra ({missing} is "
    "not installed).\nInstall it with:  pip install 'kvscope[dashboard]'"
)


def missing_dependency() -> str | None:
    """The first module of the ``dashboard`` extra that is not installed, else None."""
    for mod in _NEEDED:
        if importlib.util.find_spec(mod) is None:
            return mod
    return None


_EPILOG = """\
pages: Fleet overview (/), Engine detail (/engine), Plateau (/plateau),
       Recommendations (/recommendations), Prefix and routing (/prefix).

examples:
  kvscope dashboard --collector http://collector:8844
  kvscope dashboard --collector http://collector:8844 --token "$TOKEN" --since 2h --port 8600
  kvscope dashboard --demo      # a local collector fed the bundled real vLLM recordings
  kvscope dashboard --prometheus http://prometheus:9090 --selector '{namespace="prod"}' \
      --prometheus-user grafana --prometheus-password-file /etc/kvscope/prom-password
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``dashboard`` subcommand to the ``kvscope`` parser."""
    p = sub.add_parser(
        "dashboard",
        help="the web dashboard (Streamlit): fleet, engines, plateau, recommendations, routing",
        description=(
            "Serve the kvscope dashboard: it reads a collector's HTTP API (or vLLM's series\n"
            "in a Prometheus-compatible server), runs the advisor\n"
            "on every refresh and shows the fleet (status, batch, KV occupancy, prefix hit\n"
            "rate, preemptions, throughput, verdict), each engine's time series, the\n"
            "plateau with knee and cap, the ranked recommendations with the change to copy,\n"
            "and prefix caching and routing."
        ),
        epilog=_EPILOG,
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
        "--demo",
        action="store_true",
        help="start a collector on a temporary store, replay the bundled real vLLM "
        "recordings into it (three engines, two pools) and show them",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("KVSCOPE_TOKEN"),
        help="the collector's bearer token (default: $KVSCOPE_TOKEN)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address the dashboard listens on (default: 127.0.0.1)"
    )
    p.add_argument("--port", type=int, default=8501, help="dashboard port (default: 8501)")
    p.add_argument(
        "--since",
        default=None,
        help="start of the default window, a time as in advise: 30m, 1h30m, 7d, -2h, "
        "2026-11-30T08:00Z or unix seconds (default: 30m; with --demo 3h)",
    )
    p.add_argument("--pool", default=None, help="only the engines of this pool")
    p.add_argument(
        "--refresh",
        type=duration,
        default=10.0,
        metavar="DURATION",
        help="seconds between automatic refreshes; 0 turns them off (default: 10)",
    )
    p.add_argument(
        "--timeout",
        type=positive_duration,
        default=30.0,
        metavar="DURATION",
        help="seconds per HTTP request to the collector (default: 30)",
    )
    add_slo_targets(
        p,
        "the Latency page shows which share of requests met it (changeable on the page; "
        "default: none)",
    )
    p.add_argument(
        "--demo-dir",
        default=None,
        metavar="DIR",
        help="with --demo: keep the store and the collector's log here "
        "(default: a temporary folder, removed on exit)",
    )
    from kvscope.sources.prometheus.target import add_prometheus_arguments

    add_prometheus_arguments(p)
    p.set_defaults(func=run)


def streamlit_command(app_argv: list[str], host: str, port: int) -> list[str]:
    """The ``streamlit run`` command line serving the app with ``app_argv``."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--server.fileWatcherType",
        "none",
        "--server.runOnSave",
        "false",
        "--client.toolbarMode",
        "viewer",
        "--",
        *app_argv,
    ]


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(settings: DashboardSettings, host: str, port: int) -> int:
    """Run the app in the foreground until it exits or Ctrl-C."""
    from kvscope.sources.prometheus.target import ENV_BEARER, ENV_HEADERS, ENV_PASSWORD, ENV_USER

    env = dict(os.environ)
    for name in ("KVSCOPE_TOKEN", ENV_BEARER, ENV_HEADERS, ENV_PASSWORD, ENV_USER):
        env.pop(name, None)
    if settings.token:
        env["KVSCOPE_TOKEN"] = settings.token
    if settings.prometheus is not None:
        env.update(settings.prometheus.environ())
    env.setdefault("PYTHONUNBUFFERED", "1")
    print(
        f"kvscope dashboard: http://{host}:{port}/ reading {settings.source_label}"
        f" (window {settings.since}, refresh "
        f"{f'every {settings.refresh_s:g} s' if settings.refresh_s else 'off'}); Ctrl-C stops",
        flush=True,
    )
    if not _loopback(host):
        print(
            f"kvscope dashboard: listening on {host}: the dashboard has no login; anyone "
            f"who reaches it sees what the {settings.source_label.split()[0]} holds",
            file=sys.stderr,
        )
    proc = subprocess.Popen(streamlit_command(to_argv(settings), host, port), env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return _stop(proc, signal.SIGINT, 130)
    except Terminated:
        _stop(proc, signal.SIGTERM, 143)
        raise


def _stop(proc: subprocess.Popen[bytes], sig: int, code: int) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return code


def run(args: argparse.Namespace) -> int:
    """``kvscope dashboard``: SIGTERM stops the app and the demo collector too."""
    try:
        with stop_on_sigterm():
            return _run(args)
    except Terminated:
        return 143


def _run(args: argparse.Namespace) -> int:
    missing = missing_dependency()
    if missing:
        print(INSTALL_HINT.format(missing=missing), file=sys.stderr)
        return 2

    def fail(message: str) -> int:
        print(f"kvscope dashboard: {message}", file=sys.stderr)
        return 2

    from kvscope.sources.prometheus.target import PromArgError, prometheus_target

    if args.demo and args.collector and args.collector != os.environ.get("KVSCOPE_COLLECTOR_URL"):
        return fail("--demo starts its own collector; leave out --collector")
    if args.prometheus and (
        args.demo or (args.collector and args.collector != os.environ.get("KVSCOPE_COLLECTOR_URL"))
    ):
        return fail("--prometheus reads Prometheus; leave out --collector and --demo")
    if not args.demo and not args.collector and not args.prometheus:
        return fail(
            "pass --collector URL (or set KVSCOPE_COLLECTOR_URL), --prometheus URL, "
            "or --demo to look at the bundled recordings"
        )
    try:
        prom = prometheus_target(args)
    except PromArgError as exc:
        return fail(str(exc))
    if args.refresh < 0 or args.timeout <= 0:
        return fail("--refresh must be >= 0 and --timeout > 0")
    if not 0 < args.port < 65536:
        return fail(f"--port {args.port} is not a TCP port")
    busy = port_problem(args.host, args.port)
    if busy:
        return fail(
            f"cannot listen on {args.host}:{args.port} ({busy}): another dashboard or "
            "program holds it; pass another --port"
        )
    try:
        since = check_since(args.since or ("3h" if args.demo else "30m"))
    except SettingsError as exc:
        return fail(str(exc))
    slo = {f"slo_{k}_s": getattr(args, f"slo_{k}") for k in ("ttft", "itl", "e2e")}
    if prom is not None:
        return serve(
            DashboardSettings(
                since=since,
                refresh_s=args.refresh,
                timeout_s=args.timeout,
                pool=args.pool,
                **slo,
                prometheus=prom,
            ),
            args.host,
            args.port,
        )
    if not args.demo:
        return serve(
            DashboardSettings(
                collector_url=normalize_url(args.collector),
                token=args.token,
                since=since,
                refresh_s=args.refresh,
                timeout_s=args.timeout,
                pool=args.pool,
                **slo,
            ),
            args.host,
            args.port,
        )
    from kvscope.dashboard.demo import DEMO_FLEET, demo_collector

    print(
        f"kvscope dashboard --demo: starting a collector and replaying {len(DEMO_FLEET)} "
        "real vLLM recordings into it (about a minute)...",
        flush=True,
    )
    with demo_collector(args.demo_dir) as c:
        print(
            f"kvscope dashboard --demo: collector {c.url} (store {c.store_path}) holds "
            + ", ".join(f"{e.engine_id} ({e.recording}, pool {e.pool})" for e in DEMO_FLEET),
            flush=True,
        )
        return serve(
            DashboardSettings(
                collector_url=c.url,
                since=since,
                refresh_s=args.refresh,
                timeout_s=args.timeout,
                pool=args.pool,
                **slo,
            ),
            args.host,
            args.port,
        )

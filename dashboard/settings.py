"""The dashboard's settings: which collector (or Prometheus) to read, which window, how
often to refresh.

One typed object built from the arguments after ``--`` of ``streamlit run
dashboard/app.py -- --collector URL ...`` (or ``-- --prometheus URL ...``) and the
environment. ``kvscope dashboard`` passes the bearer token through the environment
(``KVSCOPE_TOKEN``), never on the command line, so it does not show in the process
list; Prometheus secrets likewise (``KVSCOPE_PROMETHEUS_*``, see
:mod:`kvscope.sources.prometheus.target`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvscope.args import duration, positive, positive_duration
from kvscope.sources.prometheus.target import (
    PromArgError,
    PromTarget,
    add_prometheus_arguments,
    prometheus_target,
)

DEFAULT_SINCE = "30m"
DEFAULT_REFRESH_S = 10.0
WINDOW_CHOICES = ("5m", "15m", "30m", "1h", "3h", "6h", "24h", "7d")
"""The windows the sidebar offers (``--since`` is added when it is not among them)."""


class SettingsError(ValueError):
    """The dashboard's arguments are invalid; the message names the argument."""


@dataclass(frozen=True)
class DashboardSettings:
    """Where the dashboard reads and how it refreshes.

    ``collector_url`` is the collector's base URL (no path); ``token`` its bearer
    token, if one is configured; ``since`` the default window, a duration ago
    (``30m``, ``2h``, ``7d``) or unix seconds; ``refresh_s`` seconds between
    refreshes (0 turns automatic refresh off); ``timeout_s`` bounds each HTTP request.
    ``prometheus``, when set, is read instead of a collector (``collector_url`` is then
    empty).
    """

    collector_url: str = ""
    token: str | None = None
    since: str = DEFAULT_SINCE
    refresh_s: float = DEFAULT_REFRESH_S
    timeout_s: float = 30.0
    pool: str | None = None
    prometheus: PromTarget | None = None
    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None
    slo_e2e_s: float | None = None
    """Latency targets in seconds (``--slo-ttft``, ``--slo-itl``, ``--slo-e2e``): the
    Latency page's defaults, and the advisor's SLO attainment (None: no target)."""

    @property
    def source_url(self) -> str:
        """The base URL read: the collector's or Prometheus'."""
        return self.prometheus.url if self.prometheus is not None else self.collector_url

    def cache_key(self) -> str:
        """A key that changes with every setting, secrets included, and shows none of
        them (the repr masks them; a digest stands for them)."""
        import hashlib

        secret = [self.token or ""]
        if self.prometheus is not None and self.prometheus.auth is not None:
            a = self.prometheus.auth
            secret += [a.bearer_token or "", a.password or "", repr(a.headers)]
        digest = hashlib.sha256("\0".join(secret).encode()).hexdigest()[:16]
        return f"{self!r}#{digest}"

    @property
    def source_label(self) -> str:
        """``collector http://...`` or ``Prometheus http://...``."""
        if self.prometheus is not None:
            return f"Prometheus {self.prometheus.url}"
        return f"collector {self.collector_url}"


def normalize_url(url: str) -> str:
    """``host:8844`` -> ``http://host:8844``; no trailing slash."""
    url = url.strip()
    return (url if "://" in url else f"http://{url}").rstrip("/")


def check_since(text: str) -> str:
    """``text`` when the collector's time syntax accepts it, else :class:`SettingsError`."""
    from kvscope.args import ParamError, parse_time

    try:
        parse_time("--since", text, 0.0)
    except ParamError as exc:
        raise SettingsError(str(exc)) from None
    return text.strip()


def parse_settings(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> DashboardSettings:
    """Settings from the app's arguments, with ``KVSCOPE_*`` variables as defaults.

    ``--collector`` defaults to ``$KVSCOPE_COLLECTOR_URL``, ``--token`` to
    ``$KVSCOPE_TOKEN``; ``--prometheus URL`` (with the options of
    :func:`kvscope.sources.prometheus.target.add_prometheus_arguments`) reads Prometheus instead. Raises :class:`SettingsError` naming what is missing or wrong.
    """
    env = os.environ if environ is None else environ
    p = argparse.ArgumentParser(
        prog="dashboard/app.py", add_help=False, exit_on_error=False, allow_abbrev=False
    )
    p.add_argument("--collector", default=env.get("KVSCOPE_COLLECTOR_URL"))
    p.add_argument("--token", default=env.get("KVSCOPE_TOKEN") or None)
    p.add_argument("--since", default=DEFAULT_SINCE)
    p.add_argument("--refresh", type=duration, default=DEFAULT_REFRESH_S)
    p.add_argument("--timeout", type=positive_duration, default=30.0)
    p.add_argument("--pool", default=None)
    for name in ("ttft", "itl", "e2e"):
        p.add_argument(f"--slo-{name}", type=positive, default=None)
    add_prometheus_arguments(p)
    try:
        args, unknown = p.parse_known_args(list(argv))
    except (argparse.ArgumentError, argparse.ArgumentTypeError) as exc:
        raise SettingsError(str(exc)) from None
    if unknown:
        raise SettingsError(f"unknown argument(s): {' '.join(unknown)}")
    try:
        prom = prometheus_target(args, env)
    except PromArgError as exc:
        raise SettingsError(str(exc)) from None
    if prom is None and not args.collector:
        raise SettingsError(
            "no collector: pass --collector URL (or set KVSCOPE_COLLECTOR_URL), or --prometheus URL"
        )
    return DashboardSettings(
        collector_url="" if prom else normalize_url(args.collector),
        token=None if prom else args.token,
        since=check_since(args.since),
        refresh_s=args.refresh,
        timeout_s=args.timeout,
        pool=args.pool or None,
        prometheus=prom,
        slo_ttft_s=args.slo_ttft,
        slo_itl_s=args.slo_itl,
        slo_e2e_s=args.slo_e2e,
    )


def to_argv(settings: DashboardSettings) -> list[str]:
    """The app arguments that :func:`parse_settings` turns back into ``settings``
    (secrets are left out: pass them as ``KVSCOPE_TOKEN`` and
    ``settings.prometheus.environ()``)."""
    where = (
        settings.prometheus.argv()
        if settings.prometheus is not None
        else ["--collector", settings.collector_url]
    )
    argv = [
        *where,
        f"--since={settings.since}",  # one word: a value such as -2h is no option
        "--refresh",
        f"{settings.refresh_s:g}",
        "--timeout",
        f"{settings.timeout_s:g}",
    ]
    if settings.pool:
        argv += ["--pool", settings.pool]
    for name in ("ttft", "itl", "e2e"):
        target = getattr(settings, f"slo_{name}_s")
        if target is not None:
            argv += [f"--slo-{name}", f"{target:g}"]
    return argv

"""The Prometheus options shared by ``kvscope advise``, ``report``, ``dashboard`` and ``lint``.

:func:`add_prometheus_arguments` adds them to a parser, :func:`prometheus_target` turns
the parsed arguments (and the environment) into one :class:`PromTarget`: the base URL,
the selector, the pool label, the step, and a :class:`~kvscope.sources.prometheus.auth.PromAuth`.

Secrets are read from files or the environment, never taken as command-line values
(a process list shows those): ``--prometheus-bearer-token-file`` or
``$KVSCOPE_PROMETHEUS_BEARER_TOKEN``; ``--prometheus-user`` with
``--prometheus-password-file`` or ``$KVSCOPE_PROMETHEUS_PASSWORD``. A URL carrying
``user:password@`` is refused with a message saying which options to use.
Standard library only at import time: the ``kvscope`` parser builds without extras.
"""

from __future__ import annotations

import argparse
import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvscope.args import positive_duration

if TYPE_CHECKING:
    from kvscope.sources.prometheus.auth import PromAuth
    from kvscope.sources.prometheus.source import PrometheusSource

__all__ = [
    "ENV_BEARER",
    "ENV_HEADERS",
    "ENV_PASSWORD",
    "ENV_USER",
    "PromArgError",
    "PromTarget",
    "add_prometheus_arguments",
    "prometheus_target",
]

ENV_BEARER = "KVSCOPE_PROMETHEUS_BEARER_TOKEN"
ENV_USER = "KVSCOPE_PROMETHEUS_USER"
ENV_PASSWORD = "KVSCOPE_PROMETHEUS_PASSWORD"
ENV_HEADERS = "KVSCOPE_PROMETHEUS_HEADERS"
"""Extra headers, one ``Name: value`` per line (how ``kvscope dashboard`` hands them on)."""


class PromArgError(ValueError):
    """The Prometheus options are inconsistent; the message names the option."""


def add_prometheus_arguments(
    p: argparse.ArgumentParser, *, url_group: Any = None, analysis: bool = True
) -> None:
    """``--prometheus URL``, ``--selector``, the authentication and TLS options and, with
    ``analysis``, ``--pool-label`` and ``--step``. ``url_group`` (a mutually exclusive
    group) receives ``--prometheus`` when given."""
    (url_group or p).add_argument(
        "--prometheus",
        metavar="URL",
        default=None,
        help="read vLLM's own /metrics series (and kvscope collectors' series) from this "
        "Prometheus-compatible server (Prometheus, Thanos, Mimir, VictoriaMetrics): "
        "its base URL, no /api path",
    )
    p.add_argument(
        "--selector",
        default=None,
        metavar="'{...}'",
        help="with --prometheus: label matchers added to every query, e.g. '{namespace=\"prod\"}'",
    )
    if analysis:
        p.add_argument(
            "--pool-label",
            default=None,
            metavar="LABEL",
            help="with --prometheus: the label that groups replicas into pools "
            "(default: model_name; kvscope's own series use pool)",
        )
        p.add_argument(
            "--step",
            type=positive_duration,
            default=None,
            metavar="DURATION",
            help="with --prometheus: window length in seconds (default: the scrape interval)",
        )
    a = p.add_argument_group(
        "Prometheus authentication and TLS",
        "Secrets come from files or the environment, never from the command line.",
    )
    a.add_argument(
        "--prometheus-bearer-token-file",
        metavar="FILE",
        default=None,
        help=f"send 'Authorization: Bearer <the file's content>' (default: ${ENV_BEARER} when set)",
    )
    a.add_argument(
        "--prometheus-user",
        metavar="USER",
        default=None,
        help=f"basic-auth user name (default: ${ENV_USER})",
    )
    a.add_argument(
        "--prometheus-password-file",
        metavar="FILE",
        default=None,
        help=f"basic-auth password, read from FILE (default: ${ENV_PASSWORD})",
    )
    a.add_argument(
        "--prometheus-header",
        metavar="'NAME: VALUE'",
        action="append",
        default=[],
        help="an extra header on every request, e.g. 'X-Scope-OrgID: team-a' for "
        "a Mimir tenant (repeatable)",
    )
    a.add_argument(
        "--prometheus-ca-file",
        metavar="PEM",
        default=None,
        help="trust this CA bundle for an https:// Prometheus (besides the system's)",
    )
    a.add_argument(
        "--prometheus-insecure-skip-verify",
        action="store_true",
        help="do not check the https:// server's certificate (tests only)",
    )


@dataclass(frozen=True)
class PromTarget:
    """Where and how to read one Prometheus-compatible server."""

    url: str
    selector: str | None = None
    pool_label: str | None = None
    step: float | None = None
    auth: PromAuth | None = None

    def source(self, *, timeout_s: float, **kw: Any) -> PrometheusSource:
        """A :class:`~kvscope.sources.prometheus.source.PrometheusSource` over this target
        (:class:`PromArgError` for a bad selector)."""
        from kvscope.sources.prometheus.promql import PromQLError
        from kvscope.sources.prometheus.source import PrometheusSource

        try:
            return PrometheusSource(
                self.url,
                selector=self.selector,
                pool_label=self.pool_label,
                step=self.step,
                timeout_s=timeout_s,
                auth=self.auth,
                **kw,
            )
        except PromQLError as exc:
            raise PromArgError(f"--selector: {exc}") from None

    def argv(self) -> list[str]:
        """Command-line options that rebuild this target without its secrets (those go
        through :meth:`environ`)."""
        out = ["--prometheus", self.url]
        for flag, value in (
            ("--selector", self.selector),
            ("--pool-label", self.pool_label),
            ("--step", None if self.step is None else f"{self.step:g}"),
        ):
            if value:
                out += [flag, value]
        a = self.auth
        if a is not None:
            if a.username:
                out += ["--prometheus-user", a.username]
            if a.ca_file:
                out += ["--prometheus-ca-file", a.ca_file]
            if a.insecure_skip_verify:
                out.append("--prometheus-insecure-skip-verify")
        return out

    def environ(self) -> dict[str, str]:
        """The secrets, as the environment variables :func:`prometheus_target` reads."""
        a = self.auth
        if a is None:
            return {}
        out = {}
        if a.bearer_token:
            out[ENV_BEARER] = a.bearer_token
        if a.password:
            out[ENV_PASSWORD] = a.password
        if a.headers:
            out[ENV_HEADERS] = "\n".join(f"{k}: {v}" for k, v in a.headers)
        return out


def _header(text: str) -> tuple[str, str]:
    from kvscope.args import ParamError, parse_header

    try:
        return parse_header("--prometheus-header", text)
    except ParamError as exc:
        raise PromArgError(str(exc)) from None


def _url(text: str) -> str:
    url = text.strip()
    url = (url if "://" in url else f"http://{url}").rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PromArgError(
            f"--prometheus wants an http:// or https:// base URL, got "
            f"{parts.scheme}://{parts.hostname or ''}"
        )
    if parts.username or parts.password:
        raise PromArgError(
            "--prometheus: credentials in the URL would show in the process "
            "list and in messages; use --prometheus-user with "
            "--prometheus-password-file (or $KVSCOPE_PROMETHEUS_PASSWORD)"
        )
    return url


def prometheus_target(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> PromTarget | None:
    """The target the arguments name (None without ``--prometheus``); secrets read from
    their files or ``environ``. :class:`PromArgError` says which option is wrong."""
    from kvscope.sources.prometheus.auth import PromAuth, read_secret

    if not getattr(args, "prometheus", None):
        return None
    env = os.environ if environ is None else environ
    step = getattr(args, "step", None)
    if step is not None and step < 1:
        raise PromArgError("--step must be at least 1 (seconds)")
    try:
        token = (
            read_secret(args.prometheus_bearer_token_file, "--prometheus-bearer-token-file")
            if args.prometheus_bearer_token_file
            else env.get(ENV_BEARER) or None
        )
        user = args.prometheus_user or env.get(ENV_USER) or None
        password = (
            read_secret(args.prometheus_password_file, "--prometheus-password-file")
            if args.prometheus_password_file
            else env.get(ENV_PASSWORD) or None
        )
    except ValueError as exc:
        raise PromArgError(str(exc)) from None
    if password and not user:
        raise PromArgError(
            f"a basic-auth password was given without --prometheus-user (or ${ENV_USER})"
        )
    if user and not password:
        raise PromArgError(
            f"--prometheus-user {user} needs --prometheus-password-file (or ${ENV_PASSWORD})"
        )
    if token and user:
        if args.prometheus_bearer_token_file or not args.prometheus_user:
            raise PromArgError("give either a bearer token or basic auth, not both")
        token = None  # basic auth on the command line wins over a token in the environment
    lines = list(args.prometheus_header or [])
    lines += [ln for ln in env.get(ENV_HEADERS, "").splitlines() if ln.strip()]
    headers = tuple(_header(h) for h in lines)
    if args.prometheus_ca_file and not os.path.isfile(args.prometheus_ca_file):
        raise PromArgError(f"--prometheus-ca-file {args.prometheus_ca_file}: no such file")
    try:
        auth = PromAuth(
            bearer_token=token,
            username=user,
            password=password,
            headers=headers,
            ca_file=args.prometheus_ca_file,
            insecure_skip_verify=bool(args.prometheus_insecure_skip_verify),
        )
        auth.ssl_context()  # a bad CA file fails here, with its message
    except ValueError as exc:
        raise PromArgError(str(exc)) from None
    return PromTarget(
        url=_url(args.prometheus),
        selector=getattr(args, "selector", None),
        pool_label=getattr(args, "pool_label", None),
        step=step,
        auth=auth,
    )

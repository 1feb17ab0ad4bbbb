"""Typed settings of the engine side, read from ``KVSCOPE_*`` environment variables.

:func:`load_settings` reads them into :class:`Settings`, one field per variable
(``KVSCOPE_FLUSH_INTERVAL_S`` -> ``flush_interval_s``; ``KVSCOPE_ENGINE_ID`` ->
``engine_id_override``, to which ``:<engine_index>`` is appended when the server runs
more than one engine; ``KVSCOPE_PORT`` defaults to the server's ``--port``, else 8000).
Reading never raises: a malformed value is reported once in the log and the default is
used instead. Without ``KVSCOPE_COLLECTOR_URL`` the plugin is inert.

Every variable, its default and meaning: docs/plugin.md#settings
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvscope.engine_plugins._logging import ONCE

DEFAULT_POOL = "default"
DEFAULT_PORT = 8000
DEFAULT_FLUSH_INTERVAL_S = 1.0
DEFAULT_BUFFER_STEPS = 120_000
DEFAULT_BUFFER_REQUESTS = 60_000
DEFAULT_MAX_PENDING_BATCHES = 120
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 2.0
DEFAULT_SPOOL_MAX_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Settings:
    """Engine-side settings; build with :func:`load_settings`."""

    collector_url: str | None = None
    """Base URL of the collector, without a trailing slash; None means inert."""
    token: str | None = None
    ca_file: str | None = None
    """PEM file of CA certificates for an ``https://`` collector (None: system CAs)."""
    pool: str = DEFAULT_POOL
    engine_id_override: str | None = None
    host: str = "localhost"
    port: int = DEFAULT_PORT
    flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    buffer_requests: int = DEFAULT_BUFFER_REQUESTS
    max_pending_batches: int = DEFAULT_MAX_PENDING_BATCHES
    timeout_s: float = DEFAULT_TIMEOUT_S
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    spool_dir: str | None = None
    """Base directory of the on-disk spool; None keeps undeliverable batches in memory only."""
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES
    stats_file: str | None = None
    """Where the exporter writes its counters (JSON) after every cycle; None for nowhere."""

    @property
    def spool_key(self) -> str:
        """This server's spool subdirectory name: its engine id override, else host_port."""
        raw = self.engine_id_override or f"{self.host}_{self.port}"
        return "".join(c if c.isalnum() or c in "._-" else "_" for c in raw)[:120]

    @property
    def enabled(self) -> bool:
        """Whether a collector is configured (otherwise the plugin is inert)."""
        return self.collector_url is not None

    def engine_id(self, engine_index: int, *, multi_engine: bool = False) -> str:
        """Return the stable engine id ``host:port:engine_index`` (or the override)."""
        if self.engine_id_override:
            if multi_engine:
                return f"{self.engine_id_override}:{engine_index}"
            return self.engine_id_override
        return f"{self.host}:{self.port}:{engine_index}"


def _bad(name: str, raw: str, why: str, default: object) -> None:
    ONCE.warning(
        f"config:{name}",
        "kvscope: ignoring %s=%r (%s); using the default %r",
        name,
        raw,
        why,
        default,
    )


def _float(env: Mapping[str, str], name: str, default: float, lo: float, hi: float) -> float:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        _bad(name, raw, "not a number", default)
        return default
    if not lo <= value <= hi:  # also rejects NaN
        _bad(name, raw, f"outside [{lo:g}, {hi:g}]", default)
        return default
    return value


def _int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw.strip().replace("_", ""))
    except ValueError:
        _bad(name, raw, "not an integer", default)
        return default
    if not lo <= value <= hi:
        _bad(name, raw, f"outside [{lo}, {hi}]", default)
        return default
    return value


def _text(env: Mapping[str, str], name: str, default: str | None, max_chars: int) -> str | None:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip()
    if len(value) > max_chars:
        _bad(name, raw, f"longer than {max_chars} characters", default)
        return default
    return value


def _collector_url(env: Mapping[str, str]) -> str | None:
    raw = env.get("KVSCOPE_COLLECTOR_URL")
    if raw is None or not raw.strip():
        return None
    url = raw.strip().rstrip("/")
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        parts, port_ok = None, False
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        ONCE.warning(
            "config:KVSCOPE_COLLECTOR_URL",
            "kvscope: KVSCOPE_COLLECTOR_URL=%r is not an http(s)://host[:port][/path] URL; "
            "the plugin stays inert",
            raw,
        )
        return None
    if parts.query or parts.fragment:
        url = f"{parts.scheme}://{parts.netloc}{parts.path}".rstrip("/")
    return url


def port_from_argv(argv: Sequence[str]) -> int | None:
    """Return the value of ``--port N`` / ``--port=N`` in ``argv``, or None."""
    raw: str | None = None
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            raw = argv[i + 1]
        elif arg.startswith("--port="):
            raw = arg.split("=", 1)[1]
    if raw is None:
        return None
    try:
        port = int(raw)
    except ValueError:
        return None
    return port if 0 <= port <= 65535 else None


def load_settings(
    env: Mapping[str, str] | None = None, argv: Sequence[str] | None = None
) -> Settings:
    """Read :class:`Settings` from ``env`` (default ``os.environ``) and ``argv``."""
    env = os.environ if env is None else env
    argv = sys.argv if argv is None else argv
    port = _int(env, "KVSCOPE_PORT", -1, 0, 65535)
    if port < 0:
        port = port_from_argv(argv) or DEFAULT_PORT
    host = _text(env, "KVSCOPE_HOST", None, 100)
    if host is None:
        try:
            host = socket.gethostname() or "localhost"
        except OSError:
            host = "localhost"
    return Settings(
        collector_url=_collector_url(env),
        token=_text(env, "KVSCOPE_TOKEN", None, 4096),
        ca_file=_text(env, "KVSCOPE_CA_FILE", None, 4096),
        pool=_text(env, "KVSCOPE_POOL", DEFAULT_POOL, 200) or DEFAULT_POOL,
        engine_id_override=_text(env, "KVSCOPE_ENGINE_ID", None, 180),
        host=host[:100],
        port=port,
        flush_interval_s=_float(
            env, "KVSCOPE_FLUSH_INTERVAL_S", DEFAULT_FLUSH_INTERVAL_S, 0.05, 60.0
        ),
        buffer_steps=_int(env, "KVSCOPE_BUFFER_STEPS", DEFAULT_BUFFER_STEPS, 100, 10_000_000),
        buffer_requests=_int(
            env, "KVSCOPE_BUFFER_REQUESTS", DEFAULT_BUFFER_REQUESTS, 100, 10_000_000
        ),
        max_pending_batches=_int(
            env, "KVSCOPE_MAX_PENDING_BATCHES", DEFAULT_MAX_PENDING_BATCHES, 1, 100_000
        ),
        timeout_s=_float(env, "KVSCOPE_TIMEOUT_S", DEFAULT_TIMEOUT_S, 0.05, 120.0),
        shutdown_timeout_s=_float(
            env, "KVSCOPE_SHUTDOWN_TIMEOUT_S", DEFAULT_SHUTDOWN_TIMEOUT_S, 0.0, 120.0
        ),
        spool_dir=_text(env, "KVSCOPE_SPOOL_DIR", None, 4096),
        spool_max_bytes=_int(
            env, "KVSCOPE_SPOOL_MAX_BYTES", DEFAULT_SPOOL_MAX_BYTES, 4096, 1 << 44
        ),
        stats_file=_text(env, "KVSCOPE_STATS_FILE", None, 4096),
    )

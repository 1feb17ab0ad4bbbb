"""kvscope's vLLM stat-logger plugin.

Registered under the entry-point group ``vllm.stat_logger_plugins`` as
``kvscope.engine_plugins.plugin:KvscopeStatLogger``. vLLM's API server process (AsyncLLM)
creates one instance per engine (``cls(vllm_config, engine_index)``) and calls
:meth:`KvscopeStatLogger.record` once per engine step output, on its event loop,
without a ``try``: so every entry point here is guarded. A failure is counted
(``record_errors``) and logged at most once a minute; nothing is raised into vLLM.

Without ``KVSCOPE_COLLECTOR_URL`` the logger is inert: ``record()`` returns at
once, and the process logs that once, with how to enable it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from kvscope.engine_plugins import __version__
from kvscope.engine_plugins._adapter import finished_requests, request_row, step_row, tokens_row
from kvscope.engine_plugins._config import Settings, load_settings
from kvscope.engine_plugins._logging import ERRORS, ONCE
from kvscope.engine_plugins.exporter import EngineBuffer, Exporter, current_exporter, get_exporter
from kvscope.engine_plugins.schema import MAX_ID_CHARS, MAX_LABEL_CHARS, MAX_TEXT_CHARS

_time = time.time

__all__ = [
    "INERT_MESSAGE",
    "KvscopeStatLogger",
    "Settings",
    "kv_events_endpoint",
    "offset_endpoint_port",
]

INERT_MESSAGE = (
    "kvscope: KVSCOPE_COLLECTOR_URL is not set (or not a valid URL), so the kvscope stat "
    "logger is inert and records nothing. To export engine telemetry, start vLLM with "
    "KVSCOPE_COLLECTOR_URL=http://<collector-host>:<port> (and KVSCOPE_TOKEN if the "
    "collector requires one)."
)


def _int_or_none(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    try:
        i = int(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return i if i >= 0 else None


def _float_or_none(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f == f and f >= 0.0 and f != float("inf") else None


def _text(v: Any, max_chars: int, default: str | None = None) -> str | None:
    if v is None:
        return default
    return str(v)[:max_chars]


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))[:64]
    except Exception:  # a broken vLLM install must not stop the plugin
        return "unknown"


def _model_name(model_config: Any) -> str:
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    name = served or getattr(model_config, "model", None) or "unknown"
    return str(name)[:MAX_LABEL_CHARS]


def offset_endpoint_port(endpoint: str, engine_index: int) -> str:
    """The endpoint a data-parallel engine publishes on: vLLM adds the engine's
    data-parallel index to a tcp port (``inproc`` gets a ``_dp<index>`` suffix), as
    ``ZmqEventPublisher.offset_endpoint_port`` does in vLLM 0.32."""
    if engine_index == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{engine_index}"
    head, sep, port = endpoint.rpartition(":")
    if "tcp" in endpoint and sep and port.isdigit() and int(port) != 0:
        return f"{head}:{int(port) + engine_index}"
    return endpoint


def kv_events_endpoint(kv_events_config: Any, engine_index: int) -> str | None:
    """The ZMQ endpoint of this engine's KV-cache event publisher, or None.

    None unless ``enable_kv_cache_events`` is on with the ``zmq`` publisher, and for a
    tcp port 0 (vLLM picks the port when it binds; this process never learns it).
    """
    if (
        kv_events_config is None
        or getattr(kv_events_config, "enable_kv_cache_events", False) is not True
    ):
        return None
    if getattr(kv_events_config, "publisher", None) != "zmq":
        return None
    endpoint = getattr(kv_events_config, "endpoint", None)
    if not isinstance(endpoint, str) or not endpoint or len(endpoint) > MAX_TEXT_CHARS:
        return None
    if endpoint.startswith("tcp://") and endpoint.rpartition(":")[2] == "0":
        return None
    return offset_endpoint_port(endpoint, _int_or_none(engine_index) or 0)


class KvscopeStatLogger(StatLoggerBase):
    """Per-engine stat logger: copies a few numbers per step into the exporter's buffer."""

    def __init__(
        self,
        vllm_config: Any,
        engine_index: int = 0,
        *,
        settings: Settings | None = None,
        exporter: Exporter | None = None,
        clock: Callable[[], float] | None = None,
        simulated: bool = False,
    ) -> None:
        """vLLM passes ``vllm_config`` and ``engine_index`` only. The keyword arguments
        are for the engine twin (:mod:`kvscope.twin`), which drives vLLM's scheduler on
        a simulated clock: its ``settings`` (instead of the environment), its own
        ``exporter`` (ticked by the twin, not by a thread), the ``clock`` that stamps
        rows (default :func:`time.time`) and ``simulated`` for the hello."""
        self.vllm_config = vllm_config
        self.engine_index = engine_index
        self.clock: Callable[[], float] = clock or _time
        self.simulated = simulated
        self.started_unix_s = self.clock()
        self.engine_id: str | None = None
        self.settings: Settings | None = None
        self._buf: EngineBuffer | None = None
        self._exporter: Exporter | None = None
        self._hello: dict[str, Any] = {}
        self._calls = 0
        self._errors = 0  # errors while no buffer exists
        try:
            settings = settings or load_settings()
            if not settings.enabled:
                ONCE.log(logging.INFO, "plugin:inert", INERT_MESSAGE)
                return
            self.settings = settings
            self.engine_id = self._make_engine_id(settings)
            self._attach(exporter or get_exporter(settings))
        except Exception:
            self._buf = None
            self._on_error("init")

    # -- identity and configuration -------------------------------------------------

    def _make_engine_id(self, settings: Settings) -> str:
        par = getattr(self.vllm_config, "parallel_config", None)
        dp = _int_or_none(getattr(par, "data_parallel_size", 1)) or 1
        engine_id = settings.engine_id(self.engine_index, multi_engine=dp > 1)
        # With --api-server-count > 1 every API server process loads this plugin for
        # the same engines. vLLM hands each step's scheduler stats to one of them and
        # each request's tokens to the one serving it, so each process sees a part of
        # the engine: all of them send under the engine's id, each its own boot (one
        # stream per process), and the collector merges their steps into the engine's
        # 1-second windows. (Ids of their own would show one engine as several
        # replicas, each with a share of its throughput.)
        return engine_id[:MAX_ID_CHARS]

    def build_hello(self, boot_id: str) -> dict[str, Any]:
        """Return the engine hello (``schema.HELLO_FIELDS``) from the current VllmConfig."""
        cfg = self.vllm_config
        cache = getattr(cfg, "cache_config", None)
        sched = getattr(cfg, "scheduler_config", None)
        model = getattr(cfg, "model_config", None)
        par = getattr(cfg, "parallel_config", None)
        settings = self.settings or load_settings()
        prefix = getattr(cache, "enable_prefix_caching", None)
        hello = {
            "engine_id": self.engine_id or settings.engine_id(self.engine_index),
            "boot_id": boot_id,
            "host": settings.host[:MAX_LABEL_CHARS],
            "port": settings.port,
            "pid": os.getpid(),
            "engine_index": _int_or_none(self.engine_index) or 0,
            "pool": settings.pool[:MAX_LABEL_CHARS],
            "model": _model_name(model),
            "started_unix_s": self.started_unix_s,
            "vllm_version": _vllm_version(),
            "kvscope_version": __version__,
            "num_gpu_blocks": _int_or_none(getattr(cache, "num_gpu_blocks", None)),
            "block_size": _int_or_none(getattr(cache, "block_size", None)),
            "max_num_seqs": _int_or_none(getattr(sched, "max_num_seqs", None)),
            "max_num_batched_tokens": _int_or_none(getattr(sched, "max_num_batched_tokens", None)),
            "max_model_len": _int_or_none(getattr(model, "max_model_len", None)),
            "enable_prefix_caching": prefix if isinstance(prefix, bool) else None,
            "kv_cache_dtype": _text(getattr(cache, "cache_dtype", None), 64),
            "gpu_memory_utilization": _float_or_none(
                getattr(cache, "gpu_memory_utilization", None)
            ),
            "tensor_parallel_size": _int_or_none(getattr(par, "tensor_parallel_size", None)),
            "pipeline_parallel_size": _int_or_none(getattr(par, "pipeline_parallel_size", None)),
            "data_parallel_size": _int_or_none(getattr(par, "data_parallel_size", None)),
        }
        # Optional field: sent only when there is an endpoint, so that collectors older
        # than the field keep accepting the hellos of engines without KV events.
        endpoint = kv_events_endpoint(getattr(cfg, "kv_events_config", None), self.engine_index)
        if endpoint is not None:
            hello["kv_events_endpoint"] = endpoint
        if self.simulated:
            hello["simulated"] = True
        return hello

    def _attach(self, exporter: Exporter) -> None:
        assert self.engine_id is not None
        self._hello = self.build_hello(exporter.boot_id)
        self._buf = exporter.register(self.engine_id, self._hello)
        self._exporter = exporter

    # -- vLLM's StatLoggerBase interface ---------------------------------------------

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        """Append this step's numbers to the engine's buffer. O(1), no I/O, never raises."""
        buf = self._buf
        if buf is None:
            return
        try:
            ts = self.clock()
            if scheduler_stats is not None:
                self._calls = step = self._calls + 1
                buf.steps.append(step_row(ts, step, scheduler_stats, iteration_stats))
                buf.steps_produced += 1
            elif iteration_stats is not None:
                self._calls = step = self._calls + 1
                buf.steps.append(tokens_row(ts, step, iteration_stats))
                buf.steps_produced += 1
            else:
                return
            if iteration_stats is not None:
                fins = finished_requests(iteration_stats)
                if fins:
                    rows = [request_row(ts, fr) for fr in fins]
                    buf.requests.extend(rows)
                    buf.requests_produced += len(rows)
        except Exception:
            self._on_error("record")

    def log_engine_initialized(self) -> None:
        """Re-read the configuration (``num_gpu_blocks`` is known only now); resend if changed."""
        try:
            if self._buf is None or self._exporter is None:
                return
            hello = self.build_hello(self._exporter.boot_id)
            if hello != self._hello:
                self._hello = hello
                self._buf.set_hello(hello)
        except Exception:
            self._on_error("log_engine_initialized")

    def log(self) -> None:
        """Called periodically by vLLM: re-attach to a new exporter after a fork."""
        try:
            if self._buf is None or self.settings is None:
                return
            if current_exporter() is not self._exporter:
                self._attach(get_exporter(self.settings))
        except Exception:
            self._on_error("log")

    def record_sleep_state(self, is_awake: int = 0, level: int = 0) -> None:
        """Sleep mode is not exported (the steps simply stop)."""

    # -- errors ------------------------------------------------------------------------

    @property
    def record_errors(self) -> int:
        """Exceptions caught in this logger's entry points."""
        buf = self._buf
        return self._errors + (buf.record_errors if buf is not None else 0)

    def _on_error(self, where: str) -> None:
        try:
            buf = self._buf
            if buf is not None:
                buf.record_errors += 1
            else:
                self._errors += 1
            ERRORS.warning(
                f"plugin:{where}",
                "kvscope: %s() failed; counted and ignored (vLLM is not affected)",
                where,
                exc_info=True,
            )
        except Exception:  # even logging must not raise into vLLM
            pass

"""Where the advisor reads its frames from.

A :class:`Source` answers four questions with DataFrames whose columns follow the kvscope
store: ``engines()``, ``windows(...)`` (1-second windows), ``requests(...)`` (finished
requests) and ``kv_events(...)`` (KV-cache events per engine and second; empty when not
configured). Times are unix seconds, half-open ``since <= t < until``; ``None`` leaves a side
open.

* :class:`CollectorSource` reads a kvscope collector over HTTP (``urllib``, columnar answers,
  paging when truncated; an older collector without ``/v1/kv_events`` gives an empty frame).
* :class:`FrameSource` serves DataFrames held in memory (tests, notebooks, files).

A source may also offer ``window_sample(...)``, returning a :class:`WindowSample` of whole
time blocks with the true counts, for fleets whose week of windows does not fit in memory.
This module is the only place that knows the read API's URLs.

See docs/architecture.md#the-folders.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import pandas as pd

from kvscope.advisor.request_tier import tier_step_s, with_tier


class SourceError(RuntimeError):
    """A source could not deliver (collector unreachable, bad answer).

    ``url`` is the base URL that failed, ``path`` the endpoint asked, ``status`` the
    HTTP status when the server answered (``None`` when it could not be reached),
    ``reason`` the short cause (the server's error text, or the connection error) and
    ``kind`` what went wrong when it is known: ``not_collector`` (something answered, but
    not with the collector's read API), ``tls_mismatch`` (``https://`` to a server that
    speaks plain HTTP), ``tls_verify`` (its certificate is not trusted), ``closed``
    (the server closed the connection without an answer: an HTTPS server reached with
    ``http://`` does that), else empty.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        path: str | None = None,
        status: int | None = None,
        reason: str = "",
        kind: str = "",
    ) -> None:
        super().__init__(message)
        self.url = url
        self.path = path
        self.status = status
        self.reason = reason
        self.kind = kind


_PLAIN_HTTP_TLS_REASONS = frozenset(
    {
        "WRONG_VERSION_NUMBER",
        "RECORD_LAYER_FAILURE",
        "PACKET_LENGTH_TOO_LONG",
        "HTTP_REQUEST",
        "UNKNOWN_PROTOCOL",
    }
)
"""OpenSSL's reasons for a TLS handshake answered in plain HTTP (they vary by version)."""


def connection_kind(exc: BaseException) -> str:
    """:class:`SourceError` ``kind`` of a failed connection (``tls_mismatch``,
    ``tls_verify``, ``closed``), else empty."""
    cause = getattr(exc, "reason", None)
    cause = cause if isinstance(cause, BaseException) else exc
    if isinstance(cause, ssl.SSLCertVerificationError):
        return "tls_verify"
    if isinstance(cause, ssl.SSLError):
        return "tls_mismatch" if cause.reason in _PLAIN_HTTP_TLS_REASONS else ""
    if isinstance(cause, (http.client.RemoteDisconnected, http.client.BadStatusLine)):
        return "closed"
    return ""


def not_collector_reason(body: bytes, content_type: str = "") -> str:
    """What answered instead of the collector's read API, for a person: the dashboard
    (Streamlit's page), another HTML page, JSON of another shape, something else."""
    head = body[:4096].decode(errors="replace").lstrip()
    if head.startswith("<") or "html" in content_type.lower():
        if "streamlit" in head.lower():
            return "an HTML page: looks like the kvscope dashboard, which reads a collector"
        return "an HTML page"
    try:
        json.loads(body)
    except ValueError:
        return f"not JSON: {head[:60]!r}"
    return "JSON, but not the collector's rows"


@dataclass
class WindowSample:
    """Windows, finished requests and KV-event windows of whole time blocks, and per
    engine the true ``counts`` of the range (engine_id, n_windows, first_ts_s,
    last_ts_s, n_requests, keep_ratio: the share of the engine's time kept, 1.0 when
    every window was read)."""

    windows: pd.DataFrame
    requests: pd.DataFrame
    kv_events: pd.DataFrame
    counts: pd.DataFrame

    @property
    def complete(self) -> bool:
        """True when every window and request of the range was read."""
        return not len(self.counts) or float(self.counts["keep_ratio"].min()) >= 1.0

    def coverage(self, engine_ids: set[str]) -> dict[str, Any]:
        """The report's coverage counts over ``engine_ids`` from the true counts, and
        ``window_sample_share``: the share of their windows the analyses read."""
        c = self.counts[self.counts["engine_id"].isin(engine_ids)]
        if not len(c):
            return {}
        n = float(c["n_windows"].sum())
        read = float((c["n_windows"] * c["keep_ratio"]).sum())
        first, last = float(c["first_ts_s"].min()), float(c["last_ts_s"].max())
        return {
            "n_windows": int(n),
            "n_requests": int(c["n_requests"].sum()),
            "first_window_s": first if math.isfinite(first) else None,
            "last_window_s": last if math.isfinite(last) else None,
            "window_sample_share": round(read / n, 4) if n else 1.0,
        }


@runtime_checkable
class Source(Protocol):
    """The advisor's view of a telemetry store."""

    def engines(self) -> pd.DataFrame: ...

    def windows(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame: ...

    def requests(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame: ...

    def kv_events(
        self, since: float | None = None, until: float | None = None, pool: str | None = None
    ) -> pd.DataFrame: ...


def _in_range(
    df: pd.DataFrame,
    col: str,
    since: float | None,
    until: float | None,
    engine: str | None,
    pool: str | None,
    pools: pd.DataFrame,
) -> pd.DataFrame:
    out = df
    if engine is not None and "engine_id" in out:
        out = out[out["engine_id"] == engine]
    if pool is not None and "engine_id" in out:
        ids = set(pools.loc[pools["pool"] == pool, "engine_id"]) if "pool" in pools else set()
        out = out[out["engine_id"].isin(ids)]
    if col in out:
        if since is not None:
            out = out[out[col] >= since]
        if until is not None:
            out = out[out[col] < until]
    return out.reset_index(drop=True)


class FrameSource:
    """A source over in-memory DataFrames (same columns as the collector's read API)."""

    def __init__(
        self,
        engines: pd.DataFrame,
        windows: pd.DataFrame,
        requests: pd.DataFrame | None = None,
        kv_events: pd.DataFrame | None = None,
    ) -> None:
        self._engines = engines.reset_index(drop=True)
        self._windows = windows.reset_index(drop=True)
        self._requests = (requests if requests is not None else pd.DataFrame()).reset_index(
            drop=True
        )
        self._kv_events = (kv_events if kv_events is not None else pd.DataFrame()).reset_index(
            drop=True
        )

    def engines(self) -> pd.DataFrame:
        return self._engines.copy()

    def windows(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame:
        return _in_range(self._windows, "ts_s", since, until, engine, pool, self._engines)

    def requests(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame:
        return _in_range(
            self._requests, "finished_unix_s", since, until, engine, pool, self._engines
        )

    def kv_events(
        self, since: float | None = None, until: float | None = None, pool: str | None = None
    ) -> pd.DataFrame:
        return _in_range(self._kv_events, "ts_s", since, until, None, pool, self._engines)


def _error_text(body: str) -> str:
    """The ``error`` field of a JSON error answer, else the start of the body."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        err = None
    return str(err) if err else body.strip()[:300]


class CollectorSource:
    """A source reading a kvscope collector's query API over HTTP.

    ``url`` is the collector's base URL; ``token`` its bearer token when one is
    configured; ``timeout_s`` bounds each HTTP request; ``page_rows`` is the row limit
    asked per request (the collector may cap it lower: truncated answers are paged);
    ``ca_file`` a PEM bundle of CAs to verify an ``https://`` collector with (default
    ``$KVSCOPE_CA_FILE``, else the system's CAs).
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = 30.0,
        page_rows: int = 200_000,
        ca_file: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.ca_file = ca_file or os.environ.get("KVSCOPE_CA_FILE") or None
        self._ssl: ssl.SSLContext | None = None
        self.timeout_s = timeout_s
        self.page_rows = page_rows

    def _get(self, path: str, params: dict[str, Any]) -> dict[str, Any]:
        q = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        req = urllib.request.Request(f"{self.url}{path}?{q}" if q else f"{self.url}{path}")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            if self._ssl is None and self.url.startswith("https:"):
                self._ssl = ssl.create_default_context(cafile=self.ca_file)
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ssl) as resp:
                body, status = resp.read(), int(resp.status)
                content_type = resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            raw = e.read()
            detail = _error_text(raw.decode(errors="replace"))
            html = raw.lstrip()[:1] == b"<"  # the collector's errors are JSON
            raise SourceError(
                f"{path}: collector answered {e.code}: {detail}",
                url=self.url,
                path=path,
                status=e.code,
                reason=not_collector_reason(raw) if html else detail,
                kind="not_collector" if html else "",
            ) from e
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = str(getattr(e, "reason", None) or e)
            raise SourceError(
                f"{path}: cannot read the collector at {self.url}: {reason}",
                url=self.url,
                path=path,
                reason=reason,
                kind=connection_kind(e),
            ) from e
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or not ("rows" in answer or "columns" in answer):
            what = not_collector_reason(body, content_type)
            raise SourceError(
                f"{path}: {self.url} answered, but not as a kvscope collector ({what})",
                url=self.url,
                path=path,
                status=status,
                reason=what,
                kind="not_collector",
            )
        return answer

    def steps(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
        every: int = 1,
    ) -> pd.DataFrame:
        """Raw engine steps (``/v1/steps``; kept for the collector's raw retention, a day
        by default), with ``iteration_s`` where vLLM reports it; ``every`` > 1: every
        ``every``-th step only, sampled by the collector."""
        extra = {"every": every} if every > 1 else {}
        return self._ranged("/v1/steps", "ts_unix_s", since, until, engine, pool, **extra)

    @staticmethod
    def _frame(answer: dict[str, Any]) -> pd.DataFrame:
        if "columns" in answer:
            return pd.DataFrame(answer["columns"])
        return pd.DataFrame(answer.get("rows", []))

    def _ranged(
        self,
        path: str,
        ts_col: str,
        since: float | None,
        until: float | None,
        engine: str | None,
        pool: str | None,
        **extra: Any,
    ) -> pd.DataFrame:
        return self._paged(
            path,
            ts_col,
            {
                "since": 0 if since is None else since,
                "until": until,
                "engine": engine,
                "pool": pool,
                "format": "columns",
                "limit": self.page_rows,
                **extra,
            },
        )

    def _paged(self, path: str, ts_col: str, params: dict[str, Any]) -> pd.DataFrame:
        parts: list[pd.DataFrame] = []
        while True:
            answer = self._get(path, params)
            df = self._frame(answer)
            parts.append(df)
            if not answer.get("truncated") or df.empty:
                break
            # Rows come oldest first: continue after the last timestamp, dropping the
            # rows of that timestamp from this page so none is counted twice.
            last = float(df[ts_col].iloc[-1])
            parts[-1] = df[df[ts_col] < last]
            if parts[-1].empty:
                raise SourceError(
                    f"{path}: more than {self.page_rows} rows share one timestamp; raise page_rows"
                )
            params["since"] = last
        frames = [p for p in parts if not p.empty]
        return pd.concat(frames, ignore_index=True) if frames else parts[0]

    def engines(self) -> pd.DataFrame:
        return self._frame(self._get("/v1/engines", {"format": "columns"}))

    def windows(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame:
        return self._ranged("/v1/windows", "ts_s", since, until, engine, pool)

    def minute_windows(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame:
        """The collector's downsampled tier (``/v1/windows_1m``): per engine and minute."""
        return self._ranged("/v1/windows_1m", "ts_s", since, until, engine, pool)

    def requests(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
    ) -> pd.DataFrame:
        """The finished requests of ``[since, until)``: one row each while the collector
        keeps them, and, for the part of the range its request retention deleted, rows
        standing for them from its request tier (``estimated``, see
        :mod:`kvscope.advisor.request_tier`)."""
        raw = self._ranged("/v1/requests", "finished_unix_s", since, until, engine, pool)
        tier = self.request_minutes(
            since, until, engine, pool, step_s=tier_step_s(since, until), deleted_only=True
        )
        return with_tier(raw, tier)

    def seconds_aged_out(self, since: float | None, until: float | None) -> float | None:
        """Where the collector's 1-second windows start, when ``[since, until)`` holds none
        of them but 1-minute windows: the engines ran then and the window retention has
        deleted their seconds. None otherwise (nothing ran then, or no tier)."""
        try:
            minutes = self._get(
                "/v1/windows_1m",
                {
                    "since": 0 if since is None else since,
                    "until": until,
                    "limit": 1,
                    "fields": "ts_s",
                },
            )
        except SourceError as exc:
            if exc.status == 404:  # a collector from before the tier
                return None
            raise
        if not minutes.get("rows"):
            return None
        answer = self._get("/v1/windows", {"since": 0, "limit": 1, "fields": "ts_s"})
        rows = answer.get("rows") or []
        return float(rows[0]["ts_s"]) if rows else None

    def request_minutes(
        self,
        since: float | None = None,
        until: float | None = None,
        engine: str | None = None,
        pool: str | None = None,
        *,
        step_s: int = 60,
        deleted_only: bool = False,
    ) -> pd.DataFrame:
        """``GET /v1/requests_1m``: the collector's request tier summed per engine over
        ``step_s``; with ``deleted_only`` only where the request rows were deleted. Empty
        from a collector without it (404)."""
        try:
            return self._ranged(
                "/v1/requests_1m",
                "ts_s",
                since,
                until,
                engine,
                pool,
                step=int(step_s),
                deleted_only="true" if deleted_only else "false",
            )
        except SourceError as exc:
            if exc.status == 404:
                return pd.DataFrame()
            raise

    def kv_events(
        self, since: float | None = None, until: float | None = None, pool: str | None = None
    ) -> pd.DataFrame:
        """``GET /v1/kv_events``; empty when the collector predates it (404)."""
        try:
            return self._paged(
                "/v1/kv_events",
                "ts_s",
                {"since": 0 if since is None else since, "until": until, "pool": pool},
            )
        except SourceError as e:
            if e.status == 404:
                return pd.DataFrame()
            raise

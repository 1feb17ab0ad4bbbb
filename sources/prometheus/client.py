"""A minimal client of the Prometheus HTTP API (``/api/v1/...``), standard library only.

Works against Prometheus and the Prometheus-compatible query APIs (VictoriaMetrics,
Thanos, Mimir), with the credentials and TLS options of a
:class:`~kvscope.sources.prometheus.auth.PromAuth`. Errors become :class:`~kvscope.advisor.sources.SourceError` carrying the
server's own message (Prometheus answers ``{"status": "error", "errorType": ...,
"error": ...}`` with a 4xx/5xx status).
"""

from __future__ import annotations

import json
import math
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kvscope.advisor.sources import SourceError, connection_kind
from kvscope.sources.prometheus.auth import PromAuth

__all__ = ["MAX_POINTS", "PromClient", "Series"]

MAX_POINTS = 10_000
"""Points per series asked in one range query (Prometheus refuses more than 11,000)."""

Series = tuple[dict[str, str], list[tuple[float, float]]]


def _error_text(body: str) -> str:
    try:
        doc = json.loads(body)
    except ValueError:
        return body.strip()[:300]
    if isinstance(doc, dict) and doc.get("error"):
        kind = doc.get("errorType")
        return f"{kind}: {doc['error']}" if kind else str(doc["error"])
    return body.strip()[:300]


def _auth_hint(kind: str, code: int) -> str:
    """What to check after a 401/403, by what was sent (never the secret itself)."""
    if kind == "none":
        return (
            "the server wants credentials: give --prometheus-bearer-token-file, or "
            "--prometheus-user with --prometheus-password-file"
        )
    sent = {
        "bearer": "the bearer token",
        "basic": "the basic-auth user and password",
        "headers": "the extra headers",
    }[kind]
    return f"{sent} sent {'were' if kind != 'bearer' else 'was'} " + (
        "refused" if code == 401 else "not allowed to read this"
    )


def _float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


class PromClient:
    """Reads one Prometheus-compatible server (``url`` is its base URL, no ``/api``).

    ``auth`` authenticates every request and sets the TLS options; ``headers`` are
    added to them. Header values never appear in an error, and ``Authorization`` is
    not sent on after a redirect (urllib would send it to wherever the redirect points).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        headers: dict[str, str] | None = None,
        auth: PromAuth | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.auth = auth or PromAuth()
        self.headers = {**self.auth.request_headers(), **(headers or {})}
        self._ssl = self.auth.ssl_context()
        self.requests_made = 0

    def _call(self, path: str, params: list[tuple[str, str]], *, post: bool) -> Any:
        body = urllib.parse.urlencode(params)
        if post:
            req = urllib.request.Request(f"{self.url}{path}", data=body.encode(), method="POST")
            req.add_header("Content-Type", "application/x-www-form-urlencoded")
        else:
            req = urllib.request.Request(
                f"{self.url}{path}?{body}" if body else f"{self.url}{path}"
            )
        for k, v in self.headers.items():
            if k.lower() == "authorization":  # never follows a redirect to another server
                req.add_unredirected_header(k, v)
            else:
                req.add_header(k, v)
        self.requests_made += 1
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ssl) as resp:
                raw = resp.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            detail = _error_text(e.read().decode(errors="replace"))
            if e.code == 404:
                detail += f" (is {self.url} a Prometheus base URL, without a path?)"
            elif e.code in (401, 403):
                detail += f" ({_auth_hint(self.auth.kind, e.code)})"
            raise SourceError(
                f"Prometheus at {self.url} answered {e.code} on {path}: {detail}",
                url=self.url,
                path=path,
                status=e.code,
                reason=detail,
            ) from e
        except (urllib.error.URLError, OSError, ValueError) as e:
            cause = getattr(e, "reason", None) or e
            reason = str(cause)
            if connection_kind(e) == "tls_mismatch":
                reason += (
                    f" (https:// on a plain-HTTP server: use http://{self.url.split('://', 1)[-1]})"
                )
            elif isinstance(cause, ssl.SSLError):
                reason += (
                    " (trust its certificate with --prometheus-ca-file, or skip the "
                    "check with --prometheus-insecure-skip-verify)"
                )
            raise SourceError(
                f"cannot reach Prometheus at {self.url}: {reason}",
                url=self.url,
                path=path,
                reason=reason,
            ) from e
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise SourceError(
                f"{self.url}{path} did not answer JSON (is {self.url} a "
                f"Prometheus base URL?): {raw.strip()[:120]!r}",
                url=self.url,
                path=path,
                status=200,
                reason="not JSON",
            ) from e
        if not isinstance(doc, dict) or doc.get("status") != "success":
            detail = _error_text(raw)
            raise SourceError(
                f"Prometheus at {self.url} refused {path}: {detail}",
                url=self.url,
                path=path,
                status=200,
                reason=detail,
            )
        return doc.get("data")

    def query(self, expr: str, time_s: float) -> list[tuple[dict[str, str], float]]:
        """An instant vector query: (labels, value) per series."""
        data = self._call("/api/v1/query", [("query", expr), ("time", f"{time_s:.3f}")], post=True)
        if data.get("resultType") != "vector":
            raise SourceError(
                f"query {expr!r}: expected a vector, got {data.get('resultType')}",
                url=self.url,
                path="/api/v1/query",
            )
        return [(dict(r["metric"]), _float(r["value"][1])) for r in data.get("result", [])]

    def raw_samples(self, expr: str, time_s: float) -> list[Series]:
        """An instant query of a range selector (``x[10m]``): the raw samples per series."""
        data = self._call("/api/v1/query", [("query", expr), ("time", f"{time_s:.3f}")], post=True)
        if data.get("resultType") != "matrix":
            return []
        return [
            (dict(r["metric"]), [(float(t), _float(v)) for t, v in r.get("values", [])])
            for r in data.get("result", [])
        ]

    def query_range(self, expr: str, start_s: float, end_s: float, step_s: float) -> list[Series]:
        """A range query, split into pieces of at most :data:`MAX_POINTS` points."""
        merged: dict[tuple[tuple[str, str], ...], Series] = {}
        t0 = start_s
        while t0 <= end_s:
            t1 = min(end_s, t0 + step_s * (MAX_POINTS - 1))
            data = self._call(
                "/api/v1/query_range",
                [
                    ("query", expr),
                    ("start", f"{t0:.3f}"),
                    ("end", f"{t1:.3f}"),
                    ("step", f"{step_s:g}"),
                ],
                post=True,
            )
            for r in data.get("result", []):
                labels = dict(r["metric"])
                key = tuple(sorted(labels.items()))
                pts = [(float(t), _float(v)) for t, v in r.get("values", [])]
                if key in merged:
                    merged[key][1].extend(pts)
                else:
                    merged[key] = (labels, pts)
            t0 = t1 + step_s
        return list(merged.values())

    def series(self, match: str, start_s: float, end_s: float) -> list[dict[str, str]]:
        """Label sets of the series matching ``match`` over the range."""
        data = self._call(
            "/api/v1/series",
            [("match[]", match), ("start", f"{start_s:.3f}"), ("end", f"{end_s:.3f}")],
            post=True,
        )
        return [dict(d) for d in data or []]

    def metadata(self) -> dict[str, str]:
        """Family name -> type (``counter``, ``gauge``, ``histogram``...) of scraped metrics."""
        data = self._call("/api/v1/metadata", [], post=False) or {}
        return {
            fam: str(entries[0].get("type", ""))
            for fam, entries in data.items()
            if isinstance(entries, list) and entries
        }

    def label_values(self, label: str, match: str, start_s: float, end_s: float) -> list[str]:
        """Values of ``label`` on the series matching ``match`` over the range."""
        path = f"/api/v1/label/{urllib.parse.quote(label, safe='')}/values"
        data = self._call(
            path,
            [("match[]", match), ("start", f"{start_s:.3f}"), ("end", f"{end_s:.3f}")],
            post=False,
        )
        return [str(v) for v in data or []]

"""The latency block of an engine or pool in words and table rows, shared by ``kvscope
advise``, the weekly report and the dashboard so that a number reads the same in each.

Presents a :class:`~kvscope.advisor.request_latency.RequestLatency` only; nothing is
derived beyond picking and formatting.
"""

from __future__ import annotations

from kvscope.advisor.request_latency import Quantiles, RequestLatency

__all__ = [
    "MEASURE_LABELS",
    "SLO_LABELS",
    "latency_rows",
    "latency_text",
    "ms_or_s",
    "p50_p90_p99",
    "slo_rows",
    "slo_text",
]

MEASURE_LABELS = {
    "ttft_s": "TTFT",
    "itl_s": "ITL",
    "e2e_s": "e2e",
    "queue_s": "queue",
    "prefill_s": "prefill",
    "decode_s": "decode",
    "prompt_tokens": "prompt tokens",
    "generation_tokens": "output tokens",
}
SLO_LABELS = {"ttft": "TTFT", "itl": "ITL", "e2e": "e2e", "all": "every target"}


def ms_or_s(v: float | None) -> str:
    """``0.85 s``; under a second in milliseconds (``42 ms``, ``3.1 ms``)."""
    if v is None:
        return "–"
    if abs(v) >= 1.0:
        return f"{v:,.2f} s"
    ms = v * 1e3
    return f"{ms:.1f} ms" if abs(ms) < 10 else f"{ms:,.0f} ms"


def _tokens(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f}"


def p50_p90_p99(q: Quantiles, unit: str = "s") -> str:
    """``120 ms / 300 ms / 800 ms`` (``unit`` ``s``) or ``512 / 2,048 / 4,000`` (tokens);
    a dash without values."""
    if not q.n:
        return "–"
    fmt = ms_or_s if unit == "s" else _tokens
    return f"{fmt(q.p50)} / {fmt(q.p90)} / {fmt(q.p99)}"


def latency_text(lat: RequestLatency) -> str:
    """``TTFT P50/P90/P99 120 ms / 300 ms / 800 ms; ITL ...; e2e ... (1,234 requests)``."""
    parts = [
        f"{MEASURE_LABELS[m]} {p50_p90_p99(lat.quantiles(m))}"
        for m in ("ttft_s", "itl_s", "e2e_s")
        if lat.quantiles(m).n
    ]
    est = ", estimated from histograms" if lat.weighted else ""
    return (
        f"P50 / P90 / P99: {'; '.join(parts) or 'no latencies reported'} "
        f"({lat.n_requests:,} requests{est})"
    )


def _share(a_share: float | None) -> str:
    return "–" if a_share is None else f"{a_share:.1%}"


def slo_text(lat: RequestLatency) -> str:
    """``TTFT <= 500 ms: 97.0% (970 of 1,000); ...; every target: 95.2%``; empty without
    targets."""
    parts = []
    for key, a in lat.slo.items():
        target = f" <= {ms_or_s(a.target_s)}" if a.target_s is not None else ""
        parts.append(
            f"{SLO_LABELS.get(key, key)}{target}: {_share(a.share)} ({a.n_met:,} of {a.n:,})"
        )
    return "; ".join(parts)


def latency_rows(lat: RequestLatency | None) -> list[tuple[str, str, str, str, str, str]]:
    """(measure, n, P50, P90, P99, mean) per measure with values."""
    if lat is None:
        return []
    out = []
    for m, label in MEASURE_LABELS.items():
        q = lat.quantiles(m)
        if not q.n:
            continue
        fmt = ms_or_s if m.endswith("_s") else _tokens
        out.append((label, f"{q.n:,}", fmt(q.p50), fmt(q.p90), fmt(q.p99), fmt(q.mean)))
    return out


def slo_rows(lat: RequestLatency | None) -> list[tuple[str, str, str, str]]:
    """(target, met, of, share) per target given, then every target together."""
    if lat is None:
        return []
    out = []
    for key, a in lat.slo.items():
        target = (
            f"{SLO_LABELS.get(key, key)} <= {ms_or_s(a.target_s)}"
            if a.target_s is not None
            else SLO_LABELS["all"]
        )
        out.append((target, f"{a.n_met:,}", f"{a.n:,}", _share(a.share)))
    return out

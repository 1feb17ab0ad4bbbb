"""The weekly report's latency and SLO table per pool, shared by HTML and Markdown: the
pool's latency block (this week and the week before) and each engine's, read from the
:class:`~kvscope.report.model.WeeklyReport`. Nothing is derived beyond picking and
formatting."""

from __future__ import annotations

from kvscope.advisor.findings import Report
from kvscope.advisor.render_latency import SLO_LABELS, ms_or_s, p50_p90_p99
from kvscope.advisor.request_latency import RequestLatency
from kvscope.report._view import engines_of, pool_verdict, verdict
from kvscope.report.model import WeeklyReport

TITLE = "Latency and SLOs"
NOTE = (
    "P50 / P90 / P99 of the finished requests, as vLLM measures them (from the API "
    "server's receipt). ITL is decode time / (output tokens − 1), over requests with 2 "
    "output tokens or more. SLO columns: the share of requests at or under the target "
    "(--slo-ttft, --slo-itl, --slo-e2e); every target: the share meeting all of them."
)


def _targets(wr: WeeklyReport) -> list[str]:
    """The SLO keys given to this week's analysis, in the order ttft, itl, e2e, all."""
    p = wr.current.parameters
    keys = [k for k in ("ttft", "itl", "e2e") if p.get(f"slo_{k}_s") is not None]
    return [*keys, "all"] if keys else []


def head(wr: WeeklyReport) -> list[str]:
    params = wr.current.parameters
    slo = [
        f"{SLO_LABELS[k]} <= {ms_or_s(params[f'slo_{k}_s'])}" if k != "all" else "every target"
        for k in _targets(wr)
    ]
    return ["", "requests", "TTFT", "ITL", "e2e", "queue P99", *slo, "finish reasons"]


def _reasons(lat: RequestLatency) -> str:
    total = sum(lat.finish_reasons.values())
    if not total:
        return "–"
    return ", ".join(f"{k} {n / total:.0%}" for k, n in lat.finish_reasons.items())


def _row(wr: WeeklyReport, label: str, lat: RequestLatency | None) -> list[str]:
    keys = _targets(wr)
    if lat is None:
        return [label, "0", "–", "–", "–", "–", *("–" for _ in keys), "–"]
    slo = []
    for k in keys:
        a = lat.slo.get(k)
        slo.append("–" if a is None or a.share is None else f"{a.share:.1%}")
    return [
        label,
        f"{lat.n_requests:,}",
        p50_p90_p99(lat.ttft_s),
        p50_p90_p99(lat.itl_s),
        p50_p90_p99(lat.e2e_s),
        ms_or_s(lat.queue_s.p99) if lat.queue_s.n else "–",
        *slo,
        _reasons(lat),
    ]


def _pool_latency(report: Report, pool: str | None) -> RequestLatency | None:
    pv = pool_verdict(report.pools, pool)
    return pv.latency if pv is not None else None


def rows(wr: WeeklyReport, pool: str | None) -> list[list[str]]:
    """The pool this week, the pool the week before, then each engine this week; empty
    when no request finished in the pool in either week."""
    now, before = _pool_latency(wr.current, pool), _pool_latency(wr.previous, pool)
    if now is None and before is None:
        return []
    out = [_row(wr, "pool, this week", now), _row(wr, "pool, the week before", before)]
    for eid in engines_of(wr, pool):
        v = verdict(wr.current.engines, eid)
        if v is not None and v.latency is not None:
            out.append(_row(wr, eid, v.latency))
    return out

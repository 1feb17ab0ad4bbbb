"""The terminal rendering of a :class:`~kvscope.advisor.findings.Report` (``kvscope advise``).

Order: the verdict first (per pool, then per engine: bottleneck, knee, plateau,
saturated or headroom, the recommended cap with its predicted share of peak and
P99, the trade-off sentence, and the evidence behind the bottleneck) and what was
read; a text plot of throughput against load per engine with the knee and the cap
marked; per pool, the prefix cache and routing (hit rates per replica, reuse
available / captured by routing / delivered, TTFT with and without cached tokens,
load balance, the routing recommendation); the ranked recommendations (expected
effect, trade-off, evidence, the change to copy); the findings table.

It only presents the report: every number comes from a verdict, finding or
recommendation. Messages for the two ways ``advise`` can come back empty (the
collector could not be read; no data in the window) are here too, so the CLI stays
a thin layer. Needs ``rich``.
"""

from __future__ import annotations

import math
import time
from datetime import datetime, timezone
from typing import Any

from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvscope.advisor.findings import EngineVerdict, Finding, PoolVerdict, Recommendation, Report
from kvscope.advisor.gateways import gateway_rows
from kvscope.advisor.render_latency import latency_text, slo_text
from kvscope.advisor.sources import SourceError
from kvscope.advisor.textplot import throughput_plot

__all__ = ["no_data_message", "render_report", "source_error_message", "window_text"]

MAX_PLOTS = 4
"""Engines plotted at most (the JSON report carries every engine's frame)."""

EFFECT_LABELS = {
    "throughput_fraction": "throughput",
    "p99_e2e_s": "e2e P99",
    "p99_e2e_s_uncapped": "e2e P99 uncapped",
    "p99_ttft_s": "TTFT P99",
    "p99_ttft_s_uncapped": "TTFT P99 uncapped",
    "plateau_tokens_per_s": "plateau",
    "gain_ratio": "gain",
    "kv_batch": "KV room (sequences)",
    "effective_batch": "batch",
    "step_ms": "step",
    "tokens_per_step_now": "tokens/step now",
    "hit_rate": "hit rate now",
    "predicted_hit_rate": "predicted hit rate",
    "predicted_hit_rate_max": "at most",
    "mean_ttft_change_s": "mean TTFT change",
    "mean_ttft_s": "mean TTFT now",
    "tokens_saved_per_request": "prompt tokens saved per request",
    "busiest_load": "busiest replica in flight",
    "balanced_load": "balanced in flight",
    "busiest_latency_reduction_ratio": "busiest replica's latency reduced by",
}
_CHANGE_LABELS = {
    "router_policy": "router policy",
    "production_stack": "production-stack",
    "llm_d": "llm-d",
    "load_bound": "load bound",
    "router_options": "routers",
}
_POOL_ROUTING_KINDS = ("prefix_aware_routing", "least_loaded_routing")


# -- small formatters ------------------------------------------------------------------


def _num(v: Any, spec: str = ",.1f") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "?"
    return format(v, spec)


def _tok(v: float | None) -> str:
    return f"{_num(v, ',.0f')} tok/s"


def _sec(v: float | None) -> str:
    return f"{_num(v, '.2f')} s"


def _pct(v: float | None) -> str:
    return "?" if v is None or not math.isfinite(v) else f"{v:.0%}"


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _value(key: str, v: Any) -> str:
    """One evidence or effect value, its unit taken from the key's suffix."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if key.endswith("tokens_per_s"):
            return _tok(float(v))
        if key.endswith("_ms"):
            return f"{v:.1f} ms"
        if key.endswith("change_s"):
            return f"{v * 1e3:+,.0f} ms"
        if key.endswith("_s") or "_s_" in key:
            return _sec(float(v))
        if key.endswith(
            (
                "_ratio",
                "fraction",
                "_share",
                "hit_rate",
                "hit_rate_max",
                "_loss",
                "available",
                "captured",
            )
        ):
            return _pct(float(v))
        if key.endswith("_r2"):
            return _num(v, ".2f")
        return _num(v, ",.0f") if float(v).is_integer() else _num(v, ",.1f")
    return "-" if v is None else str(v)


def _ago(seconds: float) -> str:
    """A ``--since`` duration that reaches ``seconds`` back, rounded up with margin."""
    s = max(60.0, seconds * 1.1)
    if s <= 120 * 60.0:
        return f"{math.ceil(s / 60.0)}m"
    if s <= 48 * 3600.0:
        return f"{math.ceil(s / 3600.0)}h"
    return f"{math.ceil(s / 86400.0)}d"


# -- the verdict -----------------------------------------------------------------------


def _pool_line(pv: PoolVerdict) -> Text:
    n = len(pv.engine_ids)
    kinds = ", ".join(
        k if n == 1 else f"{k} x{count}"
        for k, count in sorted(pv.bottlenecks.items(), key=lambda kv: -kv[1])
    )
    t = Text()
    t.append(f"pool {pv.pool}" if pv.pool is not None else "engines without a pool", style="bold")
    t.append(f": {kinds}", style="bold")
    t.append(f" ({n} engine{'s' if n != 1 else ''})")
    if pv.plateau_tokens_per_s is not None:
        t.append(f"; plateau {_tok(pv.plateau_tokens_per_s)}")
    if pv.recommended_concurrency_cap is not None:
        t.append(f"; recommended cap {pv.recommended_concurrency_cap} in flight", style="bold")
        if n > 1:
            t.append(" (summed over engines)")
    else:
        t.append("; no cap recommended")
    if pv.engines_without_cap and pv.recommended_concurrency_cap is not None:
        t.append(f"; {len(pv.engines_without_cap)} engine(s) without a cap")
    return t


def _ind(text: Text, n: int) -> Padding:
    """``text`` indented by ``n`` columns, wrapped lines included."""
    return Padding(text, (0, 0, 0, n), expand=False)


def _engine_block(report: Report, v: EngineVerdict) -> list[Padding]:
    head = Text()
    head.append(v.engine_id, style="bold")
    head.append(": ")
    style = {
        "kv_cache_bound": "bold red",
        "max_num_seqs_bound": "bold yellow",
        "token_budget_bound": "bold yellow",
        "compute_bound": "bold magenta",
        "frontend_bound": "bold blue",
        "unexplained": "bold cyan",
        "not_saturated": "bold green",
    }.get(v.bottleneck, "bold")
    head.append(v.bottleneck, style=style)
    if v.bottleneck == "insufficient_data":
        head.append(f" ({v.headroom})")
        return [_ind(head, 2), *(_ind(t, 4) for t in _latency_lines(v))]
    head.append(", saturated" if v.saturated else ", headroom")
    if v.preemption_thrash:
        head.append(", preemption thrash", style="bold red")
    # Saturated without a knee: a front end that limits (the engine has room).
    no_knee = "read from the engine" if v.saturated else "yet (load never went past one)"
    lines = [
        Text(
            f"knee {_num(v.knee_concurrency)} in flight; plateau "
            f"{_tok(v.plateau_tokens_per_s)} generated "
            f"({_tok(v.plateau_total_tokens_per_s)} total); confidence "
            f"{_num(v.confidence, '.2f')}"
            if v.knee_concurrency is not None
            else f"no knee {no_knee}; highest throughput "
            f"{_tok(v.plateau_tokens_per_s)} generated "
            f"({_tok(v.plateau_total_tokens_per_s)} total); confidence "
            f"{_num(v.confidence, '.2f')}"
        )
    ]
    headroom = v.headroom
    if not v.saturated and v.approaching:
        headroom += f"; approaching {v.approaching}"
    lines.append(Text(headroom, style="dim" if v.saturated else ""))
    if v.recommended_concurrency_cap is not None:
        cap = Text()
        cap.append(f"cap {v.recommended_concurrency_cap} in flight", style="bold")
        cap.append(
            f": {_pct(v.predicted_throughput_fraction_at_cap)} of peak, e2e P99 "
            f"{_sec(v.predicted_p99_e2e_s_at_cap)}"
        )
        if v.p99_e2e_s_at_max_load is not None:
            cap.append(
                f" (uncapped: {_sec(v.p99_e2e_s_at_max_load)} at "
                f"{_num(v.max_load_seen, '.0f')} in flight)"
            )
        lines.append(cap)
    rec = next(
        (
            r
            for r in report.recommendations
            if r.kind == "concurrency_cap" and r.scope.engine_id == v.engine_id
        ),
        None,
    )
    if rec is not None and rec.tradeoff:
        lines.append(Text(f"trade-off: {rec.tradeoff}"))
    why = report.findings_of("bottleneck", v.engine_id)
    if why:
        lines.append(Text(f"why: {why[0].summary}", style="dim"))
    lines.extend(_latency_lines(v))
    return [_ind(head, 2), *(_ind(t, 4) for t in lines)]


def _latency_lines(v: EngineVerdict) -> list[Text]:
    if v.latency is None:
        return []
    lines = [Text(f"latency {latency_text(v.latency)}")]
    if v.latency.slo:
        lines.append(Text(f"SLO attainment: {slo_text(v.latency)}"))
    return lines


def _verdict(report: Report) -> list[Text | Padding]:
    lines: list[Text | Padding] = []
    for pv in report.pools:
        lines.append(_pool_line(pv))
        if pv.latency is not None and len(pv.engine_ids) > 1:
            lines.append(_ind(Text(f"pool latency {latency_text(pv.latency)}"), 2))
            if pv.latency.slo:
                lines.append(_ind(Text(f"pool SLO attainment: {slo_text(pv.latency)}"), 2))
        for eid in pv.engine_ids:
            lines.extend(_engine_block(report, report.engine(eid)))
    return lines


# -- prefix cache and routing -------------------------------------------------------------


def _pool_findings(report: Report, pool: str | None, kind: str) -> list[Finding]:
    return [
        f
        for f in report.findings
        if f.kind == kind and f.scope.pool == pool and f.scope.engine_id is None
    ]


def _ttft_text(ev: dict[str, Any]) -> str | None:
    c, u = ev.get("ttft_cached") or {}, ev.get("ttft_uncached") or {}
    if not c.get("n") and not u.get("n"):
        return None

    def one(d: dict[str, Any]) -> str:
        if not d.get("n"):
            return "none"
        return f"{_num(d.get('p50_s'), '.2f')}/{_num(d.get('p90_s'), '.2f')} s (n={d['n']})"

    text = f"TTFT P50/P90 with cached tokens {one(c)}, without {one(u)}"
    if ev.get("prefill_fit_usable"):
        quality = "" if ev.get("prefill_fit_good") else ", poor fit"
        text += (
            f"; prefill {_num(ev['prefill_s_per_token'] * 1e3, '.3f')} ms per computed "
            f"prompt token (r2 {_num(ev.get('prefill_fit_r2'), '.2f')}, "
            f"n={ev.get('prefill_fit_n')}{quality})"
        )
    return text


def _prefix_block(report: Report, pv: PoolVerdict) -> list[Text | Padding]:
    cache = _pool_findings(report, pv.pool, "prefix_cache")
    if not cache:
        return []
    ev = cache[0].evidence
    head = Text()
    head.append(
        f"pool {pv.pool}" if pv.pool is not None else "engines without a pool", style="bold"
    )
    rates = ev.get("engine_hit_rates") or {}
    head.append(f": prefix-cache hit rate {_pct(pv.prefix_hit_rate)}")
    if len(rates) > 1:
        head.append(" (" + ", ".join(f"{k} {_pct(v)}" for k, v in rates.items()) + ")")
    lines: list[Text] = []
    for f in _pool_findings(report, pv.pool, "prefix_routing"):
        re_ = f.evidence
        lines.append(
            Text(
                f"reuse available {_pct(re_.get('available'))}, captured by routing "
                f"{_pct(re_.get('captured'))}, delivered {_pct(re_.get('hit_rate'))} (routing loss "
                f"{_pct(re_.get('routing_loss'))}, eviction loss {_pct(re_.get('eviction_loss'))}); "
                f"confidence {f.confidence:.2f}"
            )
        )
    for f in _pool_findings(report, pv.pool, "kv_events_missing"):
        lines.append(Text(f.summary, style="yellow" if f.severity == "warning" else ""))
    ttft = _ttft_text(ev)
    if ttft:
        lines.append(Text(ttft))
    for f in _pool_findings(report, pv.pool, "load_imbalance"):
        lines.append(Text(f.summary, style="yellow" if f.severity == "warning" else ""))
    for f in report.findings:
        if f.kind == "prefix_caching_off" and f.scope.pool == pv.pool:
            lines.append(Text(f"{f.scope.engine_id}: {f.summary}", style="yellow"))
    for i, r in enumerate(report.recommendations, start=1):
        if r.kind in _POOL_ROUTING_KINDS and r.scope.pool == pv.pool:
            t = Text("-> ", style="bold")
            t.append(r.summary, style="bold")
            t.append(f"  (recommendation {i})", style="dim")
            lines.append(t)
    return [head, *(_ind(t, 2) for t in lines)]


# -- plots, recommendations, findings ----------------------------------------------------


def _plot_lines(report: Report, v: EngineVerdict) -> tuple[str, list[str]] | None:
    """The plot of one engine: its title and its lines (None without a curve)."""
    curve = report.findings_of("throughput_curve", v.engine_id)
    if not curve or not curve[0].frame:
        return None
    f = curve[0].frame
    lines = throughput_plot(
        f.get("load", []),
        f.get("gen_tokens_per_s", []),
        f.get("gen_fit"),
        knee=v.knee_concurrency,
        cap=(
            float(v.recommended_concurrency_cap)
            if v.recommended_concurrency_cap is not None
            else None
        ),
    )
    if not lines:
        return None
    return f"{v.engine_id}: generated tok/s vs requests in flight", lines


def _plot(report: Report, v: EngineVerdict) -> Panel | None:
    plot = _plot_lines(report, v)
    if plot is None:
        return None
    title, lines = plot
    return Panel(Text("\n".join(lines)), expand=False, title=title, title_align="left")


def _change_rows(change: dict[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for key, val in change.items():
        if key == "concurrency_cap":
            continue
        if key == "vllm_flags":
            rows.append(("vLLM flags", " ".join(map(str, val))))
        elif key == "gateway" and isinstance(val, dict):
            rows.extend(gateway_rows(val))
        elif key == "per_engine_caps" and isinstance(val, dict):
            rows.append(("per engine", ", ".join(f"{k} {c}" for k, c in val.items())))
        else:
            rows.append((_CHANGE_LABELS.get(key, key), str(val)))
    return rows


def _facts(d: dict[str, Any], labels: dict[str, str] | None = None) -> str:
    parts = []
    for k, v in d.items():
        if v is None or isinstance(v, (dict, list)):
            continue
        parts.append(f"{(labels or {}).get(k, k)} {_value(k, v)}")
    return "; ".join(parts)


RECOMMENDATIONS_HEADING = "Recommendations: throughput gains, then latency cuts, each by size"
"""Gains of different kinds are not on one scale (:data:`~kvscope.advisor.findings.GAIN_KINDS`)."""


def gain_text(r: Recommendation) -> str:
    """``throughput +12%``, ``latency -61%`` (a cut), ``cost -8%``; ``not quantified``."""
    if not r.expected_gain:
        return "gain not quantified"
    if r.gain_kind == "throughput":
        return f"throughput {r.expected_gain:+.0%}"
    return f"{r.gain_kind} {-r.expected_gain:+.0%}"


def _recommendation_text(r: Recommendation) -> list[Text]:
    """A recommendation's heading (summary, scope, confidence) and its expected effect,
    trade-off and evidence; the change is :func:`_change_rows`."""
    head = Text(r.summary, style="bold")
    scope = r.scope.engine_id or (f"pool {r.scope.pool}" if r.scope.pool else "fleet")
    head.append(f"  [{scope}; {gain_text(r)}; confidence {r.confidence:.2f}; {r.id}]", style="dim")
    parts = [head]
    effect = _facts(r.expected_effect, EFFECT_LABELS)
    if effect:
        parts.append(Text(f"expected: {effect}"))
    if r.tradeoff:
        parts.append(Text(f"trade-off: {r.tradeoff}"))
    evidence = _facts(r.evidence)
    if evidence:
        parts.append(Text(f"evidence: {evidence}", style="dim"))
    return parts


def _recommendation(i: int, r: Recommendation) -> Table:
    parts: list[Any] = list(_recommendation_text(r))
    rows = _change_rows(r.change)
    if rows:
        t = Table.grid(padding=(0, 2))
        t.add_column(style="cyan", no_wrap=True)
        t.add_column(style="bold", overflow="fold")
        for label, text in rows:
            t.add_row(label, text)
        parts.append(Text("change:"))
        parts.append(Padding(t, (0, 0, 0, 2), expand=False))
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, justify="right", style="bold")
    grid.add_column()
    grid.add_row(f"{i}.", Group(*parts))
    return grid


def _findings_table(findings: list[Finding]) -> Table:
    t = Table(title="Findings", title_justify="left", show_lines=False, expand=True)
    t.add_column("kind", no_wrap=True)
    t.add_column("scope", overflow="fold")
    t.add_column("severity", no_wrap=True)
    t.add_column("conf.", justify="right", no_wrap=True)
    t.add_column("summary", ratio=1)
    sev_style = {"critical": "bold red", "warning": "yellow", "info": ""}
    for f in findings:
        t.add_row(
            f.kind,
            f.scope.engine_id or f"pool {f.scope.pool}",
            Text(f.severity, style=sev_style.get(f.severity, "")),
            f"{f.confidence:.2f}",
            f.summary,
        )
    return t


# -- entry points ---------------------------------------------------------------------


def _read_line(report: Report, source: str, window: str) -> str:
    """``from SOURCE, WINDOW: 1 engine(s), 78 one-second windows, 454 finished requests``."""
    cov = report.coverage
    read = (
        f"{cov.get('n_engines_analyzed', 0)} engine(s), {cov.get('n_windows', 0):,} "
        f"one-second windows, {cov.get('n_requests', 0):,} finished requests"
    )
    read += tiers_text(cov)
    return f"from {source or 'the source'}, {window or 'all data'}: {read}"


def tiers_text(coverage: dict[str, Any]) -> str:
    """What the read line adds for engines without 1-second windows in the range:
    `` (1 engine(s) read from 40 one-minute windows: ...)`` for those analysed from the
    1-minute tier, `` (and 2 engine(s) with request latency only: ...)`` for those with
    finished requests only; empty when every engine had its seconds."""
    oldest = coverage.get("oldest_window_unix_s")
    where = f", held from {_utc(oldest)} on" if oldest is not None else ""
    out = ""
    minutes = coverage.get("engines_from_minutes") or []
    if minutes:
        out += (
            f" ({len(minutes)} engine(s) read from {coverage.get('n_minute_windows', 0):,} "
            f"one-minute windows: their 1-second windows aged out{where}; their knees are "
            "those of the load averaged over each minute)"
        )
    n = coverage.get("n_engines_latency_only")
    if n:
        out += f" (and {n} engine(s) with request latency only: no 1-second windows{where})"
    return out


def window_text(
    since: float | None,
    until: float | None,
    since_arg: str | None = None,
    until_arg: str | None = None,
) -> str:
    """``2026-11-29 16:20:00 UTC to now (--since 30m)``."""
    start = _utc(since) if since is not None else "the beginning"
    end = _utc(until) if until is not None else "now"
    given = " ".join(f"--{k} {v}" for k, v in (("since", since_arg), ("until", until_arg)) if v)
    return f"{start} to {end}" + (f" ({given})" if given else "")


def render_report(
    report: Report,
    console: Console,
    *,
    source: str = "",
    window: str = "",
    max_plots: int = MAX_PLOTS,
) -> None:
    """Print the report: verdict, plots, recommendations, findings, what was read."""
    for line in _verdict(report):
        console.print(line)
    console.print(Text(_read_line(report, source, window), style="dim"))
    plotted = 0
    for i, v in enumerate(report.engines):
        if plotted >= max_plots:
            console.print(
                Text(
                    f"(plots of {len(report.engines) - i} more engine(s) left "
                    "out; --json carries every curve)",
                    style="dim",
                )
            )
            break
        panel = _plot(report, v)
        if panel is not None:
            console.print()
            console.print(panel)
            plotted += 1
    blocks = [b for pv in report.pools for b in _prefix_block(report, pv)]
    if blocks:
        console.print()
        console.print(Text("Prefix cache and routing", style="bold underline"))
        for line in blocks:
            console.print(line)
    console.print()
    if report.recommendations:
        console.print(Text(RECOMMENDATIONS_HEADING, style="bold underline"))
        for i, r in enumerate(report.recommendations, start=1):
            console.print(_recommendation(i, r))
    else:
        console.print(Text("No recommendations: nothing to change on this data.", style="bold"))
    if report.findings:
        console.print()
        console.print(_findings_table(report.findings))


def no_data_message(
    report: Report, source: str, window: str, now_unix_s: float | None = None
) -> str:
    """Why the report is empty, and what to try."""
    cov = report.coverage
    pool = report.parameters.get("pool")
    pools = cov.get("pools") or []
    if not cov.get("n_engines_known"):
        if pool is not None and pools:
            return f"no engines in pool {pool!r} at {source}; pools known: {', '.join(pools)}"
        return (
            f"no data: the collector at {source} knows no engines yet; point the engines' "
            "KVSCOPE_COLLECTOR_URL at it, or replay a recording (kvscope demo)"
        )
    head = f"no data in the window {window} at {source}"
    latest = cov.get("latest_step_unix_s")
    if latest is None:
        return f"{head}; widen it with --since (e.g. --since 24h)"
    now = time.time() if now_unix_s is None else now_unix_s
    until = report.until_unix_s
    since = report.since_unix_s
    oldest = cov.get("oldest_window_unix_s")
    if oldest is not None and (until if until is not None else now) <= oldest:
        return (
            f"{head}; 1-second windows are held from {_utc(oldest)} on (older ones are "
            "deleted after the collector's --window-retention, 15 days by default, and "
            "kept as 1-minute windows, which the analyses read, for its --rollup-retention; "
            f"the window holds none of these engines' minutes): move the window after "
            f"{_utc(oldest)}"
        )
    if until is not None and latest >= until:
        return (
            f"{head}; the newest step is from {_utc(latest)}, after the window: move "
            "--until later (or leave it out)"
        )
    if since is not None and latest < since:
        return f"{head}; the newest step is from {_utc(latest)}: try --since {_ago(now - latest)}"
    return f"{head}; the newest step is from {_utc(latest)}: widen the window with --since"


def source_error_message(err: SourceError, url: str) -> str:
    """One line naming the URL that failed and what to check."""
    where = err.path or "the read API"
    plain = "http://" + url.split("://", 1)[-1]
    if err.kind == "tls_mismatch":
        return (
            f"https:// on a plain-HTTP collector: {url} does not speak TLS; use {plain} "
            "(or start the collector with --tls-cert and --tls-key)"
        )
    if err.kind == "tls_verify":
        return (
            f"the collector at {url} presents a certificate this machine does not trust "
            f"({err.reason}): set KVSCOPE_CA_FILE to the CA bundle that signed it"
        )
    if err.status is None:
        hint = (
            f"; if it serves HTTPS (--tls-cert), use https://{url.split('://', 1)[-1]}"
            if err.kind == "closed" and url.startswith("http://")
            else ""
        )
        return (
            f"cannot reach the collector at {url} ({err.reason or err}): check that "
            "`kvscope collector` is running there and the host, port and scheme are right"
            f"{hint}"
        )
    if err.status == 401:
        return (
            f"the collector at {url} refused the request (401, missing or wrong bearer "
            "token): pass --token or set KVSCOPE_TOKEN"
        )
    if err.kind == "not_collector":
        return (
            f"{url} answered but is not a kvscope collector ({err.reason}): give the "
            "collector's base URL (`kvscope collector` listens on port 8844 by default)"
        )
    if err.status == 404:
        return f"{url}{where} answered 404: is {url} a kvscope collector (base URL, no path)?"
    return f"the collector at {url} answered {err.status} on {where}: {err.reason}"

"""Run every analysis per engine and per pool and assemble the :class:`Report`.

:func:`analyze` reads through a :class:`~kvscope.advisor.sources.Source` (the only I/O) and
hands frames to the pure analyses; :func:`analyze_frames` is the pure part. Per
engine: throughput curve, bottleneck, step-time and KV capacity models, latency vs
load, concurrency cap, and the recommendations that follow from the bottleneck.
Per pool: summed plateaus and caps, the one-more-replica what-if, prefix-cache reuse
and routing (:mod:`kvscope.advisor.prefix`, with vLLM's KV-cache events when the source has
them) and the load balance across replicas (:mod:`kvscope.advisor.balance`).
An engine whose range starts before the oldest 1-second window kept, and whose 1-minute
windows cover it better than the seconds left (the collector's window retention deleted
them), is analysed from its minutes (:mod:`kvscope.advisor.minute_windows`);
``coverage.engines_from_minutes`` lists them.
Recommendations are grouped by their ``gain_kind`` (throughput gains, then latency
reductions, then cost: :data:`~kvscope.advisor.findings.GAIN_KINDS`) and sorted by
expected gain within a group: a relative throughput gain, or a relative latency reduction
(P99 for a cap, mean TTFT for prefix-aware routing, the busiest replica's latency for
least-loaded routing). Gains of different kinds are not on one scale.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from typing import Any

import pandas as pd

from kvscope import __version__
from kvscope.advisor.balance import LoadBalance, upstream
from kvscope.advisor.bottleneck import BottleneckClassifier
from kvscope.advisor.cap import ConcurrencyCap
from kvscope.advisor.capacity import KvCapacityModel, _f, replica_whatif
from kvscope.advisor.curve import NotEnoughData, ThroughputCurve
from kvscope.advisor.findings import (
    GAIN_KINDS,
    EngineVerdict,
    Finding,
    PoolVerdict,
    Recommendation,
    Report,
    Scope,
)
from kvscope.advisor.frames import request_weights
from kvscope.advisor.gateways import (
    ReplicaCap,
    balance_routing,
    pool_renderings,
    prefix_routing,
)
from kvscope.advisor.latency import LatencyVsLoad
from kvscope.advisor.minute_windows import (
    append_minute_windows,
    from_minutes,
    knee_gap,
    sample_with_minutes,
)
from kvscope.advisor.prefix import PrefixRouting
from kvscope.advisor.request_latency import SloTargets, request_latency
from kvscope.advisor.sources import Source, SourceError, WindowSample
from kvscope.advisor.steptime import StepTimeModel

MAX_WINDOWS_PER_ENGINE = 30_000
"""Windows per engine the analyses read at most from a source that can sample (about
8 hours of 1-second windows); more are sampled in whole time blocks."""
NO_WINDOWS_HEADROOM = (
    "no 1-second windows in the range (the collector's window retention deleted them, or "
    "none were sent): no knee, cap or bottleneck; request latency only"
)
"""The ``headroom`` of an engine with finished requests in the range and no window."""
MIN_EXTRA_SEQUENCES = 1.0
"""A KV what-if is recommended only when it makes room for at least this many more
sequences (vLLM admits whole sequences; less is within the footprint estimate's error)."""


def analyze(
    source: Source,
    since: float | None = None,
    until: float | None = None,
    pool: str | None = None,
    *,
    slo_ttft_p99_s: float | None = None,
    slo_e2e_p99_s: float | None = None,
    slo_ttft_s: float | None = None,
    slo_itl_s: float | None = None,
    slo_e2e_s: float | None = None,
    cap_fraction: float = 0.9,
    min_routing_loss: float = 0.05,
    imbalance_threshold: float = 1.25,
    max_windows_per_engine: int | None = MAX_WINDOWS_PER_ENGINE,
) -> Report:
    """Read engines, windows, requests and KV events from ``source`` and analyse them.

    A source with ``window_sample`` (the store) gives at most about
    ``max_windows_per_engine`` windows per engine, in whole time blocks, with the
    requests and KV events of those blocks; the report's coverage then states the true
    counts and ``window_sample_share``. ``None`` reads everything."""
    engines = source.engines()
    kw: dict[str, Any] = {
        "since": since,
        "until": until,
        "pool": pool,
        "slo_ttft_p99_s": slo_ttft_p99_s,
        "slo_e2e_p99_s": slo_e2e_p99_s,
        "slo_ttft_s": slo_ttft_s,
        "slo_itl_s": slo_itl_s,
        "slo_e2e_s": slo_e2e_s,
        "cap_fraction": cap_fraction,
        "min_routing_loss": min_routing_loss,
        "imbalance_threshold": imbalance_threshold,
    }
    sampler = getattr(source, "window_sample", None)
    if sampler is not None and max_windows_per_engine:
        s = sampler(since, until, pool=pool, max_windows_per_engine=max_windows_per_engine)
        s = sample_with_minutes(source, engines, s, since, until, pool)
        return _with_oldest_window(source, since, until, analyze_sample(engines, s, **kw))
    windows = source.windows(since, until, pool=pool)
    windows = append_minute_windows(source, engines, windows, since, until, pool)
    requests = source.requests(since, until, pool=pool)
    read_events = getattr(source, "kv_events", None)  # sources written before kv_events
    kv_events = read_events(since, until, pool=pool) if read_events else None
    report = analyze_frames(engines, windows, requests, kv_events, **kw)
    return _with_oldest_window(source, since, until, report)


def _with_oldest_window(
    source: Any, since: float | None, until: float | None, report: Report
) -> Report:
    """A report of a source that deletes old 1-second windows (a collector, a store) says
    where they start (``coverage.oldest_window_unix_s``) when the range's seconds were
    deleted (its 1-minute windows are kept): its engines were then read from their
    minutes, or (without minutes to read) it analysed none."""
    aged_out = getattr(source, "seconds_aged_out", None)
    if aged_out is not None and (
        report.coverage.get("engines_from_minutes")
        or (
            not report.coverage.get("n_engines_analyzed") and report.coverage.get("n_engines_known")
        )
    ):
        with contextlib.suppress(SourceError):  # the message is then the usual one
            oldest = aged_out(since, until)
            if oldest is not None:
                report.coverage["oldest_window_unix_s"] = oldest
    return report


def analyze_sample(engines: pd.DataFrame, sample: WindowSample, **kw: Any) -> Report:
    """:func:`analyze_frames` on a :class:`~kvscope.advisor.sources.WindowSample`, with the
    coverage counted from its true counts when it is not complete."""
    report = analyze_frames(engines, sample.windows, sample.requests, sample.kv_events, **kw)
    if not sample.complete:
        report.coverage.update(sample.coverage({v.engine_id for v in report.engines}))
    return report


def analyze_frames(
    engines: pd.DataFrame,
    windows: pd.DataFrame,
    requests: pd.DataFrame,
    kv_events: pd.DataFrame | None = None,
    *,
    since: float | None = None,
    until: float | None = None,
    pool: str | None = None,
    slo_ttft_p99_s: float | None = None,
    slo_e2e_p99_s: float | None = None,
    slo_ttft_s: float | None = None,
    slo_itl_s: float | None = None,
    slo_e2e_s: float | None = None,
    cap_fraction: float = 0.9,
    min_routing_loss: float = 0.05,
    imbalance_threshold: float = 1.25,
) -> Report:
    """The pure part of :func:`analyze`: frames in, report out.

    Engines without a window in ``windows`` (no data in the time range) are left out
    of the verdicts and counted in ``report.coverage``. ``kv_events`` empty or None:
    KV events are not configured. ``slo_ttft_s``, ``slo_itl_s`` and ``slo_e2e_s`` are
    latency targets in seconds: each engine's and pool's ``latency`` block then says
    which share of requests met them (:mod:`kvscope.advisor.request_latency`); the
    ``_p99`` targets lower the concurrency cap instead.
    """
    targets = SloTargets(ttft_s=slo_ttft_s, itl_s=slo_itl_s, e2e_s=slo_e2e_s)
    params: dict[str, Any] = {
        "kvscope_version": __version__,
        "pool": pool,
        "slo_ttft_p99_s": slo_ttft_p99_s,
        "slo_e2e_p99_s": slo_e2e_p99_s,
        "slo_ttft_s": slo_ttft_s,
        "slo_itl_s": slo_itl_s,
        "slo_e2e_s": slo_e2e_s,
        "cap_fraction": cap_fraction,
        "min_routing_loss": min_routing_loss,
        "imbalance_threshold": imbalance_threshold,
        "bottleneck": BottleneckClassifier().parameters(),
        "cap": ConcurrencyCap(cap_fraction=cap_fraction).parameters(),
    }
    report = Report(since_unix_s=since, until_unix_s=until, parameters=params)
    known_pools = sorted({str(p) for p in engines["pool"].dropna()}) if "pool" in engines else []
    if pool is not None and "pool" in engines:
        engines = engines[engines["pool"] == pool]
    has_ids = "engine_id" in windows and len(windows)
    with_data = set(windows["engine_id"]) if has_ids else set()
    analyzed = (
        engines[engines["engine_id"].isin(with_data)]
        if "engine_id" in engines
        else engines.iloc[0:0]
    )
    w_in = windows[windows["engine_id"].isin(set(analyzed["engine_id"]))] if has_ids else windows
    # One pass over the frames instead of one scan per engine (a fleet has many).
    w_of = dict(tuple(w_in.groupby("engine_id", sort=False))) if has_ids else {}
    has_req = bool(len(requests)) and "engine_id" in requests
    r_of = dict(tuple(requests.groupby("engine_id", sort=False))) if has_req else {}
    # Engines with finished requests but no window in the range (their seconds aged out
    # while their request minutes are kept): latency and SLO attainment only.
    latency_only = (
        engines[engines["engine_id"].isin(set(r_of) - with_data)]
        if "engine_id" in engines and r_of
        else engines.iloc[0:0]
    )
    report.coverage = _coverage(engines, analyzed, w_in, requests, known_pools, latency_only)
    minute_rows = from_minutes(w_in)
    if minute_rows.any():
        report.coverage["n_windows"] = int((~minute_rows).sum())
        report.coverage["n_minute_windows"] = int(minute_rows.sum())
        report.coverage["engines_from_minutes"] = sorted(
            {str(e) for e in w_in.loc[minute_rows, "engine_id"]}
        )
    for _, row in analyzed.sort_values("engine_id").iterrows() if len(analyzed) else ():
        cfg = {k: (None if _isnan(v) else v) for k, v in row.to_dict().items()}
        eid = str(cfg["engine_id"])
        w = w_of.get(eid, windows.iloc[0:0])
        r = r_of.get(eid, requests.iloc[0:0]) if has_req else requests
        _engine(
            report,
            cfg,
            w,
            r,
            cap_fraction=cap_fraction,
            slo_ttft_p99_s=slo_ttft_p99_s,
            slo_e2e_p99_s=slo_e2e_p99_s,
        )
        report.engine(eid).latency = request_latency(r, targets) if len(r) else None
    for row in latency_only.to_dict("records"):
        eid, pool_of = str(row["engine_id"]), row.get("pool")
        report.engines.append(
            EngineVerdict(
                engine_id=eid,
                pool=None if pool_of is None or _isnan(pool_of) else str(pool_of),
                bottleneck="insufficient_data",
                saturated=False,
                headroom=NO_WINDOWS_HEADROOM,
                latency=request_latency(r_of[eid], targets),
            )
        )
    report.engines.sort(key=lambda v: v.engine_id)
    _pools(report)
    for pv in report.pools:
        r = _rows_of(requests, set(pv.engine_ids))
        pv.latency = request_latency(r, targets) if len(r) else None
    _prefix_and_balance(
        report,
        analyzed,
        windows,
        requests,
        kv_events,
        min_routing_loss=min_routing_loss,
        imbalance_threshold=imbalance_threshold,
    )
    # Gains of different kinds are not on one scale: grouped by kind, ranked within it.
    report.recommendations.sort(
        key=lambda x: (
            GAIN_KINDS.index(x.gain_kind) if x.gain_kind in GAIN_KINDS else len(GAIN_KINDS),
            -x.expected_gain,
            x.kind,
            str(x.scope.engine_id),
        )
    )
    return report


def _coverage(
    engines: pd.DataFrame,
    analyzed: pd.DataFrame,
    windows: pd.DataFrame,
    requests: pd.DataFrame,
    pools: list[str],
    latency_only: pd.DataFrame,
) -> dict[str, Any]:
    ids = set(analyzed["engine_id"]) if "engine_id" in analyzed else set()
    lat_ids = set(latency_only["engine_id"]) if "engine_id" in latency_only else set()
    n_req = 0
    if len(requests) and "engine_id" in requests:
        weight = request_weights(requests)
        n_req = round(float(weight[requests["engine_id"].isin(ids | lat_ids)].sum()))
    ts = pd.to_numeric(windows["ts_s"], errors="coerce") if "ts_s" in windows else pd.Series([])
    last_step = (
        pd.to_numeric(engines["last_step_unix_s"], errors="coerce").max()
        if "last_step_unix_s" in engines and len(engines)
        else math.nan
    )
    return {
        "n_engines_known": len(engines),
        "n_engines_analyzed": len(ids),
        "n_engines_latency_only": len(lat_ids),
        "n_windows": len(windows),
        "n_requests": n_req,
        "first_window_s": float(ts.min()) if len(ts) else None,
        "last_window_s": float(ts.max()) if len(ts) else None,
        "latest_step_unix_s": None if _isnan(float(last_step)) else float(last_step),
        "pools": pools,
    }


def _kv_tokens(cfg: dict[str, Any]) -> float | None:
    """Tokens the engine's KV cache holds (``num_gpu_blocks x block_size``), None when
    its hello did not say."""
    tokens = _f(cfg, "num_gpu_blocks") * _f(cfg, "block_size")
    return tokens if math.isfinite(tokens) and tokens > 0 else None


def _isnan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _engine(
    report: Report,
    cfg: dict[str, Any],
    w: pd.DataFrame,
    r: pd.DataFrame,
    *,
    cap_fraction: float,
    slo_ttft_p99_s: float | None,
    slo_e2e_p99_s: float | None,
) -> None:
    eid, pool = str(cfg["engine_id"]), cfg.get("pool")
    scope = Scope(engine_id=eid, pool=pool)
    try:
        # A window read from the 1-minute tier is sixty seconds of evidence: two make a bin.
        minutes = bool(len(w)) and bool(from_minutes(w).all())
        curve = ThroughputCurve(knee_fraction=cap_fraction, min_count=2 if minutes else 3).fit(w)
    except NotEnoughData as e:
        report.engines.append(
            EngineVerdict(
                engine_id=eid,
                pool=pool,
                bottleneck="insufficient_data",
                saturated=False,
                headroom=str(e),
            )
        )
        return
    report.findings.append(curve.finding(scope))
    steps: StepTimeModel | None = None
    try:
        steps = StepTimeModel().fit(w, kv_tokens=_kv_tokens(cfg))
    except NotEnoughData:
        steps = None
    bn = BottleneckClassifier().fit(curve, cfg, r if len(r) else None, steps)
    report.findings.extend(bn.findings(scope))
    # A knee is published only where load went past it: below saturation it is a
    # fraction of the day's highest load, and moves with it. Nor where the front end
    # limits: the engine has room, and its in-flight count is what the API server hands
    # it, not what the clients send, so a cap read from it caps the wrong thing.
    front_end = bn.label_ == "frontend_bound"
    knee = curve.knee_load_ if curve.saturated_ and not front_end else None
    verdict = EngineVerdict(
        engine_id=eid,
        pool=pool,
        bottleneck=bn.verdict_,
        saturated=curve.saturated_,
        knee_concurrency=knee,
        plateau_tokens_per_s=curve.plateau_tokens_per_s_,
        plateau_total_tokens_per_s=curve.plateau_total_tokens_per_s_,
        max_load_seen=curve.max_load_,
        headroom=curve.headroom_text(),
        approaching=bn.approaching_,
        preemption_thrash=bn.thrash_,
        confidence=bn.confidence_,
    )
    report.engines.append(verdict)
    gap = None
    if verdict.knee_concurrency is not None and minutes:
        gap = knee_gap(curve.windows_, verdict.knee_concurrency)
    if front_end and curve.saturated_:
        verdict.headroom = (
            f"throughput stopped growing at {curve.knee_load_:.1f} in flight (load reached "
            f"{curve.max_load_:.1f}) because the front end feeds the engine no faster: no "
            "knee or cap is read from the engine (more API server processes lift this "
            "limit; a cap would not)"
        )
    if gap is not None:
        # No cap where the minutes do not resolve the knee.
        verdict.confidence = round(verdict.confidence * 0.5, 3)
        verdict.headroom += (
            f"; read from 1-minute windows, too few of which held their load steady "
            f"around the knee (the steady ones nearest it: {gap[0]:.1f} and {gap[1]:.1f} "
            f"in flight): load changed within the minutes, which moves a knee up, so it "
            f"may lie anywhere up to {gap[1]:.1f}, and no cap is recommended from them"
        )

    kv: KvCapacityModel | None = None
    if steps is not None and len(r):
        try:
            kv = KvCapacityModel().fit(
                r,
                cfg,
                steps,
                max_load=curve.max_load_,
                observed_plateau_tokens_per_s=curve.plateau_tokens_per_s_,
                observed_batch=bn.evidence_["batch_median"],
                preemptions_per_s=curve.preemptions_at_max_load_,
                windows=curve.windows_,
                kv_fill=(
                    bn.evidence_["kv_usage_median"] if bn.label_ == "kv_cache_bound" else None
                ),
            )
            report.findings.append(kv.finding(scope))
        except NotEnoughData:
            kv = None

    if len(r):
        lat = LatencyVsLoad().fit(r, curve)
        report.findings.append(lat.finding(scope))
        verdict.p99_e2e_s_at_max_load = lat.p99_at(curve.max_load_)
        if knee is not None and gap is None:
            cap = ConcurrencyCap(
                cap_fraction=cap_fraction,
                slo_ttft_p99_s=slo_ttft_p99_s,
                slo_e2e_p99_s=slo_e2e_p99_s,
            ).fit(
                curve,
                lat,
                kv_sequences=(
                    kv.kv_sequences_held_
                    if kv is not None and bn.label_ == "kv_cache_bound"
                    else None
                ),
            )
            verdict.recommended_concurrency_cap = cap.cap_
            verdict.predicted_throughput_fraction_at_cap = cap.throughput_fraction_
            verdict.predicted_p99_e2e_s_at_cap = cap.p99_e2e_s_at_cap_
            kv_fit = kv.kv_batch_ if kv is not None and bn.label_ == "kv_cache_bound" else None
            report.recommendations.append(
                cap.recommendation(
                    scope,
                    cfg,
                    {"bottleneck": bn.verdict_, "knee_concurrency": curve.knee_load_},
                    kv_fit_sequences=kv_fit,
                )
            )

    if kv is not None:
        report.recommendations.extend(_config_recommendations(scope, bn, kv, steps, cfg))


def _config_recommendations(
    scope: Scope,
    bn: BottleneckClassifier,
    kv: KvCapacityModel,
    steps: StepTimeModel | None,
    cfg: dict[str, Any],
) -> list[Recommendation]:
    out: list[Recommendation] = []
    base = kv.predicted_plateau_tokens_per_s_
    if bn.label_ == "kv_cache_bound":
        for wi in kv.whatifs_:
            # vLLM admits whole sequences: a what-if that makes room for less than one more
            # (within the footprint estimate's error) changes nothing and is not made.
            if wi.gain_ratio <= 0.01 or wi.kv_batch - kv.kv_batch_ < MIN_EXTRA_SEQUENCES:
                continue
            out.append(
                Recommendation(
                    kind=f"whatif_{wi.name}",
                    scope=scope,
                    summary=(
                        f"{' '.join(wi.flags)}: room for {math.floor(wi.kv_batch)} whole "
                        f"sequences instead of {math.floor(kv.kv_batch_)}; predicted plateau "
                        f"{wi.plateau_tokens_per_s:,.0f} tok/s ({wi.gain_ratio:+.0%})"
                    ),
                    change={"vllm_flags": wi.flags},
                    expected_effect={
                        "plateau_tokens_per_s": wi.plateau_tokens_per_s,
                        "gain_ratio": wi.gain_ratio,
                        "kv_batch": wi.kv_batch,
                        "effective_batch": wi.effective_batch,
                    },
                    tradeoff=wi.assumption,
                    confidence=0.5 if wi.extrapolated else 0.8,
                    expected_gain=wi.gain_ratio,
                    evidence={
                        # vLLM allocates whole blocks
                        "num_gpu_blocks": math.floor(wi.num_gpu_blocks),
                        "extrapolated": wi.extrapolated,
                    },
                )
            )
    elif bn.label_ == "max_num_seqs_bound" and steps is not None:
        cur = kv.max_num_seqs_
        new = int(max(cur + 1, min(0.9 * kv.kv_batch_, math.ceil(kv.max_load_))))
        eff = min(new, kv.kv_batch_, kv.max_load_)
        f = kv.footprint_tokens_
        plateau = float(steps.tokens_per_s(eff, kv.prompt_ratio_, f))
        gain = plateau / base - 1.0 if base > 0 else 0.0
        step_now = float(steps.step_s(cur, kv.prompt_ratio_ * cur, f)) * 1e3
        step_new = float(steps.step_s(eff, kv.prompt_ratio_ * eff, f)) * 1e3
        out.append(
            Recommendation(
                kind="raise_max_num_seqs",
                scope=scope,
                summary=(
                    f"--max-num-seqs {new} (KV has room for {kv.kv_batch_:.0f} sequences, "
                    f"batch pinned at {cur:.0f}): predicted plateau {plateau:,.0f} tok/s "
                    f"({gain:+.0%})"
                ),
                change={"vllm_flags": [f"--max-num-seqs {new}"]},
                expected_effect={
                    "plateau_tokens_per_s": plateau,
                    "gain_ratio": gain,
                    "step_ms": step_new,
                },
                tradeoff=(
                    f"each step takes {step_new:.1f} ms instead of {step_now:.1f} ms: "
                    "inter-token latency grows by that factor, queueing shrinks"
                ),
                confidence=0.5 if eff > steps.batch_range_[1] * 1.25 else 0.8,
                expected_gain=gain,
                evidence={"kv_batch": kv.kv_batch_, "load": kv.max_load_},
            )
        )
    elif bn.label_ == "frontend_bound":
        ev = bn.evidence_
        out.append(
            Recommendation(
                kind="scale_api_server",
                scope=scope,
                summary=(
                    f"requests spend {ev['frontend_share_median']:.0%} of their life in the "
                    "API server, not the engine: run more API server processes "
                    "(vllm serve --api-server-count 2 or more) or more replicas of the front "
                    "end, and give them cores of their own; streaming fewer, larger chunks "
                    "and shorter prompts to render also lighten it"
                ),
                change={"vllm_flags": ["--api-server-count 2"]},
                expected_effect={
                    "frontend_share_now": ev["frontend_share_median"],
                    "frontend_s_median": ev["frontend_s_median"],
                },
                tradeoff="each API server process takes a core and its own memory",
                confidence=0.5,
                expected_gain=0.0,
                evidence={k: ev[k] for k in ("frontend_share_median", "e2e_s_median")},
            )
        )
    elif bn.label_ == "token_budget_bound":
        ev = bn.evidence_
        budget = ev["max_num_batched_tokens"]
        gain = float(ev["budget_doubling_gain_ratio"])
        out.append(
            Recommendation(
                kind="raise_max_num_batched_tokens",
                scope=scope,
                summary=(
                    f"steps are full at {budget:.0f} computed tokens and the step-time model "
                    f"shows a per-step cost bigger steps amortise: raise "
                    f"--max-num-batched-tokens to {2 * budget:.0f} (predicted prefill rate "
                    f"{gain:+.0%}, 95% interval {ev['budget_doubling_gain_low']:+.0%} to "
                    f"{ev['budget_doubling_gain_high']:+.0%})"
                ),
                change={"vllm_flags": [f"--max-num-batched-tokens {int(2 * budget)}"]},
                expected_effect={
                    "computed_tokens_per_step_now": ev["computed_tokens_per_step_median"],
                    "gain_ratio": gain,
                    "gain_ratio_low": float(ev["budget_doubling_gain_low"]),
                    "gain_ratio_high": float(ev["budget_doubling_gain_high"]),
                },
                tradeoff="longer steps: decoding requests see more inter-token latency during prefills",
                confidence=0.5,
                expected_gain=gain,
                evidence={k: ev[k] for k in ("budget_fill_median", "batch_median")},
            )
        )
    return out


def _cap_recs(report: Report, pool: str | None) -> list[Recommendation]:
    return [
        r for r in report.recommendations if r.kind == "concurrency_cap" and r.scope.pool == pool
    ]


def _pool_cap(report: Report, pool: str | None, vs: list[EngineVerdict]) -> None:
    """The pool's summed cap as one recommendation, with its gateways' renderings (per
    replica and per pool). A pool of one engine has none: that engine's own recommendation
    carries the pool's renderings, the replica being the whole pool."""
    capped = [v for v in vs if v.recommended_concurrency_cap is not None]
    engine_recs = _cap_recs(report, pool)
    if not capped or not engine_recs:
        return
    replicas = [ReplicaCap.from_recommendation(r) for r in engine_recs]
    uncapped = sorted({upstream(v.engine_id) for v in vs if v.recommended_concurrency_cap is None})
    gateway = pool_renderings(pool, replicas, uncapped)
    if len(vs) < 2:
        engine_recs[0].change["gateway"] = gateway
        return
    total = sum(int(v.recommended_concurrency_cap or 0) for v in capped)
    weights = [v.plateau_tokens_per_s or 0.0 for v in capped]
    fractions = [v.predicted_throughput_fraction_at_cap for v in capped]
    frac = (
        (
            sum(w * f for w, f in zip(weights, fractions, strict=True) if f is not None)
            / sum(weights)
        )
        if sum(weights) > 0 and None not in fractions
        else None
    )
    gain = sum(r.expected_gain for r in engine_recs) / len(engine_recs)
    missing = [v.engine_id for v in vs if v.recommended_concurrency_cap is None]
    p99s = [r.p99_e2e_s for r in replicas if math.isfinite(r.p99_e2e_s)]
    report.recommendations.append(
        Recommendation(
            kind="pool_concurrency_cap",
            scope=Scope(pool=pool),
            summary=(
                f"cap pool {pool} at {total} requests in flight over {len(capped)} "
                "replica(s), each at its own cap"
            ),
            change={
                "concurrency_cap": total,
                "per_engine_caps": {v.engine_id: v.recommended_concurrency_cap for v in capped},
                "gateway": gateway,
            },
            expected_effect={"throughput_fraction": frac, "p99_e2e_s": max(p99s) if p99s else None},
            tradeoff=(
                "each replica takes at most its own cap and the pool their sum; the excess is "
                "rejected (the status, and whether it first waits, depends on the gateway: "
                "see each rendering)"
                + (
                    f"; no cap for {', '.join(missing)} (not saturated or too little data), "
                    "so no pool-level limit"
                    if missing
                    else ""
                )
            ),
            confidence=min(v.confidence for v in capped),
            expected_gain=gain,
            evidence={"n_engines": len(vs), "n_capped": len(capped)},
        )
    )


def _pools(report: Report) -> None:
    by_pool: dict[str | None, list[EngineVerdict]] = {}
    for v in report.engines:
        by_pool.setdefault(v.pool, []).append(v)
    for pool, vs in sorted(by_pool.items(), key=lambda kv: str(kv[0])):
        # Only a saturated engine has a plateau; an unsaturated one's highest throughput is
        # a lower bound of its capacity and is not summed.
        plateaus = [
            v.plateau_tokens_per_s for v in vs if v.saturated and v.plateau_tokens_per_s is not None
        ]
        caps = [
            v.recommended_concurrency_cap for v in vs if v.recommended_concurrency_cap is not None
        ]
        pv = PoolVerdict(
            pool=pool,
            engine_ids=[v.engine_id for v in vs],
            bottlenecks=dict(Counter(v.bottleneck for v in vs)),
            plateau_tokens_per_s=sum(plateaus) if plateaus else None,
            recommended_concurrency_cap=sum(caps) if caps else None,
            engines_without_cap=[v.engine_id for v in vs if v.recommended_concurrency_cap is None],
            engines_not_saturated=[v.engine_id for v in vs if not v.saturated],
        )
        report.pools.append(pv)
        _pool_cap(report, pool, vs)
        if pv.plateau_tokens_per_s:
            rep = replica_whatif(pv.plateau_tokens_per_s, len(plateaus))
            report.findings.append(
                Finding(
                    kind="pool_capacity",
                    scope=Scope(pool=pool),
                    summary=(
                        f"pool {pool}: {len(vs)} engine(s), plateau "
                        f"{pv.plateau_tokens_per_s:,.0f} tok/s"
                        + (
                            f" over {len(plateaus)} saturated engine(s) ("
                            f"{len(pv.engines_not_saturated)} not saturated: their capacity "
                            "is above what they served)"
                            if pv.engines_not_saturated
                            else ""
                        )
                        + f"; one more replica: {rep['plateau_tokens_per_s']:,.0f} tok/s "
                        f"({rep['gain_ratio']:+.0%})"
                    ),
                    evidence={
                        "plateau_tokens_per_s": pv.plateau_tokens_per_s,
                        "concurrency_cap": pv.recommended_concurrency_cap,
                        "one_more_replica": rep,
                    },
                )
            )


def _finite(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def _rows_of(df: pd.DataFrame | None, ids: set[str]) -> pd.DataFrame:
    if df is None or not len(df) or "engine_id" not in df:
        return pd.DataFrame()
    return df[df["engine_id"].isin(ids)]


def _prefix_and_balance(
    report: Report,
    analyzed: pd.DataFrame,
    windows: pd.DataFrame,
    requests: pd.DataFrame,
    kv_events: pd.DataFrame | None,
    *,
    min_routing_loss: float,
    imbalance_threshold: float,
) -> None:
    """Per pool: prefix-cache reuse and routing, and the load balance across replicas."""
    configs = {
        str(c["engine_id"]): {k: (None if _isnan(v) else v) for k, v in c.items()}
        for c in (analyzed.to_dict("records") if len(analyzed) else [])
    }
    for pv in report.pools:
        # engines with latency only (no window in the range) have nothing to weigh here
        engine_ids = [e for e in pv.engine_ids if e in configs]
        if not engine_ids:
            continue
        ids = set(engine_ids)
        w, r = _rows_of(windows, ids), _rows_of(requests, ids)
        pr = PrefixRouting(min_routing_loss=min_routing_loss).fit(
            [configs[e] for e in engine_ids], w, r, _rows_of(kv_events, ids)
        )
        report.findings.extend(pr.findings(pv.pool))
        rec = pr.recommendation(pv.pool)
        addresses = sorted({upstream(e) for e in engine_ids})
        replicas = [ReplicaCap.from_recommendation(c) for c in _cap_recs(report, pv.pool)]
        if rec is not None:
            rec.change["gateway"] = prefix_routing(
                addresses,
                replicas,
                available=_finite(getattr(pr, "available_", None)),
                hit_rate=_finite(getattr(pr, "events_hit_rate_", None)),
                predicted_hit_rate=_finite(pr.predicted_hit_rate_affine_),
                predicted_hit_rate_max=_finite(pr.predicted_hit_rate_affine_max_),
                imbalance_threshold=imbalance_threshold,
            )
            report.recommendations.append(rec)
        rates = dict(zip(pr.engines_["engine_id"], pr.engines_["hit_rate"], strict=True))
        for eid in engine_ids:
            report.engine(eid).prefix_hit_rate = _finite(rates.get(eid))
        pv.prefix_hit_rate = _finite(pr.hit_rate_)
        if pr.predicted_hit_rate_affine_ is not None:
            pv.prefix_routing_loss = _finite(pr.routing_loss_)
            pv.predicted_prefix_hit_rate_affine = _finite(pr.predicted_hit_rate_affine_)
        if len(engine_ids) < 2:
            continue
        lb = LoadBalance(threshold=imbalance_threshold).fit(w, r, engine_ids)
        scope = Scope(pool=pv.pool)
        report.findings.append(lb.finding(scope))
        pv.load_imbalance = _finite(lb.imbalance_)
        busiest = report.engine(lb.busiest_) if lb.busiest_ is not None else None
        bal = lb.recommendation(scope, busiest_saturated=bool(busiest and busiest.saturated))
        if bal is not None:
            # Reuse lost across replicas too: the cache-aware policy, whose balance thresholds
            # take the load in hand, rather than one that ignores prefixes.
            bal.change.setdefault("gateway", {}).update(
                {k: dict(v) for k, v in rec.change["gateway"].items()}
                if rec is not None
                else balance_routing(addresses, busiest=lb.busiest_, imbalance=lb.imbalance_)
            )
            report.recommendations.append(bal)

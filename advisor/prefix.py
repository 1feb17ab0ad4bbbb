"""Prefix cache and routing: the reuse available, the reuse routing captures, and the reuse
the engine delivers.

From the engines' prefix-cache counters (lookups ``Q``, hits ``X``, in tokens) and, where
the collector has vLLM's KV-cache events (``--kv-events-config``), the blocks each engine
computed while another replica held them (duplicates) or that the pool had stored before
(re-seen), :class:`PrefixRouting` splits a pool's reuse into delivered (the hit rate),
captured by routing, and available, and from those the routing loss and eviction loss.
Orphan blocks and engines without events make these lower bounds and lower the confidence.

It recommends ``prefix_aware_routing`` when the routing loss is worth ``min_routing_loss``
of the lookups, predicts the hit rate prefix-affine routing would deliver (and its upper
bound) and the TTFT it saves, priced by :class:`~kvscope.advisor.prefill.PrefillCost`.
Without events it says how to turn them on (``kv_events_missing``); with prefix caching
off, ``prefix_caching_off``.

Parameters
----------
min_routing_loss : routing loss that makes the recommendation (default 0.05).
min_stored_blocks : stored blocks needed to recommend at all (default 200).
full_confidence_blocks : stored blocks for full confidence (default 5000).
hit_rate_spread : difference of replica hit rates that earns a hint (default 0.15).

The formulas, the clamps and the confidence: docs/fleet.md#the-reuse-model; the measured
routing result: docs/fleet.md#prefix-cache-and-routing.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from kvscope.advisor.findings import Finding, Recommendation, Scope
from kvscope.advisor.frames import stepped_seconds
from kvscope.advisor.prefill import PrefillCost, request_ttft_s

KV_EVENT_COLUMNS = (
    "engine_id",
    "ts_s",
    "stored_blocks",
    "dup_blocks",
    "reseen_blocks",
    "orphan_blocks",
    "removed_blocks",
    "cleared_events",
    "missed_batches",
    "held_blocks",
    "held_shared_blocks",
    "block_size",
)
"""Columns of the ``kv_events`` frame (one row per engine and second); an
``n_batches`` column (event batches received), when present, refines the missed share."""

KV_EVENTS_FLAG = (
    '--kv-events-config \'{"enable_kv_cache_events":true,'
    '"publisher":"zmq","endpoint":"tcp://*:5557"}\''
)
PREFIX_CACHING_FLAG = "--enable-prefix-caching"
_COUNTS = KV_EVENT_COLUMNS[2:-1]


def _num(df: pd.DataFrame, col: str, default: float = 0.0) -> pd.Series:
    if col not in df:
        return pd.Series(default, index=df.index, dtype=float)
    return pd.to_numeric(df[col], errors="coerce").fillna(default).astype(float)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def _pct(v: float | None) -> str:
    return "?" if v is None or not math.isfinite(v) else f"{v:.0%}"


def _caching_on(cfg: dict[str, Any]) -> bool | None:
    v = cfg.get("enable_prefix_caching")
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return bool(v)


class PrefixRouting:
    """Prefix-cache reuse of one pool and what routing would change (module docstring)."""

    def __init__(
        self,
        *,
        min_routing_loss: float = 0.05,
        min_stored_blocks: int = 200,
        full_confidence_blocks: int = 5000,
        hit_rate_spread: float = 0.15,
    ) -> None:
        self.min_routing_loss = min_routing_loss
        self.min_stored_blocks = min_stored_blocks
        self.full_confidence_blocks = full_confidence_blocks
        self.hit_rate_spread = hit_rate_spread

    def fit(
        self,
        configs: list[dict[str, Any]],
        windows: pd.DataFrame,
        requests: pd.DataFrame,
        kv_events: pd.DataFrame | None = None,
    ) -> PrefixRouting:
        """``configs``: one dict per engine of the pool with data (``engine_id``,
        ``block_size``, ``enable_prefix_caching``...); frames: the pool's rows."""
        self.configs_ = {str(c["engine_id"]): c for c in configs}
        ids = sorted(self.configs_)
        self.engine_ids_ = ids
        w = windows if len(windows) else pd.DataFrame({"engine_id": [], "ts_s": []})
        r = (
            requests
            if len(requests) and "engine_id" in requests
            else pd.DataFrame({"engine_id": []})
        )
        seconds = stepped_seconds(w)  # a minute's counts are per second stepped
        q = (_num(w, "prefix_queries") * seconds).groupby(w["engine_id"]).sum()
        x = (_num(w, "prefix_hits") * seconds).groupby(w["engine_id"]).sum()
        cached = _num(r, "cached_tokens").groupby(r["engine_id"])
        rows = []
        for e in ids:
            qe, xe = float(q.get(e, 0.0)), float(x.get(e, 0.0))
            n_cached = int((cached.get_group(e) > 0).sum()) if e in cached.groups else 0
            rows.append(
                {
                    "engine_id": e,
                    "prefix_queries": qe,
                    "prefix_hits": xe,
                    "hit_rate": _ratio(xe, qe),
                    "n_requests": int((r["engine_id"] == e).sum()),
                    "n_cached_requests": n_cached,
                    "prefix_caching": _caching_on(self.configs_[e]),
                }
            )
        self.engines_ = pd.DataFrame(
            rows,
            columns=[
                "engine_id",
                "prefix_queries",
                "prefix_hits",
                "hit_rate",
                "n_requests",
                "n_cached_requests",
                "prefix_caching",
            ],
        )
        self.queries_ = float(self.engines_["prefix_queries"].sum())
        self.hits_ = float(self.engines_["prefix_hits"].sum())
        self.hit_rate_ = _ratio(self.hits_, self.queries_)
        self.prefill_ = PrefillCost().fit(r)
        ev = kv_events if kv_events is not None and len(kv_events) else pd.DataFrame()
        ev = ev[ev["engine_id"].isin(ids)] if len(ev) and "engine_id" in ev else ev.iloc[0:0]
        self.has_events_ = bool(len(ev))
        self.events_engine_ids_ = sorted({str(e) for e in ev["engine_id"]}) if len(ev) else []
        self._fit_events(ev, w, r)
        return self

    def _fit_events(self, ev: pd.DataFrame, w: pd.DataFrame, r: pd.DataFrame) -> None:
        self.routing_loss_: float | None = None
        self.predicted_hit_rate_affine_: float | None = None
        self.predicted_hit_rate_affine_max_: float | None = None
        self.ttft_change_s_: float | None = None
        self.expected_gain_ = 0.0
        self.confidence_ = 0.0
        self.recommend_ = False
        if not self.has_events_:
            return
        sums: dict[str, float] = dict.fromkeys(_COUNTS, 0.0)
        q_ev = x_ev = dup_tok = reseen_tok = 0.0
        n_req = 0
        ttft_parts: list[np.ndarray] = []
        prefill_parts: list[np.ndarray] = []
        frame_rows = []
        for e in self.events_engine_ids_:
            rows = ev[ev["engine_id"] == e]
            ts = pd.to_numeric(rows["ts_s"], errors="coerce")
            t0, t1 = float(ts.min()), float(ts.max()) + 1.0
            cfg_bs = (
                pd.to_numeric(pd.Series([self.configs_[e].get("block_size")]), errors="coerce")
                .fillna(16.0)
                .iloc[0]
            )
            bs = _num(rows, "block_size", float(cfg_bs)).where(lambda s: s > 0, float(cfg_bs))
            we = w[
                (w["engine_id"] == e)
                & (pd.to_numeric(w["ts_s"], errors="coerce") >= t0)
                & (pd.to_numeric(w["ts_s"], errors="coerce") < t1)
            ]
            n = stepped_seconds(we)
            qe = float((_num(we, "prefix_queries") * n).sum())
            xe = float((_num(we, "prefix_hits") * n).sum())
            de = float((_num(rows, "dup_blocks") * bs).sum())
            re_ = float((_num(rows, "reseen_blocks") * bs).sum())
            q_ev, x_ev, dup_tok, reseen_tok = q_ev + qe, x_ev + xe, dup_tok + de, reseen_tok + re_
            for c in _COUNTS:
                sums[c] += float(_num(rows, c).sum())
            if len(r) and "finished_unix_s" in r:
                fin = pd.to_numeric(r["finished_unix_s"], errors="coerce")
                re_rows = r[(r["engine_id"] == e) & (fin >= t0) & (fin < t1)]
                n_req += len(re_rows)
                ttft_parts.append(request_ttft_s(re_rows))
                prefill_parts.append(
                    pd.to_numeric(re_rows["prefill_s"], errors="coerce").to_numpy(float)
                    if "prefill_s" in re_rows
                    else np.full(len(re_rows), math.nan)
                )
            frame_rows.append(
                {
                    "engine_id": e,
                    "prefix_queries": qe,
                    "prefix_hits": xe,
                    **{c: float(_num(rows, c).sum()) for c in _COUNTS},
                    "routing_loss": _ratio(de, qe),
                }
            )
        self.events_frame_ = pd.DataFrame(frame_rows)
        self.event_sums_ = sums
        h = min(1.0, max(0.0, _ratio(x_ev, q_ev))) if q_ev > 0 else 0.0
        loss = min(max(_ratio(dup_tok, q_ev), 0.0), 1.0 - h) if q_ev > 0 else 0.0
        evict = (
            min(max(_ratio(reseen_tok - dup_tok, q_ev), 0.0), 1.0 - h - loss) if q_ev > 0 else 0.0
        )
        self.events_queries_, self.events_hit_rate_ = q_ev, h
        self.routing_loss_, self.eviction_loss_ = loss, evict
        self.captured_ = h + evict
        self.available_ = self.captured_ + loss
        self.duplicated_cache_ratio_ = _ratio(sums["held_shared_blocks"], sums["held_blocks"])
        stored = sums["stored_blocks"]
        self.orphan_share_ = min(1.0, _ratio(sums["orphan_blocks"], stored)) if stored else 0.0
        missed = float(_num(ev, "missed_batches").sum())
        if "n_batches" in ev:
            self.missed_share_ = _ratio(missed, missed + float(_num(ev, "n_batches").sum()))
        else:
            self.missed_share_ = float((_num(ev, "missed_batches") > 0).mean())
        self.missed_share_ = (
            min(1.0, self.missed_share_) if math.isfinite(self.missed_share_) else 0.0
        )
        multi = len(self.events_engine_ids_) >= 2
        if multi:
            self.predicted_hit_rate_affine_ = h + loss
            self.predicted_hit_rate_affine_max_ = self.available_
        ttft = np.concatenate(ttft_parts) if ttft_parts else np.zeros(0)
        prefill = np.concatenate(prefill_parts) if prefill_parts else np.zeros(0)
        self.n_requests_events_ = n_req
        self.mean_ttft_s_events_ = float(np.nanmean(ttft)) if np.isfinite(ttft).any() else math.nan
        self.tokens_saved_per_request_ = loss * q_ev / n_req if n_req else math.nan
        change = self.prefill_.ttft_change_s(self.tokens_saved_per_request_) if n_req else None
        self.ttft_change_s_ = change
        mean_ttft = self.mean_ttft_s_events_
        if change is not None and math.isfinite(mean_ttft) and mean_ttft > 0:
            gain = -change / mean_ttft
            self.gain_basis_ = "mean TTFT reduction"
        else:
            share = (
                float(np.nanmean(prefill)) / mean_ttft
                if np.isfinite(prefill).any() and math.isfinite(mean_ttft) and mean_ttft > 0
                else 0.0
            )
            gain = _ratio(loss, 1.0 - h) * min(1.0, share) if h < 1.0 else 0.0
            self.gain_basis_ = "computed prompt tokens saved x prefill share of TTFT"
        self.expected_gain_ = float(min(1.0, max(0.0, gain)))
        conf = (
            min(1.0, stored / self.full_confidence_blocks)
            * (1.0 - self.orphan_share_)
            * (1.0 - self.missed_share_)
            * len(self.events_engine_ids_)
            / max(1, len(self.engine_ids_))
        )
        if change is None:
            conf *= 0.5
        elif not self.prefill_.good_:
            conf *= 0.75
        self.confidence_ = round(float(conf), 3)
        self.recommend_ = bool(
            multi and loss >= self.min_routing_loss and stored >= self.min_stored_blocks
        )

    # -- results -----------------------------------------------------------------------

    def _per_engine_text(self) -> str:
        return ", ".join(f"{r.engine_id} {_pct(r.hit_rate)}" for r in self.engines_.itertuples())

    def _spread(self) -> float:
        rates = self.engines_["hit_rate"].dropna()
        return float(rates.max() - rates.min()) if len(rates) >= 2 else 0.0

    def findings(self, pool: str | None) -> list[Finding]:
        scope = Scope(pool=pool)
        out = [self._cache_finding(scope)]
        if self.has_events_:
            out.append(self._routing_finding(scope))
        on = [e for e in self.engine_ids_ if _caching_on(self.configs_[e]) is not False]
        if not self.has_events_ and len(on) >= 2:
            out.append(self._missing_events_finding(scope, on))
        for e in self.engine_ids_:
            if _caching_on(self.configs_[e]) is False:
                out.append(
                    Finding(
                        kind="prefix_caching_off",
                        scope=Scope(engine_id=e, pool=pool),
                        summary=(
                            f"prefix caching is off: prompts sharing a prefix are computed "
                            f"again on every request; turn it on with {PREFIX_CACHING_FLAG} "
                            "(whether this traffic repeats prefixes shows only with it on)"
                        ),
                        evidence={"vllm_flag": PREFIX_CACHING_FLAG},
                    )
                )
        return out

    def _cache_finding(self, scope: Scope) -> Finding:
        if self.queries_ > 0:
            head = (
                f"prefix-cache hit rate {_pct(self.hit_rate_)} of "
                f"{self.queries_:,.0f} prompt tokens looked up"
            )
            if len(self.engine_ids_) > 1:
                head += f" ({self._per_engine_text()})"
        else:
            head = "no prefix-cache lookups in the window"
        return Finding(
            kind="prefix_cache",
            scope=scope,
            summary=f"{head}; {self.prefill_.summary()}",
            confidence=round(min(1.0, self.queries_ / 10_000.0), 3),
            evidence={
                "hit_rate": self.hit_rate_,
                "prefix_queries": self.queries_,
                "prefix_hits": self.hits_,
                "engine_hit_rates": dict(
                    zip(self.engines_["engine_id"], self.engines_["hit_rate"], strict=True)
                ),
                **self.prefill_.evidence(),
            },
            frame={c: self.engines_[c].tolist() for c in self.engines_.columns},
        )

    def _routing_finding(self, scope: Scope) -> Finding:
        loss = self.routing_loss_ or 0.0
        parts = [
            f"reuse available {_pct(self.available_)}, captured by routing "
            f"{_pct(self.captured_)}, delivered {_pct(self.events_hit_rate_)}: routing "
            f"loses {_pct(loss)} (recomputed while another replica held it), eviction "
            f"{_pct(self.eviction_loss_)}"
        ]
        if self.predicted_hit_rate_affine_ is not None:
            parts.append(
                f"prefix-affine routing: {_pct(self.events_hit_rate_)} -> "
                f"{_pct(self.predicted_hit_rate_affine_)} (at most "
                f"{_pct(self.predicted_hit_rate_affine_max_)})"
            )
        else:
            parts.append("one engine with KV events: no routing loss to measure")
        missing = sorted(set(self.engine_ids_) - set(self.events_engine_ids_))
        if missing:
            parts.append(f"no events from {', '.join(missing)}")
        return Finding(
            kind="prefix_routing",
            scope=scope,
            summary="; ".join(parts),
            severity="warning" if self.recommend_ else "info",
            confidence=self.confidence_,
            evidence={
                "hit_rate": self.events_hit_rate_,
                "routing_loss": self.routing_loss_,
                "eviction_loss": self.eviction_loss_,
                "captured": self.captured_,
                "available": self.available_,
                "predicted_hit_rate_affine": self.predicted_hit_rate_affine_,
                "predicted_hit_rate_affine_max": self.predicted_hit_rate_affine_max_,
                "duplicated_cache_ratio": self.duplicated_cache_ratio_,
                "orphan_share": self.orphan_share_,
                "missed_batch_share": self.missed_share_,
                "prefix_queries": self.events_queries_,
                "engines_with_events": self.events_engine_ids_,
                "engines_without_events": missing,
                **self.event_sums_,
            },
            frame={c: self.events_frame_[c].tolist() for c in self.events_frame_.columns},
        )

    def _missing_events_finding(self, scope: Scope, on: list[str]) -> Finding:
        endpoints = {
            e: self.configs_[e].get("kv_events_endpoint")
            for e in on
            if self.configs_[e].get("kv_events_endpoint")
        }
        if endpoints:
            head = (
                f"KV-cache events are configured on {', '.join(sorted(endpoints))} but "
                "none reached the collector in the window: check that it subscribes to "
                "their endpoints"
            )
        else:
            head = (
                f"cross-replica prefix duplication cannot be measured on these {len(on)} "
                f"replicas without vLLM's KV-cache events: start each with {KV_EVENTS_FLAG}"
            )
        summary = f"{head}; hit rates: {self._per_engine_text()}"
        spread = self._spread()
        if spread >= self.hit_rate_spread:
            summary += (
                f"; they differ by {spread:.0%}: requests sharing prefixes may be "
                "spread over replicas (or the replicas serve different traffic), "
                "which prefix-aware routing would fix"
            )
        return Finding(
            kind="kv_events_missing",
            scope=scope,
            summary=summary,
            severity="warning" if spread >= self.hit_rate_spread else "info",
            evidence={
                "vllm_flag": KV_EVENTS_FLAG,
                "hit_rate_spread": spread,
                "engine_hit_rates": dict(
                    zip(self.engines_["engine_id"], self.engines_["hit_rate"], strict=True)
                ),
                "configured_endpoints": endpoints,
            },
        )

    def recommendation(self, pool: str | None) -> Recommendation | None:
        """``prefix_aware_routing`` when the routing loss pays (see the module docstring)."""
        if not self.recommend_ or self.predicted_hit_rate_affine_ is None:
            return None
        ttft = (
            f", mean TTFT {self.ttft_change_s_ * 1e3:+,.0f} ms"
            if self.ttft_change_s_ is not None
            else ""
        )
        return Recommendation(
            kind="prefix_aware_routing",
            scope=Scope(pool=pool),
            summary=(
                f"route by prefix (e.g. vLLM production-stack / llm-d prefix-aware "
                f"routing, or session-affine by conversation id): predicted hit rate "
                f"{_pct(self.events_hit_rate_)} -> {_pct(self.predicted_hit_rate_affine_)}"
                f"{ttft}"
            ),
            change={
                "router_policy": "prefix-aware",
                "production_stack": "--routing-logic prefixaware (or --routing-logic "
                "session --session-key <conversation header>)",
                "llm_d": "inference scheduler with the prefix-cache scorer, weighted "
                "with the queue / KV-usage scorers",
                "load_bound": "keep load balanced: consistent hashing with bounded load "
                "(e.g. at most 1.25x the mean per replica)",
            },
            expected_effect={
                "hit_rate": self.events_hit_rate_,
                "predicted_hit_rate": self.predicted_hit_rate_affine_,
                "predicted_hit_rate_max": self.predicted_hit_rate_affine_max_,
                "mean_ttft_change_s": self.ttft_change_s_,
                "mean_ttft_s": self.mean_ttft_s_events_,
                "tokens_saved_per_request": self.tokens_saved_per_request_,
            },
            tradeoff=(
                "requests follow their prefix, not the emptiest replica: without a load "
                "bound a popular prefix overloads one replica; the predicted hit rate "
                "assumes the router always finds the holder (up to "
                f"{_pct(self.predicted_hit_rate_affine_max_)} if the cache space freed "
                "from duplicates also ends evictions)"
            ),
            confidence=self.confidence_,
            expected_gain=self.expected_gain_,
            evidence={
                "routing_loss": self.routing_loss_,
                "eviction_loss": self.eviction_loss_,
                "available": self.available_,
                "captured": self.captured_,
                "duplicated_cache_ratio": self.duplicated_cache_ratio_,
                "stored_blocks": self.event_sums_["stored_blocks"],
                "gain_basis": self.gain_basis_,
                "prefill_fit_r2": self.prefill_.r2_,
                "prefill_fit_n": self.prefill_.n_,
            },
        )

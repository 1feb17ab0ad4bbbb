"""The concurrency cap: admission control that keeps most of the throughput and
bounds the tail.

:class:`ConcurrencyCap` chooses one engine's cap ``C`` in requests in flight:

1. The crossing: the smallest load at which the monotone fit of the load bins up to the
   peak reaches ``cap_fraction`` of it, rounded up, and at least the median crossing of
   bootstrap refits (so that a bin that ran fast by luck does not set it alone).
2. Bounds, each rounded up: the batch held at a batch or KV ceiling (more in flight only
   wait in vLLM's queue); the preemption onset, where the curve still keeps
   ``onset_min_fraction`` of the peak; and on a KV-bound engine the sequences its cache
   holds through their lives (``kv_sequences``: from the requests' lengths, not the
   sweep's noisy seconds).
3. With an SLO, the largest load whose P99 meets it; none: infeasible (``feasible_``).
4. Predicted effect: the fitted share of the plateau and the P99 at the cap, against the
   P99 at the highest load seen.

Rendered as ``--max-num-seqs min(C, current) --max-num-queued-reqs C + Q`` with ``Q =
ceil(queue_share x C)``: vLLM answers the excess 503 at once. With the flags alone the
queue of ``Q`` stays full under overload, so their P99 is that at load ``C + Q``
(``p99_e2e_s_queued_``). The gateways' renderings are in :mod:`kvscope.advisor.gateways`.

See docs/advise.md#the-concurrency-cap.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from kvscope.advisor.balance import upstream
from kvscope.advisor.curve import ThroughputCurve
from kvscope.advisor.findings import Recommendation, Scope
from kvscope.advisor.frames import interp_crossing, isotonic_increasing, level_rate
from kvscope.advisor.gateways import ReplicaCap, replica_renderings, vllm_flags
from kvscope.advisor.latency import LatencyVsLoad


def _at(bins: pd.DataFrame, column: str, load: float) -> float:
    """``column`` of the curve's bins at ``load`` (linear between bins; NaN without data)."""
    if column not in bins:
        return math.nan
    b = bins[["load", column]].apply(pd.to_numeric, errors="coerce").dropna()
    if not len(b):
        return math.nan
    return float(np.interp(load, b["load"].to_numpy(float), b[column].to_numpy(float)))


def _fit_to_peak(means: np.ndarray, weights: np.ndarray) -> tuple[int, np.ndarray]:
    """The bins up to the one with the highest mean, and their monotone fit."""
    upto = int(np.argmax(means)) + 1
    return upto, isotonic_increasing(means[:upto], weights[:upto])


class ConcurrencyCap:
    """Chooses the concurrency cap of one engine and predicts its effect.

    Parameters
    ----------
    cap_fraction : share of the plateau the cap must keep.
    slo_ttft_p99_s, slo_e2e_p99_s : optional P99 targets in seconds.
    queue_share : the engine-side queue allowed, as a share of the cap.
    resamples, resample_quantile : bootstrap refits of the crossing, and the quantile of
        their loads the cap is at least.
    preempted_share_onset : share of a load bin's finished requests preempted at least once
        that marks the preemption onset.
    onset_min_fraction : share of the peak the fitted curve must keep at the onset for the
        onset to bound the cap.
    """

    def __init__(
        self,
        *,
        cap_fraction: float = 0.9,
        slo_ttft_p99_s: float | None = None,
        slo_e2e_p99_s: float | None = None,
        queue_share: float = 0.25,
        resamples: int = 200,
        resample_quantile: float = 0.5,
        preempted_share_onset: float = 0.1,
        onset_min_fraction: float = 0.8,
    ) -> None:
        self.cap_fraction = cap_fraction
        self.slo_ttft_p99_s = slo_ttft_p99_s
        self.slo_e2e_p99_s = slo_e2e_p99_s
        self.queue_share = queue_share
        self.resamples = resamples
        self.resample_quantile = resample_quantile
        self.preempted_share_onset = preempted_share_onset
        self.onset_min_fraction = onset_min_fraction

    def parameters(self) -> dict[str, float]:
        """The thresholds the cap uses (the report carries them)."""
        return {
            "cap_fraction": self.cap_fraction,
            "queue_share": self.queue_share,
            "resamples": self.resamples,
            "resample_quantile": self.resample_quantile,
            "preempted_share_onset": self.preempted_share_onset,
            "onset_min_fraction": self.onset_min_fraction,
        }

    def _crossing(self, x: np.ndarray, means: np.ndarray, weights: np.ndarray) -> float:
        """The load where the monotone fit of ``means`` (bins up to the highest) reaches
        ``cap_fraction`` of its top."""
        upto, fit = _fit_to_peak(means, weights)
        return interp_crossing(x[:upto], fit, self.cap_fraction * float(fit.max()))

    def _resampled_crossings(self, curve: ThroughputCurve) -> np.ndarray:
        """The crossing on ``resamples`` refits of bin means drawn from each bin's
        windows with replacement (a fixed seed: the same data give the same cap)."""
        w = curve.windows_
        bins = curve.bins_
        if self.resamples <= 0 or "bin" not in w or len(bins) < 2:
            return np.array([])
        groups = [g.to_numpy(float) for _, g in w.groupby("bin")["gen_tokens_per_s"]]
        if len(groups) != len(bins):
            return np.array([])
        x = bins["load"].to_numpy(float)
        n = bins["n_windows"].to_numpy(float)
        rng = np.random.default_rng(0)
        out = np.empty(self.resamples)
        for i in range(self.resamples):
            med = np.array([level_rate(rng.choice(g, len(g))) for g in groups])
            out[i] = self._crossing(x, med, n)
        return out

    def _preemption_onset(self, lat: LatencyVsLoad) -> float | None:
        """The lowest load bin in which at least ``preempted_share_onset`` of the finished
        requests were preempted (None: none, or the source has no preemption counts)."""
        b = lat.bins_
        if not len(b) or "preempted_share" not in b:
            return None
        share = pd.to_numeric(b["preempted_share"], errors="coerce").to_numpy(float)
        hit = np.isfinite(share) & (share >= self.preempted_share_onset)
        return float(b["load"].to_numpy(float)[int(np.argmax(hit))]) if hit.any() else None

    def _meets(self, lat: LatencyVsLoad, load: float) -> bool:
        for col, slo in (("ttft_s", self.slo_ttft_p99_s), ("e2e_s", self.slo_e2e_p99_s)):
            if slo is not None:
                v = lat.p99_at(load, col)
                if not math.isfinite(v) or v > slo:
                    return False
        return True

    def fit(
        self,
        curve: ThroughputCurve,
        latency: LatencyVsLoad,
        *,
        kv_sequences: int | None = None,
    ) -> ConcurrencyCap:
        """``kv_sequences``: on a KV-bound engine, the sequences its cache holds through
        their lives (the cap is at most that, see step 1)."""
        raw = curve.bins_["gen_tokens_per_s"].to_numpy(float)
        weights = curve.bins_["n_windows"].to_numpy(float)
        upto, fit = _fit_to_peak(raw, weights)  # bins up to the peak (see step 1)
        x = curve.bins_["load"].to_numpy(float)[:upto]
        plateau = float(fit.max())
        self.peak_tokens_per_s_ = plateau
        load = interp_crossing(x, fit, self.cap_fraction * plateau)
        self.point_load_ = load
        resampled = self._resampled_crossings(curve)
        self.resampled_load_ = (
            float(np.quantile(resampled, self.resample_quantile)) if len(resampled) else math.nan
        )
        if math.isfinite(self.resampled_load_):
            load = max(load, self.resampled_load_)
        self.preemption_onset_load_ = self._preemption_onset(latency)
        self.bounded_by_preemption_ = False
        onset = self.preemption_onset_load_
        if (
            onset is not None
            and onset < load
            and np.interp(onset, x, fit) >= self.onset_min_fraction * plateau
        ):
            load = onset
            self.bounded_by_preemption_ = True
        self.ceiling_batch_ = curve.ceiling_batch_
        self.bounded_by_batch_ = bool(
            self.ceiling_batch_ is not None and self.ceiling_batch_ < load
        )
        if self.bounded_by_batch_:
            self.bounded_by_preemption_ = False
        if self.ceiling_batch_ is not None:
            # Past the batch the engine held at its batch or KV ceiling only vLLM's
            # queue grows (the curve's step 5).
            load = min(load, self.ceiling_batch_)
        cap = max(1, math.ceil(load - 1e-9))
        self.kv_sequences_ = kv_sequences
        self.bounded_by_kv_ = bool(kv_sequences is not None and kv_sequences < cap)
        if self.bounded_by_kv_ and kv_sequences is not None:
            cap = max(1, int(kv_sequences))
            self.bounded_by_batch_ = self.bounded_by_preemption_ = False
        self.slo_limited_ = False
        self.feasible_ = True
        if not self._meets(latency, cap):
            ok = [c for c in range(cap - 1, 0, -1) if self._meets(latency, c)]
            self.slo_limited_ = True
            if ok:
                cap = ok[0]
            else:
                self.feasible_ = False
        self.cap_ = int(cap)
        at = float(cap)
        if (
            self.ceiling_batch_ is not None
            and curve.ceiling_load_ is not None
            and cap >= self.ceiling_batch_
        ):
            # The cap admits the batch the engine held at its ceiling: it runs as there,
            # without the queue (the curve below the ceiling had fewer running).
            at = max(at, curve.ceiling_load_)
        self.throughput_fraction_ = (
            float(np.interp(at, x, fit) / plateau) if plateau > 0 else math.nan
        )
        self.queue_ = max(1, math.ceil(self.queue_share * self.cap_))
        self.p99_e2e_s_queued_ = latency.p99_at(cap + self.queue_, "e2e_s")
        self.waiting_at_cap_ = _at(curve.bins_, "waiting", cap)
        self.kv_usage_at_cap_ = _at(curve.bins_, "kv_usage", cap)
        self.p99_e2e_s_at_cap_ = latency.p99_at(cap, "e2e_s")
        self.p99_ttft_s_at_cap_ = latency.p99_at(cap, "ttft_s")
        self.p99_e2e_s_at_max_ = latency.p99_at(curve.max_load_, "e2e_s")
        self.p99_ttft_s_at_max_ = latency.p99_at(curve.max_load_, "ttft_s")
        self.max_load_ = curve.max_load_
        return self

    def tradeoff(self) -> str:
        p_cap, p_max = self.p99_e2e_s_at_cap_, self.p99_e2e_s_at_max_
        lat = (
            f", e2e P99 {p_cap:.2f} s instead of {p_max:.2f} s at {self.max_load_:.0f} in flight"
            if math.isfinite(p_cap) and math.isfinite(p_max)
            else ""
        )
        why = " (lowered to meet the SLO)" if self.slo_limited_ and self.feasible_ else ""
        if self.bounded_by_batch_ and not self.slo_limited_ and self.ceiling_batch_ is not None:
            why = (
                f" (the engine ran {self.ceiling_batch_:.1f} requests while others waited: "
                "more in flight only queue)"
            )
        if (
            self.bounded_by_preemption_
            and not self.slo_limited_
            and self.preemption_onset_load_ is not None
        ):
            why = (
                f" (vLLM began preempting requests at {self.preemption_onset_load_:.1f} in "
                "flight: past it admitted requests are evicted and recomputed, which "
                "lengthens the tail)"
            )
        if self.bounded_by_kv_ and not self.slo_limited_ and self.kv_sequences_ is not None:
            why = (
                f" (the KV cache holds about {self.kv_sequences_} of these requests through "
                "their lives: with more in flight vLLM preempts as their outputs grow)"
            )
        bad = "; the SLO cannot be met on this engine at any load" if not self.feasible_ else ""
        return (
            f"cap {self.cap_}: {self.throughput_fraction_:.0%} of peak throughput{lat}"
            f"{why}{bad}; requests beyond the cap are rejected (a gateway holding the cap: "
            "at once; with only the vLLM flags: past a short queue in vLLM, which adds up to "
            "about one request's duration to the admitted requests' P99)"
        )

    def recommendation(
        self,
        scope: Scope,
        config: dict[str, Any],
        evidence: dict[str, Any] | None = None,
        *,
        kv_fit_sequences: float | None = None,
    ) -> Recommendation:
        """``kv_fit_sequences``: for a KV-bound engine, the sequences its KV cache holds
        (the capacity model's KV-bound batch); ``--max-num-seqs`` is kept at or below it
        so admitted requests wait in vLLM's queue instead of being preempted."""
        c = self.cap_
        try:
            current = int(config.get("max_num_seqs") or 0)
        except (TypeError, ValueError):
            current = 0
        seqs = min(c, current) if current > 0 else c
        if kv_fit_sequences is not None and math.isfinite(kv_fit_sequences):
            seqs = max(1, min(seqs, math.floor(kv_fit_sequences)))
        replica = ReplicaCap(
            address=upstream(str(scope.engine_id or "")),
            cap=c,
            max_num_seqs=seqs,
            queue=self.queue_,
            p99_e2e_s=self.p99_e2e_s_at_cap_,
            p99_e2e_s_queued=self.p99_e2e_s_queued_,
            p99_e2e_s_uncapped=self.p99_e2e_s_at_max_,
            waiting_at_cap=self.waiting_at_cap_,
            kv_usage_at_cap=self.kv_usage_at_cap_,
            engine_id=str(scope.engine_id or ""),
            model=str(config.get("model") or ""),
        )
        change = {
            "concurrency_cap": c,
            # vLLM's admission limit counts running and waiting requests together.
            "vllm_flags": vllm_flags(replica),
            "gateway": replica_renderings(replica),
        }
        gain = 0.0
        if math.isfinite(self.p99_e2e_s_at_cap_) and self.p99_e2e_s_at_max_ > 0:
            gain = 1.0 - self.p99_e2e_s_at_cap_ / self.p99_e2e_s_at_max_
        return Recommendation(
            kind="concurrency_cap",
            scope=scope,
            summary=f"cap concurrency at {c} requests in flight per replica",
            change=change,
            expected_effect={
                "throughput_fraction": self.throughput_fraction_,
                "p99_e2e_s": self.p99_e2e_s_at_cap_,
                "p99_ttft_s": self.p99_ttft_s_at_cap_,
                "p99_e2e_s_uncapped": self.p99_e2e_s_at_max_,
                "p99_ttft_s_uncapped": self.p99_ttft_s_at_max_,
            },
            tradeoff=self.tradeoff(),
            confidence=1.0 if self.feasible_ else 0.3,
            expected_gain=max(0.0, gain),
            evidence={
                "cap_fraction": self.cap_fraction,
                "point_load": self.point_load_,
                "resampled_load": self.resampled_load_,
                "ceiling_batch": self.ceiling_batch_,
                "preemption_onset_load": self.preemption_onset_load_,
                "kv_sequences_held": self.kv_sequences_,
                "slo_ttft_p99_s": self.slo_ttft_p99_s,
                "slo_e2e_p99_s": self.slo_e2e_p99_s,
                "slo_limited": self.slo_limited_,
                "feasible": self.feasible_,
                "max_num_seqs": seqs,
                "vllm_queue": self.queue_,
                "p99_e2e_s_queued": self.p99_e2e_s_queued_,
                "cap_waiting": self.waiting_at_cap_,
                "cap_kv_usage_ratio": self.kv_usage_at_cap_,
                "model": replica.model or None,
                **(evidence or {}),
            },
        )

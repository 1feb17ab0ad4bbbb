"""Throughput against load: the plateau, the knee, and whether load went past it.

Load is the requests in flight at the engine (running plus waiting, as the engine saw
them, so load past the knee shows as a queue); throughput is generated tokens/s.
:class:`ThroughputCurve` fits one engine's 1-second windows:

1. Keep windows with enough steps and load, busy over most of the second.
2. Bin them log-spaced in load, edges moved into gaps of the loads seen, thin bins merged;
   a bin's rate is the interquartile mean of its seconds (an edge through a load level, or
   a median, picks the stalled or the fast seconds of that level).
3. Fit the bins' rates by weighted isotonic regression: throughput does not truly fall
   with load; the raw fall past the peak is kept for thrash.
4. Plateau = the fit's top. Knee = the smallest load reaching ``knee_fraction`` of it, at
   most the batch ceiling (the batch stopped growing while requests waited) and the batch
   held from there on.
5. Saturated when the highest load is ``saturation_margin`` x the knee and the engine shows
   why there (a queue, preemptions, slower steps while the work done stopped growing too),
   or when it hit a ceiling: requests waited while the batch stood still or the cache was
   full. Otherwise ``growth_last_doubling_`` says how much it was still growing.

:func:`fitted_at` reads the fitted curve at a load; :class:`NotEnoughData` is raised when
too few windows remain.

See docs/advise.md#the-throughput-curve-and-the-knee.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvscope.advisor.findings import Finding, Scope
from kvscope.advisor.frames import (
    active_windows,
    frame_of,
    interp_crossing,
    isotonic_increasing,
    level_rate,
    load_bins,
    prepare_windows,
)


class NotEnoughData(ValueError):
    """Too few usable windows to draw a curve."""


class ThroughputCurve:
    """Throughput-vs-load curve of one engine: its plateau, knee and saturation.

    Parameters
    ----------
    knee_fraction : share of the plateau that defines the knee.
    saturation_margin : multiple of the knee the highest load bin must reach to be saturated.
    ceiling_batch_growth, ceiling_min_waiting : the ceiling evidence: the batch grew at most
        this share over the last doubling of load, with at least this many requests waiting.
    ceiling_kv_usage : KV usage at the highest load that, with requests waiting, is a ceiling.
    saturation_step_slowdown : step-time growth from the lowest to the highest load that
        counts as evidence of a limit (as the bottleneck classifier's compute rule).
    bins_per_doubling : log-spaced bins per factor of two in load.
    min_count : windows per bin at least.
    min_steps, min_load, min_busy_ratio : window filters.
    """

    def __init__(
        self,
        *,
        knee_fraction: float = 0.9,
        saturation_margin: float = 1.5,
        ceiling_batch_growth: float = 0.1,
        ceiling_min_waiting: float = 1.0,
        ceiling_kv_usage: float = 0.9,
        saturation_step_slowdown: float = 0.25,
        bins_per_doubling: int = 2,
        min_count: int = 3,
        min_steps: int = 5,
        min_load: float = 0.5,
        min_busy_ratio: float = 0.6,
    ) -> None:
        self.knee_fraction = knee_fraction
        self.saturation_margin = saturation_margin
        self.ceiling_batch_growth = ceiling_batch_growth
        self.ceiling_min_waiting = ceiling_min_waiting
        self.ceiling_kv_usage = ceiling_kv_usage
        self.saturation_step_slowdown = saturation_step_slowdown
        self.bins_per_doubling = bins_per_doubling
        self.min_count = min_count
        self.min_steps = min_steps
        self.min_load = min_load
        self.min_busy_ratio = min_busy_ratio

    def fit(self, windows: pd.DataFrame) -> ThroughputCurve:
        """Fit on one engine's 1-second windows (collector ``windows_1s`` columns)."""
        if not 0 < self.knee_fraction <= 1:
            raise ValueError(f"knee_fraction must be in (0, 1], got {self.knee_fraction}")
        w = active_windows(
            prepare_windows(windows),
            min_steps=self.min_steps,
            min_load=self.min_load,
            min_busy_ratio=self.min_busy_ratio,
        )
        if len(w) < max(2 * self.min_count, 4):
            raise NotEnoughData(f"{len(w)} usable windows; need {max(2 * self.min_count, 4)}")
        edges = load_bins(
            w["load"].to_numpy(), bins_per_doubling=self.bins_per_doubling, min_count=self.min_count
        )
        w = w.assign(
            bin=np.clip(np.searchsorted(edges, w["load"], side="right") - 1, 0, len(edges) - 2)
        )
        g = w.groupby("bin")
        bins = pd.DataFrame(
            {
                "load": g["load"].median(),
                "load_lo": g["load"].min(),
                "load_hi": g["load"].max(),
                "n_windows": g.size(),
                # Means, not medians: the mean of a bin's 1-second counts is its rate.
                # Prompt tokens are counted once per request, when its prefill
                # completes, so they arrive in bursts; and generated tokens/s turn
                # bimodal where vLLM preempts (a second stalled recomputing evicted
                # requests, the next at the full batch): a median of such seconds
                # picks either mode (222 or 1,111 tok/s around a true 632 on a
                # KV-starved engine).
                "gen_tokens_per_s": g["gen_tokens_per_s"].agg(level_rate),
                "total_tokens_per_s": g["total_tokens_per_s"].mean(),
                "computed_tokens_per_s": g["computed_tokens_per_s"].mean(),
                "batch": g["batch_mean"].median(),
                "waiting": g["waiting_mean"].median(),
                "kv_usage": g["kv_usage_mean"].median(),
                "preemptions_per_s": g["preemptions"].mean(),
                "steps_per_s": g["steps_per_s"].median(),
            }
        ).reset_index(drop=True)
        weights = bins["n_windows"].to_numpy(float)
        bins["gen_fit"] = isotonic_increasing(bins["gen_tokens_per_s"].to_numpy(), weights)
        bins["total_fit"] = isotonic_increasing(bins["total_tokens_per_s"].to_numpy(), weights)
        bins["work_fit"] = isotonic_increasing(bins["computed_tokens_per_s"].to_numpy(), weights)
        self.windows_ = w
        self.bins_ = bins
        x = bins["load"].to_numpy(float)
        fit = bins["gen_fit"].to_numpy(float)
        self.plateau_tokens_per_s_ = float(fit.max())
        self.plateau_total_tokens_per_s_ = float(bins["total_fit"].max())
        self.knee_load_ = interp_crossing(x, fit, self.knee_fraction * self.plateau_tokens_per_s_)
        self.max_load_ = float(x[-1])
        batch_fit = isotonic_increasing(bins["batch"].to_numpy(float), weights)
        self.batch_growth_last_doubling_ = self._growth(x, batch_fit)
        # Where the batch stopped growing while requests waited, a limit bound: more load
        # past it only queues, so the knee lies at or below it (see step 5).
        self.batch_ceiling_load_: float | None = None
        top_batch = float(batch_fit.max())
        at_ceiling = (batch_fit >= (1.0 - self.ceiling_batch_growth) * top_batch) & (
            bins["waiting"].to_numpy(float) >= self.ceiling_min_waiting
        )
        if top_batch > 0 and at_ceiling.any():
            self.batch_ceiling_load_ = float(x[int(np.argmax(at_ceiling))])
            self.knee_load_ = min(self.knee_load_, self.batch_ceiling_load_)
        # Where the KV cache was full while requests waited, the blocks bound: the same.
        self.kv_ceiling_load_: float | None = None
        kv_full = (bins["kv_usage"].to_numpy(float) >= self.ceiling_kv_usage) & (
            bins["waiting"].to_numpy(float) >= self.ceiling_min_waiting
        )
        if kv_full.any():
            self.kv_ceiling_load_ = float(x[int(np.argmax(kv_full))])
            self.knee_load_ = min(self.knee_load_, self.kv_ceiling_load_)
        # The batch the engine held from its lowest ceiling on (the median over those
        # windows): past it requests only wait for a slot or for blocks, so a cap above
        # it admits them to vLLM's queue. The ceiling's load counts the waiting requests
        # that first showed it (3.9 in flight on a cache holding 2.9 requests).
        self.ceiling_batch_: float | None = None
        ceilings = [c for c in (self.batch_ceiling_load_, self.kv_ceiling_load_) if c is not None]
        self.ceiling_load_ = min(ceilings) if ceilings else None
        if self.ceiling_load_ is not None:
            first = int(np.searchsorted(x, self.ceiling_load_))
            bin_ids = np.sort(w["bin"].unique())
            held = w.loc[w["bin"] >= bin_ids[first], "batch_mean"].astype(float)
            if len(held) and math.isfinite(float(held.median())):
                self.ceiling_batch_ = float(held.median())
                # Past the batch it held, the engine only queues: throughput stops
                # growing there at the latest (as the cap reads it, see cap.py).
                self.knee_load_ = min(self.knee_load_, self.ceiling_batch_)
        self.waiting_at_max_load_ = float(bins["waiting"].iloc[-1])
        self.preemptions_at_max_load_ = self._at_max_load(w, "preemptions")
        self.past_knee_ = bool(
            len(x) > 1 and self.max_load_ >= self.saturation_margin * self.knee_load_
        )
        self.kv_usage_at_max_load_ = float(bins["kv_usage"].iloc[-1])
        self.kv_ceiling_ = bool(
            self.waiting_at_max_load_ >= self.ceiling_min_waiting
            and self.kv_usage_at_max_load_ >= self.ceiling_kv_usage
        )
        self.ceiling_ = self.kv_ceiling_ or bool(
            self.batch_growth_last_doubling_ is not None
            and self.batch_growth_last_doubling_ <= self.ceiling_batch_growth
            and self.waiting_at_max_load_ >= self.ceiling_min_waiting
        )
        # Past the knee counts only with the engine's own evidence of a limit there.
        steps_low, steps_top = (
            float(bins["steps_per_s"].iloc[0]),
            float(bins["steps_per_s"].iloc[-1]),
        )
        slowdown = steps_low / steps_top - 1.0 if steps_top > 0 else math.nan
        self.step_slowdown_ = slowdown
        # The work done (computed prompt + generated tokens) against load: slower steps
        # are a limit only where the work per second stopped growing too. When the mix
        # shifts to longer prompts with load, steps slow and generated tokens flatten
        # while the engine does ever more work.
        work = bins["work_fit"].to_numpy(float)
        self.work_knee_load_ = interp_crossing(x, work, self.knee_fraction * float(work.max()))
        self.work_growth_last_doubling_ = self._growth(x, work)
        self.work_past_knee_ = bool(
            len(x) > 1 and self.max_load_ >= self.saturation_margin * self.work_knee_load_
        )
        self.limit_evidence_ = bool(
            self.waiting_at_max_load_ >= self.ceiling_min_waiting
            or float(bins["preemptions_per_s"].iloc[-1]) > 0
            or (
                math.isfinite(slowdown)
                and slowdown >= self.saturation_step_slowdown
                and self.work_past_knee_
            )
        )
        self.flat_without_evidence_ = self.past_knee_ and not self.limit_evidence_
        self.saturated_ = (self.past_knee_ and self.limit_evidence_) or self.ceiling_
        raw = bins["gen_tokens_per_s"].to_numpy(float)
        self.peak_load_ = float(x[int(np.argmax(raw))])
        self.drop_past_peak_ = float(1.0 - raw[-1] / raw.max()) if raw.max() > 0 else 0.0
        self.growth_last_doubling_ = self._growth(x, fit)
        return self

    def _at_max_load(self, w: pd.DataFrame, col: str) -> float:
        """The mean of ``col`` over the kept windows within half a bin (in log load) of
        the highest load a window held, those of the whole top bin where fewer than
        ``min_count`` lie there.

        The top bin spans whatever load range merging left it, and its median load
        (``max_load_``) can sit well below its top: a mean over the whole bin mixes lower
        load levels in and underprices the overload's preemptions. See
        docs/advise.md#how-well-it-decides."""
        top = w[w["bin"] == w["bin"].max()]
        highest = float(top["load"].max())
        near = top[top["load"] >= highest * 2.0 ** (-0.5 / self.bins_per_doubling)]
        v = (near if len(near) >= self.min_count else top)[col]  # numeric: prepare_windows
        return float(v.mean()) if v.notna().any() else math.nan

    @staticmethod
    def _growth(x: np.ndarray, fit: np.ndarray) -> float | None:
        half = x[-1] / 2.0
        if len(x) < 2 or half < x[0]:
            return None
        at_half = float(np.interp(half, x, fit))
        return float(fit[-1] / at_half - 1.0) if at_half > 0 else None

    def predict(self, load: float | np.ndarray) -> np.ndarray:
        """Fitted generation tokens/s at the given load(s) (flat beyond the data)."""
        return np.interp(
            np.asarray(load, float),
            self.bins_["load"].to_numpy(float),
            self.bins_["gen_fit"].to_numpy(float),
        )

    def headroom_text(self) -> str:
        g = self.growth_last_doubling_
        if self.saturated_ and not self.past_knee_:
            batch = self.bins_["batch"].to_numpy(float)
            grow = f" (throughput {g:+.0%})" if g is not None else ""
            if self.kv_ceiling_:
                return (
                    f"saturated: at {self.max_load_:.1f} in flight the KV cache was "
                    f"{self.kv_usage_at_max_load_:.0%} full while "
                    f"{self.waiting_at_max_load_:.1f} requests waited for blocks{grow}: "
                    "the batch is what fits in the cache and more load only queues"
                )
            return (
                f"saturated: over the last doubling of load (to {self.max_load_:.1f} in flight) "
                f"the batch stood at {batch[-1]:.1f} while {self.waiting_at_max_load_:.1f} "
                f"requests waited{grow}: a limit binds and more load only queues"
            )
        if self.saturated_:
            grow = f"; {g:+.0%} throughput over the last doubling" if g is not None else ""
            return (
                f"saturated: load reached {self.max_load_:.1f} in flight, "
                f"{self.max_load_ / self.knee_load_:.1f}x the knee{grow}"
            )
        grow = f" (it grew {g:+.0%} over the last doubling)" if g is not None else ""
        if self.flat_without_evidence_:
            return (
                f"not saturated: generated tokens/s flattened up to {self.max_load_:.1f} in "
                f"flight, but nothing at the engine shows a limit there (no queue, no "
                f"preemptions, {self._steps_text()}); a change in the request mix bends "
                "this curve, a limit does not"
            )
        return (
            f"not saturated: highest load seen {self.max_load_:.1f} in flight, "
            f"throughput still rising{grow}; the plateau lies beyond the observed range"
        )

    def _steps_text(self) -> str:
        slow = self.step_slowdown_
        if not (math.isfinite(slow) and slow >= self.saturation_step_slowdown):
            return f"steps no slower: {slow:+.0%} step time"
        w = self.work_growth_last_doubling_
        grew = f" ({w:+.0%} over the last doubling)" if w is not None else ""
        return (
            f"steps {slow:+.0%} slower, but the work done (computed prompt and generated "
            f"tokens/s) still grew{grew}"
        )

    def finding(self, scope: Scope) -> Finding:
        """The curve as a finding, with the binned frame for a plot."""
        n = int(self.bins_["n_windows"].sum())
        summary = (
            f"throughput plateau {self.plateau_tokens_per_s_:,.0f} generated tok/s "
            f"({self.plateau_total_tokens_per_s_:,.0f} total), knee at "
            f"{self.knee_load_:.1f} requests in flight; {self.headroom_text()}"
        )
        conf = min(1.0, n / 40.0) * min(1.0, len(self.bins_) / 4.0)
        return Finding(
            kind="throughput_curve",
            scope=scope,
            summary=summary,
            severity="warning" if self.saturated_ else "info",
            confidence=round(conf, 3),
            evidence={
                "plateau_tokens_per_s": self.plateau_tokens_per_s_,
                "plateau_total_tokens_per_s": self.plateau_total_tokens_per_s_,
                "knee_concurrency": self.knee_load_,
                "saturated": self.saturated_,
                "max_load": self.max_load_,
                "peak_load": self.peak_load_,
                "drop_past_peak_ratio": self.drop_past_peak_,
                "growth_last_doubling_ratio": self.growth_last_doubling_,
                "batch_growth_last_doubling_ratio": self.batch_growth_last_doubling_,
                "waiting_at_max_load": self.waiting_at_max_load_,
                "saturated_by_ceiling": self.ceiling_ and not self.past_knee_,
                "kv_ceiling": self.kv_ceiling_,
                "kv_usage_at_max_load": self.kv_usage_at_max_load_,
                "kv_ceiling_load": self.kv_ceiling_load_,
                "limit_evidence": self.limit_evidence_,
                "flat_without_evidence": self.flat_without_evidence_,
                "step_slowdown_ratio": self.step_slowdown_,
                "work_knee_load": self.work_knee_load_,
                "work_growth_last_doubling_ratio": self.work_growth_last_doubling_,
                "work_past_knee": self.work_past_knee_,
                "knee_fraction": self.knee_fraction,
                "batch_ceiling_load": self.batch_ceiling_load_,
                "ceiling_batch": self.ceiling_batch_,
                "n_windows": n,
                "n_bins": len(self.bins_),
            },
            frame=frame_of(self.bins_, list(self.bins_.columns)),
        )


def fitted_at(curve: ThroughputCurve, load: float) -> float:
    """Fitted throughput at ``load`` as a share of the plateau."""
    p = curve.plateau_tokens_per_s_
    return float(curve.predict(load)) / p if p > 0 and math.isfinite(p) else math.nan

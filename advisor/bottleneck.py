"""Why throughput stops growing: the bottleneck at the plateau, with its evidence.

Over the windows of the plateau region (at or past the knee of a fitted
:class:`~kvscope.advisor.curve.ThroughputCurve`; for an engine not saturated, its highest
load bin) :class:`BottleneckClassifier` takes medians of KV usage, batch, queue and
computed tokens per step, the preemptions per finished request and the blocks a waiting
request needs to be admitted. Each class is named only on positive evidence, in order:

1. ``kv_cache_bound``: the free blocks cannot hold the next waiting request, or requests
   wait while vLLM preempts (it preempts only when no block is free).
2. ``max_num_seqs_bound``: the batch is pinned at ``max_num_seqs``, the cache not full.
3. ``token_budget_bound``: steps are full at the token budget and the step-time model
   predicts that doubling it raises the prefill rate by ``min_budget_gain`` or more (its
   95% interval's lower end); ``compute_bound`` when even the upper end is below, else
   ``unexplained``.
4. ``unexplained``: requests wait while every limit has room (vLLM would admit them).
5. ``frontend_bound``: no queue, and requests spend much of their life outside the core.
6. ``compute_bound``: no queue, every limit with room, and steps got slower with the work.
7. ``unexplained`` otherwise. An engine not saturated carries the class it approaches.

Preemption thrash is flagged beside the class. Confidence is the share of plateau windows
meeting the winning rule. Every threshold is in :meth:`BottleneckClassifier.parameters`
and the report, so a verdict can be reproduced.

See docs/advise.md#the-bottleneck-classifier.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from kvscope.advisor.curve import ThroughputCurve
from kvscope.advisor.findings import Finding, Scope
from kvscope.advisor.frames import covered_seconds, request_weights
from kvscope.advisor.steptime import StepTimeModel

_TEXT = {
    "kv_cache_bound": "the KV cache is full: the free blocks cannot hold the next waiting "
    "request, the batch cannot grow, requests queue{pre}",
    "max_num_seqs_bound": "the batch is pinned at max_num_seqs={cap} with KV cache to spare",
    "token_budget_bound": "steps are filled to max_num_batched_tokens={budget} and bigger "
    "steps would amortise the per-step cost (doubling the budget: {gain} prefill rate)",
    "compute_bound": "each step slows as the work grows (KV has room, batch below the cap, "
    "{budget_text})",
    "frontend_bound": "requests spend {fe_share} of their life outside the engine core "
    "({fe_s} of {e2e_s} at the median: the API server rendering, tokenising, handing them "
    "over and streaming their tokens back) while the engine has room (no queue, KV and "
    "sequence slots free, {budget_text})",
    "unexplained": "{why}",
}

_WHY_QUEUE = (
    "requests wait while the KV cache, the sequence slots and the token budget all have "
    "room; vLLM's scheduler does not leave requests waiting in that state, so something "
    "outside these limits holds them (for one, a front end that cannot feed the engine)"
)
_WHY_NONE = "no limit shows: no queue, KV and sequence slots with room, steps not slowing"
_WHY_BUDGET = (
    "steps are full at max_num_batched_tokens={budget}, but without a step-time fit "
    "nothing tells whether a larger budget would raise throughput"
)
_WHY_BUDGET_UNSURE = (
    "steps are full at max_num_batched_tokens={budget}, but the step-time fit cannot tell "
    "whether a larger budget would pay: doubling it predicts {gain:+.0%} (95% interval "
    "{lo:+.0%} to {hi:+.0%}) against the {min_gain:.0%} that would make it the limit"
)


def _num(cfg: dict[str, Any], key: str) -> float:
    try:
        v = float(cfg.get(key))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan
    return v if math.isfinite(v) and v > 0 else math.nan


def _col(df: pd.DataFrame, name: str) -> pd.Series:
    if name in df:
        return pd.to_numeric(df[name], errors="coerce").astype(float)
    return pd.Series(np.nan, index=df.index, dtype=float)


def _pct(x: float) -> str:
    return f"{x:.0%}" if math.isfinite(x) else "?"


def _secs(x: float) -> str:
    if not math.isfinite(x):
        return "?"
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def _count(requests: pd.DataFrame) -> float:
    """Requests the rows stand for (rows read from histograms carry a ``weight``)."""
    return float(request_weights(requests).sum())


class BottleneckClassifier:
    """Names the ceiling at the plateau, with its evidence and confidence.

    Parameters
    ----------
    seq_cap_ratio : batch / ``max_num_seqs`` that counts as pinned at the cap.
    budget_fill : computed tokens per step / ``max_num_batched_tokens`` that counts as full.
    min_budget_gain : predicted prefill-rate gain from doubling the budget that makes a full
        budget the limit, judged on the prediction's 95% interval; a doubled budget also
        lengthens every step that holds decoding requests, so a small gain is no advice.
        The controls that set it: docs/advise.md#the-bottleneck-classifier.
    min_step_slowdown : growth of step time from the lowest load to the plateau that shows
        compute.
    queue_min : median waiting requests that count as a persistent queue.
    frontend_share : median share of a finished request's end-to-end latency outside the
        engine core that names the front end.
    need_quantile : quantile of the observed requests' admission need, in blocks.
    kv_slack_blocks : blocks beside the need that still count as full.
    kv_full_fallback : KV usage counted as full where the need cannot be derived.
    kv_preemptions_per_request : preemptions per finished request that, with a queue, show a
        full cache whatever the sampled usage.
    thrash_drop, thrash_preemptions_per_request : fall of the highest load's raw throughput
        below the best bin's, and preemptions per finished request there, that flag thrash.
    min_windows : plateau windows for full confidence.
    """

    def __init__(
        self,
        *,
        seq_cap_ratio: float = 0.9,
        budget_fill: float = 0.7,
        min_budget_gain: float = 0.25,
        min_step_slowdown: float = 0.25,
        queue_min: float = 1.0,
        frontend_share: float = 0.25,
        need_quantile: float = 0.9,
        kv_slack_blocks: float = 1.0,
        kv_full_fallback: float = 0.9,
        kv_preemptions_per_request: float = 0.05,
        thrash_drop: float = 0.1,
        thrash_preemptions_per_request: float = 0.5,
        min_windows: int = 10,
    ) -> None:
        self.seq_cap_ratio = seq_cap_ratio
        self.budget_fill = budget_fill
        self.min_budget_gain = min_budget_gain
        self.min_step_slowdown = min_step_slowdown
        self.queue_min = queue_min
        self.frontend_share = frontend_share
        self.need_quantile = need_quantile
        self.kv_slack_blocks = kv_slack_blocks
        self.kv_full_fallback = kv_full_fallback
        self.kv_preemptions_per_request = kv_preemptions_per_request
        self.thrash_drop = thrash_drop
        self.thrash_preemptions_per_request = thrash_preemptions_per_request
        self.min_windows = min_windows

    def parameters(self) -> dict[str, float]:
        """Every threshold the rules use (the report carries them)."""
        return {
            "seq_cap_ratio": self.seq_cap_ratio,
            "budget_fill": self.budget_fill,
            "min_budget_gain": self.min_budget_gain,
            "min_step_slowdown": self.min_step_slowdown,
            "queue_min": self.queue_min,
            "frontend_share": self.frontend_share,
            "need_quantile": self.need_quantile,
            "kv_slack_blocks": self.kv_slack_blocks,
            "kv_full_fallback": self.kv_full_fallback,
            "kv_preemptions_per_request": self.kv_preemptions_per_request,
            "thrash_drop": self.thrash_drop,
            "thrash_preemptions_per_request": self.thrash_preemptions_per_request,
            "min_windows": self.min_windows,
        }

    # -- evidence ---------------------------------------------------------------------------

    @staticmethod
    def _finished_in(requests: pd.DataFrame | None, windows: pd.DataFrame) -> pd.DataFrame | None:
        """The requests that finished inside the given windows (the seconds they cover)."""
        if requests is None or not len(requests) or "finished_unix_s" not in requests:
            return None
        fin = np.floor(pd.to_numeric(requests["finished_unix_s"], errors="coerce"))
        secs = set(covered_seconds(windows)[0].tolist())
        done = requests[fin.isin(secs)]
        if "finish_reason" in done:
            done = done[done["finish_reason"] != "abort"]
        return done

    def _admission_need(
        self, requests: pd.DataFrame | None, block_size: float, budget: float
    ) -> tuple[float, float]:
        """Tokens and blocks a waiting request needs to be admitted: its uncached prompt
        (one chunk of at most the budget) and one more token, at ``need_quantile``."""
        if requests is None or not len(requests) or not math.isfinite(block_size):
            return math.nan, math.nan
        p = _col(requests, "prompt_tokens").fillna(0.0)
        c = _col(requests, "cached_tokens").fillna(0.0)
        tokens = (p - c).clip(lower=0.0) + 1.0
        if math.isfinite(budget):
            tokens = tokens.clip(upper=budget)
        blocks = np.ceil(tokens / block_size)
        return (
            float(tokens.quantile(self.need_quantile)),
            float(blocks.quantile(self.need_quantile)),
        )

    @staticmethod
    def _frontend(done: pd.DataFrame | None) -> tuple[float, float, float]:
        """Median share of a finished request's end-to-end latency spent outside the
        engine core (``e2e - queue - prefill - decode``), and the medians of that time
        and of the end-to-end latency in seconds. NaN without per-request rows (rows
        read from histograms, with a ``weight``, do not pair the intervals)."""
        if done is None or not len(done) or "weight" in done:
            return math.nan, math.nan, math.nan
        e2e = _col(done, "e2e_s")
        inside = _col(done, "queue_s") + _col(done, "prefill_s") + _col(done, "decode_s")
        outside = (e2e - inside).clip(lower=0.0)
        ok = (e2e > 0) & outside.notna()
        if not ok.any():
            return math.nan, math.nan, math.nan
        return (
            float((outside[ok] / e2e[ok]).median()),
            float(outside[ok].median()),
            float(e2e[ok].median()),
        )

    def fit(
        self,
        curve: ThroughputCurve,
        config: dict[str, Any],
        requests: pd.DataFrame | None = None,
        steps: StepTimeModel | None = None,
    ) -> BottleneckClassifier:
        """Classify from a fitted curve (its kept windows), the engine's configuration,
        the finished requests (admission need, preemptions per request) and the step-time
        model (whether a larger token budget would pay)."""
        w = curve.windows_
        if curve.saturated_:
            region = w[w["load"] >= curve.knee_load_]
        else:
            region = w[w["bin"] == w["bin"].max()]
        cap = _num(config, "max_num_seqs")
        budget = _num(config, "max_num_batched_tokens")
        n_blocks = _num(config, "num_gpu_blocks")
        block_size = _num(config, "block_size")
        kv = region["kv_usage_mean"].astype(float)
        batch = region["batch_mean"].astype(float)
        hits = _col(region, "prefix_hits").fillna(0.0)
        prompt = region["prompt_tokens"].astype(float).fillna(0.0)
        computed_prompt = (prompt - hits).clip(lower=0.0)
        n_steps = region["n_steps"].astype(float)
        n_steps = n_steps.where(n_steps > 0)
        computed_per_step = (computed_prompt + region["gen_tokens_per_s"].astype(float)) / n_steps
        fill = computed_per_step / budget
        low = w[w["bin"] == w["bin"].min()]
        done = self._finished_in(requests, region) if "ts_s" in region else None
        need_tokens, need_blocks = self._admission_need(
            done if done is not None and len(done) else requests, block_size, budget
        )
        ev: dict[str, Any] = {
            "n_windows": len(region),
            "load_median": float(region["load"].median()),
            "kv_usage_median": float(kv.median()),
            "kv_usage_max_full_share": float((region["kv_usage_max"] >= 0.99).mean()),
            "batch_median": float(batch.median()),
            "batch_p90_median": float(pd.to_numeric(region["batch_p90"]).median()),
            "waiting_median": float(region["waiting_mean"].median()),
            "preemptions_per_s": float(region["preemptions"].mean()),
            "tokens_per_step_median": float(region["tokens_per_step"].median()),
            "computed_tokens_per_step_median": float(computed_per_step.median()),
            "max_num_seqs": cap,
            "max_num_batched_tokens": budget,
            "num_gpu_blocks": n_blocks,
            "block_size": block_size,
            "budget_fill_median": float(fill.median()),
            "steps_per_s_plateau": float(region["steps_per_s"].median()),
            "steps_per_s_low_load": float(low["steps_per_s"].median()),
            "batch_low_load": float(low["batch_mean"].median()),
            "admission_need_tokens": need_tokens,
            "admission_need_blocks": need_blocks,
        }
        # KV full: the free blocks cannot hold the next waiting request.
        free_blocks = (1.0 - kv) * n_blocks
        if math.isfinite(n_blocks) and math.isfinite(need_blocks):
            limit = need_blocks + self.kv_slack_blocks
            kv_threshold = max(0.0, 1.0 - limit / n_blocks)
            ev["kv_full_from"] = "admission_need"
        else:
            kv_threshold = self.kv_full_fallback
            ev["kv_full_from"] = "fallback_share"
        ev["kv_full_threshold"] = kv_threshold
        ev["free_blocks_median"] = float(free_blocks.median())
        kv_full_w = kv >= kv_threshold
        kv_full = ev["kv_usage_median"] >= kv_threshold
        # Preemptions per finished request (vLLM preempts only when no block is free).
        finished_per_s = (
            _count(done) / len(region) if done is not None and len(region) else math.nan
        )
        ev["finished_per_s"] = finished_per_s
        per_req = ev["preemptions_per_s"] / finished_per_s if finished_per_s > 0 else math.nan
        ev["preemptions_per_request"] = per_req
        pre_w = region["preemptions"].astype(float) > 0
        if math.isfinite(per_req):
            preempting_kv = per_req >= self.kv_preemptions_per_request
        else:  # no finished requests to normalise by: preempting in most seconds
            preempting_kv = bool(pre_w.mean() >= 0.5)
        queue = ev["waiting_median"] >= self.queue_min
        queue_w = region["waiting_mean"].astype(float) >= self.queue_min
        pinned = math.isfinite(cap) and ev["batch_median"] >= self.seq_cap_ratio * cap
        budget_full = math.isfinite(budget) and ev["budget_fill_median"] >= self.budget_fill
        # Would twice the budget pay? Twice the work per step for one per-step cost.
        gain = gain_lo = gain_hi = math.nan
        if budget_full and steps is not None:
            pp = float((computed_prompt / n_steps).median())
            gp = float((region["gen_tokens_per_s"].astype(float) / n_steps).median())
            gain, gain_lo, gain_hi = steps.budget_gain(pp, gp)
        ev["budget_doubling_gain_ratio"] = gain
        ev["budget_doubling_gain_low"] = gain_lo
        ev["budget_doubling_gain_high"] = gain_hi
        slowdown = (
            ev["steps_per_s_low_load"] / ev["steps_per_s_plateau"] - 1.0
            if ev["steps_per_s_plateau"] > 0
            else math.nan
        )
        ev["step_slowdown_ratio"] = slowdown
        slowing = math.isfinite(slowdown) and slowdown >= self.min_step_slowdown
        fe_share, fe_s, e2e_s = self._frontend(done)
        ev["frontend_share_median"] = fe_share
        ev["frontend_s_median"] = fe_s
        ev["e2e_s_median"] = e2e_s
        frontend = math.isfinite(fe_share) and fe_share >= self.frontend_share
        ev["kv_full_from_preemptions"] = False
        ev["prefill_bound"] = False
        why = ""
        if kv_full and (not pinned or ev["preemptions_per_s"] > 0):
            label, share = "kv_cache_bound", float((kv_full_w | (pre_w & preempting_kv)).mean())
        elif preempting_kv and bool(queue_w.any()) and not pinned:
            label, share = "kv_cache_bound", float((pre_w | kv_full_w).mean())
            ev["kv_full_from_preemptions"] = True
        elif pinned:
            label, share = "max_num_seqs_bound", float((batch >= self.seq_cap_ratio * cap).mean())
        elif budget_full and math.isfinite(gain_lo) and gain_lo >= self.min_budget_gain:
            label, share = "token_budget_bound", float((fill >= self.budget_fill).mean())
        elif budget_full and math.isfinite(gain_hi) and gain_hi < self.min_budget_gain:
            label, share = "compute_bound", float((fill >= self.budget_fill).mean())
            ev["prefill_bound"] = True
        elif budget_full:
            label, share = "unexplained", float((fill >= self.budget_fill).mean())
            why = (
                _WHY_BUDGET_UNSURE.format(
                    budget=_fmt_int(budget),
                    gain=gain,
                    lo=gain_lo,
                    hi=gain_hi,
                    min_gain=self.min_budget_gain,
                )
                if math.isfinite(gain)
                else _WHY_BUDGET.format(budget=_fmt_int(budget))
            )
        elif queue:
            label, share = "unexplained", float(queue_w.mean())
            why = _WHY_QUEUE
        elif frontend:
            label, share = "frontend_bound", float((~queue_w).mean())
        elif slowing:
            label, share = "compute_bound", float((~queue_w).mean())
        else:
            label, share = "unexplained", 1.0
            why = _WHY_NONE
        ev["why"] = why
        raw = curve.bins_["gen_tokens_per_s"].to_numpy(float)
        top_pre = float(curve.bins_["preemptions_per_s"].iloc[-1])
        top = w[w["bin"] == w["bin"].max()]
        top_done = self._finished_in(requests, top) if "ts_s" in top else None
        top_fin = _count(top_done) / len(top) if top_done is not None and len(top) else math.nan
        top_per_req = top_pre / top_fin if top_fin > 0 else math.nan
        thrashing = (
            top_per_req >= self.thrash_preemptions_per_request
            if math.isfinite(top_per_req)
            else bool((top["preemptions"].astype(float) > 0).mean() >= 0.5)
        )
        self.thrash_ = bool(
            curve.saturated_ and curve.drop_past_peak_ > self.thrash_drop and thrashing
        )
        ev["drop_past_peak_ratio"] = curve.drop_past_peak_
        ev["peak_tokens_per_s"] = float(np.max(raw))
        ev["top_bin_tokens_per_s"] = float(raw[-1])
        ev["top_bin_preemptions_per_s"] = top_pre
        ev["top_bin_preemptions_per_request"] = top_per_req
        self.label_ = label
        self.saturated_ = curve.saturated_
        self.evidence_ = ev
        self.confidence_ = round(share * min(1.0, len(region) / self.min_windows), 3)
        return self

    @property
    def verdict_(self) -> str:
        """The label for the engine verdict: ``not_saturated`` below the knee, except a
        front end that limits the server while the engine itself has room."""
        if self.label_ == "frontend_bound":
            return self.label_
        return self.label_ if self.saturated_ else "not_saturated"

    @property
    def approaching_(self) -> str | None:
        """For an engine that is not saturated, the limit it approaches (None when no
        limit shows at its highest load)."""
        if self.saturated_ or self.label_ in ("unexplained", "frontend_bound"):
            return None
        return self.label_

    def describe(self) -> str:
        ev = self.evidence_
        pre = ""
        if ev["preemptions_per_s"] > 0:
            pre = f" and {ev['preemptions_per_s']:.1f} preemptions/s"
            if math.isfinite(ev["preemptions_per_request"]):
                pre += f" ({ev['preemptions_per_request']:.2f} per finished request)"
        if ev.get("kv_full_from_preemptions"):
            pre += ", full between the sampled usage readings"
        gain = ev["budget_doubling_gain_ratio"]
        gain_text = f"{gain:+.0%}" if math.isfinite(gain) else "?"
        lo, hi = (
            ev.get("budget_doubling_gain_low", math.nan),
            ev.get("budget_doubling_gain_high", math.nan),
        )
        if math.isfinite(lo) and math.isfinite(hi):
            gain_text += f" (95%: {lo:+.0%} to {hi:+.0%})"
        budget_text = (
            f"steps full at the token budget but step time grows with the tokens in them: "
            f"doubling it predicts {gain_text}"
            if ev.get("prefill_bound")
            else "steps below the token budget"
        )
        text = _TEXT[self.label_].format(
            pre=pre,
            cap=_fmt_int(ev["max_num_seqs"]),
            budget=_fmt_int(ev["max_num_batched_tokens"]),
            gain=gain_text,
            budget_text=budget_text,
            why=ev.get("why", ""),
            fe_share=_pct(ev.get("frontend_share_median", math.nan)),
            fe_s=_secs(ev.get("frontend_s_median", math.nan)),
            e2e_s=_secs(ev.get("e2e_s_median", math.nan)),
        )
        facts = (
            f"KV usage {ev['kv_usage_median']:.0%} (full at {ev['kv_full_threshold']:.1%}"
            f"{'' if ev['kv_full_from'] == 'admission_need' else ', a fixed share'}), batch "
            f"{ev['batch_median']:.1f} of max_num_seqs {_fmt_int(ev['max_num_seqs'])}, waiting "
            f"{ev['waiting_median']:.1f}, {ev['computed_tokens_per_step_median']:.0f} computed "
            f"tokens/step of {_fmt_int(ev['max_num_batched_tokens'])}, steps/s "
            f"{ev['steps_per_s_low_load']:.0f} -> {ev['steps_per_s_plateau']:.0f}"
        )
        if self.saturated_ or self.label_ == "frontend_bound":
            head = self.label_
        elif self.approaching_ is None:
            head = "not saturated; no limit in sight at the loads seen"
            return f"{head} ({facts})"
        else:
            head = f"not saturated; approaching {self.label_}"
        return f"{head}: {text} ({facts})"

    def findings(self, scope: Scope) -> list[Finding]:
        out = [
            Finding(
                kind="bottleneck",
                scope=scope,
                summary=self.describe(),
                severity="warning" if self.saturated_ else "info",
                confidence=self.confidence_,
                evidence={"bottleneck": self.verdict_, "limit": self.label_, **self.evidence_},
            )
        ]
        if self.thrash_:
            ev = self.evidence_
            out.append(
                Finding(
                    kind="preemption_thrash",
                    scope=scope,
                    severity="critical",
                    confidence=min(1.0, ev["drop_past_peak_ratio"] / (2 * self.thrash_drop)),
                    summary=(
                        f"preemption thrash: throughput falls {ev['drop_past_peak_ratio']:.0%} "
                        f"past its peak ({ev['peak_tokens_per_s']:,.0f} -> "
                        f"{ev['top_bin_tokens_per_s']:,.0f} tok/s) at "
                        f"{ev['top_bin_preemptions_per_s']:.1f} preemptions/s"
                        + (
                            f" ({ev['top_bin_preemptions_per_request']:.2f} per finished request)"
                            if math.isfinite(ev["top_bin_preemptions_per_request"])
                            else ""
                        )
                    ),
                    evidence={
                        k: ev[k]
                        for k in (
                            "drop_past_peak_ratio",
                            "peak_tokens_per_s",
                            "top_bin_tokens_per_s",
                            "top_bin_preemptions_per_s",
                            "top_bin_preemptions_per_request",
                        )
                    },
                )
            )
        return out


def _fmt_int(v: float) -> str:
    return "?" if not math.isfinite(v) else f"{v:.0f}"

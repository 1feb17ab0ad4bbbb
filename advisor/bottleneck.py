"""Why throughput stops growing: the bottleneck at the plateau, with its evidence.

Algorithm
---------
The classifier looks at the windows of the **plateau region**: those whose load is at
or beyond the knee of a fitted :class:`~kvscope.advisor.curve.ThroughputCurve` (when the
engine is not saturated, the windows of its highest load bin: what the engine is
*approaching*). Over those windows it takes medians of KV usage, running batch,
waiting queue, tokens per step (prompt + generated tokens / steps) and the mean
preemption rate, and applies the rules in this order:

1. ``token_budget_bound``: steps are filled to ``max_num_batched_tokens``: median
   tokens per step at least ``budget_fill`` of the budget, and KV usage below
   ``kv_full``. Long prefills fill the budget; requests queue while the KV cache has
   room. This rule comes first so a prompt-heavy replica queueing at low KV usage is
   never called KV-bound.
2. ``kv_cache_bound``: median KV usage at least ``kv_full`` while the batch stays
   below ``seq_cap_ratio`` x ``max_num_seqs`` (or preemptions happen at all). The
   waiting queue and the preemption rate are its supporting evidence. Also without
   the usage: requests queue, the batch stays below the cap and preemptions run at
   ``kv_preemptions_per_s`` or more. vLLM preempts only when a running request finds
   no free block, so this is the cache filling up between samples; it matters for
   usage read from a gauge sampled once per scrape (vLLM's own series), which reads
   the cache between steps and often lower than the per-step mean.
3. ``max_num_seqs_bound``: median batch at least ``seq_cap_ratio`` x ``max_num_seqs``
   with KV usage below ``kv_full``: the scheduler's sequence cap, not memory.
4. ``compute_bound``: none of the above. Its evidence is the step rate: steps per
   second at the plateau against the lowest load bin (each step got slower as the
   batch grew, so adding sequences stopped adding tokens).

**Preemption thrash** is flagged beside the label when the raw (not monotone-fitted)
median throughput of the highest load bin lies more than ``thrash_drop`` below the
best bin while preemptions run at ``thrash_min_preemptions_per_s`` or more there.

Confidence is the share of plateau windows that satisfy the winning rule's main
condition, times ``min(1, n / min_windows)``.

Parameters
----------
kv_full : KV usage ratio that counts as full (default 0.9).
seq_cap_ratio : batch / max_num_seqs ratio that counts as pinned at the cap (0.9).
budget_fill : tokens per step / max_num_batched_tokens that counts as a full step (0.7).
thrash_drop : relative fall of throughput past the peak that counts as thrash (0.1).
thrash_min_preemptions_per_s : preemption rate needed for thrash (1.0).
kv_preemptions_per_s : preemption rate (with a queue, below the sequence cap) that
    shows a full KV cache whatever the sampled usage (1.0).
min_windows : plateau windows for full confidence (10).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from kvscope.advisor.curve import ThroughputCurve
from kvscope.advisor.findings import Finding, Scope

_TEXT = {
    "kv_cache_bound": "the KV cache is full: the batch cannot grow, requests queue{pre}",
    "max_num_seqs_bound": "the batch is pinned at max_num_seqs={cap} with KV cache to spare",
    "token_budget_bound": "steps are filled to max_num_batched_tokens={budget} (long prefills) "
    "while the KV cache has room",
    "compute_bound": "each step slows as the batch grows (KV has room, batch below the cap, "
    "steps below the token budget)",
}


def _num(cfg: dict[str, Any], key: str) -> float:
    try:
        v = float(cfg.get(key))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan
    return v if math.isfinite(v) and v > 0 else math.nan


class BottleneckClassifier:
    """Names the ceiling at the plateau (see the module docstring)."""

    def __init__(
        self,
        *,
        kv_full: float = 0.9,
        seq_cap_ratio: float = 0.9,
        budget_fill: float = 0.7,
        thrash_drop: float = 0.1,
        thrash_min_preemptions_per_s: float = 1.0,
        min_windows: int = 10,
        kv_preemptions_per_s: float = 1.0,
    ) -> None:
        self.kv_full = kv_full
        self.seq_cap_ratio = seq_cap_ratio
        self.budget_fill = budget_fill
        self.thrash_drop = thrash_drop
        self.thrash_min_preemptions_per_s = thrash_min_preemptions_per_s
        self.min_windows = min_windows
        self.kv_preemptions_per_s = kv_preemptions_per_s

    def fit(self, curve: ThroughputCurve, config: dict[str, Any]) -> BottleneckClassifier:
        """Classify from a fitted curve (its kept windows) and the engine's configuration."""
        w = curve.windows_
        if curve.saturated_:
            region = w[w["load"] >= curve.knee_load_]
        else:
            region = w[w["bin"] == w["bin"].max()]
        cap = _num(config, "max_num_seqs")
        budget = _num(config, "max_num_batched_tokens")
        kv = region["kv_usage_mean"].astype(float)
        batch = region["batch_mean"].astype(float)
        fill = region["tokens_per_step"].astype(float) / budget
        low = w[w["bin"] == w["bin"].min()]
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
            "max_num_seqs": cap,
            "max_num_batched_tokens": budget,
            "budget_fill_median": float(fill.median()),
            "steps_per_s_plateau": float(region["steps_per_s"].median()),
            "steps_per_s_low_load": float(low["steps_per_s"].median()),
            "batch_low_load": float(low["batch_mean"].median()),
        }
        kv_full = ev["kv_usage_median"] >= self.kv_full
        pinned = math.isfinite(cap) and ev["batch_median"] >= self.seq_cap_ratio * cap
        budget_full = math.isfinite(budget) and ev["budget_fill_median"] >= self.budget_fill
        preempting = (
            ev["preemptions_per_s"] >= self.kv_preemptions_per_s and ev["waiting_median"] > 0
        )
        ev["kv_full_from_preemptions"] = False
        pre = region["preemptions"].astype(float) > 0
        shares: dict[str, float] = {
            "token_budget_bound": float((fill >= self.budget_fill).mean()),
            "kv_cache_bound": float(((kv >= self.kv_full) | (pre if preempting else False)).mean()),
            "max_num_seqs_bound": float((batch >= self.seq_cap_ratio * cap).mean())
            if math.isfinite(cap)
            else 0.0,
        }
        if budget_full and not kv_full:
            label = "token_budget_bound"
        elif kv_full and (not pinned or ev["preemptions_per_s"] > 0):
            label = "kv_cache_bound"
        elif preempting and not pinned:
            label = "kv_cache_bound"
            ev["kv_full_from_preemptions"] = True
        elif pinned:
            label = "max_num_seqs_bound"
        else:
            label = "compute_bound"
            shares["compute_bound"] = 1.0 - max(shares.values())
        raw = curve.bins_["gen_tokens_per_s"].to_numpy(float)
        top_pre = float(curve.bins_["preemptions_per_s"].iloc[-1])
        self.thrash_ = bool(
            curve.saturated_
            and curve.drop_past_peak_ > self.thrash_drop
            and top_pre >= self.thrash_min_preemptions_per_s
        )
        ev["drop_past_peak_ratio"] = curve.drop_past_peak_
        ev["peak_tokens_per_s"] = float(np.max(raw))
        ev["top_bin_tokens_per_s"] = float(raw[-1])
        ev["top_bin_preemptions_per_s"] = top_pre
        self.label_ = label
        self.saturated_ = curve.saturated_
        self.evidence_ = ev
        self.confidence_ = round(shares[label] * min(1.0, len(region) / self.min_windows), 3)
        return self

    @property
    def verdict_(self) -> str:
        """The label for the engine verdict: ``not_saturated`` below the knee."""
        return self.label_ if self.saturated_ else "not_saturated"

    def describe(self) -> str:
        ev = self.evidence_
        pre = ""
        if ev["preemptions_per_s"] > 0:
            pre = f" and {ev['preemptions_per_s']:.1f} preemptions/s"
        if ev.get("kv_full_from_preemptions"):
            pre += ", full between the sampled usage readings"
        text = _TEXT[self.label_].format(
            pre=pre, cap=_fmt_int(ev["max_num_seqs"]), budget=_fmt_int(ev["max_num_batched_tokens"])
        )
        facts = (
            f"KV usage {ev['kv_usage_median']:.0%}, batch {ev['batch_median']:.1f} of "
            f"max_num_seqs {_fmt_int(ev['max_num_seqs'])}, waiting {ev['waiting_median']:.1f}, "
            f"{ev['tokens_per_step_median']:.0f} tokens/step of "
            f"{_fmt_int(ev['max_num_batched_tokens'])}, steps/s "
            f"{ev['steps_per_s_low_load']:.0f} -> {ev['steps_per_s_plateau']:.0f}"
        )
        head = self.label_ if self.saturated_ else f"not saturated; approaching {self.label_}"
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
                    ),
                    evidence={
                        k: ev[k]
                        for k in (
                            "drop_past_peak_ratio",
                            "peak_tokens_per_s",
                            "top_bin_tokens_per_s",
                            "top_bin_preemptions_per_s",
                        )
                    },
                )
            )
        return out


def _fmt_int(v: float) -> str:
    return "?" if not math.isfinite(v) else f"{v:.0f}"

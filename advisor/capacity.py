"""KV capacity model: how many sequences the cache holds, the plateau that implies,
and what a configuration change would move it to.

:class:`KvCapacityModel` fits one engine from its finished requests, its configuration
and, where given, its windows:

1. Footprint: the KV tokens a running request holds, ``p - c + g/2`` on average (prompt,
   prefix-cached and generated tokens, weighted by ``g`` as the batch sees them), or read
   from vLLM's KV usage over the batch, at the plateau where KV is the limit.
2. Fill: the usage a KV-bound cache reached (vLLM leaves about one admission free).
3. KV-bound batch ``B_kv = KV tokens x fill / footprint``; the effective batch is at most
   ``max_num_seqs`` and the highest load seen.
4. Sequences held through their lives (``kv_sequences_held_``, the cap's bound): the
   largest ``C`` whose blocks (mean ``C x m``, standard deviation ``sqrt(C) x s`` over the
   requests' lives) fit the cache with ``kv_headroom_sigmas`` of headroom.
5. Plateau: the :class:`~kvscope.advisor.steptime.StepTimeModel` throughput at the
   effective batch, less the recomputation of preempted requests at the highest load, set
   against the observed :class:`~kvscope.advisor.curve.ThroughputCurve`.
6. What-ifs (:class:`WhatIf`), each a new block count through the same model: fp8 KV cache,
   a higher ``--gpu-memory-utilization``, ``--tensor-parallel-size 2``
   (``--max-model-len`` does not size the cache). :func:`replica_whatif` adds a replica.

See docs/advise.md#the-kv-capacity-model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvscope.advisor.curve import NotEnoughData
from kvscope.advisor.findings import Finding, Scope
from kvscope.advisor.steptime import StepTimeModel

_SIXTEEN_BIT = {"auto", "bfloat16", "bf16", "float16", "fp16", "half"}


_FOOTPRINT_FROM = {
    "plateau": "the KV usage vLLM reports at the plateau over the batch there",
    "kv_usage": "by the KV usage vLLM reports",
    "requests": "from its prompt and output",
}


@dataclass
class WhatIf:
    """One configuration change and the plateau it is predicted to give."""

    name: str
    flags: list[str]
    num_gpu_blocks: float
    kv_batch: float
    effective_batch: float
    plateau_tokens_per_s: float
    gain_ratio: float
    assumption: str
    extrapolated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _f(cfg: dict[str, Any], key: str, default: float = math.nan) -> float:
    try:
        v = float(cfg.get(key))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default
    return v if math.isfinite(v) else default


class KvCapacityModel:
    """Predicts the KV-bound batch and plateau, and the what-ifs.

    Parameters
    ----------
    target_gpu_memory_utilization : the setting the memory what-if raises to.
    min_requests : fewer finished requests raise ``NotEnoughData``.
    kv_headroom_sigmas : standard deviations of headroom the sequences held keep, against
        the cache overflowing as their outputs grow; the runs that chose the default:
        docs/advise.md#the-kv-capacity-model.
    """

    def __init__(
        self,
        *,
        target_gpu_memory_utilization: float = 0.95,
        min_requests: int = 10,
        kv_headroom_sigmas: float = 1.5,
    ) -> None:
        self.target_gpu_memory_utilization = target_gpu_memory_utilization
        self.min_requests = min_requests
        self.kv_headroom_sigmas = kv_headroom_sigmas

    def fit(
        self,
        requests: pd.DataFrame,
        config: dict[str, Any],
        steps: StepTimeModel,
        *,
        max_load: float,
        observed_plateau_tokens_per_s: float,
        observed_batch: float,
        preemptions_per_s: float = 0.0,
        windows: pd.DataFrame | None = None,
        kv_fill: float | None = None,
    ) -> KvCapacityModel:
        """``windows``: the engine's kept windows (for the measured footprint);
        ``kv_fill``: the KV usage the engine reached when the cache was its limit (with
        ``observed_batch``, the batch there, it gives the footprint at the plateau);
        ``preemptions_per_s``: the rate at the highest load seen."""
        r = requests
        if len(r) < self.min_requests:
            raise NotEnoughData(f"{len(r)} finished requests; need {self.min_requests}")
        p = pd.to_numeric(r["prompt_tokens"], errors="coerce").fillna(0).to_numpy(float)
        g = pd.to_numeric(r["generation_tokens"], errors="coerce").fillna(0).to_numpy(float)
        c = (
            pd.to_numeric(r["cached_tokens"], errors="coerce").fillna(0).to_numpy(float)
            if "cached_tokens" in r
            else np.zeros(len(r))
        )
        self.block_size_ = _f(config, "block_size", 16.0)
        self.num_gpu_blocks_ = _f(config, "num_gpu_blocks")
        self.max_num_seqs_ = _f(config, "max_num_seqs", math.inf)
        self.kv_tokens_ = self.num_gpu_blocks_ * self.block_size_
        weights = np.maximum(g, 1.0)
        held = np.maximum(p - c, 0.0) + g / 2.0
        self.footprint_formula_tokens_ = float(
            np.average(held, weights=weights) + self.block_size_ / 2
        )
        measured = self._measured_footprint(windows)
        self.footprint_top_load_tokens_ = measured
        fill = float(kv_fill) if kv_fill is not None and 0 < kv_fill <= 1 else 1.0
        at_plateau = fill * self.kv_tokens_ / float(observed_batch)
        if fill < 1 and observed_batch >= 2 and math.isfinite(at_plateau):
            self.footprint_from_, self.footprint_tokens_ = "plateau", at_plateau
        elif math.isfinite(measured):
            self.footprint_from_, self.footprint_tokens_ = "kv_usage", measured
        else:
            self.footprint_from_, self.footprint_tokens_ = (
                "requests",
                self.footprint_formula_tokens_,
            )
        self.kv_fill_ = fill
        self.slack_blocks_ = (1.0 - fill) * self.num_gpu_blocks_
        self.prompt_ratio_ = float(np.maximum(p - c, 0).sum() / max(g.sum(), 1.0))
        self.mean_prompt_tokens_ = float(p.mean())
        self.mean_generation_tokens_ = float(g.mean())
        self.mean_cached_tokens_ = float(c.mean())
        self.max_request_tokens_ = float((p + g).max())
        self.steps_ = steps
        self.max_load_ = float(max_load)
        self.kv_batch_ = self._kv_batch(self.num_gpu_blocks_)
        self.lifetime_blocks_mean_, self.lifetime_blocks_sd_ = self._lifetime_blocks(
            np.maximum(p - c, 0.0), g
        )
        self.kv_sequences_held_ = self._sequences_held(self.num_gpu_blocks_)
        self.effective_batch_ = self._effective(self.kv_batch_, self.max_num_seqs_)
        self.kv_limited_ = self.kv_batch_ <= min(self.max_num_seqs_, self.max_load_)
        self.preemptions_per_s_ = float(preemptions_per_s)
        if not math.isfinite(self.preemptions_per_s_):  # the source counts none
            self.preemptions_per_s_ = 0.0
        share = steps.preemption_time_share(self.preemptions_per_s_) if self.kv_limited_ else 0.0
        self.preemption_time_share_ = share
        self.predicted_plateau_clean_ = self._plateau(self.effective_batch_)
        self.predicted_plateau_tokens_per_s_ = self.predicted_plateau_clean_ * (1.0 - share)
        self.observed_plateau_tokens_per_s_ = float(observed_plateau_tokens_per_s)
        self.observed_batch_ = float(observed_batch)
        obs = self.observed_plateau_tokens_per_s_
        self.prediction_error_ratio_ = (
            self.predicted_plateau_tokens_per_s_ / obs - 1.0 if obs > 0 else math.nan
        )
        self.whatifs_ = self._whatifs(config)
        return self

    def _measured_footprint(self, windows: pd.DataFrame | None, min_windows: int = 5) -> float:
        """Median tokens held per running request over the windows of the highest
        loads (the top quarter by load, at least two sequences running); NaN with fewer
        than ``min_windows`` such windows or no usage reported."""
        if windows is None or not len(windows) or "kv_usage_mean" not in windows:
            return math.nan
        if not math.isfinite(self.kv_tokens_) or self.kv_tokens_ <= 0:
            return math.nan
        usage = pd.to_numeric(windows["kv_usage_mean"], errors="coerce").astype(float)
        batch = pd.to_numeric(windows["batch_mean"], errors="coerce").astype(float)
        load = pd.to_numeric(windows.get("load", batch), errors="coerce").astype(float)
        ok = (batch >= 2) & (usage > 0) & load.notna()
        if ok.sum() < min_windows:
            return math.nan
        top = ok & (load >= load[ok].quantile(0.75))
        if top.sum() < min_windows:
            top = ok
        return float((usage[top] * self.kv_tokens_ / batch[top]).median())

    def _kv_batch(self, blocks: float) -> float:
        """Sequences ``blocks`` hold: the blocks less the free ones vLLM leaves when the
        cache is full (a fixed number), over the footprint."""
        usable = max(blocks - self.slack_blocks_, 0.0)
        return usable * self.block_size_ / self.footprint_tokens_

    def _lifetime_blocks(
        self, uncached: np.ndarray, generated: np.ndarray, samples: int = 20_000
    ) -> tuple[float, float]:
        """Mean and standard deviation of the blocks a running request holds, over the
        requests (weighted by the steps each stays in the batch) and the steps of their
        lives (a fixed-seed sample of request-steps: the same data give the same answer)."""
        bs = self.block_size_
        g = np.maximum(generated, 1.0)
        if not len(g) or not math.isfinite(bs) or bs <= 0:
            return math.nan, math.nan
        rng = np.random.default_rng(0)
        i = rng.choice(len(g), samples, p=g / g.sum())
        t = np.floor(rng.random(samples) * g[i]) + 1.0
        blocks = np.ceil((uncached[i] + t) / bs)
        return float(blocks.mean()), float(blocks.std())

    def _sequences_held(self, blocks: float) -> int | None:
        """The most requests in flight whose blocks stay within ``blocks`` with
        ``kv_headroom_sigmas`` of headroom (at least 1; None without a block count)."""
        m, s = self.lifetime_blocks_mean_, self.lifetime_blocks_sd_
        if not (math.isfinite(blocks) and blocks > 0 and math.isfinite(m) and m > 0):
            return None
        z = self.kv_headroom_sigmas
        c = max(1, math.floor(blocks / m))
        while c > 1 and c * m + z * math.sqrt(c) * s > blocks:
            c -= 1
        return c

    def _effective(self, kv_batch: float, max_num_seqs: float) -> float:
        return float(min(kv_batch, max_num_seqs, self.max_load_))

    def _plateau(self, batch: float) -> float:
        return float(self.steps_.tokens_per_s(batch, self.prompt_ratio_, self.footprint_tokens_))

    def _variant(
        self,
        name: str,
        flags: list[str],
        blocks: float,
        assumption: str,
        max_num_seqs: float | None = None,
    ) -> WhatIf:
        kv_batch = self._kv_batch(blocks)
        cap = self.max_num_seqs_ if max_num_seqs is None else max_num_seqs
        eff = self._effective(kv_batch, cap)
        # More blocks end the preemptions only if the new batch fits the load.
        share = self.preemption_time_share_ if kv_batch < self.max_load_ else 0.0
        plateau = self._plateau(eff) * (1.0 - share)
        base = self.predicted_plateau_tokens_per_s_
        return WhatIf(
            name=name,
            flags=flags,
            num_gpu_blocks=blocks,
            kv_batch=kv_batch,
            effective_batch=eff,
            plateau_tokens_per_s=plateau,
            gain_ratio=plateau / base - 1.0 if base > 0 else math.nan,
            assumption=assumption,
            extrapolated=eff > self.steps_.batch_range_[1] * 1.25,
        )

    def _whatifs(self, cfg: dict[str, Any]) -> list[WhatIf]:
        out: list[WhatIf] = []
        blocks = self.num_gpu_blocks_
        dtype = str(cfg.get("kv_cache_dtype") or "auto").lower()
        if dtype in _SIXTEEN_BIT:
            out.append(
                self._variant(
                    "kv_cache_dtype_fp8",
                    ["--kv-cache-dtype fp8"],
                    2 * blocks,
                    "fp8 halves the bytes per KV token: 2x blocks in the same memory "
                    "(check the model's accuracy with an fp8 cache)",
                )
            )
        u = _f(cfg, "gpu_memory_utilization")
        t = self.target_gpu_memory_utilization
        if math.isfinite(u) and 0 < u < t:
            out.append(
                self._variant(
                    "gpu_memory_utilization",
                    [f"--gpu-memory-utilization {t:.2f}"],
                    blocks * t / u,
                    f"KV blocks assumed proportional to gpu_memory_utilization ({u:.2f} -> {t:.2f}); "
                    "a lower bound, since the weights take a fixed share",
                )
            )
        tp = _f(cfg, "tensor_parallel_size", 1.0)
        out.append(
            self._variant(
                "tensor_parallel_2",
                [f"--tensor-parallel-size {int(2 * tp)}"],
                2 * blocks,
                "KV memory doubles across two GPUs (more, as the weights are split); step time "
                "assumed unchanged; takes a second GPU per replica (compare: one more replica)",
            )
        )
        mml = _f(cfg, "max_model_len")
        if math.isfinite(mml):
            half = mml / 2
            w = self._variant(
                "shorter_max_model_len",
                [f"--max-model-len {int(half)}"],
                blocks,
                "vLLM v1 sizes the KV cache from memory, not from max_model_len: no more "
                "blocks; a shorter limit only rejects longer requests",
            )
            w.extra["requests_longer_than_limit_max_tokens"] = self.max_request_tokens_
            w.extra["would_reject_any"] = bool(self.max_request_tokens_ > half)
            out.append(w)
        return out

    def summary(self) -> str:
        return (
            f"KV cache {self.kv_tokens_:,.0f} tokens ({self.num_gpu_blocks_:,.0f} blocks x "
            f"{self.block_size_:.0f}); a request holds {self.footprint_tokens_:.0f} tokens on "
            f"average ({_FOOTPRINT_FROM[self.footprint_from_]}"
            f"{f', the cache fills to {self.kv_fill_:.0%}' if self.kv_fill_ < 1 else ''}) -> room "
            f"for {self.kv_batch_:.1f} sequences; predicted plateau "
            f"{self.predicted_plateau_tokens_per_s_:,.0f} tok/s at batch "
            f"{self.effective_batch_:.1f}, observed {self.observed_plateau_tokens_per_s_:,.0f} "
            f"tok/s at batch {self.observed_batch_:.1f} "
            f"({self.prediction_error_ratio_:+.0%})"
        )

    def finding(self, scope: Scope) -> Finding:
        ev: dict[str, Any] = {
            "kv_tokens": self.kv_tokens_,
            "num_gpu_blocks": self.num_gpu_blocks_,
            "block_size": self.block_size_,
            "footprint_tokens": self.footprint_tokens_,
            "footprint_from": self.footprint_from_,
            "footprint_formula_tokens": self.footprint_formula_tokens_,
            "footprint_top_load_tokens": self.footprint_top_load_tokens_,
            "kv_fill": self.kv_fill_,
            "mean_prompt_tokens": self.mean_prompt_tokens_,
            "mean_generation_tokens": self.mean_generation_tokens_,
            "mean_cached_tokens": self.mean_cached_tokens_,
            "prompt_ratio": self.prompt_ratio_,
            "kv_batch": self.kv_batch_,
            "kv_sequences_held": self.kv_sequences_held_,
            "lifetime_blocks_mean": self.lifetime_blocks_mean_,
            "lifetime_blocks_sd": self.lifetime_blocks_sd_,
            "kv_headroom_sigmas": self.kv_headroom_sigmas,
            "effective_batch": self.effective_batch_,
            "kv_limited": self.kv_limited_,
            "observed_batch": self.observed_batch_,
            "predicted_plateau_tokens_per_s": self.predicted_plateau_tokens_per_s_,
            "predicted_plateau_without_preemption_tokens_per_s": self.predicted_plateau_clean_,
            "preemptions_per_s": self.preemptions_per_s_,
            "preemption_time_share": self.preemption_time_share_,
            "observed_plateau_tokens_per_s": self.observed_plateau_tokens_per_s_,
            "prediction_error_ratio": self.prediction_error_ratio_,
            "step_model": self.steps_.evidence(),
        }
        ws = self.whatifs_
        frame: dict[str, list[Any]] = {
            "what_if": [w.name for w in ws],
            "num_gpu_blocks": [w.num_gpu_blocks for w in ws],
            "kv_batch": [w.kv_batch for w in ws],
            "effective_batch": [w.effective_batch for w in ws],
            "plateau_tokens_per_s": [w.plateau_tokens_per_s for w in ws],
            "gain_ratio": [w.gain_ratio for w in ws],
        }
        err = abs(self.prediction_error_ratio_)
        conf = max(0.0, 1.0 - err) if math.isfinite(err) else 0.3
        return Finding(
            kind="kv_capacity",
            scope=scope,
            summary=self.summary(),
            confidence=round(conf, 3),
            evidence=ev,
            frame=frame,
        )


def replica_whatif(pool_plateau_tokens_per_s: float, n_engines: int) -> dict[str, float]:
    """One more replica in a pool of ``n_engines`` behind a balancing router."""
    gain = 1.0 / n_engines if n_engines > 0 else math.nan
    return {
        "n_engines": n_engines,
        "plateau_tokens_per_s": pool_plateau_tokens_per_s * (1 + gain),
        "gain_ratio": gain,
    }

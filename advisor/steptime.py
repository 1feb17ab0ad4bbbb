"""Step-time model: how long one engine step takes as the batch grows.

Algorithm
---------
An engine step (one forward pass) costs a fixed part (reading the weights, launching
the step: ``a`` seconds), a part per running sequence (its decode token and its KV
reads: ``b`` seconds per sequence) and a part per prompt token computed in that step
(``c`` seconds per token; prompt tokens served from the prefix cache are not computed
and are left out); a preempted request costs ``d`` seconds more (its tokens are
recomputed when it is resumed, and that recomputation is not counted as prompt
tokens). Summed over a 1-second window in which the engine was busy the whole
second::

    1 s  ~=  a * n_steps  +  b * sum(batch over steps)
             +  c * (prompt_tokens - prefix_hits)  +  d * preemptions

With the engine's KV-cache size known, a fifth part is a cost per KV token in use
(``k`` seconds per token each step: the attention reads every running sequence's
context, so a step over long contexts costs more than one over short ones)::

    1 s  ~=  a * n_steps  +  b * sum(batch)  +  k * sum(KV tokens in use)
             +  c * (prompt_tokens - prefix_hits)  +  d * preemptions

(KV tokens in use per step: vLLM's KV usage times the cache's tokens.) Without it a
KV-bound engine, whose cache is full at every busy load, files that cost under the
fixed part ``a``, and a what-if that doubles its blocks predicts each step as cheap
as today's: on the lab's KV-starved engine (48 blocks) the fit without ``k`` put
9.6 ms on each step and 0.05 ms on each sequence, and predicted 11.0 ms for the
steps of the same engine with 96 blocks at 32 clients (measured 12.4 ms) and 11.2 ms
with 4,096 (measured 19.2 ms); with ``k`` it finds 0.66 us per KV token (the
4,096-block engine's full batch measures 0.71) and predicts 11.7 and 15.9 ms
(``bench/step_time_by_kv.py --what-if``). A sequence's KV tokens are its share of that cost:
:meth:`StepTimeModel.step_s` takes the tokens in use, or counts
``kv_tokens_per_seq_`` (the fitted windows' mean) for each sequence.

Every busy window is one linear equation; the model is their least-squares
solution. Windows in which the engine idled part of the second sit above the fit
(their steps explain less than a second), so the fit is trimmed: windows whose
explained time falls short of the second by more than ``idle_tolerance`` are
dropped and the fit repeated (``n_iter`` times). A window with requests waiting
(``min_queue`` or more on average) is never dropped so: with a queue the engine
cannot idle, and such a window running slow (a slower machine at that time, a
long-context batch) is evidence the fit must explain, not an idle second. A negative
coefficient is set to zero (it means the data does not separate that cost): the fit is
a non-negative least squares.

With a prompt-to-generation ratio ``r`` (prompt tokens prefilled per generated
token), a batch of ``B`` sequences produces

    T(B) = B / (a + (b + k*f)*B + c*r*B)     generated tokens per second,

(``f`` KV tokens per sequence) rising with ``B`` towards the compute ceiling
``1 / (b + k*f + c*r)``: the engine's
throughput at a batch it has not run yet is predicted from the batches it has run.
This is how the KV capacity model turns "the cache fits N sequences" into tokens
per second, and how an engine that is not saturated gets its headroom.

Whether a larger token budget pays
----------------------------------
:meth:`StepTimeModel.budget_gain` answers it from a second fit on the same busy windows,
summed over blocks of ``budget_block`` consecutive windows::

    busy seconds  ~=  a * n_steps  +  g * generated tokens  +  c * computed prompt tokens

Generated tokens stand for the decode work (on a GPU a decoding sequence's KV reads cost
far more than a prompt token's compute). Blocks rather than seconds: vLLM counts a
prompt's tokens in the step that completes its prefill, while its chunks ran in the
steps before, often in the second before; one-second windows then put the chunks' time
and their tokens in different equations, and the fit hands the prefill's cost to
whatever else grew with it (the batch). Summed over a few seconds the two meet again.
On the lab's CPU engine (a 256-token budget) the per-second fit put 5 ms on each
generated token and 15 us on a prompt token; over blocks of three seconds it finds no
separate decode cost and about 100 us per prompt token, as on every engine measured
(budgets of 64 to 2,048 tokens).
At the plateau, with requests waiting, the engine admits them as fast as their prompts
are prefilled, so the decode work per step follows the prefill (the same generated
tokens per prompt token): twice the budget carries twice the prompt tokens (``p`` per
step now) and twice the decode work (``d``), and only the per-step cost ``a`` is
shared. A step of ``t1 = a + g d + c p`` becomes ``2 t1 - a`` and the prefill rate
changes by ``2 t1 / (2 t1 - a) - 1 = a / (2 t1 - a)``: what a bigger budget buys is the
per-step cost it amortises. (Holding the decode work fixed instead would over-state it:
the decoding requests a faster prefill admits lengthen the steps.) The 95% interval
comes from refits on resampled blocks (a block bootstrap: neighbouring seconds are not
independent).

Parameters
----------
min_busy_ratio : windows used must have steps spread over this share of the second
    (default 0.9).
idle_tolerance : explained time this far below 1 s marks a window as partly idle
    (default 0.08).
n_iter : trimming rounds (default 3).
min_windows : fewer usable windows raise :class:`~kvscope.advisor.curve.NotEnoughData`
    (default 8).
min_queue : requests waiting (mean over the window's steps) that mark a window as never
    idle (default 1).
budget_block : consecutive busy windows summed into one equation of the budget fit
    (default 3).
min_budget_blocks : fewer blocks leave :meth:`StepTimeModel.budget_gain` unanswered
    (default 6).
budget_boot : bootstrap refits for the budget gain's interval (default 200; seeded, so a
    verdict is reproducible).
kv_block, kv_boot, min_kv_independence : the per-KV-token cost is kept only where the
    windows separate it from the other costs: at least ``min_kv_independence`` (default
    0.05) of the KV tokens' variance over the fitted windows must be independent of the
    other columns (1 - R^2 of a least-squares fit on them), and the 5th percentile of
    ``kv_boot`` (default 100, seeded) refits on resampled runs of ``kv_block`` (default
    10) consecutive fitted windows must be above zero; otherwise the model is fitted
    without it (``k`` = 0). A cache reported full at every step leaves ``k`` and the fixed
    part indistinguishable (0.000); requests of one length leave ``k`` and the
    per-sequence part so (the lab's long-context, budget- and prefill-bound engines:
    0.006-0.018; their fits put 0.6-4.6 us on a KV token and took it off the
    per-sequence part, an exchange the data cannot judge). The KV-starved engines with
    512-token outputs: 0.48-0.68.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import pandas as pd
from scipy import optimize

from kvscope.advisor.curve import NotEnoughData
from kvscope.advisor.frames import prepare_windows


class BudgetGain(NamedTuple):
    """Predicted prefill-rate change from doubling the token budget, with its 95%
    bootstrap interval (NaN when the budget fit has too few blocks)."""

    ratio: float
    low: float
    high: float


class StepTimeModel:
    """Linear step-time model fitted on busy 1-second windows (see module docstring)."""

    def __init__(
        self,
        *,
        min_busy_ratio: float = 0.9,
        idle_tolerance: float = 0.08,
        n_iter: int = 3,
        min_windows: int = 8,
        min_queue: float = 1.0,
        budget_block: int = 3,
        min_budget_blocks: int = 6,
        budget_boot: int = 200,
        kv_block: int = 10,
        kv_boot: int = 100,
        min_kv_independence: float = 0.05,
    ) -> None:
        self.min_busy_ratio = min_busy_ratio
        self.idle_tolerance = idle_tolerance
        self.n_iter = n_iter
        self.min_windows = min_windows
        self.min_queue = min_queue
        self.budget_block = budget_block
        self.min_budget_blocks = min_budget_blocks
        self.budget_boot = budget_boot
        self.kv_block = kv_block
        self.kv_boot = kv_boot
        self.min_kv_independence = min_kv_independence

    def fit(self, windows: pd.DataFrame, kv_tokens: float | None = None) -> StepTimeModel:
        """Fit on an engine's 1-second windows; ``kv_tokens``, the tokens its KV cache
        holds (``num_gpu_blocks x block_size``), adds the per-KV-token cost ``k`` (from
        the windows' KV usage); without it, or without usage, ``k`` is 0."""
        w = prepare_windows(windows)
        if "batch_sum" in windows:
            bsum = pd.to_numeric(windows["batch_sum"], errors="coerce").to_numpy(float)
        else:
            bsum = (w["batch_mean"] * w["n_steps"]).to_numpy(float)
        # Prompt tokens served from the prefix cache cost no compute: only the computed ones
        # (vLLM counts every prompt token, and the cached ones again as prefix hits).
        computed = (w["prompt_tokens"] - w["prefix_hits"].fillna(0.0)).clip(lower=0.0)
        kv_sum = self._kv_token_steps(windows, w, kv_tokens)
        X = np.c_[
            w["n_steps"].to_numpy(float),
            bsum,
            np.nan_to_num(kv_sum, nan=0.0),
            computed.to_numpy(float),
            w["preemptions"].fillna(0.0).to_numpy(float),
        ]
        busy = w["busy_ratio"].fillna(1.0).to_numpy(float)
        # A window with requests waiting (one or more over its steps, on average) did not
        # idle: the engine steps back to back while any request runs, and with a queue
        # some does. Explaining less than its second, it ran slower than the fit.
        queued = (w["waiting_mean"].fillna(0.0) + w["deferred_mean"].fillna(0.0)).to_numpy(float)
        never_idle = queued >= self.min_queue
        use = (w["n_steps"].to_numpy(float) >= 5) & (busy >= self.min_busy_ratio)
        use &= np.isfinite(X).all(axis=1)
        if use.sum() < self.min_windows:
            raise NotEnoughData(f"{int(use.sum())} busy windows; need {self.min_windows}")
        with_kv = bool(np.isfinite(kv_sum[use]).all() and np.nansum(kv_sum[use]) > 0)
        plain = [0, 1, 3, 4]
        first_use = use
        coef, use = self._trimmed(X, use, never_idle, [0, 1, 2, 3, 4] if with_kv else plain)
        self.k_interval_s_ = (math.nan, math.nan)
        self.kv_independence_ = math.nan
        if with_kv:
            order = np.flatnonzero(use)
            if "ts_s" in w:
                order = order[np.argsort(w["ts_s"].to_numpy(float)[order], kind="stable")]
            self.kv_independence_ = self._independence(X[order])
            if self.kv_independence_ >= self.min_kv_independence:
                self.k_interval_s_ = self._k_interval(X[order])
            if not self.k_interval_s_[0] > 0:  # not separated: the model without it
                coef, use = self._trimmed(X, first_use, never_idle, plain)
        resid = 1.0 - X[use] @ coef
        self.a_s_, self.b_s_, self.k_s_, self.c_s_, self.d_s_ = (float(v) for v in coef)
        # KV tokens a running sequence held on average over the fitted windows: what each
        # sequence of a predicted batch counts when its tokens are not given.
        batch_steps = float(X[use, 1].sum())
        self.kv_tokens_per_seq_ = (
            float(X[use, 2].sum() / batch_steps) if with_kv and batch_steps > 0 else 0.0
        )
        self.n_windows_ = int(use.sum())
        self.rmse_s_ = float(np.sqrt(np.mean(resid**2)))
        self.batch_range_ = (
            float(w.loc[use, "batch_mean"].min()),
            float(w.loc[use, "batch_mean"].max()),
        )
        # The budget fit's columns: the same, with generated tokens for the batch.
        self._fit_budget(w, np.c_[X[:, 0], w["gen_tokens_per_s"].to_numpy(float), X[:, 3:]], use)
        return self

    def _trimmed(
        self, X: np.ndarray, use: np.ndarray, never_idle: np.ndarray, cols: list[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The fit on columns ``cols`` of the windows ``use``, refitted without the partly
        idle ones (module docstring); the coefficients (0 for the columns left out) and the
        windows kept."""
        coef = np.zeros(X.shape[1])
        for _ in range(max(1, self.n_iter)):
            coef = np.zeros(X.shape[1])
            coef[cols] = self._solve(X[use][:, cols])
            explained = X @ coef
            keep = use & ((explained >= 1.0 - self.idle_tolerance) | never_idle)
            if keep.sum() < self.min_windows or (keep == use).all():
                break
            use = keep
        return coef, use

    @staticmethod
    def _independence(X: np.ndarray) -> float:
        """The share of the KV column's variance (third) that the other columns do not
        explain (1 - R^2 of its least-squares fit on them): 0 when the KV tokens in use are
        a linear function of the steps, batch, prompt tokens and preemptions."""
        y = X[:, 2]
        others = X[:, [0, 1, 3, 4]]
        coef, *_ = np.linalg.lstsq(others, y, rcond=None)
        resid = y - others @ coef
        spread = float(((y - y.mean()) ** 2).sum())
        return float(resid @ resid / spread) if spread > 0 else 0.0

    def _k_interval(self, X: np.ndarray) -> tuple[float, float]:
        """The 90% block-bootstrap interval of the per-KV-token cost (``X``: the fitted
        windows' columns in time order, the KV tokens third): refits on resampled runs of
        ``kv_block`` consecutive windows, as neighbouring seconds are not independent."""
        k = max(1, self.kv_block)
        n_blocks = len(X) // k
        if n_blocks < 4:
            return (math.nan, math.nan)
        blocks = X[: n_blocks * k].reshape(n_blocks, k, X.shape[1])
        rng = np.random.default_rng(0)
        ks = [
            self._solve(blocks[rng.integers(0, n_blocks, n_blocks)].reshape(-1, X.shape[1]))[2]
            for _ in range(self.kv_boot)
        ]
        lo, hi = np.percentile(ks, [5, 95])
        return (float(lo), float(hi))

    @staticmethod
    def _kv_token_steps(raw: pd.DataFrame, w: pd.DataFrame, kv_tokens: float | None) -> np.ndarray:
        """Per window, the KV tokens in use summed over its steps (NaN where unknown)."""
        if kv_tokens is None or not math.isfinite(kv_tokens) or kv_tokens <= 0:
            return np.full(len(w), math.nan)
        if "kv_usage_sum" in raw:
            usage_steps = pd.to_numeric(raw["kv_usage_sum"], errors="coerce").to_numpy(float)
        else:
            usage_steps = (w["kv_usage_mean"] * w["n_steps"]).to_numpy(float)
        return usage_steps * float(kv_tokens)

    def _fit_budget(self, w: pd.DataFrame, Xw: np.ndarray, use: np.ndarray) -> None:
        """The budget fit (module docstring): blocks of ``budget_block`` busy windows in
        time order, each summed into one equation."""
        rows = np.flatnonzero(use & np.isfinite(Xw).all(axis=1))
        if "ts_s" in w:
            rows = rows[np.argsort(w["ts_s"].to_numpy(float)[rows], kind="stable")]
        k = max(1, self.budget_block)
        blocks = [rows[i : i + k] for i in range(0, len(rows) - k + 1, k)]
        self._budget_X = np.array([Xw[b].sum(axis=0) for b in blocks]).reshape(-1, 4)
        self._budget_y = np.full(len(blocks), float(k))  # busy seconds per block
        self.budget_coef_ = np.full(4, math.nan)
        if len(blocks) >= self.min_budget_blocks:
            self.budget_coef_, _ = optimize.nnls(self._budget_X, self._budget_y)

    @staticmethod
    def _doubling_gain(coef: np.ndarray, prompt_per_step: float, gen_per_step: float) -> float:
        t1 = coef[0] + coef[1] * gen_per_step + coef[2] * prompt_per_step
        t2 = 2.0 * t1 - coef[0]  # twice the prompt and decode work, one per-step cost
        return float(2.0 * t1 / t2 - 1.0) if t2 > 0 else math.nan

    def budget_gain(self, prompt_per_step: float, gen_per_step: float) -> BudgetGain:
        """Predicted change of the prefill rate from doubling the token budget, for steps
        that carry ``prompt_per_step`` computed prompt tokens and ``gen_per_step``
        generated tokens (twice both per step, one per-step cost: module docstring),
        with its 95% block-bootstrap interval."""
        if not np.isfinite(self.budget_coef_).all():
            return BudgetGain(math.nan, math.nan, math.nan)
        if prompt_per_step <= 0:
            return BudgetGain(0.0, 0.0, 0.0)
        ratio = self._doubling_gain(self.budget_coef_, prompt_per_step, gen_per_step)
        rng = np.random.default_rng(0)
        n = len(self._budget_y)
        boot = []
        for _ in range(self.budget_boot):
            pick = rng.integers(0, n, n)
            coef, _ = optimize.nnls(self._budget_X[pick], self._budget_y[pick])
            boot.append(self._doubling_gain(coef, prompt_per_step, gen_per_step))
        lo, hi = np.nanpercentile(boot, [2.5, 97.5])
        return BudgetGain(ratio, float(lo), float(hi))

    @staticmethod
    def _solve(X: np.ndarray) -> np.ndarray:
        """Non-negative least squares (SciPy's :func:`scipy.optimize.nnls`, Lawson-Hanson):
        the costs are times, never negative, and the active-set method finds the optimum
        under that constraint (dropping the most negative coefficient and refitting does
        not always)."""
        coef, _ = optimize.nnls(X, np.ones(len(X)))
        return np.asarray(coef, float)

    def step_s(
        self,
        batch: float | np.ndarray,
        prompt_per_step: float | np.ndarray = 0.0,
        kv_tokens_per_seq: float | None = None,
    ) -> np.ndarray:
        """Predicted seconds per step of ``batch`` sequences holding
        ``kv_tokens_per_seq`` KV tokens each (default: the fitted windows' mean)."""
        b = np.asarray(batch, float)
        return (
            self.a_s_
            + self._per_seq_s(kv_tokens_per_seq) * b
            + self.c_s_ * np.asarray(prompt_per_step, float)
        )

    def _per_seq_s(self, kv_tokens_per_seq: float | None) -> float:
        """A running sequence's cost per step: its own and its KV tokens'."""
        f = self.kv_tokens_per_seq_ if kv_tokens_per_seq is None else float(kv_tokens_per_seq)
        return self.b_s_ + self.k_s_ * f

    def preemption_time_share(self, preemptions_per_s: float) -> float:
        """Share of engine time spent recomputing preempted requests."""
        return float(min(1.0, max(0.0, self.d_s_ * preemptions_per_s)))

    def tokens_per_s(
        self,
        batch: float | np.ndarray,
        prompt_ratio: float = 0.0,
        kv_tokens_per_seq: float | None = None,
    ) -> np.ndarray:
        """Predicted generated tokens/s at a batch of ``batch`` sequences, with
        ``prompt_ratio`` prompt tokens prefilled per generated token and
        ``kv_tokens_per_seq`` KV tokens held by each (default: the fitted windows' mean)."""
        b = np.asarray(batch, float)
        return b / self.step_s(b, prompt_ratio * b, kv_tokens_per_seq)

    def ceiling_tokens_per_s(self, prompt_ratio: float = 0.0) -> float:
        """The compute ceiling: generated tokens/s as the batch grows without bound."""
        per_seq = self._per_seq_s(None) + self.c_s_ * prompt_ratio
        return float("inf") if per_seq <= 0 else 1.0 / per_seq

    def batch_for_fraction(self, fraction: float, prompt_ratio: float = 0.0) -> float:
        """Smallest batch whose predicted throughput reaches ``fraction`` of the ceiling.

        From T(B) = B / (a + k*B) with k = b + k_kv*f + c*r: T/T_max = kB / (a + kB) = f
        gives B = f*a / ((1 - f)*k).
        """
        k = self._per_seq_s(None) + self.c_s_ * prompt_ratio
        if k <= 0 or not 0 < fraction < 1:
            return float("inf")
        return fraction * self.a_s_ / ((1.0 - fraction) * k)

    def evidence(self) -> dict[str, float | int]:
        return {
            "step_fixed_s": self.a_s_,
            "step_per_seq_s": self.b_s_,
            "step_per_kv_token_s": self.k_s_,
            "step_per_kv_token_low_s": self.k_interval_s_[0],
            "step_per_kv_token_high_s": self.k_interval_s_[1],
            "kv_independence": self.kv_independence_,
            "kv_tokens_per_seq": self.kv_tokens_per_seq_,
            "step_per_prompt_token_s": self.c_s_,
            "preemption_s": self.d_s_,
            "n_windows": self.n_windows_,
            "rmse_s": self.rmse_s_,
            "batch_min": self.batch_range_[0],
            "batch_max": self.batch_range_[1],
            "budget_fit_blocks": len(self._budget_y),
            "budget_fit_step_s": float(self.budget_coef_[0]),
            "budget_fit_per_generated_token_s": float(self.budget_coef_[1]),
            "budget_fit_per_prompt_token_s": float(self.budget_coef_[2]),
        }

"""Step-time model: how long one engine step takes as the batch grows.

An engine step costs a fixed part ``a`` (reading the weights, launching the step), ``b``
per running sequence, ``k`` per KV token in use (only with the cache's size known), ``c``
per computed prompt token (prefix-cache hits are not computed) and ``d`` per preemption
(its recomputation). Summed over a 1-second window in which the engine was busy::

    1 s  ~=  a * n_steps  +  b * sum(batch)  +  k * sum(KV tokens in use)
             +  c * (prompt_tokens - prefix_hits)  +  d * preemptions

1. Keep the windows busy over most of the second; solve their equations by non-negative
   least squares (a negative cost means the data does not separate it).
2. Drop windows that explain too little of the second (partly idle) and refit; a window
   with requests waiting is never dropped (the engine cannot idle then).
3. Keep ``k`` only where the windows separate it from the other costs; otherwise ``k = 0``.

A batch ``B`` then yields ``T(B) = B / (a + (b + k*f + c*r)*B)`` generated tokens/s (``r``
prompt tokens per generated token, ``f`` KV tokens per sequence): the throughput at a batch
the engine has not run, which the KV capacity model needs. :meth:`StepTimeModel.budget_gain`
says whether a larger token budget pays, from a second fit over blocks of busy windows:
twice the budget shares only the per-step cost, a prefill-rate gain of ``a / (2t - a)``
for a step of ``t``, with a block-bootstrap 95% interval (:class:`BudgetGain`).

See docs/advise.md#the-step-time-model.
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
    """Linear step-time model fitted on busy 1-second windows.

    Parameters
    ----------
    min_busy_ratio : share of the second a window's steps must cover for it to be used.
    idle_tolerance : explained time this far below 1 s marks a window as partly idle.
    n_iter : trimming rounds.
    min_windows : fewer usable windows raise :class:`~kvscope.advisor.curve.NotEnoughData`.
    min_queue : requests waiting (mean over the window's steps) that mark it as never idle.
    budget_block, min_budget_blocks, budget_boot : busy windows summed into one equation of
        the budget fit, the blocks it needs to answer, and its seeded bootstrap refits.
    kv_block, kv_boot, min_kv_independence : ``k`` is kept where at least
        ``min_kv_independence`` of the KV tokens' variance is independent of the other
        columns and the 5th percentile of ``kv_boot`` seeded refits on resampled runs of
        ``kv_block`` windows is above zero.
    """

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

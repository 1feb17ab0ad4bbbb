"""What one engine step costs: the part of the engine the twin does not run.

The twin runs vLLM's scheduler and KV-cache manager for real; the forward pass is
replaced by a step-time model that turns the scheduled step (how many requests, how
many prompt tokens computed, how much context attended to) into seconds. Two models:

* :class:`LinearStepCost`, ``a + b*requests + c*prompt_tokens + d*context_tokens``:
  fitted from an engine's own telemetry by the advisor's step-time model
  (:class:`kvscope.advisor.steptime.StepTimeModel`, on busy 1-second windows), so a
  twin of a running engine starts from what that engine measured. Prompt tokens
  include recomputed ones (a preempted request's tokens, scheduled again).
* :class:`RooflineStepCost`, for a GPU nobody has measured here: a step reads the
  weights once and the KV of every attended token (memory time), and does
  ``2 * params`` FLOPs per scheduled token plus attention (compute time); the step takes
  the larger of the two plus a fixed launch overhead. Device figures are the vendors'
  datasheets (:data:`GPUS`); the efficiencies are assumptions (stated on each preset),
  which is why a fitted model beats this one wherever telemetry exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvscope.twin.shape import ModelShape


@dataclass(frozen=True)
class StepLoad:
    """What one scheduled step asks of the device."""

    requests: int
    """Requests scheduled in the step (decoding and prefilling)."""
    decode_requests: int
    """Of which decode one token."""
    prompt_tokens: int
    """Prompt tokens computed (prefill chunks and recomputation), cached ones excluded."""
    context_tokens: int
    """Tokens attended to, summed over the scheduled requests (their KV read this step)."""
    attention_pairs: float = 0.0
    """Query-key pairs of the step (a prefill chunk of n tokens at position p: n*(p+n/2))."""


class StepCost(Protocol):
    """Seconds one step takes."""

    def step_s(self, load: StepLoad) -> float: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class LinearStepCost:
    """``a + b*requests + c*prompt_tokens + d*context_tokens`` seconds."""

    a_s: float
    b_s: float
    c_s: float
    d_s: float = 0.0
    source: str = "given"

    def __post_init__(self) -> None:
        if min(self.a_s, self.b_s, self.c_s, self.d_s) < 0 or self.a_s + self.b_s <= 0:
            raise ValueError(
                "a step-time model needs non-negative costs and a positive fixed or "
                f"per-request part (got a={self.a_s}, b={self.b_s}, c={self.c_s}, d={self.d_s})"
            )

    def step_s(self, load: StepLoad) -> float:
        return (
            self.a_s
            + self.b_s * load.requests
            + self.c_s * load.prompt_tokens
            + self.d_s * load.context_tokens
        )

    @classmethod
    def from_fit(cls, model: Any, source: str = "telemetry") -> LinearStepCost:
        """From a fitted :class:`kvscope.advisor.steptime.StepTimeModel`."""
        return cls(model.a_s_, model.b_s_, model.c_s_, model.k_s_, source)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "linear",
            "source": self.source,
            "fixed_s": self.a_s,
            "per_request_s": self.b_s,
            "per_prompt_token_s": self.c_s,
            "per_context_token_s": self.d_s,
        }


def fit_steps(
    steps: Any, *, cycle: bool = False, trim: float | None = None, min_steps: int = 200
) -> LinearStepCost:
    """``a + b*batch + c*computed prompt tokens`` fitted on single engine steps.

    One equation per step, not per second, so the per-request and per-token costs separate far
    better than on 1-second sums. The batch is vLLM's ``num_running_reqs`` after the step;
    computed prompt tokens are the step's prompt tokens less its prefix-cache hits (vLLM
    counts a prompt at the step that completes it). A non-negative least-squares fit.

    Parameters
    ----------
    steps : the collector's raw step frame of one engine (``/v1/steps``), with ``iteration_s``
        (vLLM's ``--enable-logging-iteration-details``), ``batch_size``, ``prompt_tokens``,
        ``prefix_hits`` and ``ts_unix_s``.
    cycle : fit the step cycle (the time from one step's stats to the next's, which holds what
        vLLM does around the execution) against the requests running when the step began,
        leaving out steps that began idle; else fit ``iteration_s``.
    trim : share of the largest residuals left out in one refit (default 0.05; 0 with
        ``cycle``, so the fit sums to the engine's busy time).
    min_steps : steps needed for a fit.

    Why the cycle counts every long step, measured: docs/twin.md#step-time-models.
    """
    import numpy as np
    from scipy import optimize

    need = ("iteration_s", "batch_size", "prompt_tokens", "prefix_hits")
    missing = [c for c in need if c not in steps]
    if missing:
        raise ValueError(f"steps lack {missing}; read them from the collector's /v1/steps")
    if cycle:
        # Step i's cycle ends when its stats arrive and began when step i-1's did; it
        # ran the requests running after step i-1 and computed step i's prompt tokens.
        ts = np.asarray(steps["ts_unix_s"], dtype=float)
        order = np.argsort(ts, kind="stable")
        steps = steps.iloc[order]
        t = np.insert(np.diff(ts[order]), 0, np.nan)
        batch = np.insert(np.asarray(steps["batch_size"], dtype=float)[:-1], 0, np.nan)
    else:
        t = np.asarray(steps["iteration_s"], dtype=float)
        batch = np.asarray(steps["batch_size"], dtype=float)
    prompt = np.asarray(steps["prompt_tokens"], dtype=float)
    hits = np.nan_to_num(np.asarray(steps["prefix_hits"], dtype=float))
    ok = np.isfinite(t) & (t > 0) & np.isfinite(batch) & np.isfinite(prompt) & (batch >= 1)
    if ok.sum() < min_steps:
        raise ValueError(
            f"{int(ok.sum())} steps with an iteration time (need {min_steps}): start vLLM "
            "with --enable-logging-iteration-details, or fit on windows instead"
        )
    X = np.c_[np.ones(int(ok.sum())), batch[ok], np.clip(prompt[ok] - hits[ok], 0.0, None)]
    y = t[ok]
    coef, _ = optimize.nnls(X, y)
    keep = np.ones(len(y), dtype=bool)
    trim = (0.0 if cycle else 0.05) if trim is None else trim
    if trim > 0:
        resid = np.abs(y - X @ coef)
        keep = resid <= np.quantile(resid, 1.0 - trim)
        coef, _ = optimize.nnls(X[keep], y[keep])
    return LinearStepCost(
        float(coef[0]), float(coef[1]), float(coef[2]), 0.0, f"{int(keep.sum())} engine steps"
    )


@dataclass(frozen=True)
class Gpu:
    """A device's datasheet figures."""

    name: str
    memory_bytes: float
    bandwidth_bytes_s: float
    bf16_flops: float
    """Dense BF16 tensor throughput (no sparsity)."""
    source: str


#: Datasheet figures (dense BF16, no sparsity).
GPUS: dict[str, Gpu] = {
    "a100-80gb": Gpu(
        "A100 SXM4 80GB", 80e9, 2.039e12, 312e12, "NVIDIA A100 Tensor Core GPU datasheet"
    ),
    "h100-80gb": Gpu("H100 SXM5 80GB", 80e9, 3.35e12, 989e12, "NVIDIA H100 Tensor Core datasheet"),
    "l40s": Gpu("L40S 48GB", 48e9, 0.864e12, 362e12, "NVIDIA L40S datasheet"),
}


@dataclass(frozen=True)
class RooflineStepCost:
    """A step on ``gpu`` for ``model``: ``overhead + max(memory time, compute time)``.

    Memory time: the weights (split over ``tensor_parallel_size`` devices) and the KV of
    every attended token, at ``bandwidth_efficiency`` of the datasheet bandwidth.
    Compute time: ``2 * params`` FLOPs per scheduled token and ``4 * hidden * layers``
    per attention pair, at ``mfu`` of the datasheet BF16 rate. The defaults are
    assumptions: ~80% of peak bandwidth is what memory-bound decode kernels reach on
    these devices, ~50% model-FLOPs utilisation is typical of large prefill batches, and a
    few milliseconds per step is vLLM's CPU-side work (scheduling, sampling, launch).
    """

    model: ModelShape
    gpu: Gpu
    tensor_parallel_size: int = 1
    bandwidth_efficiency: float = 0.8
    mfu: float = 0.5
    overhead_s: float = 0.004
    kv_bytes_per_value: float = 2.0

    def step_s(self, load: StepLoad) -> float:
        tp = self.tensor_parallel_size
        kv = self.model.kv_bytes_per_token(self.kv_bytes_per_value) * load.context_tokens
        memory = (
            (self.model.weight_bytes + kv)
            / tp
            / (self.gpu.bandwidth_bytes_s * self.bandwidth_efficiency)
        )
        tokens = load.decode_requests + load.prompt_tokens
        flops = 2.0 * self.model.params * tokens
        flops += 4.0 * self.model.hidden_size * self.model.num_layers * load.attention_pairs
        compute = flops / tp / (self.gpu.bf16_flops * self.mfu)
        return self.overhead_s + max(memory, compute)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "roofline",
            "source": self.gpu.source,
            "gpu": self.gpu.name,
            "model": self.model.name,
            "tensor_parallel_size": self.tensor_parallel_size,
            "bandwidth_efficiency": self.bandwidth_efficiency,
            "mfu": self.mfu,
            "overhead_s": self.overhead_s,
        }


def gpu(name: str) -> Gpu:
    """The device called ``name`` (see :data:`GPUS`)."""
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; choose from {', '.join(sorted(GPUS))}") from None

"""Request streams for the twin: what arrives, when, and which prompt prefixes it shares.

A stream is a list of :class:`TwinRequest`; with arrival times it is replayed open
loop (requests arrive whatever the engine does, as production traffic does), and
:class:`ClosedLoop` turns the same requests into a fixed number of clients that each
send the next request when the previous one finishes (a benchmark client's
``--max-concurrency``).

Prefix sharing is carried by block ids, as in the Mooncake traces (or by the prompts'
own token ids, for a stream tokenized from real prompts): a prompt is a
sequence of blocks of ``block_tokens`` tokens, equal ids are equal token blocks, so
vLLM's prefix cache finds them for real (by hashing the token ids). Token ids are
derived from the block id; the tokens after the last block are the request's own.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvscope.lab.sweep.traces import MOONCAKE_BLOCK_TOKENS, load_trace

#: Token ids are drawn from this range (any model's vocabulary has them).
_TOKEN_RANGE = 30_000
_TOKEN_BASE = 100


class StreamError(ValueError):
    """A stream that cannot be replayed (the message says what to change)."""


@dataclass(frozen=True)
class TwinRequest:
    """One request of a stream."""

    prompt_tokens: int
    output_tokens: int
    arrival_s: float | None = None
    """Seconds after the stream's start (open loop); None in a closed-loop stream."""
    block_ids: tuple[int, ...] = ()
    """Shared prompt blocks, in order, each :attr:`block_tokens` tokens (the last one
    may be cut short by the prompt's length)."""
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    key: int = 0
    """Seeds the tokens after the shared blocks (distinct keys, distinct tokens)."""
    tokens: tuple[int, ...] | None = None
    """The prompt's own token ids, when known (a tokenized prompt): used as they are."""

    def token_ids(self) -> list[int]:
        """The prompt's token ids."""
        if self.tokens is not None:
            return list(self.tokens)
        out = np.empty(self.prompt_tokens, dtype=np.int64)
        pos = 0
        offsets = np.arange(self.block_tokens, dtype=np.int64)
        for b in self.block_ids:
            if pos >= self.prompt_tokens:
                break
            n = min(self.block_tokens, self.prompt_tokens - pos)
            out[pos : pos + n] = _tokens(1 + b, offsets[:n])
            pos += n
        if pos < self.prompt_tokens:
            rest = np.arange(self.prompt_tokens - pos, dtype=np.int64)
            out[pos:] = _tokens(-(1 + self.key), rest)
        return out.tolist()


def _tokens(seed: int, offsets: np.ndarray) -> np.ndarray:
    """Deterministic, well-spread token ids for one block (or one request's own tokens)."""
    x = (np.int64(seed) * np.int64(1_000_003) + offsets * np.int64(7_919)) % np.int64(2_147_483_647)
    x = (x * np.int64(48_271)) % np.int64(2_147_483_647)
    return _TOKEN_BASE + x % _TOKEN_RANGE


@dataclass(frozen=True)
class ClosedLoop:
    """``concurrency`` clients, each sending the next of ``requests`` when its last one
    finishes (after ``think_s``), for ``duration_s`` seconds or until the requests run
    out."""

    requests: Sequence[TwinRequest]
    concurrency: int
    think_s: float = 0.0
    duration_s: float | None = None
    """Clients send no new request after this many seconds (the phase then drains);
    None sends every request."""
    steady_state: bool = False
    """With ``duration_s``: count it from the end of a warm-up that lasts until every
    client's first request has returned (and ``warmup_s`` has passed), and make it at
    least one cycle of the loop as the warm-up measured it (``concurrency`` over the
    requests per second it finished); each at most ``max_stretch_s``. The clients start
    together, so their first requests are served as one wave; this measures the load
    after it. The driver records each phase's window (``phase_windows``)."""
    warmup_s: float = 0.0
    """The least warm-up of a ``steady_state`` loop."""
    max_stretch_s: float = 3600.0
    """The longest warm-up, and the longest window, of a ``steady_state`` loop."""

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise StreamError(f"a closed loop needs at least one client (got {self.concurrency})")
        if not self.requests:
            raise StreamError("a closed loop needs requests to send")
        if self.duration_s is not None and not self.duration_s > 0:
            raise StreamError(f"a closed loop's duration must be positive (got {self.duration_s})")
        if self.steady_state and self.duration_s is None:
            raise StreamError("a steady-state closed loop needs a duration (its least window)")
        if self.warmup_s < 0 or not self.max_stretch_s > 0:
            raise StreamError("a closed loop's warm-up must be >= 0 and its stretch limit > 0")


def from_trace(
    path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
) -> list[TwinRequest]:
    """The requests of a trace file (formats of :mod:`kvscope.lab.sweep.traces`).

    ``time_scale`` stretches the arrival times (0.5 replays twice as fast). A trace
    without times gives requests without arrivals (for :class:`ClosedLoop` or
    :func:`with_poisson_arrivals`).
    """
    if time_scale <= 0:
        raise StreamError(f"time_scale must be positive (got {time_scale})")
    rows = load_trace(path, limit)
    return [
        TwinRequest(
            r.input_tokens,
            r.output_tokens,
            None if r.arrival_s is None else r.arrival_s * time_scale,
            r.block_ids,
            MOONCAKE_BLOCK_TOKENS,
            i,
        )
        for i, r in enumerate(rows)
    ]


def with_poisson_arrivals(
    requests: Sequence[TwinRequest], rate_per_s: float, seed: int = 0
) -> list[TwinRequest]:
    """The same requests arriving as a Poisson process of ``rate_per_s``."""
    if not rate_per_s > 0 or math.isinf(rate_per_s):
        raise StreamError(f"an arrival rate must be positive and finite (got {rate_per_s})")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, len(requests))
    times = np.cumsum(gaps) - gaps[0]
    return [
        TwinRequest(r.prompt_tokens, r.output_tokens, float(t), r.block_ids, r.block_tokens, r.key)
        for r, t in zip(requests, times, strict=True)
    ]


def synthetic(
    n: int,
    *,
    prompt_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    shared_prefix_tokens: int = 0,
    prefix_groups: int = 1,
    seed: int = 0,
) -> list[TwinRequest]:
    """``n`` requests with uniform prompt and output lengths in the given inclusive
    ranges; the first ``shared_prefix_tokens`` of each prompt are one of
    ``prefix_groups`` shared prefixes (a system prompt per application)."""
    if n < 1:
        raise StreamError(f"a stream needs at least one request (got {n})")
    for name, (lo, hi) in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
        if not 1 <= lo <= hi:
            raise StreamError(f"{name} range must be 1 <= low <= high (got {lo}, {hi})")
    rng = np.random.default_rng(seed)
    prompts = rng.integers(prompt_tokens[0], prompt_tokens[1] + 1, n)
    outputs = rng.integers(output_tokens[0], output_tokens[1] + 1, n)
    groups = rng.integers(0, max(1, prefix_groups), n)
    shared = max(0, shared_prefix_tokens)
    return [
        TwinRequest(
            int(prompts[i]),
            int(outputs[i]),
            None,
            (int(groups[i]),) if shared else (),
            max(1, shared),
            10_000_000 + i,
        )
        for i in range(n)
    ]

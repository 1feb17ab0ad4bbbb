"""The twin's loop: vLLM's scheduler on a simulated clock.

Each step does what vLLM's engine core and front end do, with the forward pass replaced by a
step-time model (:mod:`kvscope.twin.steptime`): arriving requests are added with vLLM's block
hasher, ``Scheduler.schedule()`` decides the step, its cost advances the clock, a
``ModelRunnerOutput`` gives one token to every request whose known tokens are computed, and
``Scheduler.update_from_output()`` and vLLM's ``IterationStats`` report it as the engine would.
Events stamped with ``time.monotonic()`` are re-stamped with the simulated time, so queueing,
prefill and decode times come out in simulated seconds. Nothing else of vLLM is changed.

:class:`Twin` runs one engine, :class:`TwinPool` several behind a router on one clock; both
return a :class:`TwinResult`. See docs/twin.md#how-it-works.
"""

from __future__ import annotations

import heapq
import itertools
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pandas as pd

from kvscope.lab.sweep.stats import steady_window_s
from kvscope.twin.shape import EngineShape, TwinConfigError, build_scheduler, build_vllm_config
from kvscope.twin.steptime import StepCost, StepLoad
from kvscope.twin.streams import ClosedLoop, StreamError, TwinRequest

#: Event timestamps below this are the scheduler's own monotonic clock, not yet re-stamped.
_SIM_EPOCH_FLOOR = 1e9
_SAMPLED_TOKEN = 7


class TwinError(RuntimeError):
    """The replay cannot go on (the message says why and what to change)."""


class Sink(Protocol):
    """Where each step's stats go (the plugin and a collector, see :mod:`kvscope.twin.feed`)."""

    def record(self, scheduler_stats: Any, iteration_stats: Any, now_unix_s: float) -> None: ...

    def close(self, now_unix_s: float) -> None: ...


@dataclass
class _ReqState:
    stats: Any
    prompt_len: int
    max_tokens: int
    arrival: float
    client: int | None
    is_prefilling: bool = True
    num_cached_tokens: int = 0


STEP_COLUMNS = (
    "t_end",
    "step_s",
    "running",
    "waiting",
    "kv_usage",
    "scheduled_requests",
    "decode_requests",
    "prompt_computed",
    "context_tokens",
    "generated",
    "prompt_tokens",
    "preempted",
    "prefix_queries",
    "prefix_hits",
)
REQUEST_COLUMNS = (
    "arrival",
    "finish",
    "e2e_s",
    "ttft_s",
    "queued_s",
    "prefill_s",
    "decode_s",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "preemptions",
    "finish_reason",
)


@dataclass
class TwinResult:
    """One replay: every step and every finished request, on the simulated clock."""

    shape: EngineShape
    cost: dict[str, Any]
    steps: pd.DataFrame
    requests: pd.DataFrame
    start_unix_s: float
    end_unix_s: float
    wall_s: float
    rejected: int = 0
    unfinished: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def sim_s(self) -> float:
        return self.end_unix_s - self.start_unix_s

    def window(self, lo: float = 0.1, hi: float = 0.9) -> tuple[float, float]:
        """The steady part of the run: from the ``lo`` to the ``hi`` quantile of the
        finish times (the ramp-up and the drain at the end are left out)."""
        fin = self.requests["finish"].to_numpy(float)
        if len(fin) < 3:
            return self.start_unix_s, self.end_unix_s
        a, b = np.quantile(fin, [lo, hi])
        return float(a), float(max(b, a + 1e-9))

    def summary(self, lo: float = 0.1, hi: float = 0.9) -> dict[str, float]:
        """Throughput and latency over the steady window (see :meth:`window`)."""
        a, b = self.window(lo, hi)
        s = self.steps
        in_w = (s["t_end"] > a) & (s["t_end"] <= b)
        r = self.requests
        done = r[(r["finish"] > a) & (r["finish"] <= b)]
        gen = float(s.loc[in_w, "generated"].sum())
        dur = b - a
        busy = s.loc[in_w, "step_s"].to_numpy(float)
        running = s.loc[in_w, "running"].to_numpy(float)
        out = {
            "output_tokens_per_s": gen / dur if dur > 0 else float("nan"),
            "requests_per_s": len(done) / dur if dur > 0 else float("nan"),
            "mean_running": float(np.average(running, weights=busy)) if busy.sum() else 0.0,
            "mean_waiting": float(s.loc[in_w, "waiting"].mean()) if in_w.any() else 0.0,
            "kv_usage_mean": float(np.average(s.loc[in_w, "kv_usage"], weights=busy))
            if busy.sum()
            else 0.0,
            "step_s_median": float(np.median(busy)) if len(busy) else float("nan"),
            "preemptions_per_request": float(done["preemptions"].mean()) if len(done) else 0.0,
            "finished": float(len(r)),
        }
        for col, name in (("ttft_s", "ttft"), ("e2e_s", "e2e")):
            v = done[col].to_numpy(float)
            for q in (50, 90, 99):
                out[f"{name}_p{q}_s"] = float(np.percentile(v, q)) if len(v) else float("nan")
        return out


class Twin:
    """vLLM's scheduler for one engine configuration, driven by a step-time model."""

    def __init__(
        self,
        shape: EngineShape,
        cost: StepCost,
        *,
        sink: Sink | None = None,
        start_unix_s: float | None = None,
        max_sim_s: float | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        self.shape = shape
        self.cost = cost
        self.sink = sink
        self.start_unix_s = time.time() if start_unix_s is None else float(start_unix_s)
        self.max_sim_s = max_sim_s
        self.progress = progress
        self.vllm_config = build_vllm_config(shape)

    def run(self, *phases: Sequence[TwinRequest] | ClosedLoop) -> TwinResult:
        """Replay ``phases`` one after another on one engine (its prefix cache stays warm):
        a list of requests is replayed open loop by their arrival times (relative to the
        phase's start), a :class:`ClosedLoop` by its clients. A phase starts when the
        previous one has no request left."""
        return TwinPool([self], start_unix_s=self.start_unix_s).run(*phases)[0]


#: Routing policies of :class:`TwinPool` (those of the lab's load generator,
#: :mod:`kvscope.lab.sweep.routing`).
ROUTING = ("round-robin", "least-loaded", "prefix-affine")


class TwinPool:
    """Several twins behind one router, on one simulated clock.

    Each engine keeps its own clock (when its next step can start); the pool always
    advances whichever comes first, the next arrival or the engine whose step starts
    earliest, so the engines run side by side as replicas do. ``routing``:
    ``round-robin`` (in turn), ``least-loaded`` (fewest requests in flight) or
    ``prefix-affine`` (the request's first shared block picks the engine).
    """

    def __init__(
        self,
        twins: Sequence[Twin],
        *,
        routing: str = "round-robin",
        start_unix_s: float | None = None,
        max_sim_s: float | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        if not twins:
            raise TwinConfigError("a pool needs at least one engine")
        if routing not in ROUTING:
            raise TwinConfigError(f"unknown routing {routing!r}; choose from {', '.join(ROUTING)}")
        self.twins = list(twins)
        self.routing = routing
        self.start_unix_s = twins[0].start_unix_s if start_unix_s is None else float(start_unix_s)
        self.max_sim_s = max_sim_s if max_sim_s is not None else twins[0].max_sim_s
        self.progress = progress if progress is not None else twins[0].progress

    def run(self, *phases: Sequence[TwinRequest] | ClosedLoop) -> list[TwinResult]:
        """Replay ``phases`` (see :meth:`Twin.run`); one result per engine."""
        if not phases:
            raise StreamError("nothing to replay: give at least one phase")
        driver = _Driver(self)
        for i, phase in enumerate(phases):
            driver.phase(phase, i)
        return driver.finish()


class _Engine:
    """One twin's scheduler, clock and rows within a replay."""

    def __init__(self, twin: Twin, t0: float) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.metrics.stats import LoRARequestStates

        self.twin = twin
        self.shape = twin.shape
        self.sched = build_scheduler(twin.shape, twin.vllm_config)
        hash_fn = get_hash_fn_by_name(twin.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(twin.shape.block_size, hash_fn)
        self.lora_states = LoRARequestStates(True)
        self.t = t0
        self.states: dict[str, _ReqState] = {}
        self.step_rows: list[tuple[Any, ...]] = []
        self.req_rows: list[tuple[Any, ...]] = []
        self.rejected = 0

    @property
    def busy(self) -> bool:
        return self.sched.get_num_unfinished_requests() > 0

    @property
    def in_flight(self) -> int:
        return len(self.states)

    def add(self, request_id: str, req: TwinRequest, at: float, client: int | None) -> bool:
        """Hand ``req`` to the scheduler at ``at``; False if vLLM would refuse it."""
        shape = self.shape
        prompt = req.prompt_tokens
        if prompt >= shape.max_model_len:
            self.rejected += 1  # vLLM answers 400: the prompt does not fit the context
            return False
        if not self.busy:
            self.t = max(self.t, at)  # an idle engine waits for the request
        max_tokens = min(req.output_tokens, shape.max_model_len - prompt)
        request = _make_request(request_id, req, max_tokens, at, self.hasher)
        self.sched.add_request(request)
        for ev in request.events:
            ev.timestamp = at
        self.states[request_id] = _ReqState(
            _request_state_stats(at), prompt, max_tokens, at, client
        )
        return True

    def step(self) -> list[int]:
        """Schedule, cost and complete one engine step; return the clients whose request
        finished in it."""
        from vllm.v1.metrics.stats import IterationStats

        sched = self.sched
        so = sched.schedule()
        if so.total_num_scheduled_tokens == 0:
            _empty_update(sched, so)
            raise TwinError(
                f"the scheduler cannot run any of {sched.get_num_unfinished_requests()} "
                "requests (a prompt larger than the KV cache?): raise num_gpu_blocks or "
                "lower max_model_len"
            )
        load, req_ids, sampled = _step_load(sched, so)
        _restamp(sched, so, self.t)
        dt = float(self.twin.cost.step_s(load))
        if not dt > 0:
            raise TwinError(f"the step-time model gave {dt} s for {load}; it must be > 0")
        self.t += dt
        t = self.t
        outs = sched.update_from_output(so, _runner_output(req_ids, sampled))
        it = IterationStats()
        it.iteration_timestamp = t
        eco = outs.get(0)
        sched_stats = None
        clients: list[int] = []
        if eco is not None:
            sched_stats = eco.scheduler_stats
            for out in eco.outputs:
                st = self.states.get(out.request_id)
                if st is None:
                    continue
                it.update_from_output(out, t, st.is_prefilling, st.stats, self.lora_states, None)
                if st.is_prefilling:
                    if out.prefill_stats is not None:
                        st.num_cached_tokens = out.prefill_stats.num_cached_tokens
                    st.is_prefilling = False
                if out.finish_reason is not None:
                    it.update_from_finished_request(
                        finish_reason=out.finish_reason,
                        request_id=out.request_id,
                        num_prompt_tokens=st.prompt_len,
                        max_tokens_param=st.max_tokens,
                        req_stats=st.stats,
                        num_cached_tokens=st.num_cached_tokens,
                    )
                    fr = it.finished_requests[-1]
                    self.req_rows.append(
                        (
                            st.arrival,
                            t,
                            fr.e2e_latency,
                            st.stats.first_token_latency,
                            fr.queued_time,
                            fr.prefill_time,
                            fr.decode_time,
                            fr.num_prompt_tokens,
                            fr.num_generation_tokens,
                            fr.num_cached_tokens,
                            fr.num_preemptions,
                            str(fr.finish_reason),
                        )
                    )
                    del self.states[out.request_id]
                    if st.client is not None:
                        clients.append(st.client)
        if sched_stats is not None:
            pcs = sched_stats.prefix_cache_stats
            self.step_rows.append(
                (
                    t,
                    dt,
                    sched_stats.num_running_reqs,
                    sched_stats.num_waiting_reqs + sched_stats.num_skipped_waiting_reqs,
                    sched_stats.kv_cache_usage,
                    load.requests,
                    load.decode_requests,
                    load.prompt_tokens,
                    load.context_tokens,
                    it.num_generation_tokens,
                    it.num_prompt_tokens,
                    it.num_preempted_reqs,
                    pcs.queries,
                    pcs.hits,
                )
            )
            _add_iteration_details(sched_stats, len(self.step_rows), load, dt)
        if self.twin.sink is not None:
            self.twin.sink.record(sched_stats, it, t)
        return clients

    def result(self, start: float, end: float, wall_s: float, extra: dict[str, Any]) -> TwinResult:
        if self.twin.sink is not None:
            self.twin.sink.close(max(self.t, end))
        return TwinResult(
            shape=self.shape,
            cost=self.twin.cost.describe(),
            steps=pd.DataFrame(self.step_rows, columns=list(STEP_COLUMNS)),
            requests=pd.DataFrame(self.req_rows, columns=list(REQUEST_COLUMNS)),
            start_unix_s=start,
            end_unix_s=end,
            wall_s=wall_s,
            rejected=self.rejected,
            unfinished=self.sched.get_num_unfinished_requests(),
            extra=dict(extra),
        )


class _Driver:
    """The state of one :meth:`TwinPool.run`: the engines, the arrivals, the clock."""

    def __init__(self, pool: TwinPool) -> None:
        self.pool = pool
        self.t0 = self.now = pool.start_unix_s
        self.engines = [_Engine(tw, self.t0) for tw in pool.twins]
        self.deadline = None if pool.max_sim_s is None else self.t0 + pool.max_sim_s
        self.counter = itertools.count()
        self.rr = itertools.cycle(range(len(self.engines)))
        self.wall0 = time.perf_counter()
        self.next_progress = self.t0
        self.phase_starts: list[float] = []
        self.phase_windows: list[tuple[float, float]] = []
        """Per phase, its measurement window: a steady-state loop's (from its warm-up's
        end to when its clients stop sending), a timed loop's (from its start to its
        stop), else the whole phase."""
        self.unsent = 0
        self.stopped = False

    def _route(self, req: TwinRequest) -> _Engine:
        engines = self.engines
        if len(engines) == 1:
            return engines[0]
        if self.pool.routing == "least-loaded":
            return min(engines, key=lambda e: e.in_flight)
        if self.pool.routing == "prefix-affine" and req.block_ids:
            return engines[zlib.crc32(str(req.block_ids[0]).encode()) % len(engines)]
        return engines[next(self.rr)]

    def phase(self, stream: Sequence[TwinRequest] | ClosedLoop, index: int) -> None:
        if self.stopped:
            return
        start = max([self.now, *(e.t for e in self.engines)])
        self.phase_starts.append(start)
        arrivals: list[tuple[float, int, TwinRequest, int | None]] = []
        backlog: Any = iter(())
        think = 0.0
        stop_at = float("inf")
        steady: ClosedLoop | None = None
        window_start = start
        back: set[int] = set()  # clients whose first request has returned
        returned = 0  # requests returned in this phase
        if isinstance(stream, ClosedLoop):
            backlog = iter(stream.requests)
            think = stream.think_s
            if stream.steady_state:
                steady = stream
            elif stream.duration_s is not None:
                stop_at = start + stream.duration_s
            for client0 in range(stream.concurrency):
                nxt = next(backlog, None)
                if nxt is None:
                    break
                heapq.heappush(arrivals, (start, next(self.counter), nxt, client0))
        else:
            for req in stream:
                if req.arrival_s is None:
                    raise StreamError(
                        f"phase {index + 1} is open loop but has requests without arrival "
                        "times; give it times (with_poisson_arrivals) or replay it as a "
                        "ClosedLoop"
                    )
                heapq.heappush(arrivals, (start + req.arrival_s, next(self.counter), req, None))

        def warmed(now: float) -> None:
            """End a steady-state warm-up at ``now``: the window is set from it."""
            nonlocal stop_at, window_start, steady
            assert steady is not None and steady.duration_s is not None
            window_start = now
            stop_at = now + steady_window_s(
                steady.concurrency, now - start, returned, steady.duration_s, steady.max_stretch_s
            )
            steady = None

        def next_for(sender: int, now: float) -> None:
            nonlocal returned
            returned += 1
            back.add(sender)
            if (
                steady is not None
                and now >= start + steady.warmup_s
                and (len(back) >= steady.concurrency or now >= warm_limit)
            ):
                warmed(now)
            if now + think >= stop_at:
                return
            nxt = next(backlog, None)
            if nxt is not None:
                heapq.heappush(arrivals, (now + think, next(self.counter), nxt, sender))

        warm_limit = (
            start + max(steady.warmup_s, steady.max_stretch_s) if steady is not None else 0.0
        )
        try:
            while True:
                busy = [e for e in self.engines if e.busy]
                first = min(busy, key=lambda e: e.t) if busy else None
                t_step = first.t if first is not None else float("inf")
                if steady is not None and first is not None and first.t >= warm_limit:
                    warmed(first.t)  # the first wave not all back within the stretch limit
                if arrivals and arrivals[0][0] <= t_step:
                    at, n, req, client = heapq.heappop(arrivals)
                    self.now = max(self.now, at)
                    if not self._route(req).add(f"r{n}", req, at, client) and client is not None:
                        next_for(client, at)
                    continue
                if first is None:
                    return  # nothing in flight and nothing to arrive: the phase is over
                self.now = max(self.now, first.t)
                if self.deadline is not None and first.t >= self.deadline:
                    self.unsent += len(arrivals) + sum(1 for _ in backlog)
                    self.stopped = True
                    return
                for done in first.step():
                    next_for(done, first.t)
                progress = self.pool.progress
                if progress is not None and first.t >= self.next_progress:
                    progress(first.t - self.t0)
                    self.next_progress = first.t + 1.0
        finally:
            end = stop_at if stop_at < float("inf") else self.now
            self.phase_windows.append((window_start, max(end, window_start)))

    def finish(self) -> list[TwinResult]:
        end = max([self.now, *(e.t for e in self.engines)])
        wall = time.perf_counter() - self.wall0
        extra = {
            "phase_starts": self.phase_starts,
            "phase_windows": self.phase_windows,
            "unsent": self.unsent,
        }
        results = [e.result(self.t0, end, wall, extra) for e in self.engines]
        if self.unsent and results:
            results[0].unfinished += self.unsent
        return results


# -- vLLM objects ----------------------------------------------------------------------


def _make_request(
    request_id: str, req: TwinRequest, max_tokens: int, arrival: float, hasher: Any
) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=request_id,
        prompt_token_ids=req.token_ids(),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        arrival_time=arrival,
        block_hasher=hasher,
    )


def _request_state_stats(arrival: float) -> Any:
    from vllm.v1.metrics.stats import RequestStateStats

    return RequestStateStats(arrival_time=arrival)


def _step_load(sched: Any, so: Any) -> tuple[StepLoad, list[str], list[list[int]]]:
    """What the scheduled step computes, and which requests sample a token.

    After ``schedule()`` a request's ``num_computed_tokens`` already includes this
    step's tokens; a request samples when all its known tokens are computed.
    """
    requests = sched.requests
    decode = prompt = context = 0
    pairs = 0.0
    req_ids: list[str] = []
    sampled: list[list[int]] = []
    for rid, n in so.num_scheduled_tokens.items():
        r = requests[rid]
        after = r.num_computed_tokens
        before = after - n
        samples = after >= r.num_tokens
        if n == 1 and samples and before > 0:
            decode += 1
            pairs += after
        else:
            prompt += n
            pairs += n * (before + (n + 1) / 2.0)
        context += after
        req_ids.append(rid)
        sampled.append([_SAMPLED_TOKEN] if samples else [])
    load = StepLoad(len(req_ids), decode, prompt, context, pairs)
    return load, req_ids, sampled


def _restamp(sched: Any, so: Any, now: float) -> None:
    """Give the events this ``schedule()`` recorded the simulated time of the step."""
    requests = sched.requests
    ids: Any = so.num_scheduled_tokens.keys()
    if so.preempted_req_ids:
        ids = itertools.chain(ids, so.preempted_req_ids)
    for rid in ids:
        r = requests.get(rid)
        if r is None or not r.events:
            continue
        for ev in r.events:
            if ev.timestamp < _SIM_EPOCH_FLOOR:
                ev.timestamp = now


def _runner_output(req_ids: list[str], sampled: list[list[int]]) -> Any:
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def _empty_update(sched: Any, so: Any) -> None:
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    sched.update_from_output(so, EMPTY_MODEL_RUNNER_OUTPUT)


def _add_iteration_details(stats: Any, index: int, load: StepLoad, dt: float) -> None:
    """vLLM's per-iteration details (as with ``--enable-logging-iteration-details``):
    the step's simulated time, so the collector stores ``iteration_s`` per step."""
    from vllm.v1.metrics.stats import SchedulerIterationDetails

    stats.iteration_details = SchedulerIterationDetails(
        iteration_index=index,
        num_ctx_requests=load.requests - load.decode_requests,
        num_ctx_tokens=load.prompt_tokens,
        num_generation_requests=load.decode_requests,
        num_generation_tokens=load.decode_requests,
        elapsed_ms=dt * 1000.0,
    )


__all__ = ["Sink", "Twin", "TwinConfigError", "TwinError", "TwinResult"]

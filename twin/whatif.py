"""What-ifs by replay: the advisor's proposals, tried on a twin of the engine.

The advisor predicts each configuration change in closed form (:mod:`kvscope.advisor.capacity`);
:func:`replay_whatifs` replays the same change through vLLM's own scheduler on a twin built
from what the collector knows of the engine:

* its configuration from the engine's hello (:func:`shape_of`, :func:`apply_flags`);
* its step time from its step cycle (:func:`engine_cost`), else from the advisor's fit on its
  1-second windows (:func:`cost_of`);
* its traffic from the requests it served (:func:`stream_of`), cached prompt tokens as a
  shared prefix.

Each change is judged at the highest load the engine saw, against the same replay of the
current configuration; the finding states the twin's figure beside the advisor's and whether
they agree within ``agree_within``. See docs/twin.md#what-ifs-by-replay.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from kvscope.advisor.findings import Finding, Report, Scope
from kvscope.twin.shape import EngineShape, ModelShape, TwinConfigError
from kvscope.twin.sim import Twin, TwinResult
from kvscope.twin.steptime import LinearStepCost
from kvscope.twin.streams import ClosedLoop, TwinRequest

#: Stand-in model for a twin built from telemetry: the linear step time needs no model
#: figures, and vLLM's scheduler only reads the KV geometry for memory accounting.
_TELEMETRY_MODEL = ModelShape("engine", 0.0, 1, 64, 1, 1, 64)


def shape_of(hello: dict[str, Any] | pd.Series) -> EngineShape:
    """The engine's configuration from its stored hello."""

    def num(key: str, default: float | None = None) -> int:
        v = hello.get(key)
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            if default is None:
                raise TwinConfigError(f"the engine's hello has no {key}; the twin needs it")
            return int(default)
        return int(v)

    blocks = num("num_gpu_blocks")
    bs = num("block_size", 16)
    prefix = hello.get("enable_prefix_caching")
    return EngineShape(
        _TELEMETRY_MODEL,
        num_gpu_blocks=blocks,
        block_size=bs,
        max_num_seqs=num("max_num_seqs", 256),
        max_num_batched_tokens=num("max_num_batched_tokens", 8192),
        max_model_len=num("max_model_len", min(8192, (blocks - 1) * bs)),
        enable_prefix_caching=True if prefix is None else bool(prefix),
        kv_cache_dtype=str(hello.get("kv_cache_dtype") or "auto"),
    )


def cost_of(report: Report, engine_id: str) -> LinearStepCost | None:
    """The advisor's step-time fit of ``engine_id`` (None when it could not fit one)."""
    for f in report.findings:
        if f.kind == "kv_capacity" and f.scope.engine_id == engine_id:
            sm = f.evidence.get("step_model") or {}
            try:
                return LinearStepCost(
                    float(sm["step_fixed_s"]),
                    float(sm["step_per_seq_s"]),
                    float(sm["step_per_prompt_token_s"]),
                    float(sm.get("step_per_kv_token_s") or 0.0),
                    source=f"the advisor's fit on {engine_id}'s windows",
                )
            except (KeyError, TypeError, ValueError):
                return None
    return None


MIN_CYCLE_STEPS = 200
"""Steps the step-cycle fit needs (:func:`~kvscope.twin.steptime.fit_steps`)."""


def engine_cost(
    report: Report, source: Any, engine_id: str, since: float | None, until: float | None
) -> LinearStepCost | None:
    """``engine_id``'s step time: fitted on its step cycle where the source holds its raw
    steps, else the advisor's fit on its windows (:func:`cost_of`; None: neither).

    The step cycle first: a 1-second window holds the steps that ended in it, so a step
    longer than the gap to the previous window (a long prefill on a slow device) is
    priced as if it fitted in its second, and a prompt token comes out far too cheap
    (docs/twin.md#step-time-models). The cycle is used only where one stat logger saw every step of the engine (its step
    numbers run on by one): the cycles of an engine whose steps reach several API server
    processes interleave."""
    steps_of = getattr(source, "steps", None)
    if steps_of is not None:
        try:
            steps = steps_of(since, until, engine=engine_id)
        except Exception:  # a source without raw steps, or they expired
            steps = None
        if steps is not None and len(steps) >= MIN_CYCLE_STEPS and _one_logger(steps):
            from kvscope.twin.steptime import fit_steps

            try:
                fit = fit_steps(steps, cycle=True, min_steps=MIN_CYCLE_STEPS)
            except ValueError:
                fit = None
            if fit is not None:
                return replace(fit, source=f"the step cycle of {engine_id} ({fit.source})")
    return cost_of(report, engine_id)


def _one_logger(steps: pd.DataFrame) -> bool:
    """Whether one stat logger recorded these steps: within each boot, in time order,
    nearly every step number is the previous one's plus one."""
    if "step" not in steps or "ts_unix_s" not in steps:
        return False
    ok = total = 0
    for _, g in steps.groupby("boot_id") if "boot_id" in steps else [(None, steps)]:
        n = pd.to_numeric(g.sort_values("ts_unix_s")["step"], errors="coerce").to_numpy(float)
        d = np.diff(n)
        ok += int(np.sum(d == 1))
        total += len(d)
    return total > 0 and ok >= 0.95 * total


def stream_of(requests: pd.DataFrame) -> list[TwinRequest]:
    """The engine's served requests as a stream (see the module docstring)."""
    r = requests
    if "finish_reason" in r:
        r = r[r["finish_reason"] != "abort"]
    fin = pd.to_numeric(r["finished_unix_s"], errors="coerce").to_numpy(float)
    e2e = pd.to_numeric(r["e2e_s"], errors="coerce").fillna(0.0).to_numpy(float)
    prompt = pd.to_numeric(r["prompt_tokens"], errors="coerce").fillna(0).to_numpy(int)
    out_t = pd.to_numeric(r["generation_tokens"], errors="coerce").fillna(0).to_numpy(int)
    cached = pd.to_numeric(r.get("cached_tokens", 0), errors="coerce")
    cached = np.zeros(len(r), int) if np.isscalar(cached) else cached.fillna(0).to_numpy(int)
    arrival = fin - e2e
    ok = np.isfinite(arrival) & (prompt >= 1) & (out_t >= 1)
    if not ok.any():
        return []
    t0 = float(np.min(arrival[ok]))
    out = []
    for i in np.flatnonzero(ok)[np.argsort(arrival[ok], kind="stable")]:
        c = int(min(cached[i], prompt[i] - 1))
        out.append(
            TwinRequest(
                int(prompt[i]),
                int(out_t[i]),
                float(arrival[i] - t0),
                (0,) if c > 0 else (),
                max(1, c),
                int(i),
            )
        )
    return out


#: Flags that change who is admitted, not what the scheduler does with what it runs: the
#: replay keeps every request (the engine's throughput at its load is what is compared).
_ADMISSION_FLAGS = ("--max-num-queued-reqs",)


def apply_flags(shape: EngineShape, flags: list[str], hello: Any) -> EngineShape | None:
    """``shape`` with vLLM ``flags`` applied; None for a flag the twin cannot model
    (admission flags, :data:`_ADMISSION_FLAGS`, leave the shape as it is)."""
    out = shape
    for flag in flags:
        parts = shlex.split(flag)
        if len(parts) != 2:
            return None
        name, value = parts
        try:
            if name in _ADMISSION_FLAGS:
                continue
            if name == "--kv-cache-dtype" and value.startswith("fp8"):
                if shape.kv_cache_dtype.startswith("fp8"):
                    return None
                out = out.with_(num_gpu_blocks=2 * out.num_gpu_blocks, kv_cache_dtype="fp8")
            elif name == "--gpu-memory-utilization":
                u = float(hello.get("gpu_memory_utilization") or math.nan)
                if not math.isfinite(u) or u <= 0:
                    return None
                out = out.with_(num_gpu_blocks=int(out.num_gpu_blocks * float(value) / u))
            elif name == "--tensor-parallel-size":
                tp = float(hello.get("tensor_parallel_size") or 1)
                out = out.with_(num_gpu_blocks=int(out.num_gpu_blocks * float(value) / tp))
            elif name == "--max-num-seqs":
                out = out.with_(max_num_seqs=int(value))
            elif name == "--max-num-batched-tokens":
                out = out.with_(max_num_batched_tokens=int(value))
            else:
                return None
        except (TypeError, ValueError, TwinConfigError):
            return None
    return out


@dataclass
class _Run:
    tokens_per_s: float
    e2e_p99_s: float
    preemptions_per_request: float


def _closed(
    shape: EngineShape, cost: LinearStepCost, reqs: list[TwinRequest], load: int, seconds: float
) -> _Run:
    from kvscope.twin.sweep import endless

    # In steady state (ClosedLoop.steady_state): the clients start together, and at an
    # engine's top load a request can spend longer in it than a fixed window.
    loop = ClosedLoop(
        endless(reqs),
        load,
        duration_s=0.75 * seconds,
        steady_state=True,
        warmup_s=0.25 * seconds,
        max_stretch_s=4 * seconds,
    )
    res = Twin(shape, cost, start_unix_s=1e9).run(loop)
    a, b = res.extra["phase_windows"][0]
    return _steady(res, a, b)


def _steady(res: TwinResult, a: float, b: float) -> _Run:
    s, r = res.steps, res.requests
    st = s[(s["t_end"] > a) & (s["t_end"] <= b)]
    done = r[(r["finish"] > a) & (r["finish"] <= b)]
    return _Run(
        float(st["generated"].sum()) / (b - a),
        float(done["e2e_s"].quantile(0.99)) if len(done) else math.nan,
        float(done["preemptions"].mean()) if len(done) else math.nan,
    )


def replay_whatifs(
    report: Report,
    source: Any,
    since: float | None,
    until: float | None,
    *,
    seconds: float = 60.0,
    agree_within: float = 0.10,
    max_requests: int = 5000,
) -> list[Finding]:
    """One ``whatif_replay`` finding per engine with proposals (see the module docstring)."""
    engines = source.engines()
    out: list[Finding] = []
    for v in report.engines:
        recs = [
            r
            for r in report.recommendations
            if r.scope.engine_id == v.engine_id and (r.change or {}).get("vllm_flags")
        ]
        cap = v.recommended_concurrency_cap
        if not recs and cap is None:
            continue
        scope = Scope(v.engine_id, v.pool)
        hello_rows = engines[engines["engine_id"] == v.engine_id]
        cost = engine_cost(report, source, v.engine_id, since, until)
        reqs = stream_of(source.requests(since, until, engine=v.engine_id).tail(max_requests))
        load = round(v.max_load_seen or 0)
        why = None
        if hello_rows.empty:
            why = "the collector holds no hello for this engine"
        elif cost is None:
            why = "the advisor could not fit this engine's step time"
        elif len(reqs) < 20 or load < 1:
            why = "too few requests in the window to replay"
        if why is not None:
            out.append(Finding("whatif_replay", scope, f"what-ifs not replayed: {why}"))
            continue
        assert cost is not None
        hello = hello_rows.iloc[-1]
        try:
            base_shape = shape_of(hello)
        except TwinConfigError as exc:
            out.append(Finding("whatif_replay", scope, f"what-ifs not replayed: {exc}"))
            continue
        base = _closed(base_shape, cost, reqs, load, seconds)
        replayed: dict[EngineShape, _Run] = {base_shape: base}
        rows: list[dict[str, Any]] = []
        for rec in recs:
            flags = list(rec.change["vllm_flags"])
            shape = apply_flags(base_shape, flags, hello)
            effect = rec.expected_effect or {}
            # A cap keeps a share of the throughput (and cuts the tail); the other
            # changes promise a gain.
            capping = "throughput_fraction" in effect
            row: dict[str, Any] = {"kind": rec.kind, "flags": " ".join(flags)}
            if capping:
                row["closed_form_fraction"] = effect.get("throughput_fraction")
                row["closed_form_e2e_p99_s"] = effect.get("p99_e2e_s")
            else:
                row["closed_form_gain"] = effect.get("gain_ratio", rec.expected_gain)
            if shape is None:
                row["note"] = "not a change the twin models"
                rows.append(row)
                continue
            if shape not in replayed:  # fp8 and a second GPU both double the blocks
                replayed[shape] = _closed(shape, cost, reqs, load, seconds)
            got = replayed[shape]
            ratio = got.tokens_per_s / base.tokens_per_s if base.tokens_per_s else math.nan
            row.update(
                twin_tokens_per_s=got.tokens_per_s,
                twin_e2e_p99_s=got.e2e_p99_s,
                twin_preemptions_per_request=got.preemptions_per_request,
            )
            if capping:
                want = row["closed_form_fraction"]
                row["twin_fraction"] = ratio
                row["agree"] = want is not None and abs(ratio - float(want)) <= agree_within
            else:
                want = row["closed_form_gain"]
                row["twin_gain"] = ratio - 1.0
                row["agree"] = want is not None and abs(ratio - 1.0 - float(want)) <= agree_within
            rows.append(row)
        if cap is not None:
            got = _closed(base_shape, cost, reqs, int(cap), seconds)
            frac = got.tokens_per_s / base.tokens_per_s if base.tokens_per_s else math.nan
            pred = v.predicted_throughput_fraction_at_cap
            rows.append(
                {
                    "kind": "cap_in_flight",
                    "flags": f"cap {cap} in flight",
                    "closed_form_fraction": pred,
                    "twin_fraction": frac,
                    "twin_e2e_p99_s": got.e2e_p99_s,
                    "closed_form_e2e_p99_s": v.predicted_p99_e2e_s_at_cap,
                    "agree": pred is not None and abs(frac - pred) <= agree_within,
                }
            )
        parts = []
        for row in rows:
            if "note" in row:
                parts.append(f"{row['flags']}: not replayed ({row['note']})")
                continue
            if "twin_fraction" in row:
                text = (
                    f"{row['flags']}: twin keeps {row['twin_fraction']:.0%} of the throughput "
                    f"at load {load}, e2e P99 {row['twin_e2e_p99_s']:.2f} s (advisor "
                    f"{_pct0(row['closed_form_fraction'])})"
                )
            else:
                text = (
                    f"{row['flags']}: twin {row['twin_gain']:+.0%}, advisor "
                    f"{_pct(row['closed_form_gain'])}"
                )
            if any(a in row["flags"] for a in _ADMISSION_FLAGS):
                text += "; the replay admits every request, so its P99 holds the queue vLLM would refuse"
            parts.append(text + ("" if row["agree"] else " (they disagree: trust the replay)"))
        disagree = [r for r in rows if r.get("agree") is False]
        out.append(
            Finding(
                kind="whatif_replay",
                scope=scope,
                summary=(
                    f"replayed through vLLM's scheduler ({len(reqs)} of this engine's requests, "
                    f"{load} in flight, its fitted step time): " + "; ".join(parts)
                ),
                severity="warning" if disagree else "info",
                confidence=0.8,
                evidence={
                    "load": load,
                    "n_requests": len(reqs),
                    "baseline_tokens_per_s": base.tokens_per_s,
                    "baseline_e2e_p99_s": base.e2e_p99_s,
                    "baseline_preemptions_per_request": base.preemptions_per_request,
                    "step_time": cost.describe(),
                    "engine": base_shape.describe(),
                    "n_disagree": len(disagree),
                },
                frame={k: [r.get(k) for r in rows] for k in sorted({k for r in rows for k in r})},
            )
        )
    return out


def _pct(v: Any) -> str:
    return "-" if v is None else f"{float(v):+.0%}"


def _pct0(v: Any) -> str:
    return "-" if v is None else f"{float(v):.0%}"

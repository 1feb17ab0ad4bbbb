"""How fast the engine twin replays: simulated engine-seconds per wall-second.

One command (about a minute)::

    .venv/bin/python bench/twin_speed.py [--running 50,250,1000] [--seconds 60]

For each target of running requests ``N``: a twin of an 8B model on one A100 (the
roofline step-time model, :mod:`kvscope.twin.steptime`) with room for ``N`` sequences
(``max_num_seqs`` N, KV blocks for all of them), ``N`` closed-loop clients with
300-token prompts and 1,000-token outputs (steps are mostly decode at a batch of
``N``), run for ``--seconds`` simulated seconds, with and without the feed into a
collector (the plugin's ``record()`` and the export). The table gives the twin's steps
per wall-second against the modelled GPU engine's steps per second (its step time from
the same model): their ratio is how many times faster than real time the twin replays,
the issue's target being at least 10x for a 256-sequence engine on one core. The
baseline measured in the same run is the bare scheduler: ``schedule()`` and
``update_from_output()`` alone, without the twin's accounting, so the table also shows
what the twin adds to vLLM's own work.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvscope.collector.process import CollectorProcess
from kvscope.twin.feed import CollectorFeed
from kvscope.twin.shape import EngineShape, model_shape
from kvscope.twin.sim import Twin, TwinResult
from kvscope.twin.steptime import GPUS, RooflineStepCost
from kvscope.twin.streams import ClosedLoop, synthetic


def _shape(n: int) -> EngineShape:
    blocks = n * (1400 // 16 + 2)  # prompt + output for every sequence, and spare
    return EngineShape(
        model_shape("llama-3.1-8b"),
        num_gpu_blocks=blocks,
        max_num_seqs=n,
        max_num_batched_tokens=max(8192, n),
    )


def _run(n: int, seconds: float, url: str | None) -> TwinResult:
    shape = _shape(n)
    cost = RooflineStepCost(shape.model, GPUS["a100-80gb"])
    start = time.time() - seconds - 120
    twin = Twin(shape, cost, start_unix_s=start, max_sim_s=seconds)
    if url is not None:
        twin.sink = CollectorFeed(
            url, twin.vllm_config, engine_id=f"speed-{n}:0", pool=f"speed-{n}", start_unix_s=start
        )
    reqs = synthetic(n * 20, prompt_tokens=(300, 300), output_tokens=(1000, 1000), seed=n)
    return twin.run(ClosedLoop(reqs, n))


def _bare(n: int, steps: int) -> float:
    """Steps per wall-second of vLLM's scheduler alone on the same engine and load:
    ``schedule()`` and ``update_from_output()``, one token per finished prefill,
    finished requests replaced; no clock, no stats, no feed."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from kvscope.twin.shape import build_scheduler

    shape = _shape(n)
    sched = build_scheduler(shape)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(shape.block_size, hash_fn)
    reqs = iter(synthetic(n * 40, prompt_tokens=(300, 300), output_tokens=(1000, 1000), seed=n))

    def add(i: int) -> None:
        r = next(reqs)
        sched.add_request(
            Request(
                request_id=f"b{i}",
                prompt_token_ids=r.token_ids(),
                sampling_params=SamplingParams(max_tokens=r.output_tokens, ignore_eos=True),
                pooling_params=None,
                block_hasher=hasher,
            )
        )

    for i in range(n):
        add(i)
    added = n
    t = time.perf_counter()
    for _ in range(steps):
        so = sched.schedule()
        ids = list(so.num_scheduled_tokens)
        sampled = [
            [7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
            for r in ids
        ]
        outs = sched.update_from_output(
            so,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled,
            ),
        )
        eco = outs.get(0)
        for out in eco.outputs if eco is not None else ():
            if out.finish_reason is not None:
                add(added)
                added += 1
    return steps / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", default="50,250,1000", help="running requests to test")
    ap.add_argument("--seconds", type=float, default=60.0, help="simulated seconds per run")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    targets = [int(v) for v in args.running.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        col = CollectorProcess(Path(d) / "speed.duckdb", extra_args=["--kv-events", "off"]).start()
        try:
            for n in targets:
                bare = _run(n, args.seconds, None)
                fed = _run(n, args.seconds, col.url)
                steps = bare.steps
                sched_rate = _bare(n, min(len(steps), 2000))
                gpu_step = statistics.median(steps["step_s"])
                running = statistics.median(steps["running"])
                rows.append(
                    (
                        n,
                        running,
                        sched_rate,
                        gpu_step * 1000,
                        1 / gpu_step,
                        len(steps) / bare.wall_s,
                        bare.sim_s / bare.wall_s,
                        len(fed.steps) / fed.wall_s,
                        fed.sim_s / fed.wall_s,
                    )
                )
        finally:
            col.stop()
    print(
        "| running (target) | running (median) | scheduler alone, steps/s | twin steps/s "
        "(/ scheduler) | twin fed, steps/s (/ scheduler) | GPU step (ms) | GPU steps/s "
        "| x real time | x real time, fed |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n, run, sched_rate, step_ms, gpu_rate, rate, x, rate_fed, x_fed in rows:
        print(
            f"| {n} | {run:.0f} | {sched_rate:,.0f} | {rate:,.0f} ({rate / sched_rate:.2f}) | "
            f"{rate_fed:,.0f} ({rate_fed / sched_rate:.2f}) | {step_ms:.1f} | {gpu_rate:.1f} | "
            f"{x:.1f}x | {x_fed:.1f}x |"
        )
    return 0


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    raise SystemExit(run_stoppable(main))

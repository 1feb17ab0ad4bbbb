"""``kvscope twin``: vLLM's own scheduler replaying traffic for a configuration nobody
has started (:mod:`kvscope.twin`).

``kvscope twin sweep`` runs closed-loop concurrency levels and prints each level's
throughput and latency, a plot, and the advisor's verdict on the result (knee,
plateau, bottleneck, cap), read back from a collector the twin fed through the real
plugin. ``kvscope twin replay`` replays a trace's arrivals (or Poisson arrivals at
``--rate``) open loop and prints the same summary.

Exit codes: 0 done; 2 bad arguments (the message says what to change).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvscope.args import count, fraction, positive, positive_duration
from kvscope.cli.checks import require

__all__ = ["add_parser"]

EPILOG = """\
engines: --model names a published architecture (llama-3.1-8b, llama-3.1-70b,
qwen2.5-7b, llama-2-7b, lab-mid, lab-tiny); --gpu a datasheet (a100-80gb, h100-80gb,
l40s). KV blocks are what --gpu-memory-utilization leaves after the weights, unless
--num-gpu-blocks is given; --kv-cache-dtype fp8 halves the bytes per block.
Step time: a roofline of the GPU's datasheet figures (assumed efficiencies, see
kvscope.twin.steptime), or --step-time A,B,C[,D] seconds: A per step, B per
request, C per computed prompt token, D per context token (the advisor's fitted
step-time model of your engine gives A, B and C).

examples:
  kvscope twin sweep --model llama-3.1-8b --gpu l40s --levels 8,16,32,64,128,256,456
  kvscope twin sweep --trace traces/mooncake_conversation_trace.jsonl --kv-cache-dtype fp8
  kvscope twin replay --trace traces/AzureLLMInferenceTrace_conv.csv --gpu h100-80gb
  kvscope twin replay --prompt-tokens 200:800 --output-tokens 100:400 --rate 12 \\
      --collector http://collector:8844 --pool llama-8b
  kvscope twin replay --like gpu-7:8000:0 --source http://collector:8844 --kv-cache-dtype fp8
"""


STRETCH_LEVELS = 4.0
"""A steady-state level's warm-up, and its window, last at most this many
``--seconds-per-level``."""


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected LOW:HIGH tokens, e.g. 200:800 (got {text!r})"
        ) from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH (got {text!r})")
    return a, b


def _levels(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected concurrencies like 8,16,32 (got {text!r})"
        ) from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be positive (got {text!r})")
    return out


def _step_time(text: str) -> Any:
    if text == "roofline":
        return text
    try:
        vals = [float(v) for v in text.split(",")]
    except ValueError:
        vals = []
    if len(vals) not in (3, 4) or min(vals) < 0:
        raise argparse.ArgumentTypeError(
            f"expected 'roofline' or A,B,C[,D] non-negative seconds (got {text!r})"
        )
    return vals


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "twin",
        help="what a configuration would do, from vLLM's own scheduler (no GPU, no restart)",
        description=(
            "Replay traffic through vLLM's real v1 scheduler and KV-cache manager for a\n"
            "given engine configuration, with the forward pass replaced by a step-time\n"
            "model: the throughput curve, knee, plateau, TTFT and latency of a GPU engine\n"
            "before anyone starts it."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    twin_sub = p.add_subparsers(dest="twin_command", metavar="{sweep,replay}")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        c = twin_sub.add_parser(
            name, help=text, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        _common(c)
        return c

    s = command("sweep", "closed-loop concurrency levels, and the advisor's verdict on them")
    s.add_argument(
        "--levels",
        type=_levels,
        default=[8, 16, 32, 64, 128, 256, 456],
        help="concurrencies to run, in order (default: 8,16,32,64,128,256,456)",
    )
    s.add_argument(
        "--seconds-per-level",
        type=positive_duration,
        default=60.0,
        metavar="DURATION",
        help="simulated seconds per level, the least with steady-state levels (default: 60)",
    )
    s.add_argument(
        "--fixed-windows",
        action="store_true",
        help="levels of exactly --seconds-per-level, measured after their first quarter; by "
        "default each level is stretched into its steady state: its warm-up lasts until every "
        "client's first request has returned, its window at least one closed-loop cycle "
        "(each at most 4 x --seconds-per-level)",
    )
    s.set_defaults(func=run_sweep)
    r = command("replay", "replay arrivals open loop (a trace's times, or Poisson at --rate)")
    r.add_argument(
        "--rate",
        type=positive,
        default=None,
        metavar="R",
        help="Poisson arrivals at R requests/s (default: the trace's own times)",
    )
    r.add_argument(
        "--time-scale",
        type=positive,
        default=1.0,
        metavar="X",
        help="stretch the trace's times by X (0.5 replays twice as fast; default: 1)",
    )
    r.set_defaults(func=run_replay)
    p.set_defaults(func=lambda _args: (p.print_help(), 2)[1])


def _common(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("engine")
    e.add_argument("--model", default="llama-3.1-8b", help="model shape (default: llama-3.1-8b)")
    e.add_argument("--gpu", default="a100-80gb", help="GPU datasheet (default: a100-80gb)")
    e.add_argument("--tensor-parallel-size", type=count, default=1, metavar="N")
    e.add_argument("--gpu-memory-utilization", type=fraction, default=0.9, metavar="F")
    e.add_argument(
        "--num-gpu-blocks",
        type=count,
        default=None,
        metavar="N",
        help="KV-cache blocks (default: from the GPU's memory, as vLLM would allocate)",
    )
    e.add_argument("--block-size", type=count, default=None, metavar="N", help="(default: 16)")
    e.add_argument("--max-num-seqs", type=count, default=None, metavar="N", help="(default: 256)")
    e.add_argument(
        "--max-num-batched-tokens", type=count, default=None, metavar="N", help="(default: 8192)"
    )
    e.add_argument("--max-model-len", type=count, default=None, metavar="N", help="(default: 8192)")
    e.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--no-chunked-prefill", action="store_true")
    e.add_argument(
        "--step-time",
        type=_step_time,
        default="roofline",
        metavar="roofline|A,B,C[,D]",
        help="step-time model (default: roofline of the GPU's datasheet)",
    )
    like = p.add_argument_group(
        "a running engine",
        "start from an engine a collector knows: its configuration (the flags above "
        "override it), the advisor's fit of its step time, and the requests it served",
    )
    like.add_argument("--like", default=None, metavar="ENGINE_ID", help="the engine's id")
    like.add_argument("--source", default=None, metavar="URL", help="the collector that has it")
    like.add_argument("--source-token", default=None, help="that collector's bearer token")
    like.add_argument(
        "--since", default="1h", help="its data from this long ago (default: 1h; see advise)"
    )
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default=None, metavar="FILE", help="Mooncake, Azure or lengths trace")
    w.add_argument("--limit", type=count, default=None, metavar="N", help="first N trace rows")
    w.add_argument("--prompt-tokens", type=_range, default=(200, 800), metavar="LOW:HIGH")
    w.add_argument("--output-tokens", type=_range, default=(100, 400), metavar="LOW:HIGH")
    w.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="TOKENS",
        help="tokens of a shared system prompt at the start of every synthetic prompt",
    )
    w.add_argument("--prefix-groups", type=count, default=1, metavar="N")
    w.add_argument("--requests", type=count, default=2000, metavar="N")
    w.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument(
        "--collector",
        default=None,
        metavar="URL",
        help="feed this collector (pool '<--pool>-twin'); default: a temporary one for the verdict",
    )
    o.add_argument("--token", default=None, help="the collector's bearer token")
    o.add_argument("--pool", default="twin", help="pool label (suffixed '-twin'; default: twin)")
    o.add_argument("--json", dest="json_out", default=None, metavar="FILE", help="write results")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


# -- building from the arguments -------------------------------------------------------------


def _quiet_vllm(args: argparse.Namespace) -> None:
    """vLLM logs its configuration on every engine build (and warnings about the CPU
    platform that do not apply to a scheduler without a model): errors only, unless -v."""
    if not getattr(args, "verbose", False):
        logging.getLogger("vllm").setLevel(logging.ERROR)


def _fail(msg: str) -> int:
    print(f"kvscope twin: {msg}", file=sys.stderr)
    return 2


_DEFAULTS = {
    "block_size": 16,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "max_model_len": 8192,
}


def _setting(args: argparse.Namespace, name: str) -> int:
    v = getattr(args, name)
    return int(_DEFAULTS[name] if v is None else v)


def _like(args: argparse.Namespace) -> tuple[Any, Any, list[Any]]:
    """Shape, step time and requests of a running engine (``--like`` / ``--source``)."""
    from kvscope.advisor import CollectorSource, analyze
    from kvscope.args import parse_time
    from kvscope.twin.shape import TwinConfigError
    from kvscope.twin.whatif import engine_cost, shape_of, stream_of

    if not args.source:
        raise TwinConfigError("--like needs --source URL, the collector that knows the engine")
    src = CollectorSource(args.source, token=args.source_token)
    now = time.time()
    since = parse_time("--since", args.since, now)
    engines = src.engines()
    rows = engines[engines["engine_id"] == args.like] if len(engines) else engines
    if rows.empty:
        known = ", ".join(sorted(map(str, engines.get("engine_id", [])))[:10]) or "none"
        raise TwinConfigError(f"the collector has no engine {args.like!r} (it has: {known})")
    hello = rows.iloc[-1]
    report = analyze(src, since, now, hello.get("pool"))
    cost = engine_cost(report, src, args.like, since, now)
    if cost is None:
        raise TwinConfigError(
            f"the advisor could not fit {args.like}'s step time from its data since "
            f"{args.since}: widen --since, or give --step-time A,B,C"
        )
    requests = stream_of(src.requests(since, now, engine=args.like))
    if not requests:
        raise TwinConfigError(f"{args.like} served no request since {args.since}")
    shape = shape_of(hello)
    changes = {
        name: int(getattr(args, name))
        for name in ("num_gpu_blocks", *_DEFAULTS)
        if getattr(args, name, None) is not None
    }
    if args.kv_cache_dtype == "fp8" and not shape.kv_cache_dtype.startswith("fp8"):
        changes["num_gpu_blocks"] = changes.get("num_gpu_blocks", 2 * shape.num_gpu_blocks)
        changes["kv_cache_dtype"] = "fp8"  # type: ignore[assignment]
    if args.no_prefix_caching:
        changes["enable_prefix_caching"] = False
    return shape.with_(**changes), cost, requests


def _build(args: argparse.Namespace) -> tuple[Any, Any, list[Any]]:
    from kvscope.twin.shape import EngineShape, blocks_for, model_shape
    from kvscope.twin.steptime import LinearStepCost, RooflineStepCost, gpu
    from kvscope.twin.streams import from_trace, synthetic

    cost: Any
    if args.like:
        shape, cost, requests = _like(args)
        if args.step_time != "roofline":
            v = args.step_time
            cost = LinearStepCost(v[0], v[1], v[2], v[3] if len(v) > 3 else 0.0, "--step-time")
        return shape, cost, requests
    model = model_shape(args.model)
    device = gpu(args.gpu)
    kv_bytes = 1.0 if args.kv_cache_dtype == "fp8" else 2.0
    blocks = args.num_gpu_blocks or blocks_for(
        model,
        device.memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=_setting(args, "block_size"),
        kv_bytes_per_value=kv_bytes,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    shape = EngineShape(
        model,
        num_gpu_blocks=blocks,
        block_size=_setting(args, "block_size"),
        max_num_seqs=_setting(args, "max_num_seqs"),
        max_num_batched_tokens=_setting(args, "max_num_batched_tokens"),
        max_model_len=_setting(args, "max_model_len"),
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.step_time == "roofline":
        cost = RooflineStepCost(
            model, device, args.tensor_parallel_size, kv_bytes_per_value=kv_bytes
        )
    else:
        v = args.step_time
        cost = LinearStepCost(v[0], v[1], v[2], v[3] if len(v) > 3 else 0.0, "--step-time")
    if args.trace:
        requests = from_trace(
            args.trace, limit=args.limit, time_scale=getattr(args, "time_scale", 1.0)
        )
    else:
        requests = synthetic(
            args.requests,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            shared_prefix_tokens=args.shared_prefix,
            prefix_groups=args.prefix_groups,
            seed=args.seed,
        )
    return shape, cost, requests


class _Collector:
    """The collector to feed: the one given, or a temporary one on a fresh store."""

    def __init__(self, url: str | None) -> None:
        self.url = url
        self._proc: Any = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> _Collector:
        if self.url is None:
            from kvscope.collector.process import CollectorProcess

            self._dir = tempfile.TemporaryDirectory(prefix="kvscope-twin-")
            self._proc = CollectorProcess(
                Path(self._dir.name) / "twin.duckdb", extra_args=["--kv-events", "off"]
            ).start()
            self.url = self._proc.url
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.stop()
        if self._dir is not None:
            self._dir.cleanup()


def _feed(args: argparse.Namespace, url: str, shape: Any, start: float) -> Any:
    """The plugin and exporter that send the twin's steps to the collector at ``url``."""
    from kvscope.twin.feed import CollectorFeed
    from kvscope.twin.shape import build_vllm_config

    return CollectorFeed(
        url,
        build_vllm_config(shape),
        engine_id=f"twin-{args.like}" if args.like else f"twin-{shape.model.name}:0",
        pool=args.pool,
        token=args.token,
        start_unix_s=start,
    )


def _progress(total_s: float, enabled: bool) -> tuple[Any, Any]:
    if not enabled:
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=round(total_s), unit="sim s", file=sys.stderr, leave=False, disable=None)

    def tick(elapsed: float) -> None:
        bar.update(max(0, min(round(elapsed), bar.total) - bar.n))

    return tick, bar


def run_sweep(args: argparse.Namespace) -> int:
    require("twin", "twin")
    _quiet_vllm(args)
    from kvscope.advisor.sources import SourceError
    from kvscope.twin.shape import TwinConfigError
    from kvscope.twin.streams import StreamError
    from kvscope.twin.sweep import sweep

    try:
        shape, cost, requests = _build(args)
    except (TwinConfigError, StreamError, ValueError, OSError, SourceError) as exc:
        return _fail(str(exc))
    stretch_s = STRETCH_LEVELS * args.seconds_per_level
    # The simulated steps land in the past: each level takes at most its stretched
    # warm-up and window, plus the drain of its last requests.
    level_s = args.seconds_per_level if args.fixed_windows else 2 * stretch_s
    start = time.time() - len(args.levels) * (level_s + args.seconds_per_level) - 60
    tick, bar = _progress(len(args.levels) * args.seconds_per_level, not args.no_progress)
    with _Collector(args.collector) as col:
        assert col.url is not None
        feed = _feed(args, col.url, shape, start)
        try:
            result = sweep(
                shape,
                cost,
                requests,
                args.levels,
                seconds_per_level=args.seconds_per_level,
                steady_state=not args.fixed_windows,
                max_stretch_s=stretch_s,
                sink=feed,
                start_unix_s=start,
                progress=tick,
            )
        finally:
            if bar is not None:
                bar.close()
        verdict = _verdict(col.url, args.token, feed.settings.pool, start)
    result.extra["advisor"] = verdict
    _print_sweep(result, verdict)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
        print(f"results written to {args.json_out}")
    return 0


def run_replay(args: argparse.Namespace) -> int:
    require("twin", "twin")
    _quiet_vllm(args)
    from kvscope.advisor.sources import SourceError
    from kvscope.twin.shape import TwinConfigError
    from kvscope.twin.sim import Twin
    from kvscope.twin.streams import StreamError, with_poisson_arrivals

    try:
        shape, cost, requests = _build(args)
        if args.rate is not None:
            requests = with_poisson_arrivals(requests, args.rate, args.seed)
        elif any(r.arrival_s is None for r in requests):
            return _fail("this workload has no arrival times: give --rate R, or a timed trace")
    except (TwinConfigError, StreamError, ValueError, OSError, SourceError) as exc:
        return _fail(str(exc))
    span = max(r.arrival_s or 0.0 for r in requests)
    start = time.time() - 3 * span - 600
    tick, bar = _progress(span, not args.no_progress)
    with _Collector(args.collector) as col:
        assert col.url is not None
        feed = _feed(args, col.url, shape, start)
        twin = Twin(shape, cost, sink=feed, start_unix_s=start, progress=tick)
        try:
            run = twin.run(requests)
        except StreamError as exc:
            return _fail(str(exc))
        finally:
            if bar is not None:
                bar.close()
        verdict = _verdict(col.url, args.token, feed.settings.pool, start)
    summary = run.summary()
    print(
        f"replayed {len(run.requests)} requests ({run.rejected} refused, {run.unfinished} "
        f"unfinished) in {run.sim_s:,.0f} simulated s ({run.wall_s:,.1f} s wall, "
        f"{run.sim_s / max(run.wall_s, 1e-9):,.0f}x real time)"
    )
    print(_engine_line(shape, run.cost))
    for k, v in summary.items():
        print(f"  {k:26s} {v:,.3f}")
    _print_verdict(verdict)
    if args.json_out:
        doc = {"engine": shape.describe(), "step_time": run.cost, "summary": summary}
        doc["advisor"] = verdict
        Path(args.json_out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"results written to {args.json_out}")
    return 0


# -- output ------------------------------------------------------------------------------


def _verdict(url: str, token: str | None, pool: str, since: float) -> dict[str, Any] | None:
    from kvscope.advisor.analyze import analyze
    from kvscope.advisor.sources import CollectorSource

    report = analyze(CollectorSource(url, token), since=since, pool=pool)
    if not report.engines:
        return None
    v = report.engines[0]
    return {
        "bottleneck": v.bottleneck,
        "saturated": v.saturated,
        "knee_concurrency": v.knee_concurrency,
        "plateau_tokens_per_s": v.plateau_tokens_per_s,
        "recommended_concurrency_cap": v.recommended_concurrency_cap,
        "predicted_throughput_fraction_at_cap": v.predicted_throughput_fraction_at_cap,
        "headroom": v.headroom,
    }


def _engine_line(shape: Any, cost: dict[str, Any]) -> str:
    return (
        f"engine: {shape.model.name}, {shape.num_gpu_blocks:,} KV blocks of {shape.block_size} "
        f"({shape.kv_tokens:,} tokens), max_num_seqs {shape.max_num_seqs}, budget "
        f"{shape.max_num_batched_tokens:,}, prefix caching "
        f"{'on' if shape.enable_prefix_caching else 'off'}; step time: {cost['kind']} "
        f"({cost.get('gpu') or cost.get('source')})"
    )


def _num(value: float, fmt: str, unit: str = "") -> str:
    """``value`` formatted, or ``-`` when it is not a number (no request to measure)."""
    return "-" if value is None or not math.isfinite(value) else f"{value:{fmt}}{unit}"


def _print_sweep(result: Any, verdict: dict[str, Any] | None) -> None:
    from kvscope.advisor.textplot import throughput_plot

    run = result.run
    print(
        f"twin sweep: {len(result.levels)} levels of {result.seconds_per_level:g} simulated s or more "
        f"in {run.wall_s:,.1f} s wall ({run.sim_s / max(run.wall_s, 1e-9):,.0f}x real time)"
    )
    print(_engine_line(result.shape, result.cost))
    head = (
        f"{'conc':>6} {'out tok/s':>10} {'total tok/s':>12} {'running':>8} {'waiting':>8} "
        f"{'KV use':>7} {'preempt/req':>11} {'TTFT p50':>9} {'TTFT p99':>9} {'e2e p50':>8} "
        f"{'e2e p99':>8} {'warm+window':>12}"
    )
    print(head)
    for lv in result.levels:
        print(
            f"{lv.concurrency:>6} {lv.output_tokens_per_s:>10,.0f} {lv.total_tokens_per_s:>12,.0f} "
            f"{lv.mean_running:>8.1f} {lv.mean_waiting:>8.1f} {lv.kv_usage_mean:>7.0%} "
            f"{_num(lv.preemptions_per_request, '.2f'):>11} {_num(lv.ttft_p50_s, '.2f', 's'):>9} "
            f"{_num(lv.ttft_p99_s, '.2f', 's'):>9} {_num(lv.e2e_p50_s, '.1f', 's'):>8} "
            f"{_num(lv.e2e_p99_s, '.1f', 's'):>8} {f'{lv.warmup_s:.0f}+{lv.window_s:.0f}s':>12}"
        )
    if any(lv.finished == 0 for lv in result.levels):
        print(
            "-: no request finished inside that level's window (the window is shorter than a "
            "request's time in the engine; drop --fixed-windows or raise --seconds-per-level)"
        )
    knee = verdict.get("knee_concurrency") if verdict else None
    cap = verdict.get("recommended_concurrency_cap") if verdict else None
    lines = throughput_plot(
        [lv.concurrency for lv in result.levels],
        [lv.output_tokens_per_s for lv in result.levels],
        knee=knee,
        cap=cap,
    )
    if lines:
        print("\ngenerated tok/s against concurrency (log scale)")
        print("\n".join(lines))
    _print_verdict(verdict)


def _print_verdict(verdict: dict[str, Any] | None) -> None:
    if verdict is None:
        print("\nadvisor: not enough data for a verdict (run longer levels)")
        return
    knee = verdict["knee_concurrency"]
    cap = verdict["recommended_concurrency_cap"]
    plateau = verdict["plateau_tokens_per_s"]
    print(
        f"\nadvisor (on the twin's data, through the plugin and a collector): "
        f"{verdict['bottleneck']}"
        + (f", knee {knee:.1f} in flight" if knee else "")
        + (f", plateau {plateau:,.0f} tok/s" if plateau else "")
        + (f", cap {cap}" if cap else "")
    )
    if verdict.get("headroom"):
        print(f"  {verdict['headroom']}")

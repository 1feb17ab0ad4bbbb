"""What a closed-loop level measures when it is shorter than a request's time in the server.

One command (about eight minutes with the defaults, one engine start included)::

    .venv/bin/python bench/sweep_steady_state.py [--concurrency 32] [--output-tokens 512]
        [--num-gpu-blocks 48] [--reference-s 240] [--json out.json]

What it does
------------
The real vLLM server (``kvscope.lab.engine.VllmServer`` on the lab's "mid" model,
``--num-gpu-blocks`` KV blocks of 32 tokens: with 512-token outputs the cache holds a
few requests at a time) is driven by ``kvscope sweep`` at ``--concurrency`` clients,
one level per row, in this order on one engine:

- **fixed**: ``--fixed-windows --warmup 3 --duration 10``, the levels of a quick sweep;
- **steady (defaults)**: the sweep's defaults (``--warmup 2 --duration 10``, each level
  stretched into its steady state: :mod:`kvscope.lab.sweep.runner`);
- **steady (3 + 10)**: ``--warmup 3 --duration 10``, stretched likewise;
- **reference**: ``--fixed-windows`` with a 60-second warm-up and a ``--reference-s``
  window, long enough for hundreds of requests to turn over. vLLM's own e2e histogram
  (``vllm:e2e_request_latency_seconds``, scraped when the reference window opens and
  when it closes) gives the mean over the same window from the server's side.

The table gives each level's length, throughput and e2e percentiles, and their ratios
to the reference measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from _fleet import dump_json

from kvscope.lab.engine import VllmServer, build_model, default_model_dir, parse_prometheus_text
from kvscope.lab.sweep import SweepConfig, run_sweep
from kvscope.lab.sweep.stats import LevelResult

MODEL_NAME = "kvscope-steady"
E2E_HISTOGRAM = "vllm:e2e_request_latency_seconds"


@dataclass
class Row:
    level: str
    warmup_s: float
    window_s: float
    output_tokens_per_s: float
    requests_completed: int
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    e2e_p99_truncated: bool
    elapsed_s: float


def e2e_sum_count(metrics_text: str) -> tuple[float, float]:
    """``(sum, count)`` of vLLM's e2e latency histogram, over all its label sets."""
    samples = parse_prometheus_text(metrics_text).items()
    total = sum(v for (name, _), v in samples if name == f"{E2E_HISTOGRAM}_sum")
    count = sum(v for (name, _), v in samples if name == f"{E2E_HISTOGRAM}_count")
    return total, count


def ratio(value: float | None, reference: float | None) -> str:
    if value is None or not reference:
        return "-"
    return f"{value / reference:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=512)
    parser.add_argument("--num-gpu-blocks", type=int, default=48)
    parser.add_argument(
        "--reference-s", type=float, default=240.0, help="the reference window (default 240)"
    )
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--json", default=None, metavar="FILE", help="write the rows here")
    parser.add_argument(
        "--log",
        default=str(Path(tempfile.gettempdir()) / "kvscope-steady-state-vllm.log"),
        metavar="FILE",
        help="the vLLM server's log (default: %(default)s)",
    )
    args = parser.parse_args(argv)

    model = build_model(default_model_dir("mid"), "mid")

    def config(url: str, **kw: object) -> SweepConfig:
        cfg = SweepConfig(
            url=url,
            model=MODEL_NAME,
            concurrency=[args.concurrency],
            cooldown_s=0.0,
            prompt_words=(8, 40),
            output_tokens=(args.output_tokens, args.output_tokens),
            seed=args.seed,
            progress=sys.stderr.isatty(),
        )
        for key, value in kw.items():
            setattr(cfg, key, value)
        return cfg

    def row(name: str, lv: LevelResult, elapsed_s: float) -> Row:
        return Row(
            name, lv.warmup_s, lv.duration_s, lv.output_tokens_per_s, lv.requests_completed,
            lv.e2e_p50_s, lv.e2e_p99_s, lv.e2e_p99_truncated, elapsed_s,
        )  # fmt: skip

    levels = [
        ("fixed 3 + 10 s", {"warmup_s": 3.0, "duration_s": 10.0, "steady_state": False}),
        ("steady (defaults)", {}),
        ("steady (3 + 10 s)", {"warmup_s": 3.0, "duration_s": 10.0}),
    ]
    rows: list[Row] = []
    server_mean_s = None
    with VllmServer(
        model,
        served_model_name=MODEL_NAME,
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=32,
        max_num_seqs=256,
        log_path=args.log,
    ) as server:
        print(f"vLLM at {server.url}, {args.num_gpu_blocks} KV blocks", file=sys.stderr)
        warm = config(server.url, concurrency=[4], output_tokens=(64, 64), steady_state=False)
        warm.warmup_s, warm.duration_s = 1.0, 2.0
        run_sweep(warm)  # first requests run slower
        for name, kw in levels:
            started = time.monotonic()
            (lv,) = run_sweep(config(server.url, **kw)).levels
            rows.append(row(name, lv, time.monotonic() - started))
            time.sleep(5.0)  # the cancelled requests leave the engine
        snaps: dict[str, tuple[float, float]] = {}

        def snap(key: str) -> None:
            with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
                snaps[key] = e2e_sum_count(resp.read().decode())

        reference_warmup_s = 60.0
        timer = threading.Timer(reference_warmup_s, snap, args=("start",))
        started = time.monotonic()
        timer.start()
        ref_cfg = config(server.url, warmup_s=reference_warmup_s, duration_s=args.reference_s)
        ref_cfg.steady_state = False
        (lv,) = run_sweep(ref_cfg).levels
        snap("end")
        timer.join()
        rows.append(row("reference", lv, time.monotonic() - started))
        if "start" in snaps:
            (s0, c0), (s1, c1) = snaps["start"], snaps["end"]
            if c1 > c0:
                server_mean_s = (s1 - s0) / (c1 - c0)

    ref = rows[-1]
    print(
        f"\n{args.concurrency} clients, {args.output_tokens}-token outputs, "
        f"{args.num_gpu_blocks} KV blocks of 32 tokens"
    )
    header = (
        f"{'level':<20} {'warm+window':>12} {'done':>5} {'out tok/s':>9} "
        f"{'e2e p50':>8} {'e2e p99':>9}   vs reference: {'p50':>5} {'p99':>5} {'tok/s':>5}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        p99 = "-" if r.e2e_p99_s is None else f"{r.e2e_p99_s:.1f}s"
        p99 = (">" if r.e2e_p99_truncated else "") + p99
        p50 = "-" if r.e2e_p50_s is None else f"{r.e2e_p50_s:.1f}s"
        print(
            f"{r.level:<20} {f'{r.warmup_s:.0f}+{r.window_s:.0f}s':>12} {r.requests_completed:>5} "
            f"{r.output_tokens_per_s:>9.0f} {p50:>8} {p99:>9}   {'':>14}"
            f"{ratio(r.e2e_p50_s, ref.e2e_p50_s):>5} {ratio(r.e2e_p99_s, ref.e2e_p99_s):>5} "
            f"{ratio(r.output_tokens_per_s, ref.output_tokens_per_s):>5}"
        )
    if server_mean_s is not None:
        print(f"vLLM's e2e histogram over the reference window: mean {server_mean_s:.1f} s")
    if args.json:
        dump_json(
            args.json,
            {
                "args": vars(args),
                "rows": [r.__dict__ for r in rows],
                "server_mean_s": server_mean_s,
            },
        )
    return 0


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    raise SystemExit(run_stoppable(main))

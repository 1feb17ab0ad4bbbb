"""Engine throughput with and without the kvscope plugin, on the real vLLM CPU engine.

One command (about five minutes with the defaults, four engine starts included)::

    .venv/bin/python bench/engine_ab.py [--rounds 2] [--runs 2] [--duration 10]
        [--concurrency 32] [--json out.json]

What it does
------------
The real vLLM server (``kvscope.lab.engine.VllmServer`` on the lab's "mid" model, ample
KV cache: the compute-bound regime) is driven by the kvscope sweep's closed loop at
``--concurrency`` clients (past the knee on these machines: the engine is saturated)
for ``--duration`` seconds per run, the same workload every run (prompts of 8-40
words, 128 output tokens, one seed). Three arms:

- **A, plugin inert**: the plugin is installed but ``KVSCOPE_COLLECTOR_URL`` is unset
  (what every vLLM server with kvscope installed and not configured runs);
- **B, plugin active, collector up**: the plugin records every step and its exporter
  thread ships a batch a second to a real collector process;
- **C, plugin active, collector down**: the same engine with the collector stopped:
  connections are refused, the exporter retries with backoff and drops the oldest
  batches once ``KVSCOPE_MAX_PENDING_BATCHES`` wait.

Switching A <-> B needs an engine restart (the plugin reads its configuration at
start), B <-> C does not. So the engine is started ``2 x --rounds`` times, alternating
inert and active (A, B/C, A, B/C, ...); an inert start runs ``--runs`` runs of A, an
active one alternates B and C ``--runs`` times each. Only one engine may run on the
machine: another one found by ``pgrep`` is waited for.

The table gives each arm's median output tokens/s over its runs, the ratio to A, and
the noise floor: the spread of A's runs (largest minus smallest over their median)
and the A-vs-A ratio across engine starts (median of the later starts' runs over the
first's). Target: B and C within 1% of A, and within the noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from _fleet import dump_json
from tqdm import tqdm

from kvscope.collector.process import CollectorProcess
from kvscope.lab.engine import REGIMES, VllmServer, build_model, default_model_dir
from kvscope.lab.sweep import SweepConfig, run_sweep

TARGET = 0.01
MODEL_NAME = "kvscope-ab"
ENGINE_PATTERN = "vllm.entrypoints|vllm serve"
MAX_ATTEMPTS = 3
"""Runs of an arm made until none overlapped another engine on the machine."""


@dataclass
class Run:
    arm: str
    start: int
    """Engine start number (0, 1, ...)."""
    output_tokens_per_s: float
    requests_per_s: float
    e2e_p99_s: float | None
    errors: int
    disturbed: bool = False
    """Another vLLM engine ran on the machine during the run (after MAX_ATTEMPTS tries)."""


def wait_for_engine_slot(poll_s: float = 1.0) -> None:
    """Wait until no vLLM server runs on this machine (only one may run at a time)."""
    waited = False
    while True:
        out = subprocess.run(
            ["pgrep", "-fa", ENGINE_PATTERN], capture_output=True, text=True
        ).stdout.strip()
        if not out:
            return
        if not waited:
            tqdm.write(
                f"another vLLM engine is running; waiting for it to end:\n{out[:300]}",
                file=sys.stderr,
            )
            waited = True
        time.sleep(poll_s)


def other_engines(own_pgid: int | None) -> list[str]:
    """vLLM servers running on this machine outside the process group ``own_pgid``."""
    out = subprocess.run(
        ["pgrep", "-f", ENGINE_PATTERN], capture_output=True, text=True
    ).stdout.split()
    others = []
    for pid in out:
        try:
            if own_pgid is None or os.getpgid(int(pid)) != own_pgid:
                others.append(pid)
        except (ProcessLookupError, ValueError):
            continue
    return others


def sweep_once(url: str, args: argparse.Namespace) -> tuple[float, float, float | None, int]:
    cfg = SweepConfig(
        url=url,
        model=MODEL_NAME,
        concurrency=[args.concurrency],
        duration_s=args.duration,
        warmup_s=args.warmup,
        cooldown_s=0.0,
        seed=args.seed,
        progress=False,
        steady_state=False,  # the A/B compares equal windows of the same length
    )
    lv = run_sweep(cfg).levels[0]
    return lv.output_tokens_per_s, lv.requests_per_s, lv.e2e_p99_s, lv.error_count


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="See the module docstring for the method."
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="pairs of engine starts (inert, active); default 2"
    )
    parser.add_argument(
        "--runs", type=int, default=2, help="runs per arm per engine start (default: 2)"
    )
    parser.add_argument(
        "--duration", type=float, default=10.0, help="measured seconds per run (default: 10)"
    )
    parser.add_argument(
        "--warmup", type=float, default=3.0, help="unmeasured seconds before each run (default: 3)"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=32,
        help="clients, each keeping one request in flight (default: 32)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument(
        "--model-dir",
        default=None,
        help="lab model folder (default: built or reused under ~/.cache/kvscope)",
    )
    parser.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.runs < 1 or args.duration <= 0:
        parser.error("--rounds and --runs must be >= 1, --duration > 0")

    model_dir = build_model(args.model_dir or default_model_dir("mid"), "mid")
    runs: list[Run] = []
    starts: list[dict[str, object]] = []
    n_total = args.rounds * 3 * args.runs
    with tempfile.TemporaryDirectory(prefix="kvscope-ab-") as tmp:
        work = Path(tmp)
        collector = CollectorProcess(work / "ab.duckdb", extra_args=["--advise-interval-s", "0"])
        collector.start()
        bar = tqdm(total=n_total, desc="runs", unit="run", file=sys.stderr)
        try:
            for start in range(2 * args.rounds):
                active = start % 2 == 1
                env = {"KVSCOPE_POOL": "ab"}
                if active:
                    env["KVSCOPE_COLLECTOR_URL"] = collector.url
                wait_for_engine_slot()
                bar.set_postfix_str(f"starting engine {start} ({'active' if active else 'inert'})")
                server = VllmServer(
                    model_dir,
                    served_model_name=MODEL_NAME,
                    env=env,
                    enable_prefix_caching=True,
                    **REGIMES["ample-kv"],
                    log_path=work / f"vllm-{start}.log",
                )
                with server:
                    starts.append({"start": start, "active": active, "startup_s": server.startup_s})
                    sweep_once(server.url, argparse.Namespace(**{**vars(args), "duration": 3.0}))
                    arms = ["B", "C"] * args.runs if active else ["A"] * args.runs
                    for arm in arms:
                        bar.set_postfix_str(f"engine {start}, arm {arm}")
                        down = collector.proc is None or collector.proc.poll() is not None
                        if arm == "C" and not down:
                            collector.stop()
                        elif arm == "B" and down:
                            collector = CollectorProcess(
                                collector.store_path,
                                port=collector.port,
                                extra_args=collector.extra_args,
                            ).start()
                        for attempt in range(1, MAX_ATTEMPTS + 1):
                            while other_engines(server.pid):
                                time.sleep(5.0)  # another engine started meanwhile: wait
                            tok_s, req_s, p99, errors = sweep_once(server.url, args)
                            disturbed = bool(other_engines(server.pid))
                            tqdm.write(
                                f"engine {start}, arm {arm}: {tok_s:.1f} output tok/s, "
                                f"{errors} errors"
                                f"{'; another engine ran meanwhile: run again' if disturbed else ''}",
                                file=sys.stderr,
                            )
                            if not disturbed or attempt == MAX_ATTEMPTS:
                                break
                        runs.append(Run(arm, start, tok_s, req_s, p99, errors, disturbed))
                        bar.update(1)
            if collector.proc is None or collector.proc.poll() is not None:
                collector = CollectorProcess(
                    collector.store_path, port=collector.port, extra_args=collector.extra_args
                ).start()
            stored = collector.get_json("/v1/totals", params={"source": "steps"})
        finally:
            bar.close()
            collector.stop()

    clean = [r for r in runs if not r.disturbed] or runs
    by_arm = {arm: [r.output_tokens_per_s for r in clean if r.arm == arm] for arm in "ABC"}
    med = {arm: statistics.median(v) for arm, v in by_arm.items()}
    a_starts = sorted({r.start for r in clean if r.arm == "A"})
    first = statistics.median([r.output_tokens_per_s for r in clean if r.start == a_starts[0]])
    later = [r.output_tokens_per_s for r in clean if r.arm == "A" and r.start != a_starts[0]]
    a_vs_a = statistics.median(later) / first if later else float("nan")
    noise = spread(by_arm["A"])
    labels = {
        "A": "plugin inert (no collector URL)",
        "B": "plugin active, collector up",
        "C": "plugin active, collector down",
    }

    print()
    print(
        f"vLLM CPU, lab model 'mid', ample KV, {args.concurrency} clients, "
        f"{args.duration:g} s per run; engine starts: "
        + ", ".join(
            f"{s['start']} {'active' if s['active'] else 'inert'} ({s['startup_s']:.0f} s)"
            for s in starts
        )
    )
    print()
    header = f"{'arm':<36} {'runs':>4} {'median tok/s':>12} {'min':>7} {'max':>7} {'vs A':>7}"
    print(header)
    print("-" * len(header))
    for arm in "ABC":
        v = by_arm[arm]
        print(
            f"{arm + ': ' + labels[arm]:<36} {len(v):>4} {med[arm]:>12.1f} {min(v):>7.1f} "
            f"{max(v):>7.1f} {med[arm] / med['A']:>7.3f}"
        )
    print()
    print(
        "runs in order (arm, engine start: tok/s; * overlapped another engine, left out): "
        + "  ".join(
            f"{r.arm}{r.start}:{r.output_tokens_per_s:.0f}{'*' if r.disturbed else ''}"
            for r in runs
        )
    )
    errors = sum(r.errors for r in runs)
    n_steps = sum(int(e["n_steps"]) for e in stored["rows"])
    print(
        f"noise floor: A runs spread {noise:.1%} (max - min over median); A-vs-A across "
        f"engine starts {a_vs_a:.3f}; client errors {errors}; steps stored by the collector "
        f"{n_steps:,}"
    )
    worst = max(abs(med["B"] / med["A"] - 1), abs(med["C"] / med["A"] - 1))
    if worst <= TARGET:
        verdict = "met"
    elif worst <= noise:
        verdict = (
            f"within the noise floor ({noise:.1%}), which is above the target: not "
            "resolved here; more --rounds and a longer --duration lower it"
        )
    else:
        verdict = "MISSED"
    print(
        f"target: plugin arms within {TARGET:.0%} of A: {verdict} (largest difference "
        f"{worst:.1%}; B {med['B'] / med['A'] - 1:+.1%}, C {med['C'] / med['A'] - 1:+.1%})"
    )
    ok = verdict != "MISSED"
    dump_json(
        args.json,
        {
            "runs": [asdict(r) for r in runs],
            "medians": med,
            "a_spread": noise,
            "a_vs_a": a_vs_a,
            "starts": starts,
            "args": vars(args),
        },
    )
    return 0 if ok else 1


if __name__ == "__main__":
    from kvscope.cli._lifecycle import run_stoppable

    # SIGTERM unwinds like Ctrl-C: the engine's process group and the collector (in
    # sessions of their own) are stopped on the way out.
    raise SystemExit(run_stoppable(main))

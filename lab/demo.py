"""``kvscope demo``: a collector on a local store, fed with a real vLLM overload run.

By default the feed is the bundled recording of the real vLLM CPU engine (a
KV-starved server driven by a concurrency sweep), replayed over HTTP into the
collector's ingest endpoint exactly as the plugin sent it. With ``--live`` the demo
starts the real engine itself, with the kvscope plugin pointed at the collector,
and runs the sweep. Either way it then reads back what the collector stored,
through the same query API the dashboard and the report use, and prints it.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvscope.collector.process import CollectorProcess
from kvscope.lab.recording import BUNDLED_RECORDING, load_recording, replay


def _levels_from_header(header: dict[str, Any], shift_s: float) -> list[dict[str, Any]]:
    levels = (header.get("sweep") or {}).get("levels") or []
    out = []
    for lv in levels:
        lv = dict(lv)
        lv["window_start_unix_s"] += shift_s
        lv["window_end_unix_s"] += shift_s
        out.append(lv)
    return out


def _fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def level_table(levels: list[dict[str, Any]], windows: dict[str, list[Any]]) -> str:
    """Per sweep level: the client's view beside the engine's, from the stored windows."""
    head = (
        f"{'clients':>7} {'batch':>6} {'waiting':>7} {'KV used':>8} {'KV max':>6} "
        f"{'preempt/s':>9} {'gen tok/s':>9} {'client tok/s':>12} {'TTFT p99':>8} "
        f"{'e2e p99':>8}"
    )
    lines = [head, "-" * len(head)]
    ts = windows.get("ts_s", [])
    for lv in levels:
        lo, hi = lv["window_start_unix_s"], lv["window_end_unix_s"]
        idx = [i for i, t in enumerate(ts) if lo <= t and t + 1 <= hi + 0.5]
        if not idx:
            continue

        def med(col: str, idx: list[int] = idx) -> float:
            return float(statistics.median(windows[col][i] for i in idx))

        span_s = max(len(idx), 1)
        preempt = sum(windows["preemptions"][i] for i in idx) / span_s
        gen = sum(windows["generation_tokens"][i] for i in idx) / span_s
        kv_max = max(windows["kv_usage_max"][i] for i in idx)
        lines.append(
            f"{lv['concurrency']:>7} {med('batch_mean'):>6.1f} {med('waiting_mean'):>7.1f} "
            f"{med('kv_usage_mean'):>8.0%} {kv_max:>6.0%} {preempt:>9.1f} {gen:>9.0f} "
            f"{lv['output_tokens_per_s']:>12.0f} {_fmt(lv.get('ttft_p99_s'), '.2f'):>7}s "
            f"{_fmt(lv.get('e2e_p99_s'), '.2f'):>7}s"
        )
    return "\n".join(lines)


def summarize(collector: CollectorProcess, levels: list[dict[str, Any]], out: Any) -> None:
    """Print what the collector stored, read back through its query API."""
    engines = collector.get_json("/v1/engines")["rows"]
    totals = collector.get_json("/v1/totals", params={"source": "windows"})["rows"]
    windows = collector.get_json("/v1/windows", params={"since": "0", "format": "columns"})
    stats = collector.get_json("/v1/request_stats", params={"since": "0", "group_by": "all"})
    n_req = stats["rows"][0]["n_requests"] if stats["rows"] else 0
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("")
    for e in engines:
        kv_tokens = (e.get("num_gpu_blocks") or 0) * (e.get("block_size") or 0)
        p(
            f"engine {e['engine_id']}  pool={e['pool']}  model={e['model']}  "
            f"vLLM {e['vllm_version']}"
        )
        p(
            f"  KV cache: {e.get('num_gpu_blocks')} blocks x {e.get('block_size')} tokens "
            f"= {kv_tokens:,} tokens; max_num_seqs {e.get('max_num_seqs')}, "
            f"max_num_batched_tokens {e.get('max_num_batched_tokens')}, "
            f"prefix caching {'on' if e.get('enable_prefix_caching') else 'off'}"
        )
    for t in totals:
        hit = t["prefix_hits"] / t["prefix_queries"] if t["prefix_queries"] else 0.0
        p(
            f"  stored: {t['n_steps']:,} engine steps in {windows['n_rows']:,} one-second "
            f"windows, {n_req:,} finished requests; {t['generation_tokens']:,} tokens "
            f"generated, {t['preemptions']:,} preemptions, prefix-cache hit rate {hit:.0%}"
        )
    if levels:
        p("\nPer load level (client side from the sweep, engine side from kvscope's windows):")
        p(level_table(levels, windows["columns"]))
    p("\nWhere to look (the collector is at " + collector.url + "):")
    p(f"  {collector.url}/metrics                 Prometheus exposition (point Grafana here)")
    p(f"  {collector.url}/v1/engines              engines and their configuration")
    p(f"  {collector.url}/v1/windows?since=1h     1-second windows (batch, KV, waiting, tokens)")
    p(f"  {collector.url}/v1/request_stats        latency percentiles of finished requests")
    p(f"  kvscope advise --collector {collector.url}   the verdict: knee, bottleneck, cap, flags")
    text = collector.get_text("/metrics")
    sample = [
        ln
        for ln in text.splitlines()
        if ln.startswith(
            (
                "kvscope_engine_kv_usage_ratio{",
                "kvscope_engine_batch_size{",
                "kvscope_engine_preemptions_total{",
                "kvscope_engine_step_kv_usage_ratio_bucket{",
            )
        )
    ][:8]
    if sample:
        p("\nA few lines of /metrics:")
        for ln in sample:
            p("  " + ln)


def show_verdict(collector: CollectorProcess) -> None:
    """Print the advisor's answer on what was stored, as `kvscope advise` shows it."""
    from kvscope.advisor import CollectorSource, analyze
    from kvscope.advisor.render_text import print_report

    print(
        "\nThe advisor's verdict (what `kvscope advise --collector "
        f"{collector.url} --since 0` prints):\n"
    )
    report = analyze(CollectorSource(collector.url))
    print_report(report, sys.stdout, source=collector.url, window="all data")


def _feed_recording(collector: CollectorProcess, path: Path) -> list[dict[str, Any]]:
    recording = load_recording(path)
    src = recording.header.get("source", {})
    print(
        f"Replaying {path.name}: a real vLLM {src.get('vllm_version', '')} run "
        f"({src.get('regime', '?')}), {len(recording.batches)} ingest batches."
    )
    _, last = recording.span_unix_s
    end = time.time()
    counts = replay(recording, collector.url, end_at_unix_s=end)
    print(f"Stored {counts.get('stored', 0)} batches ({counts.get('duplicate', 0)} duplicates).")
    return _levels_from_header(recording.header, end - last)


def _feed_live(collector: CollectorProcess, args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvscope.lab.engine import REGIMES, VllmServer, build_model
    from kvscope.lab.sweep import SweepConfig, print_table, run_sweep

    workdir = Path(args.workdir)
    print("Building the local model and starting the real vLLM CPU engine (about a minute)...")
    model = build_model(workdir / "models" / "llama-mid", "mid")
    env = {"KVSCOPE_COLLECTOR_URL": collector.url, "KVSCOPE_POOL": "demo"}
    with VllmServer(
        model,
        served_model_name="kvscope-demo",
        env=env,
        enable_prefix_caching=True,
        log_path=workdir / "vllm-demo.log",
        **REGIMES["kv-starved"],
    ) as server:
        print(f"vLLM is serving at {server.url} (log: {server.log_path}); sweeping...")
        result = run_sweep(
            SweepConfig(
                url=server.url,
                model="kvscope-demo",
                concurrency=[1, 2, 4, 8, 16, 32],
                duration_s=8.0,
            )
        )
        print_table(result)
        time.sleep(2.5)  # the plugin ships each completed second about a second later
    return [lv.__dict__ for lv in result.levels]


def run_demo(args: argparse.Namespace) -> int:
    store = Path(args.store)
    store.parent.mkdir(parents=True, exist_ok=True)
    for p in (store, Path(str(store) + ".wal")):
        p.unlink(missing_ok=True)
    if not args.live:
        recording = Path(args.recording) if args.recording else BUNDLED_RECORDING
        if not recording.exists():
            print(
                f"kvscope demo: no recording at {recording}; run with --live or give "
                "--recording FILE",
                file=sys.stderr,
            )
            return 2
    with CollectorProcess(store, port=args.port, log_path=store.with_suffix(".log")) as c:
        print(f"kvscope collector listening on {c.url}, store {store}")
        levels = _feed_live(c, args) if args.live else _feed_recording(c, recording)
        summarize(c, levels, sys.stdout)
        show_verdict(c)
        if args.serve:
            # Ctrl-C ends the wait here; SIGTERM (kvscope's command line raises it as
            # an exception) leaves through the `with`, which stops the collector too.
            print(f"\nThe collector keeps running at {c.url}; Ctrl-C or SIGTERM stops it.")
            sys.stdout.flush()
            with contextlib.suppress(KeyboardInterrupt):
                while c.proc is not None and c.proc.poll() is None:
                    time.sleep(1)
        else:
            print("\nRun `scripts/demo --serve` to keep the collector up for browsing.")
    return 0

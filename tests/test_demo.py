"""`kvscope demo` end to end: a real collector process fed the bundled real-engine run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvscope.collector.process import free_port
from kvscope.lab.recording import BUNDLED_RECORDING, load_recording


def test_bundled_recording_is_a_real_overload_run():
    rec = load_recording(BUNDLED_RECORDING)
    assert rec.header["source"]["vllm_version"].startswith("0.32")
    hello = next(b["hello"] for b in rec.batches if b.get("hello"))
    assert hello["num_gpu_blocks"] == 48 and hello["block_size"] == 32
    kv = [v for b in rec.batches for v in b["steps"].get("kv_usage_ratio", [])]
    assert max(kv) >= 0.99
    # The plugin's totals equal what vLLM itself counted over the run.
    after, before = rec.header["vllm_counters_after"], rec.header["vllm_counters_before"]
    gen = sum(t for b in rec.batches for t in b["steps"].get("generation_tokens", []))
    pre = sum(t for b in rec.batches for t in b["steps"].get("preemptions", []))
    assert gen == after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert pre == after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"]


def test_demo_replays_into_a_real_collector(tmp_path: Path):
    store = tmp_path / "demo.duckdb"
    port = free_port()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope.cli.main",
            "demo",
            "--port",
            str(port),
            "--store",
            str(store),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    rec = load_recording(BUNDLED_RECORDING)
    assert f"Stored {len(rec.batches)} batches (0 duplicates)" in text
    assert "KV cache: 48 blocks x 32 tokens = 1,536 tokens" in text
    n_steps = sum(len(b["steps"].get("ts_unix_s", [])) for b in rec.batches)
    assert f"{n_steps:,} engine steps" in text
    assert f"http://127.0.0.1:{port}/metrics" in text
    # One table row per sweep level.
    levels = [lv["concurrency"] for lv in rec.header["sweep"]["levels"]]
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("clients")) + 2
    rows = lines[start : start + len(levels) + 1]
    assert [int(r.split()[0]) for r in rows if r.strip()] == levels
    # The advisor's verdict on the stored run closes the demo.
    assert "pool demo: kv_cache_bound" in text
    assert "--max-num-seqs" in text
    # The store stays behind and reopens.
    assert store.exists()


def test_demo_fails_clearly_on_a_missing_recording(tmp_path: Path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope.cli.main",
            "demo",
            "--port",
            str(free_port()),
            "--store",
            str(tmp_path / "x.duckdb"),
            "--recording",
            str(tmp_path / "nope.gz"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "no recording" in out.stderr

"""`kvscope demo` end to end: a real collector process fed the bundled real-engine run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import duckdb

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


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_the_demo_collector_and_frees_its_port_and_store(tmp_path: Path):
    """``kvscope demo --serve`` stopped as a service manager stops it: SIGTERM to the
    command alone. Its collector (a child in a session of its own, which the signal does
    not reach) must stop with it."""
    store, port = tmp_path / "demo.duckdb", free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvscope.cli.main", "demo", "--serve"),
            *("--port", str(port), "--store", str(store)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "keeps running" in line:
                break
        assert "keeps running" in seen[-1], "".join(seen)
        (collector,) = _children(proc.pid)
        assert _alive(collector)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143, proc.stdout.read()
        deadline = time.monotonic() + 5
        while _alive(collector) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(collector), "the collector outlived kvscope demo"
        with socket.socket() as s:  # the port is free for the next server (as servers bind)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
        duckdb.connect(str(store)).close()  # and the store is no longer locked
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

"""``kvscope twin`` and ``kvscope advise --replay`` from the command line.

``advise --replay`` runs on the bundled recording of the real vLLM CPU engine driven into
KV-cache overload (48 blocks of 32 tokens): the twin is built from that engine's hello,
its fitted step time and its requests, and the real engine's own figures are the check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.cli.main import main
from tests.conftest import Replayed


def test_sweep_prints_levels_a_plot_and_the_advisors_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep.json"
    code = main(
        [
            "twin", "sweep", "--model", "llama-3.1-8b", "--gpu", "a100-80gb",
            "--num-gpu-blocks", "600", "--levels", "2,4,8,16,32,64",
            "--seconds-per-level", "45", "--prompt-tokens", "300:500",
            "--output-tokens", "150:250", "--no-progress", "--json", str(out),
        ]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    # 600 blocks of 16 hold 9,600 tokens: ~16 requests of ~600 tokens at their end.
    assert "600 KV blocks of 16 (9,600 tokens)" in text
    assert "generated tok/s against concurrency" in text
    assert "advisor (on the twin's data" in text and "kv_cache_bound" in text
    doc = json.loads(out.read_text())
    levels = doc["levels"]
    assert [lv["concurrency"] for lv in levels] == [2, 4, 8, 16, 32, 64]
    top = levels[-1]
    assert top["kv_usage_mean"] > 0.9 and top["mean_waiting"] > 30
    assert 10 <= top["mean_running"] <= 20
    assert doc["advisor"]["bottleneck"] == "kv_cache_bound"
    assert 8 <= doc["advisor"]["recommended_concurrency_cap"] <= 32


def test_replay_needs_times_or_a_rate(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["twin", "replay", "--no-progress"])
    assert code == 2
    assert "--rate" in capsys.readouterr().err


def test_bad_values_say_what_is_expected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["twin", "sweep", "--levels", "8,x"])
    assert e.value.code == 2
    assert "concurrencies like 8,16,32" in capsys.readouterr().err
    assert main(["twin", "sweep", "--model", "gpt-9", "--no-progress"]) == 2
    assert "unknown model shape 'gpt-9'" in capsys.readouterr().err


def test_advise_replay_tries_the_proposals_on_a_twin_of_the_real_engine(
    kv_starved_collector: Replayed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "advice.json"
    code = main(
        [
            "advise", "--collector", kv_starved_collector.collector.url,
            "--since", "30m", "--replay", "--json", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    (replay,) = [f for f in doc["findings"] if f["kind"] == "whatif_replay"]
    ev, frame = replay["evidence"], replay["frame"]
    assert ev["engine"]["num_gpu_blocks"] == 48 and ev["engine"]["block_size"] == 32
    assert ev["n_requests"] >= 100
    rows = {k: {c: frame[c][i] for c in frame} for i, k in enumerate(frame["kind"])}
    fp8 = rows["whatif_kv_cache_dtype_fp8"]
    # Twice the blocks on a KV-starved engine: more throughput on the twin too.
    assert fp8["twin_gain"] > 0.1
    cap = rows["cap_in_flight"]
    assert 0.7 <= cap["twin_fraction"] <= 1.1
    assert cap["twin_e2e_p99_s"] < ev["baseline_e2e_p99_s"]
    assert "replayed through vLLM's scheduler" in replay["summary"]


def test_a_twin_of_a_running_engine_replays_its_own_requests(
    kv_starved_collector: Replayed, capsys: pytest.CaptureFixture[str]
) -> None:
    url = kv_starved_collector.collector.url
    args = ["twin", "replay", "--like", "demo-host:8000:0", "--source", url, "--since", "30m"]
    assert main([*args, "--no-progress"]) == 0
    base = capsys.readouterr().out
    # The engine's own configuration (48 blocks of 32) and every request it served.
    assert "48 KV blocks of 32 (1,536 tokens)" in base
    assert "replayed 454 requests (0 refused, 0 unfinished)" in base
    assert main([*args, "--kv-cache-dtype", "fp8", "--no-progress"]) == 0
    assert "96 KV blocks of 32" in capsys.readouterr().out
    assert main(["twin", "replay", "--like", "nope:1:0", "--source", url, "--no-progress"]) == 2
    assert "has no engine 'nope:1:0' (it has: demo-host:8000:0" in capsys.readouterr().err


def test_a_twin_of_an_engine_whose_steps_are_kept_takes_its_step_cycle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the raw steps kept (the collector's default day), the twin's step time is the
    engine's own step cycle, not the advisor's fit on 1-second windows."""
    import time

    from kvscope.collector.process import CollectorProcess
    from kvscope.lab.recording import load_recording, replay
    from tests.conftest import KV_STARVED_ENDED_AGO_S, RECORDINGS

    c = CollectorProcess(tmp_path / "kvscope.duckdb").start()
    try:
        replay(
            load_recording(RECORDINGS / "overload_kv_starved.jsonl.gz"),
            c.url,
            end_at_unix_s=time.time() - KV_STARVED_ENDED_AGO_S,
            progress=False,
        )
        out = tmp_path / "replay.json"
        args = ["twin", "replay", "--like", "demo-host:8000:0", "--source", c.url]
        code = main([*args, "--since", "30m", "--no-progress", "--json", str(out)])
        assert code == 0, capsys.readouterr().err
    finally:
        c.stop()
    step = json.loads(out.read_text())["step_time"]
    assert "step cycle of demo-host:8000:0" in step["source"], step
    assert step["per_prompt_token_s"] > 0 and step["fixed_s"] > 0, step

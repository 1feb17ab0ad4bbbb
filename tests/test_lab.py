"""Tests of the lab: the local model build, the server command line, /metrics parsing.

Starting the real engine takes 30-60 s; it is exercised by the engine tests, not here.
The metrics fixture is a real scrape of vLLM 0.32, kept in ``tests/fixtures``.
"""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import pytest

from kvscope.lab.engine import (
    MARKER_FILE,
    VLLM_COUNTERS,
    LabError,
    VllmServer,
    build_model,
    cpu_flags,
    engine_dtype,
    free_port,
    parse_prometheus_text,
    vllm_counter_totals,
)
from kvscope.lab.sweep.prompts import TOKENS_PER_WORD, random_words

METRICS_SAMPLE = Path(__file__).parent / "fixtures" / "vllm_metrics_sample.txt"
"""A real scrape of vLLM 0.32's /metrics (CPU build)."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("lab") / "tiny", "tiny")


def test_tiny_model_loads_with_transformers(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (128, 2, 512)
    assert cfg.hidden_size // cfg.num_attention_heads == 64  # the CPU attention kernel's head_dim
    assert model.dtype == torch.bfloat16
    ids = tokenizer("the time of day", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512)


def test_tokenizer_roundtrip_and_chat_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert len(tokenizer) == 512
    text = random_words(random.Random(0), 50)
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|user|>\nhello\n<|assistant|>\n"


def test_tokens_per_word_matches_the_lab_tokenizer(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rng = random.Random(1)
    n_words = 400
    counts = [len(tokenizer(random_words(rng, n_words))["input_ids"]) - 1 for _ in range(50)]
    # BOS excluded; about one extra token for the first word, which has no leading space
    per_word = (sum(counts) / len(counts) - 1) / n_words
    assert per_word == pytest.approx(TOKENS_PER_WORD, abs=0.02)


def test_build_is_deterministic_and_reused(tiny_model: Path, tmp_path: Path) -> None:
    weights = tiny_model / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert build_model(tiny_model, "tiny") == tiny_model
    assert weights.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert json.loads((tiny_model / MARKER_FILE).read_text())["hidden_size"] == 128
    again = build_model(tmp_path / "again", "tiny")
    assert (again / "model.safetensors").read_bytes() == weights.read_bytes()
    assert (again / "tokenizer.json").read_text() == (tiny_model / "tokenizer.json").read_text()
    with pytest.raises(ValueError, match="unknown model size"):
        build_model(tmp_path / "x", "huge")


AVX2_EPYC = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma f16c bmi2\n"
AVX512_XEON = "flags\t\t: fpu avx avx2 avx512f avx512dq avx512cd avx512bw avx512vl\n"
ARM_BF16 = "Features\t: fp asimd evtstrm aes sve bf16 i8mm\n"


def test_the_engine_dtype_is_the_one_the_cpu_has_a_bf16_matmul_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVSCOPE_LAB_DTYPE", raising=False)
    # An AVX2-only CPU has no oneDNN bf16 matmul: vLLM falls back to torch and the
    # step time grows almost with the batch, so the lab runs float32 there.
    assert engine_dtype(cpu_flags(AVX2_EPYC)) == "float32"
    assert engine_dtype(cpu_flags(AVX512_XEON)) == "bfloat16"
    assert engine_dtype(cpu_flags("flags\t: avx2 amx_bf16 amx_tile\n")) == "bfloat16"
    assert engine_dtype(cpu_flags(ARM_BF16)) == "bfloat16"
    assert engine_dtype(cpu_flags("flags\t: avx2 avx512f\n")) == "float32"  # no BW/VL/DQ
    assert engine_dtype(set()) == "float32"
    monkeypatch.setenv("KVSCOPE_LAB_DTYPE", "bfloat16")
    assert engine_dtype(cpu_flags(AVX2_EPYC)) == "bfloat16"
    assert VllmServer(Path("m")).dtype == "bfloat16"
    monkeypatch.setenv("KVSCOPE_LAB_DTYPE", "fp8")
    with pytest.raises(LabError, match="KVSCOPE_LAB_DTYPE"):
        engine_dtype()


def test_server_command_line_and_environment(tmp_path: Path) -> None:
    server = VllmServer(
        tmp_path,
        served_model_name="m",
        port=8123,
        num_gpu_blocks=48,
        max_num_seqs=6,
        enable_prefix_caching=False,
        extra_args=["--seed", "1"],
        env={"KVSCOPE_COLLECTOR_URL": "http://c:9000", "VLLM_CPU_KVCACHE_SPACE": "2"},
        log_path=tmp_path / "log.txt",
    )
    cmd = server.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for part in (
        "--port 8123",
        "--block-size 32",
        "--num-gpu-blocks-override 48",
        "--max-num-seqs 6",
        "--max-model-len 1504",
        f"--dtype {engine_dtype()}",
        "--no-enable-prefix-caching",
        "--seed 1",
    ):
        assert part in joined
    assert "--max-num-batched-tokens" not in joined
    env = server.environment()
    assert env["KVSCOPE_COLLECTOR_URL"] == "http://c:9000" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert server.url == "http://127.0.0.1:8123"
    assert VllmServer(tmp_path, port=1).max_model_len == 2048


def test_server_start_failure_reports_the_log(tmp_path: Path) -> None:
    server = VllmServer(
        tmp_path, python="/bin/false", log_path=tmp_path / "log.txt", startup_timeout_s=10
    )
    with pytest.raises(LabError, match="exited with code 1"), server:
        pass
    assert server.pid is None  # stopped


def test_server_start_failure_names_the_root_cause_above_the_tail(tmp_path: Path) -> None:
    """vLLM's last lines say only "see root cause above": the error leads with the log's
    error lines, however far up, and the memory the machine had left."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        "echo 'ERROR 12-07 [core.py:1] EngineCore failed to start.'\n"
        "echo 'OSError: [Errno 98] Address already in use'\n"
        'for i in $(seq 60); do echo "  File traceback line $i"; done\n'
        "echo 'RuntimeError: Engine core initialization failed. See root cause above.'\n"
        "exit 1\n"
    )
    fake.chmod(0o755)
    server = VllmServer(
        tmp_path, python=str(fake), log_path=tmp_path / "log.txt", startup_timeout_s=10
    )
    with pytest.raises(LabError) as caught, server:
        pass
    text = str(caught.value)
    assert "exited with code 1" in text and "memory available: " in text
    assert text.index("Address already in use") < text.index("traceback line 60")
    assert "EngineCore failed to start" in text


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_parse_real_vllm_metrics_sample() -> None:
    text = METRICS_SAMPLE.read_text()
    samples = parse_prometheus_text(text)
    engine = {("engine", "0"), ("model_name", "tiny-llama")}
    assert samples[("vllm:num_preemptions_total", frozenset(engine))] == 1524.0
    length = frozenset(engine | {("finished_reason", "length")})
    assert samples[("vllm:request_success_total", length)] == 2455.0
    info = next(labels for (name, labels) in samples if name == "vllm:cache_config_info")
    assert ("num_gpu_blocks", "64") in info and ("kv_cache_dtype_skip_layers", "[]") in info
    totals = vllm_counter_totals(text)
    assert set(totals) == set(VLLM_COUNTERS)
    assert totals["vllm:num_preemptions_total"] == 1524.0
    assert totals["vllm:request_success_total"] == 2455.0
    assert totals["vllm:prompt_tokens_total"] == 60272.0
    assert all(value >= 0 for value in totals.values())


def test_parse_prometheus_text_edge_cases() -> None:
    text = (
        "# HELP x a counter\n"
        'x_total{a="q\\"uote",b="back\\\\slash",c="new\\nline"} 3 1700000000000\n'
        "bare 1e3\n"
        'h_bucket{le="+Inf"} +Inf\n'
        "nan_metric NaN\n"
    )
    samples = parse_prometheus_text(text)
    assert (
        samples[("x_total", frozenset({("a", 'q"uote'), ("b", "back\\slash"), ("c", "new\nline")}))]
        == 3
    )
    assert samples[("bare", frozenset())] == 1000.0
    assert samples[("h_bucket", frozenset({("le", "+Inf")}))] == float("inf")
    assert vllm_counter_totals("") == dict.fromkeys(VLLM_COUNTERS, 0.0)
    with pytest.raises(ValueError, match="not a Prometheus text exposition"):
        parse_prometheus_text("not a sample line at all {")


def test_renice_process_group_touches_only_the_named_processes_of_the_group() -> None:
    import os
    import subprocess
    import time

    from kvscope.lab.engine import renice_process_group

    leader = subprocess.Popen(["sleep", "30"], start_new_session=True)
    other = subprocess.Popen(["sleep", "30"])  # same name, not in the group
    try:
        time.sleep(0.2)
        changed = renice_process_group(leader.pid, "sleep", 7)
        assert changed == 1
        assert os.getpriority(os.PRIO_PROCESS, leader.pid) == 7
        assert os.getpriority(os.PRIO_PROCESS, other.pid) == os.getpriority(os.PRIO_PROCESS, 0)
        assert renice_process_group(leader.pid, "VLLM::EngineCor", 7) == 0
    finally:
        for p in (leader, other):
            p.kill()
            p.wait()


def test_limit_cpu_holds_a_busy_process_to_its_quota() -> None:
    """The real cgroup CPU controller (root, as CI): a process that spins on a whole core
    gets about the limit's share of one once limited (CFS quota, 20 ms periods)."""
    import os
    import subprocess
    import sys
    import time

    from kvscope.lab.engine import limit_cpu, release_cpu_limit

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    group = None
    try:
        group = limit_cpu(spin.pid, 0.2, f"kvscope-test-limit-{os.getpid()}")
        time.sleep(0.3)  # the first period's burst

        def cpu_s() -> float:
            fields = Path(f"/proc/{spin.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        c0, t0 = cpu_s(), time.monotonic()
        time.sleep(2.0)
        share = (cpu_s() - c0) / (time.monotonic() - t0)
        assert 0.1 <= share <= 0.3, f"a 0.2-CPU limit let the spinning process use {share:.2f}"
    finally:
        spin.kill()
        spin.wait()
        if group is not None:
            time.sleep(0.1)
            release_cpu_limit(group)
            assert not group.exists(), "the cgroup outlived its process"


def test_limit_cpu_writes_a_v2_quota_and_says_what_is_missing(tmp_path: Path) -> None:
    from kvscope.lab.engine import limit_cpu

    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    group = limit_cpu(4321, 0.25, "api", root=tmp_path)
    assert (group / "cpu.max").read_text() == "5000 20000"
    assert (group / "cgroup.procs").read_text() == "4321"
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "cgroup.controllers").write_text("memory pids\n")
    with pytest.raises(LabError, match="no cgroup CPU controller"):
        limit_cpu(4321, 0.25, "api", root=bare)
    with pytest.raises(LabError, match="positive number of cores"):
        limit_cpu(4321, 0.0, "api", root=tmp_path)

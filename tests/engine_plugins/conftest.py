"""Fixtures for the engine-plugin tests."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _ep_helpers import Blackhole
from _plugin_testkit import RecordingServer, make_settings

from kvscope.engine_plugins import exporter as exporter_mod
from kvscope.engine_plugins._logging import ERRORS, LOGGER, ONCE
from kvscope.engine_plugins.exporter import Exporter


@pytest.fixture(autouse=True)
def _fresh_log_limits() -> Iterator[None]:
    ERRORS.reset()
    ONCE.reset()
    yield


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def log_records() -> Iterator[list[logging.LogRecord]]:
    """Records logged by kvscope (its logger does not propagate to pytest's caplog)."""
    handler = _ListHandler()
    LOGGER.addHandler(handler)
    old_level = LOGGER.level
    LOGGER.setLevel(logging.DEBUG)
    yield handler.records
    LOGGER.removeHandler(handler)
    LOGGER.setLevel(old_level)


@pytest.fixture
def collector() -> Iterator[RecordingServer]:
    c = RecordingServer()
    yield c
    c.close()


@pytest.fixture
def blackhole() -> Iterator[Blackhole]:
    b = Blackhole()
    yield b
    b.close()


@pytest.fixture
def installed_exporter(
    monkeypatch: pytest.MonkeyPatch, collector: RecordingServer
) -> Iterator[Exporter]:
    """A not-started exporter installed as the process's exporter, aimed at ``collector``.

    Tests drive it with ``tick()``; ``KVSCOPE_COLLECTOR_URL`` points at the collector.
    """
    monkeypatch.setenv("KVSCOPE_COLLECTOR_URL", collector.url)
    monkeypatch.setenv("KVSCOPE_HOST", "testhost")
    monkeypatch.setenv("KVSCOPE_PORT", "8123")
    exp = Exporter(make_settings(collector.url))
    monkeypatch.setattr(exporter_mod, "_EXPORTER", exp)
    yield exp
    exp.shutdown(0.5)


@pytest.fixture
def light_vllm_config() -> Any:
    """A real VllmConfig without a model (fast), with a known KV-cache size."""
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig

    cfg = VllmConfig(
        cache_config=CacheConfig(block_size=32, gpu_memory_utilization=0.5),
        scheduler_config=SchedulerConfig(
            max_num_seqs=6,
            max_num_batched_tokens=512,
            max_model_len=512,
            is_encoder_decoder=False,
        ),
    )
    cfg.cache_config.num_gpu_blocks = 48
    return cfg


_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 1024,
    "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "head_dim": 64,
}  # fmt: skip


@pytest.fixture(scope="session")
def full_vllm_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real VllmConfig with a ModelConfig (what PrometheusStatLogger needs). ~10 s."""
    from vllm.config import ModelConfig, VllmConfig

    model_dir: Path = tmp_path_factory.mktemp("tiny-llama")
    (model_dir / "config.json").write_text(json.dumps(_TINY_LLAMA))
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, served_model_name="tiny")
    cfg = VllmConfig(model_config=model)
    cfg.cache_config.num_gpu_blocks = 64
    return cfg

"""The engine a twin stands for: the model's KV geometry and vLLM's scheduler settings.

vLLM's scheduler needs a :class:`vllm.config.VllmConfig`, whose ``ModelConfig`` reads a
model folder. The twin never loads weights or a tokenizer, so the folder it writes holds
a ``config.json`` only (the architecture's shape: layers, heads, KV heads, head size),
enough for vLLM to build its configuration exactly as for a server of that model.

Model shapes are published architecture figures (the models' ``config.json`` on their
model cards); ``params`` is the parameter count the step-time model reads weights for.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any


class TwinConfigError(ValueError):
    """An engine configuration the twin cannot build (the message says what to change)."""


@dataclass(frozen=True)
class ModelShape:
    """What the twin needs of a model: its size and the geometry of its KV cache."""

    name: str
    params: float
    """Parameter count (weights read once per step)."""
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int = 32_000
    max_position_embeddings: int = 8_192
    weight_bytes_per_param: float = 2.0
    """2 for bf16/fp16 weights."""

    def kv_bytes_per_token(self, kv_bytes_per_value: float = 2.0) -> float:
        """Bytes of K and V per token over all layers (``kv_bytes_per_value`` 1 for fp8)."""
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * kv_bytes_per_value

    @property
    def weight_bytes(self) -> float:
        return self.params * self.weight_bytes_per_param


#: Published shapes (from each model's config.json on its model card).
MODELS: dict[str, ModelShape] = {
    # meta-llama/Meta-Llama-3.1-8B: 32 layers, hidden 4096, 32 heads, 8 KV heads.
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 8.03e9, 32, 4096, 32, 8, 128, 128_256, 131_072),
    # meta-llama/Meta-Llama-3.1-70B: 80 layers, hidden 8192, 64 heads, 8 KV heads.
    "llama-3.1-70b": ModelShape("llama-3.1-70b", 70.6e9, 80, 8192, 64, 8, 128, 128_256, 131_072),
    # Qwen/Qwen2.5-7B-Instruct: 28 layers, hidden 3584, 28 heads, 4 KV heads.
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 7.62e9, 28, 3584, 28, 4, 128, 152_064, 32_768),
    # meta-llama/Llama-2-7b-hf: 32 layers, hidden 4096, 32 heads, no GQA.
    "llama-2-7b": ModelShape("llama-2-7b", 6.74e9, 32, 4096, 32, 32, 128, 32_000, 4_096),
    # The lab's local models (kvscope.lab.engine.MODEL_SPECS).
    "lab-mid": ModelShape("lab-mid", 46e6, 6, 768, 12, 4, 64, 512, 2_048),
    "lab-tiny": ModelShape("lab-tiny", 0.5e6, 2, 128, 2, 2, 64, 512, 2_048),
}


def model_shape(name: str) -> ModelShape:
    """The shape called ``name`` (see :data:`MODELS`)."""
    try:
        return MODELS[name]
    except KeyError:
        raise TwinConfigError(
            f"unknown model shape {name!r}; choose from {', '.join(sorted(MODELS))}"
        ) from None


@dataclass(frozen=True)
class EngineShape:
    """One vLLM engine configuration: the flags that decide the plateau.

    Defaults are vLLM 0.32's for a GPU server (``max_num_seqs`` 256, a token budget of
    8,192 with chunked prefill, prefix caching on, blocks of 16 tokens).
    """

    model: ModelShape
    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8_192
    max_model_len: int = 8_192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_dtype: str = "auto"
    """``auto`` (the model dtype) or ``fp8``: only the hello and KV bytes change; the
    number of blocks is what the twin schedules with."""

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise TwinConfigError(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.max_model_len < 2:
            raise TwinConfigError(f"max_model_len must be at least 2 (got {self.max_model_len})")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise TwinConfigError(
                f"without chunked prefill vLLM needs max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) >= max_model_len ({self.max_model_len}); "
                "raise the budget, lower --max-model-len, or enable chunked prefill"
            )

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds."""
        return self.num_gpu_blocks * self.block_size

    def with_(self, **changes: Any) -> EngineShape:
        """A copy with some settings changed (a what-if)."""
        return replace(self, **changes)

    def describe(self) -> dict[str, Any]:
        """The settings as plain values (for reports and JSON)."""
        d = asdict(self)
        d["model"] = self.model.name
        return d


def blocks_for(
    model: ModelShape,
    gpu_memory_bytes: float,
    *,
    gpu_memory_utilization: float = 0.9,
    block_size: int = 16,
    kv_bytes_per_value: float = 2.0,
    tensor_parallel_size: int = 1,
    activation_reserve_bytes: float = 2e9,
) -> int:
    """KV-cache blocks vLLM would allocate: what ``gpu_memory_utilization`` of the device
    leaves after the weights (split over ``tensor_parallel_size`` devices) and the
    profiled activation peak (``activation_reserve_bytes``, an assumption: vLLM measures
    it at start-up), divided by the bytes of one block on one device."""
    budget = gpu_memory_bytes * gpu_memory_utilization
    free = budget - model.weight_bytes / tensor_parallel_size - activation_reserve_bytes
    per_block = model.kv_bytes_per_token(kv_bytes_per_value) / tensor_parallel_size * block_size
    if free <= per_block:
        raise TwinConfigError(
            f"{model.name} does not fit: {gpu_memory_bytes / 1e9:.0f} GB x "
            f"{gpu_memory_utilization} leaves {free / 1e9:.1f} GB after the weights; "
            "raise --gpu-memory-utilization or the tensor-parallel size"
        )
    return int(free // per_block)


_MODEL_DIRS: dict[ModelShape, Path] = {}


def model_dir(model: ModelShape) -> Path:
    """A folder with the ``config.json`` of ``model`` (written once per process)."""
    found = _MODEL_DIRS.get(model)
    if found is not None and (found / "config.json").is_file():
        return found
    d = Path(tempfile.mkdtemp(prefix=f"kvscope-twin-{model.name}-"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "intermediate_size": 4 * model.hidden_size,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500_000.0,
    }
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _MODEL_DIRS[model] = d
    return d


def build_vllm_config(shape: EngineShape) -> Any:
    """vLLM's own ``VllmConfig`` for ``shape`` (imports vLLM)."""
    try:
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    except ImportError as exc:  # pragma: no cover - exercised without vllm only
        raise TwinConfigError(
            "the engine twin needs vLLM (the CPU build is enough): pip install 'kvscope[twin]'"
        ) from exc
    # A twin may have a longer context than its stand-in model folder declares; vLLM
    # reads this switch while it builds the config. And vLLM's platform code sets
    # switches of its own for the process it configures (a worker start method, kernel
    # layouts). Both are for this moment only: the environment is inherited by anything
    # started later, a real vLLM server included.
    with _restored_environ(VLLM_ALLOW_LONG_MAX_MODEL_LEN="1"):
        model_config = ModelConfig(
            model=str(model_dir(shape.model)),
            served_model_name=shape.model.name,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=shape.max_model_len,
            seed=0,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=shape.max_num_seqs,
            max_num_batched_tokens=shape.max_num_batched_tokens,
            max_model_len=shape.max_model_len,
            enable_chunked_prefill=shape.enable_chunked_prefill,
            is_encoder_decoder=False,
        )
        cache_config = CacheConfig(
            block_size=shape.block_size,
            enable_prefix_caching=shape.enable_prefix_caching,
            cache_dtype=shape.kv_cache_dtype,  # type: ignore[arg-type]
        )
        cache_config.num_gpu_blocks = shape.num_gpu_blocks
        return VllmConfig(
            model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config
        )


@contextlib.contextmanager
def _restored_environ(**switches: str) -> Iterator[None]:
    """Set ``switches`` for the block; afterwards the environment is what it was."""
    saved = dict(os.environ)
    os.environ.update(switches)
    try:
        yield
    finally:
        if dict(os.environ) != saved:
            os.environ.clear()
            os.environ.update(saved)


def build_scheduler(shape: EngineShape, vllm_config: Any | None = None) -> Any:
    """vLLM's v1 ``Scheduler`` and KV-cache manager for ``shape``, without a model."""
    vc = vllm_config if vllm_config is not None else build_vllm_config(shape)
    with _restored_environ():
        return _scheduler(shape, vc)


def _scheduler(shape: EngineShape, vc: Any) -> Any:
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(
        block_size=shape.block_size,
        num_kv_heads=shape.model.num_kv_heads,
        head_size=shape.model.head_dim,
        dtype=torch.bfloat16,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=shape.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layers"], spec)],
    )
    return Scheduler(
        vllm_config=vc,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=shape.block_size,
        log_stats=True,
    )

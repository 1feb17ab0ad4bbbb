"""The KV what-if recommendations: none that changes nothing, whole sequences and whole
blocks in their text and evidence."""

from __future__ import annotations

from types import SimpleNamespace

from kvscope.advisor.analyze import _config_recommendations
from kvscope.advisor.capacity import WhatIf
from kvscope.advisor.findings import Scope


def _whatif(name: str, blocks: float, kv_batch: float, gain: float) -> WhatIf:
    return WhatIf(
        name=name,
        flags=[f"--{name.replace('_', '-')} x"],
        num_gpu_blocks=blocks,
        kv_batch=kv_batch,
        effective_batch=kv_batch,
        plateau_tokens_per_s=1000.0 * (1 + gain),
        gain_ratio=gain,
        assumption="",
    )


def test_no_whatif_that_changes_nothing() -> None:
    kv = SimpleNamespace(
        kv_batch_=12.3,
        predicted_plateau_tokens_per_s_=1000.0,
        whatifs_=[
            # 0.88 -> 0.90 of the memory: 48.5 -> 49.6 blocks, room 12.3 -> 12.6 sequences
            _whatif("gpu_memory_utilization", 49.6, 12.6, 0.02),
            _whatif("kv_cache_dtype_fp8", 97.0, 24.6, 0.9),
            _whatif("shorter_max_model_len", 48.5, 12.3, 0.0),
        ],
    )
    bn = SimpleNamespace(label_="kv_cache_bound")
    recs = _config_recommendations(Scope("e", "p"), bn, kv, None, {})  # type: ignore[arg-type]
    assert [r.kind for r in recs] == ["whatif_kv_cache_dtype_fp8"]
    (fp8,) = recs
    assert "room for 24 whole sequences instead of 12;" in fp8.summary
    assert fp8.evidence["num_gpu_blocks"] == 97 and isinstance(fp8.evidence["num_gpu_blocks"], int)
    assert fp8.gain_kind == "throughput"


def test_blocks_are_whole_in_the_evidence() -> None:
    kv = SimpleNamespace(
        kv_batch_=12.3,
        predicted_plateau_tokens_per_s_=1000.0,
        whatifs_=[_whatif("gpu_memory_utilization", 99.7, 25.2, 0.8)],
    )
    bn = SimpleNamespace(label_="kv_cache_bound")
    (r,) = _config_recommendations(Scope("e", "p"), bn, kv, None, {})  # type: ignore[arg-type]
    assert r.evidence["num_gpu_blocks"] == 99  # vLLM allocates whole blocks: 99.7 is 99
    assert "room for 25 whole sequences instead of 12;" in r.summary

"""The vLLM metric-name table: wire names, detection per version, renames, the docs table."""

from __future__ import annotations

from pathlib import Path

from kvscope.lab.engine import parse_prometheus_text
from kvscope.sources.prometheus.vllm_metrics import (
    CHANGES,
    ROLES,
    change_for,
    family_of,
    markdown_table,
    replacement,
    resolve,
    wire_names,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_metrics_sample.txt"


def fixture_names() -> set[str]:
    return {name for name, _ in parse_prometheus_text(FIXTURE.read_text())}


def test_wire_names() -> None:
    assert wire_names("vllm:prompt_tokens", "counter") == ("vllm:prompt_tokens_total",)
    assert wire_names("vllm:num_preemptions_total", "counter") == ("vllm:num_preemptions_total",)
    assert wire_names("vllm:e2e_request_latency_seconds", "histogram") == (
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_sum",
        "vllm:e2e_request_latency_seconds_count",
    )
    assert wire_names("vllm:kv_cache_usage_perc", "gauge") == ("vllm:kv_cache_usage_perc",)


def test_every_role_resolves_on_the_real_vllm_032_scrape() -> None:
    got = resolve(fixture_names())
    # 0.32 exposes everything kvscope reads (speculative decoding's counters only with a
    # draft model configured, which this engine had not)...
    assert set(got) == set(ROLES) - {"spec_accepted"}
    assert got["kv_usage"] == "vllm:kv_cache_usage_perc"  # ...under the new names
    assert got["prefix_hits"] == "vllm:prefix_cache_hits"
    assert got["itl"] == "vllm:inter_token_latency_seconds"
    assert got["iterations"] == "vllm:iteration_tokens_total"  # a histogram ending in _total


def test_old_names_resolve_when_only_they_are_exposed() -> None:
    old = {
        "vllm:num_requests_running",
        "vllm:gpu_cache_usage_perc",
        "vllm:gpu_prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_hits_total",
        "vllm:time_per_output_token_seconds_count",
        "vllm:time_in_queue_requests_count",
    }
    got = resolve(old)
    assert got == {
        "running": "vllm:num_requests_running",
        "kv_usage": "vllm:gpu_cache_usage_perc",
        "prefix_queries": "vllm:gpu_prefix_cache_queries",
        "prefix_hits": "vllm:gpu_prefix_cache_hits",
        "itl": "vllm:time_per_output_token_seconds",
        "queue": "vllm:time_in_queue_requests",
    }
    # 0.9.2 - 0.11 exposed both: the new name wins.
    assert resolve(old | {"vllm:kv_cache_usage_perc"})["kv_usage"] == "vllm:kv_cache_usage_perc"
    # A counter's family name without _total is not what is on the wire.
    assert "prefix_hits" not in resolve({"vllm:prefix_cache_hits"})


def test_renames_and_removals() -> None:
    c, suffix = change_for("vllm:gpu_prefix_cache_hits_total") or (None, "")
    assert c is not None and c.new == "vllm:prefix_cache_hits" and suffix == "_total"
    assert replacement("vllm:gpu_prefix_cache_hits_total") == "vllm:prefix_cache_hits_total"
    assert replacement("vllm:gpu_prefix_cache_hits") == "vllm:prefix_cache_hits_total"
    assert replacement("vllm:gpu_cache_usage_perc") == "vllm:kv_cache_usage_perc"
    assert (
        replacement("vllm:time_per_output_token_seconds_bucket")
        == "vllm:inter_token_latency_seconds_bucket"
    )
    assert replacement("vllm:num_requests_swapped") is None
    assert change_for("vllm:num_requests_running") is None
    assert family_of("vllm:iteration_tokens_total_count") == (
        "vllm:iteration_tokens_total",
        "_count",
    )
    assert family_of("vllm:gpu_prefix_cache_queries_total") == (
        "vllm:gpu_prefix_cache_queries",
        "_total",
    )


def test_no_new_name_is_also_retired_and_new_names_exist_in_032() -> None:
    names = fixture_names()
    olds = {c.old for c in CHANGES}
    for c in CHANGES:
        assert c.new not in olds
        if c.new:
            assert wire_names(c.new, c.kind)[-1] in names, c.new
        assert not any(w in names for w in wire_names(c.old, c.kind)), c.old


def test_markdown_table_lists_every_change() -> None:
    table = markdown_table()
    lines = table.splitlines()
    assert lines[0].startswith("| old name | use instead |")
    assert len(lines) == 2 + len(CHANGES)
    assert (
        "| `vllm:gpu_prefix_cache_hits_total` | `vllm:prefix_cache_hits_total` | counter |" in table
    )
    assert "`rate(vllm:generation_tokens_total[1m])`" in table

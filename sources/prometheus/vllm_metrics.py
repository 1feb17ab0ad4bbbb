"""vLLM's own Prometheus metric names across versions, and which of them a target exposes.

vLLM renamed some of its metrics and removed others (deprecated in version X.Y,
hidden in X.Y+1 unless ``--show-hidden-metrics-for-version=X.Y``, removed in X.Y+2).
Dashboards and alerts written for an older vLLM then match nothing, silently.

* :data:`ROLES`: what kvscope reads, each with the names that carried it, newest
  first. :func:`resolve` picks, per role, the first name a target actually exposes.
* :data:`CHANGES`: every rename and removal kvscope knows of, with versions and the
  fix; :func:`change_for` looks a name up (with or without its wire suffix) and
  :func:`markdown_table` renders the table for the docs.
* :func:`wire_names`: how a metric family appears on the wire. ``prometheus_client``
  exposes a counter family ``vllm:prompt_tokens`` as ``vllm:prompt_tokens_total``
  (and ``..._created``), a histogram ``X`` as ``X_bucket``, ``X_sum``, ``X_count``;
  PromQL sees only the wire names.

Sources: vLLM's ``vllm/v1/metrics/loggers.py`` at v0.9.1, v0.9.2, v0.11.0, v0.12.0
and v0.32.0 (the deprecation comments name the versions), the metrics design
document (``docs/design/metrics.md``) and the pull requests named in the notes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "CHANGES",
    "ROLES",
    "MetricChange",
    "Role",
    "change_for",
    "family_of",
    "markdown_table",
    "replacement",
    "resolve",
    "wire_names",
]

GAUGE = "gauge"
COUNTER = "counter"
HISTOGRAM = "histogram"

_HIST_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Role:
    """One quantity kvscope reads, and the metric families that carried it (newest first)."""

    key: str
    kind: str
    names: tuple[str, ...]
    required: bool = False


#: What :class:`~kvscope.sources.prometheus.source.PrometheusSource` reads from vLLM's /metrics.
ROLES: dict[str, Role] = {
    r.key: r
    for r in (
        Role("running", GAUGE, ("vllm:num_requests_running",), required=True),
        Role("waiting", GAUGE, ("vllm:num_requests_waiting",)),
        Role("kv_usage", GAUGE, ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
        Role(
            "prefix_queries",
            COUNTER,
            ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
        ),
        Role("prefix_hits", COUNTER, ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")),
        Role("preemptions", COUNTER, ("vllm:num_preemptions",)),
        Role("prompt_tokens", COUNTER, ("vllm:prompt_tokens",)),
        Role("generation_tokens", COUNTER, ("vllm:generation_tokens",)),
        Role("spec_accepted", COUNTER, ("vllm:spec_decode_num_accepted_tokens",)),
        Role("iterations", HISTOGRAM, ("vllm:iteration_tokens_total",)),
        Role("e2e", HISTOGRAM, ("vllm:e2e_request_latency_seconds",)),
        Role("ttft", HISTOGRAM, ("vllm:time_to_first_token_seconds",)),
        Role(
            "queue", HISTOGRAM, ("vllm:request_queue_time_seconds", "vllm:time_in_queue_requests")
        ),
        Role("prefill", HISTOGRAM, ("vllm:request_prefill_time_seconds",)),
        Role("decode", HISTOGRAM, ("vllm:request_decode_time_seconds",)),
        Role(
            "itl",
            HISTOGRAM,
            ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        ),
        Role("request_prompt_tokens", HISTOGRAM, ("vllm:request_prompt_tokens",)),
        Role("request_generation_tokens", HISTOGRAM, ("vllm:request_generation_tokens",)),
        Role("request_success", COUNTER, ("vllm:request_success",)),
        Role("cached_prompt_tokens", COUNTER, ("vllm:prompt_tokens_cached",)),
        Role("cache_config", GAUGE, ("vllm:cache_config_info",)),
    )
}


@dataclass(frozen=True)
class MetricChange:
    """A vLLM metric that was renamed or removed.

    ``old`` and ``new`` are family names (counters without ``_total``); ``new`` is
    empty when nothing replaces it; ``promql`` is the expression to use instead
    when the replacement is a computation rather than a name.
    """

    old: str
    new: str
    kind: str
    deprecated: str
    removed: str
    note: str = ""
    promql: str = ""


CHANGES: tuple[MetricChange, ...] = (
    MetricChange(
        "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        GAUGE,
        "0.9.2",
        "0.12",
        "hidden from 0.11 (--show-hidden-metrics-for-version=0.10 shows it); "
        "a 0-1 fraction under both names",
    ),
    MetricChange(
        "vllm:gpu_prefix_cache_queries",
        "vllm:prefix_cache_queries",
        COUNTER,
        "0.9.2",
        "0.12",
        "tokens looked up; hidden from 0.11",
    ),
    MetricChange(
        "vllm:gpu_prefix_cache_hits",
        "vllm:prefix_cache_hits",
        COUNTER,
        "0.9.2",
        "0.12",
        "tokens found; hidden from 0.11",
    ),
    MetricChange(
        "vllm:time_per_output_token_seconds",
        "vllm:inter_token_latency_seconds",
        HISTOGRAM,
        "0.11",
        "after 0.12 (absent in 0.30)",
        "same buckets; hidden in 0.12. Not vllm:request_time_per_output_token_seconds "
        "(a per-request TPOT added later)",
    ),
    MetricChange(
        "vllm:time_in_queue_requests",
        "vllm:request_queue_time_seconds",
        HISTOGRAM,
        "0.8 (V0)",
        "with the V0 engine",
        "a duplicate of the queue-time histogram",
    ),
    MetricChange(
        "vllm:gpu_prefix_cache_hit_rate",
        "",
        GAUGE,
        "0.8 (V0)",
        "with the V0 engine",
        "V1 has token counters instead of a hit-rate gauge",
        "rate(vllm:prefix_cache_hits_total[5m]) / rate(vllm:prefix_cache_queries_total[5m])",
    ),
    MetricChange(
        "vllm:cpu_prefix_cache_hit_rate",
        "",
        GAUGE,
        "0.8 (V0)",
        "with the V0 engine",
        "no CPU swap space in V1",
    ),
    MetricChange(
        "vllm:cpu_cache_usage_perc",
        "",
        GAUGE,
        "0.8 (V0)",
        "with the V0 engine",
        "no CPU swap space in V1",
    ),
    MetricChange(
        "vllm:num_requests_swapped",
        "",
        GAUGE,
        "0.8 (V0)",
        "with the V0 engine",
        "no swapping in V1: a preempted request is recomputed (vllm:num_preemptions_total)",
    ),
    MetricChange(
        "vllm:model_forward_time_milliseconds",
        "",
        HISTOGRAM,
        "0.8 (V0)",
        "with the V0 engine",
        "use the request phase histograms",
        "vllm:request_prefill_time_seconds, vllm:request_decode_time_seconds",
    ),
    MetricChange(
        "vllm:model_execute_time_milliseconds",
        "",
        HISTOGRAM,
        "0.8 (V0)",
        "with the V0 engine",
        "use the request phase histograms",
        "vllm:request_inference_time_seconds",
    ),
    MetricChange(
        "vllm:avg_prompt_throughput_toks_per_s",
        "",
        GAUGE,
        "early 2024 (PR #2764)",
        "early 2025 (PR #12383)",
        "a gauge averaged inside vLLM",
        "rate(vllm:prompt_tokens_total[1m])",
    ),
    MetricChange(
        "vllm:avg_generation_throughput_toks_per_s",
        "",
        GAUGE,
        "early 2024 (PR #2764)",
        "early 2025 (PR #12383)",
        "a gauge averaged inside vLLM",
        "rate(vllm:generation_tokens_total[1m])",
    ),
)

_CHANGES_BY_OLD = {c.old: c for c in CHANGES}
_KIND_OF: dict[str, str] = {n: r.kind for r in ROLES.values() for n in r.names}
_KIND_OF.update({c.new: c.kind for c in CHANGES if c.new})
_KIND_OF.update({c.old: c.kind for c in CHANGES})


def wire_names(family: str, kind: str) -> tuple[str, ...]:
    """The sample names a family of ``kind`` is exposed as (what PromQL must use)."""
    if kind == COUNTER:
        return (family if family.endswith("_total") else f"{family}_total",)
    if kind == HISTOGRAM:
        return tuple(family + s for s in _HIST_SUFFIXES)
    return (family,)


def family_of(sample_name: str) -> tuple[str, str]:
    """The family and wire suffix of a sample name: ``("vllm:x", "_bucket")``.

    Only suffixes of known families are split off (``vllm:iteration_tokens_total`` is a
    histogram family whose name ends in ``_total``).
    """
    if sample_name in _KIND_OF:
        return sample_name, ""
    for suffix in ("_total", *_HIST_SUFFIXES, "_created"):
        base = sample_name[: -len(suffix)]
        if sample_name.endswith(suffix) and base in _KIND_OF:
            return base, suffix
    return sample_name, ""


def change_for(name: str) -> tuple[MetricChange, str] | None:
    """The change that retired ``name`` (a family or a wire name), and the suffix used."""
    family, suffix = family_of(name)
    c = _CHANGES_BY_OLD.get(family)
    return (c, suffix) if c is not None else None


def replacement(name: str) -> str | None:
    """The wire name to use instead of ``name`` (same suffix), when a name replaces it."""
    found = change_for(name)
    if found is None or not found[0].new:
        return None
    c, suffix = found
    if c.kind == COUNTER:
        return wire_names(c.new, COUNTER)[0]
    return c.new + suffix


def resolve(available: Iterable[str]) -> dict[str, str]:
    """Per role, the family a target exposes (by its wire names), newest name first.

    ``available`` holds sample names as stored (``__name__`` values). Roles none of whose
    names is exposed are left out.
    """
    have = set(available)
    out: dict[str, str] = {}
    for role in ROLES.values():
        for fam in role.names:
            wire = wire_names(fam, role.kind)
            probe = wire[-1] if role.kind == HISTOGRAM else wire[0]  # _count for histograms
            if probe in have:
                out[role.key] = fam
                break
    return out


def _shown(family: str, kind: str) -> str:
    """A family as a query names it: counters with ``_total``, others as the family."""
    return wire_names(family, COUNTER)[0] if kind == COUNTER else family


def markdown_table() -> str:
    """The renames and removals as a Markdown table (the README's copy is rendered here)."""
    rows = [
        "| old name | use instead | type | deprecated | removed | note |",
        "|---|---|---|---|---|---|",
    ]
    for c in CHANGES:
        old = f"`{_shown(c.old, c.kind)}`"
        if c.new:
            new = f"`{_shown(c.new, c.kind)}`"
        elif c.promql:
            new = f"`{c.promql}`"
        else:
            new = "nothing"
        rows.append(f"| {old} | {new} | {c.kind} | {c.deprecated} | {c.removed} | {c.note} |")
    return "\n".join(rows)

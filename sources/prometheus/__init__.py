"""The advisor over a Prometheus-compatible query API: vLLM's own series, scraped.

- :mod:`.source`: :class:`PrometheusSource`, the advisor's :class:`~kvscope.advisor.sources.Source`
  over Prometheus, and :func:`analyze_prometheus`.
- :mod:`.client` (the HTTP API), :mod:`.auth` (credentials and TLS), :mod:`.promql` (a
  small PromQL tokenizer), :mod:`.read` (queries), :mod:`.frames` (series into frames),
  :mod:`.vllm_metrics` (vLLM's metric names across versions).

Importing this package imports only the standard library (the command line reads its
argument types from here with no extra installed); the names below load
:mod:`.source`, and with it pandas, on first use.
"""

from typing import Any

__all__ = ["PrometheusSource", "analyze_prometheus", "annotate_report"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvscope.sources.prometheus import source

        return getattr(source, name)
    raise AttributeError(f"module 'kvscope.sources.prometheus' has no attribute {name!r}")

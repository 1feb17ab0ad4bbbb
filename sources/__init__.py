"""Where the advisor reads telemetry from besides a kvscope collector: a
Prometheus-compatible server scraping vLLM's own ``/metrics``
(:mod:`kvscope.sources.prometheus`).
"""

"""kvscope's collector: ingest, store, Prometheus /metrics and the query API."""

__all__: list[str] = []

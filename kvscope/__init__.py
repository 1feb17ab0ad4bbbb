"""kvscope: observability and tuning advice for fleets of vLLM inference servers.

One import package over the repository's folders (each a subpackage):

- :mod:`kvscope.engine_plugins`: the vLLM stat-logger plugin and its exporter (standard
  library only; loaded inside the engine).
- :mod:`kvscope.collector`: the collector service: ingest, store, ``/metrics``, the query API.
- :mod:`kvscope.advisor`: the analyses, frames in and findings out (no I/O).
- :mod:`kvscope.sources`: where the advisor's frames come from besides the collector
  (Prometheus-compatible servers).
- :mod:`kvscope.cli`, :mod:`kvscope.dashboard`, :mod:`kvscope.report`: the surfaces.
- :mod:`kvscope.lab`: the real-engine lab: engine runner, sweep, recordings, demo, fleets.

Importing this package imports nothing else, so loading the plugin into a vLLM engine
costs only the plugin's own modules.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

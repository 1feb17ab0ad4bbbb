"""kvscope's engine side: a vLLM stat-logger plugin and its exporter.

Imports only the standard library at import time; the plugin class itself lives in
:mod:`engine_plugins.plugin`, which imports vLLM (already loaded in the process that
loads the plugin).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

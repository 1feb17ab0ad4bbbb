"""kvscope's engine side: a vLLM stat-logger plugin and its exporter.

Imports only the standard library at import time; the plugin class itself lives in
:mod:`kvscope.engine_plugins.plugin`, which imports vLLM (already loaded in the process that
loads the plugin).
"""

from kvscope import __version__

__all__ = ["__version__"]

"""``kvscope sweep``: a closed-loop concurrency sweep against an OpenAI-compatible server.

For each concurrency level, that many clients keep one streaming completion each
in flight; the level's throughput (output and total tokens/s, requests/s), latency
(TTFT and end-to-end P50/P99) and errors are measured client-side over a fixed
window. The curve of throughput against concurrency shows where a server stops
scaling (its knee). Requests come from a seeded length distribution or a public
trace, optionally with shared prompt prefixes.

Modules: :mod:`~kvscope.lab.sweep.config` (options), :mod:`~kvscope.lab.sweep.workload`
and :mod:`~kvscope.lab.sweep.prompts` (requests), :mod:`~kvscope.lab.sweep.traces`
(trace files), :mod:`~kvscope.lab.sweep.client` (one streaming request),
:mod:`~kvscope.lab.sweep.runner` (levels), :mod:`~kvscope.lab.sweep.stats` (summaries),
:mod:`~kvscope.lab.sweep.result` (JSON and table).
"""

from kvscope.lab.sweep.config import SweepConfig, add_sweep_arguments, config_from_args
from kvscope.lab.sweep.errors import SweepError, TraceFormatError
from kvscope.lab.sweep.result import SCHEMA_VERSION, SweepResult, format_table, print_table
from kvscope.lab.sweep.runner import run_sweep, run_sweep_async
from kvscope.lab.sweep.stats import LevelResult, RequestRecord, percentile, summarize_level
from kvscope.lab.sweep.traces import TraceRow, load_trace
from kvscope.lab.sweep.workload import RequestSpec, Workload

__all__ = [
    "SCHEMA_VERSION",
    "LevelResult",
    "RequestRecord",
    "RequestSpec",
    "SweepConfig",
    "SweepError",
    "SweepResult",
    "TraceFormatError",
    "TraceRow",
    "Workload",
    "add_sweep_arguments",
    "config_from_args",
    "format_table",
    "load_trace",
    "percentile",
    "print_table",
    "run_sweep",
    "run_sweep_async",
    "summarize_level",
]

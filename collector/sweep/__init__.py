"""``kvscope sweep``: a closed-loop concurrency sweep against an OpenAI-compatible server.

For each concurrency level, that many clients keep one streaming completion each
in flight; the level's throughput (output and total tokens/s, requests/s), latency
(TTFT and end-to-end P50/P99) and errors are measured client-side over a fixed
window. The curve of throughput against concurrency shows where a server stops
scaling (its knee). Requests come from a seeded length distribution or a public
trace, optionally with shared prompt prefixes.

Modules: :mod:`~collector.sweep.config` (options), :mod:`~collector.sweep.workload`
and :mod:`~collector.sweep.prompts` (requests), :mod:`~collector.sweep.traces`
(trace files), :mod:`~collector.sweep.client` (one streaming request),
:mod:`~collector.sweep.runner` (levels), :mod:`~collector.sweep.stats` (summaries),
:mod:`~collector.sweep.result` (JSON and table).
"""

from collector.sweep.config import SweepConfig, add_sweep_arguments, config_from_args
from collector.sweep.errors import SweepError, TraceFormatError
from collector.sweep.result import SCHEMA_VERSION, SweepResult, format_table, print_table
from collector.sweep.runner import run_sweep, run_sweep_async
from collector.sweep.stats import LevelResult, RequestRecord, percentile, summarize_level
from collector.sweep.traces import TraceRow, load_trace
from collector.sweep.workload import RequestSpec, Workload

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

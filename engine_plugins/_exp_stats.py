"""The exporter's accounting: counters per engine and in total, and the stats file.

Exact whenever no ``record()`` runs concurrently::

    steps_produced    == steps_sent + steps_merged + steps_dropped + steps_buffered
    requests_produced == requests_sent + requests_dropped + requests_buffered

where ``buffered`` includes this boot's rows in the spool.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from kvscope.engine_plugins._exp_state import ExporterState
from kvscope.engine_plugins._logging import ERRORS


class Accounting(ExporterState):
    """Snapshots of the exporter's counters."""

    def stats(self, engine_id: str | None = None) -> dict[str, int]:
        """A snapshot of the exporter's counters, for one engine or summed over all."""
        keys = (
            "steps_produced", "steps_sent", "steps_merged", "steps_dropped", "steps_buffered",
            "requests_produced", "requests_sent", "requests_dropped", "requests_buffered",
            "batches_built", "batches_sent", "batches_dropped", "batches_pending",
            "send_failures", "hellos_sent", "record_errors",
            "batches_dropped_full", "batches_dropped_rejected", "batches_dropped_exit",
            "batches_spooled", "batches_in_spool",
        )  # fmt: skip
        out = dict.fromkeys(keys, 0)
        with self._lock:
            engines = list(self._engines.values())
            if engine_id is not None:
                engines = [e for e in engines if e.engine_id == engine_id]
            for e in engines:
                steps_produced, requests_produced = e.steps_produced, e.requests_produced
                in_steps = e.refresh_buffer_drops()
                in_requests = len(e.requests)
                values = (
                    steps_produced, e.steps_sent, e.folder.merged_rows,
                    e.buffer_dropped_steps + e.batch_dropped_steps,
                    in_steps + len(e.held_steps) + e.folder.carry_rows + e.pending_steps
                    + e.spool_steps,
                    requests_produced, e.requests_sent,
                    e.buffer_dropped_requests + e.batch_dropped_requests,
                    in_requests + e.pending_requests + e.spool_requests,
                    e.batches_built, e.batches_sent, e.dropped_batches, e.pending_batches,
                    e.send_failures, e.hellos_sent, e.record_errors,
                    e.dropped_full, e.dropped_rejected, e.dropped_exit,
                    e.spooled_batches, e.spool_batches,
                )  # fmt: skip
                for key, value in zip(keys, values, strict=True):
                    out[key] += value
            out["engines"] = len(engines)
            out["invalid_values"] = self._columns.invalid_values
            out["exporter_errors"] = self.exporter_errors
            out["pending_bytes"] = self._pending_bytes
            spool = self._spool
            out["spool_records"] = len(spool) if spool is not None else 0
            out["spool_bytes"] = spool.size_bytes if spool is not None else 0
            out["spool_corrupt_records"] = spool.corrupt_records if spool is not None else 0
            out["replayed_batches"] = self.replayed_batches
        return out

    def _write_stats(self) -> None:
        path = self.settings.stats_file
        assert path is not None
        data: dict[str, Any] = {"pid": self.pid, "boot_id": self.boot_id,
                                "written_unix_s": time.time(), "total": self.stats(),
                                "engines": {}}  # fmt: skip
        for engine_id in list(self._engines):
            data["engines"][engine_id] = self.stats(engine_id)
        tmp = f"{path}.{self.pid}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(data, fh)
            os.replace(tmp, path)
        except OSError as exc:
            ERRORS.warning("stats:write", "kvscope: cannot write KVSCOPE_STATS_FILE (%s)", exc)

"""The demo fleet the dashboard tests read, and the advisor's answer on it."""

from __future__ import annotations

import time

from kvscope.advisor import CollectorSource, Report, analyze
from kvscope.dashboard.demo import DEMO_FLEET

KV_STARVED = DEMO_FLEET[0].engine_id
"""The KV-starved replica (pool ``demo``)."""
SEQ_CAPPED = DEMO_FLEET[1].engine_id
"""The replica pinned at max_num_seqs 6 (pool ``demo``)."""
AMPLE = DEMO_FLEET[2].engine_id
"""The replica with KV cache to spare (pool ``demo-ample``)."""


def expected_report(url: str, since_s: float = 1800.0, token: str | None = None) -> Report:
    """What ``kvscope advise --since 30m`` answers on the same collector now."""
    return analyze(CollectorSource(url, token=token), time.time() - since_s)

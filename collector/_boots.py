"""A limit on new boot ids (process starts) per engine.

Every boot of an engine adds a configuration row, a ledger stream and exporter counters;
a real engine restarts a few times a day at most (a vLLM start takes tens of seconds). A
sender minting a boot id per batch would grow the store without bound, so at most
``per_minute`` boot ids not seen before are admitted per engine per sliding minute;
boots the store knows, and boots admitted in the last minute, always pass.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

__all__ = ["BootGate"]


class BootGate:
    """Admits at most ``per_minute`` new boot ids per engine per sliding minute.

    ``known(engine_id, boot_id)`` says whether the store holds the boot. Used only on
    the event loop (no lock). Engines tracked at once are bounded by ``max_engines``
    (the oldest forgotten first: their boots were admitted more than a minute ago or
    their engine is gone).
    """

    def __init__(
        self,
        per_minute: int,
        known: Callable[[str, str], bool],
        clock: Callable[[], float] = time.monotonic,
        max_engines: int = 100_000,
    ) -> None:
        self.per_minute = per_minute
        self._known = known
        self._clock = clock
        self._max_engines = max_engines
        self._admitted: collections.OrderedDict[str, collections.OrderedDict[str, float]] = (
            collections.OrderedDict()
        )

    def admit(self, engine_id: str, boot_id: str) -> bool:
        """True if the boot is known, recently admitted, or a new one fits the rate."""
        boots = self._admitted.get(engine_id)
        if boots is not None and boot_id in boots:
            return True
        if self._known(engine_id, boot_id):
            return True
        now = self._clock()
        if boots is None:
            boots = self._admitted[engine_id] = collections.OrderedDict()
            while len(self._admitted) > self._max_engines:
                self._admitted.popitem(last=False)
        else:
            self._admitted.move_to_end(engine_id)
        while boots and next(iter(boots.values())) <= now - 60.0:
            boots.popitem(last=False)
        if len(boots) >= self.per_minute:
            return False
        boots[boot_id] = now
        return True

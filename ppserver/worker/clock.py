"""Time a worker spends inside its mappers, reported in its heartbeats.

The server sees when a task leaves and when its result comes back; only the worker knows
how much of that the mapper took. Counters are cumulative over the process's life, so a
lost heartbeat loses nothing, and the heartbeat thread only reads them.
"""

from __future__ import annotations

import time
from typing import Any, Dict


class MapperClock:
    def __init__(self) -> None:
        self.seconds = 0.0  # inside the mapper
        self.seqs = 0  # outputs it returned
        self.paused = 0.0  # a stream mapper waiting for its next input (not mapping)
        self._started = 0.0
        self._paused_at_start = 0.0

    def start(self) -> None:
        self._started = time.perf_counter()
        self._paused_at_start = self.paused

    def stop(self, seqs: int = 1) -> None:
        """The mapper returned `seqs` outputs since start(), less the time it waited for inputs."""
        self.seconds += time.perf_counter() - self._started - (self.paused - self._paused_at_start)
        self.seqs += seqs


def heartbeat_stats(*clocks: MapperClock) -> Dict[str, Any]:
    """The `stats` field of a worker's heartbeat (see docs/protocol.md)."""
    return {"map_s": round(sum(c.seconds for c in clocks), 6), "mapped": sum(c.seqs for c in clocks)}

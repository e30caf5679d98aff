"""The scheduler's view of one worker, and why workers leave."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple


class Departure(enum.Enum):
    """Why a worker was forgotten. Crashes make the seqs it held suspect."""

    DEPARTED = "departed"  # said goodbye
    EXITED = "exited"  # a local worker process exited
    LOST = "lost"  # no heartbeat for heartbeat_timeout
    REREGISTERED = "registered again"  # the same identity said hello again
    RECONNECTED = "reconnected"  # a new identity of the same process replaced it (connection reset)

    @property
    def crashed(self) -> bool:
        return self in (Departure.EXITED, Departure.LOST)


@dataclass
class WorkerState:
    wid: bytes
    host: str
    pid: int
    local_index: Optional[int]
    capacity: int
    joined: float
    last_seen: float
    tasks: Set[Tuple[int, int]] = field(default_factory=set)  # (run, pos) of map_seq tasks (seqs or batches) held
    partitions: Set[Tuple[int, int]] = field(default_factory=set)  # (run, partition) of streams run here
    done: int = 0
    isolating: bool = False  # runs one suspect seq (or batch) alone, so that a crash names the right seq
    # bytes of inputs per task message: None, dispatch_bytes (the inputs travel in the message);
    # else what its way of getting them allows (shared memory: a part of the segment; reading the
    # server's memory: no limit)
    input_bytes: Optional[float] = None
    # inputs of tasks in flight when their run ended, by run: kept until the worker drops the run
    retained: Dict[int, List[Any]] = field(default_factory=dict)
    mapping: Optional[Tuple[int, int, Optional[str]]] = None  # (run, pos, seq_tag) its suspect batch maps now

    @property
    def name(self) -> str:
        return self.wid.decode("utf8", "replace")

    def free(self) -> int:
        return self.capacity - len(self.tasks)

    def describe(self, now: float) -> Dict[str, Any]:
        return {
            "id": self.name,
            "host": self.host,
            "pid": self.pid,
            "local": self.local_index is not None,
            "seqs_done": self.done,
            "in_flight": len(self.tasks) + len(self.partitions),
            "partitions": sorted(p for _, p in self.partitions),
            "last_heartbeat_s": round(now - self.last_seen, 3),
        }

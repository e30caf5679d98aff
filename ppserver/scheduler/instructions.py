"""What the scheduler asks the server to do. The server performs them in order, nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence

from ppclient.protocol import Item, Message


@dataclass(frozen=True)
class Instruction:
    pass


@dataclass(frozen=True)
class ToWorker(Instruction):
    """Send `msg` (with `items` if it is a batch) to a worker; `heartbeat`: to its heartbeat socket."""

    wid: bytes
    msg: Message
    items: Sequence[Item] = ()
    heartbeat: bool = False


@dataclass(frozen=True)
class ToClient(Instruction):
    """Send `msg` to a consumer's data socket."""

    consumer: bytes
    msg: Message
    items: Sequence[Item] = ()


@dataclass(frozen=True)
class ReadUpTo(Instruction):
    """The reader may read this run's inputs at positions < `upto`."""

    run: int
    upto: int


@dataclass(frozen=True)
class Replay(Instruction):
    """Read these positions again for a stream partition (in this order)."""

    run: int
    partition: int
    positions: List[int] = field(default_factory=list)
    ticket: int = 0  # echoed in ReplayRead, so an answer to an earlier owner's request is told apart


@dataclass(frozen=True)
class StopReading(Instruction):
    """The run is over (done, failed or superseded): the reader drops it."""

    run: int

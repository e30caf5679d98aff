"""What the scheduler asks the server to do. The server performs them in order, nothing else.

Each carries the stimulus id of the event that caused it (set by `Scheduler.handle`; not
compared, so an instruction equals the same one of another event)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from ppclient.batching import Batching
from ppclient.protocol import Item, Message


@dataclass(frozen=True)
class Instruction:
    stimulus: str = field(default="", kw_only=True, compare=False)


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
class Reply(Instruction):
    """Answer a client's request on the control socket."""

    requester: bytes
    msg: Message


@dataclass(frozen=True)
class Prepare(Instruction):
    """Set the dataset up for a new run's epoch (after checking the request against it).
    `batching`: a map_seq run that batches; its positions are then the epoch's batches (the
    reader cuts them) and its inputs are Batch objects. `contiguous`: the job's lanes, when
    it reads RETURNN's contiguous shards (server/shards.py); None: strided."""

    run: int
    epoch: int
    seq_list: Optional[List[str]] = None
    seq_order: Optional[List[int]] = None
    batching: Optional[Batching] = None
    contiguous: Optional[int] = None


@dataclass(frozen=True)
class Read(Instruction):
    """Read these positions (seqs, or batches) of the run's epoch, in this order (ascending, each once)."""

    run: int
    positions: List[int] = field(default_factory=list)


@dataclass(frozen=True)
class Replay(Instruction):
    """Read these positions again for a stream partition (in this order)."""

    run: int
    partition: int
    positions: List[int] = field(default_factory=list)
    ticket: int = 0  # echoed in ReplayRead, so an answer to an earlier owner's request is told apart


@dataclass(frozen=True)
class StopReading(Instruction):
    """The run reads nothing more (its reading is complete, or it ended): the reader drops it, and
    may set the dataset up for another epoch once no run of this one reads."""

    run: int

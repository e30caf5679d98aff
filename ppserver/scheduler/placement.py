"""Which worker the next map_seq task goes to, and how many go with it; which worker runs a stream
partition: pure decisions, the policy of where work goes in one module.

`choose` reads the workers (through `Candidate`: a WorkerState is one), the charges of the seq
at the head of the queue and the limits of a message, and returns a `Send` or a `Wait`; it
changes nothing, the dispatch (seqs.py) performs it. The rules, in order:

- A retiring worker (the elastic pool shrinks by it) gets nothing; nor does one that isolates.
- A suspect (a seq that was on a worker that crashed) goes alone to an idle worker, which
  isolates until it is settled, so a crash names the right seq.
- A seq that let a worker down (malformed result, task dropped unread) avoids it if there is
  another worker; if only that one has room now, the seqs behind it go first (OTHERS_FIRST).
- Any other seq goes to the worker with the most free credit (the first such), with up to
  `chunk` (half a worker's credit) tasks behind it, so consecutive seqs spread over the workers
  and results come back close to delivery order; and with the input bytes one message of that
  worker's takes (`InputPath.message_bytes`), at least one task whatever its size.
- A seq behind the head rides in the same message unless it needs a decision of its own
  (`joins`): a suspect, or one that avoids this worker.

`choose_owner` says which worker a stream partition without an owner goes to (streams.py opens
it there): not a retiring one; of the others the one running the fewest streams (the earliest
joined of equals), and not the worker the partition let it down on if there is another.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Collection, NamedTuple, Optional, Protocol, Tuple, Union

from ppserver.scheduler.settings import Settings
from ppserver.scheduler.workers import ISOLATING, InputPath, Isolation


class Candidate(Protocol):
    """What placement reads of a worker."""

    @property
    def wid(self) -> bytes: ...

    @property
    def tasks(self) -> Collection[object]: ...  # the tasks it holds (none: idle)

    @property
    def retiring(self) -> bool: ...

    @property
    def isolation(self) -> Isolation: ...

    @property
    def inputs(self) -> InputPath: ...

    def free(self) -> int: ...  # the tasks its credit has room for


@dataclass(frozen=True)
class Limits:
    """What one task message may hold: `chunk` tasks, `dispatch_bytes` input bytes when the inputs
    travel in it."""

    chunk: int
    dispatch_bytes: int

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(max(1, min(settings.buf_size // 2, settings.max_dispatch_batch)), settings.dispatch_bytes)


class Send(NamedTuple):
    """Send the head of the queue to `wid`, with up to `tasks` tasks in the message (all of them)
    and input bytes until `max_bytes` is reached; `isolate`: the worker runs it alone. (A
    NamedTuple: one is made for each message, and a tuple is made fastest.)"""

    wid: bytes
    tasks: int
    max_bytes: float
    isolate: bool = False


class Wait(enum.Enum):
    """Why the seq at the head of the queue is not sent now."""

    NO_ROOM = "no worker may take it now"
    OTHERS_FIRST = "only the worker it let down has room: the seqs behind it go first"


Decision = Union[Send, Wait]


def choose(workers: Collection[Candidate], limits: Limits, deaths: int = 0, avoid: Optional[bytes] = None) -> Decision:
    """Where the seq at the head of the queue goes: `deaths`, the crashes it was in (a suspect from
    the first on); `avoid`, the worker it let down."""
    if avoid is not None and len(workers) < 2:
        avoid = None  # no other worker to go to
    if deaths:
        others = False
        for w in workers:
            if not w.tasks and not w.retiring:
                if w.wid != avoid:
                    return Send(w.wid, 1, w.inputs.message_bytes(limits.dispatch_bytes), isolate=True)
                others = True
        return Wait.OTHERS_FIRST if others else Wait.NO_ROOM
    best: Optional[Candidate] = None
    most = 0
    others = False
    for w in workers:
        if not _eligible(w):
            continue
        free = w.free()
        if free <= 0:
            continue
        if w.wid == avoid:
            others = True
        elif free > most:
            best, most = w, free
    if best is not None:
        return Send(best.wid, min(most, limits.chunk), best.inputs.message_bytes(limits.dispatch_bytes))
    return Wait.OTHERS_FIRST if others else Wait.NO_ROOM


def joins(send: Send, deaths: int, avoid: Optional[bytes]) -> bool:
    """Whether a charged seq behind the head rides in the message `send` makes: not a suspect (it
    goes alone), nor one that avoids that worker."""
    return not deaths and avoid != send.wid


def may_send(workers: Collection[Candidate]) -> bool:
    """Whether any worker may take a task now (an idle one may: room for a suspect). (A loop: this
    runs after every event, and a generator would cost more than the test.)"""
    for w in workers:
        if _eligible(w) and w.free() > 0:
            return True
    return False


def _eligible(w: Candidate) -> bool:
    """Whether `w` may take a task that is not a suspect's (which `choose` sends to an idle worker
    alone): the rule `choose` and `may_send` share."""
    return not w.retiring and w.isolation is not ISOLATING


class Owner(Protocol):
    """What placement reads of a worker to choose a stream partition's owner."""

    @property
    def wid(self) -> bytes: ...

    @property
    def retiring(self) -> bool: ...

    @property
    def partitions(self) -> Collection[object]: ...  # the stream partitions it runs

    @property
    def joined(self) -> float: ...


def choose_owner(workers: Collection[Owner], avoid: Optional[bytes] = None) -> Optional[bytes]:
    """The worker a partition without an owner goes to; `avoid`, the worker it let down (it goes
    back there only if no other may take it). None: no worker may (all retire, or there are none)."""
    best: Optional[Owner] = None
    fallback: Optional[Owner] = None
    for w in workers:
        if w.retiring:
            continue
        if w.wid == avoid:
            fallback = w
        elif best is None or _load(w) < _load(best):
            best = w
    owner = best or fallback
    return None if owner is None else owner.wid


def _load(w: Owner) -> Tuple[int, float]:
    return (len(w.partitions), w.joined)

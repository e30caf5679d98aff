"""The scheduler's view of one worker, how it gets its inputs, whether it runs a suspect alone,
whether the pool shrinks by it, and why workers leave."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from ppserver.scheduler.story import WORKER, Story


class Departure(enum.Enum):
    """Why a worker was forgotten. Crashes make the seqs it held suspect."""

    DEPARTED = "departed"  # said goodbye
    EXITED = "exited"  # a local worker process exited
    LOST = "lost"  # no heartbeat for heartbeat_timeout
    REREGISTERED = "registered again"  # the same identity said hello again
    RECONNECTED = "reconnected"  # a new identity of the same process replaced it (connection reset)
    RETIRED = "retired"  # the pool shrank by it: it exited holding nothing

    @property
    def crashed(self) -> bool:
        return self in (Departure.EXITED, Departure.LOST)


JOINED = "joined"  # a worker's state in the story from its joining to its leaving (a Departure)


class InputWay(enum.Enum):
    """How a worker gets the inputs of its tasks."""

    MESSAGE = "in the message"  # the bytes travel in the task message
    SHARED_MEMORY = "in shared memory"  # in a block of the worker's segment
    ADDRESS = "by address"  # the worker reads them in the server's memory


@dataclass(frozen=True)
class InputPath:
    """How a worker gets its inputs, and so how many input bytes one task message may carry: in
    the message, `dispatch_bytes` (large seqs gain nothing from batching); in shared memory,
    what one block of its segment holds well; by address, no bound but the worker's credit."""

    way: InputWay = InputWay.MESSAGE
    block_bytes: int = 0  # SHARED_MEMORY: the input bytes of one message's block

    @classmethod
    def message(cls) -> InputPath:
        return cls(InputWay.MESSAGE)

    @classmethod
    def shared_memory(cls, block_bytes: int) -> InputPath:
        return cls(InputWay.SHARED_MEMORY, block_bytes)

    @classmethod
    def by_address(cls) -> InputPath:
        return cls(InputWay.ADDRESS)

    def message_bytes(self, dispatch_bytes: int) -> float:
        """The input bytes of one task message (a message holds at least one task, whatever its size)."""
        if self.way is InputWay.MESSAGE:
            return dispatch_bytes
        if self.way is InputWay.SHARED_MEMORY:
            return self.block_bytes
        return math.inf


class Isolation(enum.Enum):
    """Whether a worker runs a suspect seq (or batch) alone, so that a crash names the right one.

        NORMAL ─an idle worker takes a suspect─► ISOLATING ─its last task left it─► NORMAL

    Placement (placement.py) decides; the dispatch moves the worker to ISOLATING as it sends the
    suspect, and the seq table moves it back when the task leaves the worker (settled, taken
    back, or its run closed). An isolating worker holds exactly that one task."""

    NORMAL = "normal"  # takes any work its credit allows
    ISOLATING = "isolating"  # runs one suspect alone: it gets nothing else


NORMAL, ISOLATING = Isolation


class Retirement(enum.Enum):
    """Whether the pool shrinks by a worker (the elastic pool's policy, or a self-sizing host's):

        SERVING ─the pool retires it─► RETIRING ─it holds nothing─► TOLD ─its bye or exit─► (gone)

    A RETIRING worker gets no new work (placement.py), so whatever it holds is finished, not
    redone; the scheduler's step after each event tells it to exit (`Retire`) as soon as it
    holds nothing, so between events a RETIRING worker holds something and a TOLD one nothing."""

    SERVING = "serving"  # takes new work
    RETIRING = "retiring"  # takes none; told to exit once it holds none
    TOLD = "told to retire"  # told to exit: its bye (or its exit, if local) is on its way


SERVING, RETIRING, TOLD = Retirement


@dataclass
class WorkerState:
    """A registered worker: it holds at most `capacity` (buf_size) map_seq tasks, and a suspect
    alone (`isolation`), and gets nothing new once the pool shrinks by it (`retirement`); each
    task and stream partition it holds is its run's dispatch's too."""

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
    isolation: Isolation = NORMAL  # ISOLATING: runs one suspect seq (or batch) alone (moved by isolate/rejoin)
    inputs: InputPath = field(default_factory=InputPath)  # how it gets its inputs
    # inputs of tasks in flight when their run ended, by run: kept until the worker drops the run
    retained: Dict[int, List[Any]] = field(default_factory=dict)
    mapping: Optional[Tuple[int, int, Optional[str]]] = None  # (run, pos, seq_tag) its suspect batch maps now
    progress: Optional[Tuple[int, int, int]] = None  # (run, pos, seqs mapped) of the batch it maps, as last heard
    retirement: Retirement = SERVING  # the pool shrinks by it (moved by retire/tell_to_retire)

    @property
    def name(self) -> str:
        return self.wid.decode("utf8", "replace")

    @property
    def retiring(self) -> bool:
        """The pool shrinks by it (RETIRING or TOLD): it gets no new work."""
        return self.retirement is not SERVING

    def free(self) -> int:
        """The tasks its credit has room for (whether it may take any is placement's word)."""
        return self.capacity - len(self.tasks)

    def held_of(self, run: int) -> List[int]:
        """The positions of run `run`'s tasks it holds, or of its stream partitions it runs
        (a run maps seqs or streams, never both), ascending."""
        return sorted(k for held in (self.tasks, self.partitions) for r, k in held if r == run)

    def drop_task(self, run: int, pos: int, story: Story) -> None:
        """The task at `pos` of run `run` left it (settled, taken back, or its run closed): its
        slot is free, and if that was its suspect, it rejoins."""
        tasks = self.tasks
        tasks.discard((run, pos))
        if not tasks and self.isolation is ISOLATING:
            self.rejoin(story)

    def join(self, story: Story) -> None:
        """(none) -> joined: it registered; its story begins."""
        story.move(WORKER, self.name, None, None, JOINED, self.wid, f"host {self.host} pid {self.pid}")

    def leave(self, story: Story, why: Departure, note: str) -> None:
        """joined -> `why`: it is forgotten (its work went back first, and with it any isolation);
        its story ends."""
        story.move(WORKER, self.name, None, JOINED, why, self.wid, note)

    def isolate(self, story: Story, note: str) -> None:
        """NORMAL -> ISOLATING: the idle worker takes a suspect (`note`: which), to run it alone."""
        if self.isolation is not NORMAL or self.tasks:
            raise AssertionError(f"worker {self.name}: {self.isolation.value} -> isolating, {len(self.tasks)} tasks")
        self.isolation = ISOLATING
        story.move(WORKER, self.name, None, NORMAL, ISOLATING, self.wid, note)

    def rejoin(self, story: Story) -> None:
        """ISOLATING -> NORMAL: its suspect left it; it takes any work again."""
        if self.isolation is not ISOLATING or self.tasks:
            raise AssertionError(f"worker {self.name}: {self.isolation.value} -> normal, {len(self.tasks)} tasks")
        self.isolation = NORMAL
        story.move(WORKER, self.name, None, ISOLATING, NORMAL, self.wid)

    def retire(self, story: Story) -> None:
        """SERVING -> RETIRING: the pool shrinks by it; it finishes what it holds and gets nothing new."""
        if self.retirement is not SERVING:
            raise AssertionError(f"worker {self.name}: {self.retirement.value} -> retiring")
        self.retirement = RETIRING
        held = f"{len(self.tasks)} tasks, {len(self.partitions)} partitions to finish"
        story.move(WORKER, self.name, None, SERVING, RETIRING, self.wid, held)

    def tell_to_retire(self, story: Story) -> None:
        """RETIRING -> TOLD: it holds nothing any more; it is told to exit."""
        if self.retirement is not RETIRING or not self.holds_nothing:
            held = f"{len(self.tasks)} tasks, {len(self.partitions)} partitions"
            raise AssertionError(f"worker {self.name}: {self.retirement.value} -> told to retire, holding {held}")
        self.retirement = TOLD
        story.move(WORKER, self.name, None, RETIRING, TOLD, self.wid)

    @property
    def holds_nothing(self) -> bool:
        return not self.tasks and not self.partitions

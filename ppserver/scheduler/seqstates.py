"""The states of a map_seq position, the moves between them, and what each one holds.

A position of a map_seq run is in exactly one state (SeqTable.state) while the run holds
anything of it; what goes with the state (its input, its worker, its result, its charges)
sits in dicts keyed by position, and SeqTable, their only writer, keeps them in step with it:

    (none) ─asked─► ASKED ─input read─► QUEUED ─sent─► RUNNING ─result─► READY ─released─► (none)
    RUNNING ─worker lost, malformed result, input unreadable, task dropped unread─► QUEUED
    ASKED, QUEUED, READY ─no rank wants it any more─► (none)
    RUNNING ─no rank wants it any more─► ORPHAN ─settled─► (none)
    (none) ─its released direct result was lost─► REDO ─sent─► REDOING ─result─► (none)
    REDOING ─worker lost, ...─► REDO

A released direct result's input stays in `KeptInputs` (not a state: a redo starts from it)
until its consumer has taken the seq.

Every move is told to the run's story (story.py) with the worker it leaves or goes to; a seq
released in epoch order is told as "delivered".
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, FrozenSet, List, Optional, Sequence, Set, Union

from ppclient.protocol import Batch, Item
from ppserver.scheduler.placement import Send, joins
from ppserver.scheduler.story import DELIVERED, POS, Story
from ppserver.scheduler.workers import ISOLATING, WorkerState

Input = Union[Item, Batch]


class Seq(enum.IntEnum):
    """The state of a position of a map_seq run. (An IntEnum: it hashes as fast as an int, and
    the hot path asks which set a state is in.)"""

    ASKED = 1  # asked of the reader; its input has not come
    QUEUED = 2  # its input is here; it waits for a worker (in the todo heap)
    RUNNING = 3  # a worker maps it
    READY = 4  # its result waits for its turn in epoch order
    ORPHAN = 5  # no rank wants it, but a worker still maps it: its input stays until then
    REDO = 6  # a released direct result its consumer never got, to be made again (todo heap)
    REDOING = 7  # such a seq on a worker; its result goes through the server


ASKED, QUEUED, RUNNING, READY, ORPHAN, REDO, REDOING = Seq  # (the enum's own lookup is slow on the hot path)

# The moves a position may make (None: not held).
MOVES: Dict[Optional[Seq], FrozenSet[Optional[Seq]]] = {
    None: frozenset({ASKED, REDO}),
    ASKED: frozenset({QUEUED, None}),
    QUEUED: frozenset({RUNNING, None}),
    RUNNING: frozenset({READY, QUEUED, ORPHAN}),
    READY: frozenset({None}),
    ORPHAN: frozenset({None}),
    REDO: frozenset({REDOING}),
    REDOING: frozenset({REDO, None}),
}
OPEN = frozenset({ASKED, QUEUED, RUNNING, READY})  # asked, and neither released nor dropped yet
WITH_INPUT = frozenset({QUEUED, RUNNING, ORPHAN, REDO, REDOING})
ON_WORKER = frozenset({RUNNING, ORPHAN, REDOING})
TO_SEND = frozenset({QUEUED, REDO})
CHARGEABLE = frozenset({QUEUED, RUNNING, REDO, REDOING})  # to be done still


class Charge(enum.Enum):
    """What a task that comes back charges its seq with (each counted in Charges)."""

    DEATH = "the worker that held it crashed"
    MALFORMED = "its result was malformed"
    UNREADABLE = "its worker could not read its input"
    REFUSED = "its worker dropped its task unread"


@dataclass
class Charges:
    """What a seq has cost: crashes of workers that held it (it is a suspect from the first on),
    malformed results, workers that could not read its input, workers that dropped its task
    unread; and the worker it goes to last, if others can take it (the one that let it down)."""

    deaths: int = 0
    malformed: int = 0
    unreadable: int = 0
    refused: int = 0
    avoid: Optional[bytes] = None

    def add(self, charge: Charge) -> int:
        """One more `charge`; returns how many of it the seq has now."""
        if charge is Charge.DEATH:
            self.deaths += 1
            return self.deaths
        if charge is Charge.MALFORMED:
            self.malformed += 1
            return self.malformed
        if charge is Charge.UNREADABLE:
            self.unreadable += 1
            return self.unreadable
        self.refused += 1
        return self.refused


class KeptInputs:
    """The inputs of direct results, kept until their consumer has taken the seq: one lost on
    its way is made again from it. Each lane's positions are forgotten in order."""

    def __init__(self, width: int):
        self.width = width
        self.inputs: Dict[int, Input] = {}
        self.order: Dict[int, Deque[int]] = {}  # lane -> its kept positions, in order

    def keep(self, pos: int, item: Input) -> None:
        self.inputs[pos] = item
        self.order.setdefault(pos % self.width, deque()).append(pos)

    def get(self, pos: int) -> Optional[Input]:
        return self.inputs.get(pos)

    def forget(self, lane: int, upto: int) -> None:
        """The consumer of `lane` has taken its seqs below index `upto` of the lane."""
        order = self.order.get(lane)
        while order and order[0] // self.width < upto:
            self.inputs.pop(order.popleft(), None)

    def clear(self) -> None:
        self.inputs.clear()
        self.order.clear()

    def __len__(self) -> int:
        return len(self.inputs)


class SeqTable:
    """The positions a map_seq run holds: each one's state, and what goes with it, and the window
    they lie in. It alone writes them: `move` moves a state and what goes with it; `ask`,
    `received`, `take_for`, `ready` and `release` are the moves every seq makes, written out for
    the hot path (the first three a list of positions at a time); the window's bounds move with
    them and with `skip_rest`, `set_end`, `pass_over` and `drop_next`. Every move is told to the
    story; with `strict`, every move is checked against MOVES. A worker's task leaving it ends
    the worker's isolation when it was its last (workers.Isolation)."""

    def __init__(
        self, run: int, width: int, strict: bool, first: int, end: Optional[int], story: Story, subject: str = POS
    ):
        self.run = run
        self.strict = strict
        # the window: positions from next_out (the next to release) up to read_next (the next to
        # consider reading) may be open; none from `end` on (drop_last; None: not known yet).
        self.next_out = first
        self.read_next = first
        self.end = end
        self.awaiting = 0  # positions asked of the reader whose answer has not come
        self.state: Dict[int, Seq] = {}
        self.inputs: Dict[int, Input] = {}  # of positions QUEUED, RUNNING, ORPHAN, REDO, REDOING
        self.worker: Dict[int, bytes] = {}  # of positions RUNNING, ORPHAN, REDOING: the worker mapping it
        self.results: Dict[int, Item] = {}  # of positions READY
        self.charges: Dict[int, Charges] = {}  # of positions charged since they last settled
        self.todo: List[int] = []  # heap of QUEUED and REDO positions (and stale entries): lowest first
        self.aside: List[int] = []  # positions taken off the heap for a moment (`set_aside`)
        self.open = 0  # positions asked for and neither released nor dropped (states in OPEN)
        self.kept = KeptInputs(width)
        self.story = story  # where the moves are told (the scheduler's)
        self.subject = subject  # what a position is in the story (BATCH in a run that batches)

    def move(self, pos: int, new: Optional[Seq], w: Optional[WorkerState] = None) -> None:
        """Move the seq at `pos` to `new` (None: the run holds nothing of it any more), off its
        worker `w` if given (the slot is free). What goes with the state follows: one to send is
        queued; one done for good (READY, gone) drops its input and charges, an ORPHAN its charges."""
        if self.strict:
            self._check_move(pos, new, w)
        self.story.move(self.subject, pos, self.run, self.state.get(pos), new, None if w is None else w.wid)
        if w is not None:
            del self.worker[pos]
            w.drop_task(self.run, pos, self.story)
        if new is None:
            del self.state[pos]
            self.inputs.pop(pos, None)
            self.results.pop(pos, None)
            self.charges.pop(pos, None)
            return
        self.state[pos] = new
        if new is QUEUED or new is REDO:
            heapq.heappush(self.todo, pos)
        elif new is READY:
            del self.inputs[pos]
            self.charges.pop(pos, None)
        elif new is ORPHAN:
            self.charges.pop(pos, None)

    # ---- the moves every seq makes --------------------------------------------------------
    def ask(self, positions: List[int]) -> None:
        """(none) -> ASKED for each of `positions`, ascending from read_next on (no rank wants
        those between them): the reader is asked for their inputs and owes them."""
        if not positions:
            return
        if self.strict and positions[0] < self.read_next:
            raise AssertionError(f"run {self.run}: seq {positions[0]} asked for, {self.read_next} the next to read")
        state, move, subject, run, strict = self.state, self.story.move, self.subject, self.run, self.strict
        for pos in positions:
            if strict:
                self._check_move(pos, ASKED, None)
            state[pos] = ASKED  # (nothing goes with it)
            move(subject, pos, run, None, ASKED)
        self.read_next = positions[-1] + 1
        self.open += len(positions)
        self.awaiting += len(positions)

    def received(self, items: Sequence[Input]) -> int:
        """ASKED -> QUEUED for each input the reader sent (one no rank wants any more, dropped
        meanwhile, is forgotten). Returns the position after the last one queued (0: none)."""
        self.awaiting -= len(items)
        state, inputs, todo, strict, move = self.state, self.inputs, self.todo, self.strict, self.story.move
        subject, run = self.subject, self.run
        after = 0
        for item in items:
            pos = item.pos
            if state.get(pos) is not ASKED:
                continue
            if strict:
                self._check_move(pos, QUEUED, None)
            move(subject, pos, run, ASKED, QUEUED)
            state[pos] = QUEUED
            inputs[pos] = item
            heapq.heappush(todo, pos)
            after = pos + 1
        return after

    def take_for(self, w: WorkerState, send: Send) -> List[int]:
        """The tasks of one message to `w` (placement's `send`) leave the head of the queue:
        QUEUED -> RUNNING, REDO -> REDOING; up to `send.tasks`, with inputs until `send.max_bytes`
        (at least one), each behind the head only if it joins the message (placement.joins).
        Returns their positions, in order."""
        todo, state, charges, inputs, worker = self.todo, self.state, self.charges, self.inputs, self.worker
        held = w.tasks
        move, subject, run, wid, strict = self.story.move, self.subject, self.run, w.wid, self.strict
        limit, max_bytes = send.tasks, send.max_bytes
        taken: List[int] = []
        nbytes = 0
        while todo and len(taken) < limit and (nbytes < max_bytes or not taken):
            pos = todo[0]
            if taken:
                charged = charges.get(pos)
                if charged is not None and not joins(send, charged.deaths, charged.avoid):
                    break
            heapq.heappop(todo)
            old = state.get(pos)
            if old is QUEUED:
                new = RUNNING
            elif old is REDO:
                new = REDOING
            else:
                continue  # a stale entry
            if strict:
                self._check_move(pos, new, None)
            state[pos] = new
            move(subject, pos, run, old, new, wid)
            worker[pos] = wid
            held.add((run, pos))
            nbytes += inputs[pos].nbytes
            taken.append(pos)
        return taken

    def ready(self, pos: int, w: WorkerState, result: Item, keep: bool = False) -> Input:
        """RUNNING -> READY off `w`: its result came; returns the input it held, which is kept
        for the consumer (KeptInputs) with `keep`."""
        if self.strict:
            self._check_move(pos, READY, w)
        self.story.move(self.subject, pos, self.run, RUNNING, READY, w.wid)
        del self.worker[pos]
        w.drop_task(self.run, pos, self.story)
        self.state[pos] = READY
        self.results[pos] = result
        self.charges.pop(pos, None)
        item = self.inputs.pop(pos)
        if keep:
            self.kept.keep(pos, item)
        return item

    def release(self, pos: int) -> None:
        """READY -> (none), told as delivered: the result at `pos`, the next out, goes to its rank."""
        if self.strict:
            self._check_move(pos, None, None)
        del self.state[pos], self.results[pos]  # (a READY seq holds nothing else)
        self.story.move(self.subject, pos, self.run, READY, DELIVERED)
        self.open -= 1
        self.next_out += 1

    # ---- the window -----------------------------------------------------------------------
    def skip_rest(self) -> None:
        """No rank wants a position from read_next up to the end: none of them is read."""
        assert self.end is not None
        self.read_next = self.end

    def set_end(self, count: int, end: int) -> None:
        """The dataset has `count` seqs, and no rank gets a position from `end` on (drop_last):
        positions asked for beyond the dataset never come (the reader owes them no more), and
        open ones from `end` on are dropped."""
        for pos in [p for p, state in self.state.items() if p >= count and state is ASKED]:
            self.awaiting -= 1
            self.drop(pos)
        self.end = end
        for pos in [p for p, state in self.state.items() if p >= end and state in OPEN]:
            self.drop(pos)

    def pass_over(self) -> None:
        """The next out was never read (no rank wanted it when it came up): delivery moves on to
        the lowest position still open, or, with none, to the next to consider reading."""
        pos = self.next_out
        asked = (p for p, state in self.state.items() if state in OPEN)
        self.next_out = max(pos + 1, min(asked, default=self.read_next))

    def drop_next(self) -> None:
        """The next out was read, but no rank wants it any more (its rank left): dropped, and
        delivery moves past it."""
        self.drop(self.next_out)
        self.next_out += 1

    # ---- the queue ------------------------------------------------------------------------
    def head(self) -> Optional[int]:
        """The lowest position to send (stale entries of the heap dropped), or None."""
        todo, state = self.todo, self.state
        while todo:
            head_state = state.get(todo[0])
            if head_state is QUEUED or head_state is REDO:
                return todo[0]
            heapq.heappop(todo)
        return None

    def set_aside(self) -> None:
        """Take the head off the queue until `restore` (the seqs behind it go first)."""
        self.aside.append(heapq.heappop(self.todo))

    def restore(self) -> None:
        """Back to the queue with the positions set aside."""
        for pos in self.aside:
            heapq.heappush(self.todo, pos)
        self.aside.clear()

    def _check_move(self, pos: int, new: Optional[Seq], w: Optional[WorkerState]) -> None:
        old = self.state.get(pos)
        if new not in MOVES[old]:
            raise AssertionError(f"run {self.run}, seq at {pos}: {_name(old)} -> {_name(new)} is not a move")
        off = old in ON_WORKER and new not in ON_WORKER
        if (w is not None) != off or (w is not None and self.worker.get(pos) != w.wid):
            raise AssertionError(f"run {self.run}, seq at {pos}: {_name(old)} -> {_name(new)} off worker {w}")

    def drop(self, pos: int) -> None:
        """No rank wants the seq any more (it was asked for, not yet released): forgotten; a task in
        flight keeps its worker's slot, and its input, until it is settled."""
        self.open -= 1
        self.move(pos, ORPHAN if self.state[pos] is RUNNING else None)

    def take_back(
        self, w: WorkerState, pos: int, charge: Optional[Charge] = None, avoid: bool = False
    ) -> Optional[int]:
        """Take the task at `pos` back from `w`, which maps it now (else its word is late): to the
        queue if the seq is still wanted (a redo of a lost result stays one), charged with
        `charge` and, `avoid`, to go to another worker if there is one.
        Returns how many such charges the seq has (0: none counted), or None if nothing went back."""
        if not self.mine(w, pos):
            return None
        if self.state[pos] is ORPHAN:
            self.move(pos, None, w)  # no rank wants it: nothing to redo
            return None
        self.move(pos, QUEUED if self.state[pos] is RUNNING else REDO, w)
        if charge is None:
            return 0
        charges = self.charges.get(pos)
        if charges is None:
            charges = self.charges[pos] = Charges()
        n = charges.add(charge)
        if avoid:
            charges.avoid = w.wid
        return n

    def mine(self, w: WorkerState, pos: int) -> bool:
        """Whether `w` maps the seq at `pos` now (else its word about it is late, or a duplicate)."""
        return self.worker.get(pos) == w.wid

    def reading_done(self) -> bool:
        """Everything wanted has been read: the reader may move on to another epoch."""
        return self.end is not None and self.read_next >= self.end and self.awaiting == 0

    def forget(self, lane: int, upto: int) -> None:
        """The consumer of `lane` has taken its outputs below index `upto` of the lane."""
        self.kept.forget(lane, upto)

    def redo_lost(self, pos: int) -> bool:
        """A released direct result its consumer never got: made again from its kept input, to go
        through the server. False if there is nothing to redo (not released, or not kept)."""
        item = self.kept.get(pos)
        if item is None or pos in self.state:
            return False
        self.inputs[pos] = item
        self.move(pos, REDO)
        return True

    def close(self, workers: Dict[bytes, WorkerState]) -> None:
        """Forget everything of the run (it ended); workers' slots are freed. The inputs of tasks in
        flight stay with their workers until each says it dropped the run (`run_dropped`): one
        reading the server's memory may not have read them yet."""
        for pos, wid in self.worker.items():
            w = workers.get(wid)
            if w is not None:
                w.drop_task(self.run, pos, self.story)
                w.retained.setdefault(self.run, []).append(self.inputs[pos])
        for held in (self.state, self.inputs, self.worker, self.results, self.charges):
            held.clear()
        self.todo.clear()
        self.aside.clear()
        self.kept.clear()
        self.open = 0

    def holds(self) -> List[int]:
        return sorted(set(self.inputs) | set(self.kept.inputs))

    def validate(self, workers: Dict[bytes, WorkerState]) -> None:
        """Each position held is in one state, holds what that state says and nothing else, and
        lies where that state says: an open one in the window, a redo behind it; the reader owes
        every one asked for; a task's worker lists it, and lists no other of this run; a worker
        that isolates runs a suspect (or one no rank wants any more)."""
        where = f"run {self.run}"
        by_state: Dict[Seq, Set[int]] = {state: set() for state in Seq}
        for pos, state in self.state.items():
            by_state[state].add(pos)

        def in_states(states: FrozenSet[Seq]) -> Set[int]:
            return {pos for state in states for pos in by_state[state]}

        for name, held, states in [
            ("inputs", set(self.inputs), WITH_INPUT),
            ("workers", set(self.worker), ON_WORKER),
            ("results", set(self.results), frozenset({READY})),
        ]:
            want = in_states(states)
            assert held == want, f"{where}: {name} held for {sorted(held ^ want)}, against their states"
        stray = set(self.charges) - in_states(CHARGEABLE)
        assert not stray, f"{where}: charges of seqs settled for good: {sorted(stray)}"
        unqueued = in_states(TO_SEND) - set(self.todo)
        assert not unqueued, f"{where}: seqs to send missing from the queue: {sorted(unqueued)}"
        opened = in_states(OPEN)
        assert self.open == len(opened), f"{where}: {self.open} open seqs counted, {len(opened)} held"
        if opened:
            window = f"{where}: seqs {min(opened)}..{max(opened)} open, the window {self.next_out}..{self.read_next}"
            assert self.next_out <= min(opened) and max(opened) < self.read_next, window
            assert self.end is None or max(opened) < self.end, f"{window}, the end {self.end}"
        asked = len(by_state[ASKED])
        assert self.awaiting >= asked, f"{where}: {asked} seqs asked for, {self.awaiting} owed by the reader"
        redone = in_states(frozenset({REDO, REDOING}))
        assert all(pos < self.next_out for pos in redone), f"{where}: seqs {sorted(redone)} redone, not released"
        ordered = {pos for order in self.kept.order.values() for pos in order}
        assert set(self.kept.inputs) <= ordered, f"{where}: kept inputs its lanes do not list"
        kept_in = {self.state.get(pos) for pos in self.kept.inputs} - {None, READY, REDO, REDOING}
        assert not kept_in, f"{where}: inputs kept for consumers of seqs {sorted(map(_name, kept_in))}"
        for pos, wid in self.worker.items():
            w = workers.get(wid)
            assert w is not None and (self.run, pos) in w.tasks, f"{where}: seq {pos} on {wid!r}, not in its tasks"
        for w in workers.values():
            for run, pos in w.tasks:
                assert run != self.run or self.worker.get(pos) == w.wid, (
                    f"{where}: {w.name} holds seq {pos}, not its own"
                )
                charged = self.charges.get(pos)
                assert (
                    run != self.run
                    or w.isolation is not ISOLATING
                    or self.state[pos] is ORPHAN
                    or (charged is not None and charged.deaths > 0)
                ), f"{where}: {w.name} isolates with seq {pos}, no suspect"
        assert not self.aside, f"{where}: seqs {self.aside} set aside between events"


def _name(state: Optional[Seq]) -> str:
    return "none" if state is None else state.name.lower()

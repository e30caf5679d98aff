"""map_seq dispatch: every input is a task any worker may run; outputs leave in input order.

Only positions some rank wants are read (`wanted`: a resumed rank's skipped seqs and the
seqs of ranks that left are neither read nor mapped), at most `window` ahead of delivery.
Positions no one wants are passed over at once (`next_wanted`), not one by one: a run that
serves one of many lanes would otherwise pass over all the others' positions for each of its own.

Each position the run holds is in one state (seqstates.py). An input stays until its result
arrives, so the tasks of a worker that dies are sent again elsewhere. Every task lost in a
crash becomes suspect; a suspect later runs alone on an idle worker, so once a seq has been
charged `max_seq_retries` crashes it really is the one that kills workers, and the run fails
naming it. A malformed result is dropped and its seq redone on another worker when there is
one; `max_seq_retries` malformed results of one seq fail the run too, so a broken worker
cannot loop forever.

Batches: in a run that batches, a position is a batch of the epoch and an input is a Batch (its
seqs, cut by the reader); it travels as its seqs, each naming the batch, and comes back as one
padded result. A suspect batch is probed: its worker says which seq it maps before each one,
so a crash is charged to the batch and the failure names the seq that was being mapped.

Direct results: a task may name the consumer its result goes to (`route`); the worker sends
it there and tells the server only its position and size (`completed`). Its input is kept
until the consumer has taken the seq (`forget`), so a result lost on the way (`redo_lost`: the
consumer reports it missing) is made again and sent through the server (`late`).

Skipped seqs (map_seq returned None): a result says how many of its task's seqs were skipped
(its header, or `completed`); it takes its turn in delivery like any other (a marker, or a batch
without them), and the accepted ones are listed in `skips` for the scheduler to count (skips.py).
"""

from __future__ import annotations

import enum
import heapq
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from ppclient.protocol import BadItem, Batch, FailureKind, Item, Tasks, short_tag
from ppserver.scheduler.dispatch import Drop, Room, SeqWork, Workers
from ppserver.scheduler.events import CompletedReceived
from ppserver.scheduler.instructions import Instruction, ToWorker
from ppserver.scheduler.seqstates import (
    ASKED,
    OPEN,
    ORPHAN,
    QUEUED,
    READY,
    REDO,
    REDOING,
    RUNNING,
    Charges,
    Input,
    SeqTable,
)
from ppserver.scheduler.settings import Failure, Settings
from ppserver.scheduler.story import BATCH, DELIVERED, POS, Story
from ppserver.scheduler.workers import WorkerState

BATCH_READ_SLACK = 4  # batches read beyond the workers' credit
BATCH_READ_STEP = 2


class SeqDispatch(SeqTable, SeqWork):
    def __init__(
        self,
        run: int,
        num_seqs: Optional[int],
        settings: Settings,
        *,
        wanted: Callable[[int], bool],
        next_wanted: Callable[[int], Optional[int]],
        end: Optional[int],
        first: int = 0,
        route: Optional[Callable[[int], Optional[bytes]]] = None,
        width: int = 1,
        strict: bool = False,
        batched: bool = False,
        story: Optional[Story] = None,
    ):
        super().__init__(run, width, strict, first, end)
        if story is not None:
            self.story = story
        self.subject = BATCH if batched else POS
        self.num_seqs = num_seqs
        self.settings = settings
        # read ahead of the workers' credit: a few seqs, or (each holding many) a few batches
        self.slack, self.step = (
            (BATCH_READ_SLACK, BATCH_READ_STEP) if batched else (settings.read_slack, settings.read_step)
        )
        self.wanted = wanted
        self.next_wanted = next_wanted  # the first position from p on that some rank wants (None: none)
        self.route = route  # position -> the consumer its result goes to directly (None: the server)
        self.fed = 0  # inputs received from the reader
        self.late: List[Item] = []  # results of REDOING positions, to send to their consumer now
        self.skips: List[Tuple[int, int, List[str]]] = []  # accepted results with skipped seqs (skips.py)

    @property
    def one_output_per_input(self) -> bool:
        return True

    # ---- inputs ---------------------------------------------------------------------------
    def add_inputs(self, items: Sequence[Union[Item, Batch]]) -> None:
        state, inputs, to = self.state, self.inputs, self._to
        self.awaiting -= len(items)
        for item in items:
            pos = item.pos
            if state.get(pos) is not ASKED:
                continue  # dropped meanwhile (its rank left)
            if pos >= self.fed:
                self.fed = pos + 1
            inputs[pos] = item
            to(pos, QUEUED)

    def requests(self, capacity: int) -> List[int]:
        """Positions to read now: the wanted ones, at most the workers' credit plus a little slack
        ahead of delivery."""
        window = capacity + self.slack
        if window - self.open < self.step and len(self.todo) >= self.slack // 2:
            return []  # enough inputs wait to be sent: ask for a step at a time (fewer wake-ups)
        out: List[int] = []
        while (self.end is None or self.read_next < self.end) and self.open < window:
            pos = self.read_next if self.wanted(self.read_next) else self.next_wanted(self.read_next)
            if pos is None or (self.end is not None and pos >= self.end):
                if self.end is not None:
                    self.read_next = self.end  # no one wants the rest
                break
            self.read_next = pos + 1
            if self.strict:
                self._check_move(pos, ASKED, None)
            self.state[pos] = ASKED  # (in place: nothing goes with it)
            self.story.move(self.subject, pos, self.run, None, ASKED)
            self.open += 1
            out.append(pos)
        self.awaiting += len(out)
        return out

    def inputs_ended(self, count: int, end: Optional[int]) -> None:
        """The dataset has `count` seqs (it could not say so in advance); `end`: the first position
        no rank gets (drop_last)."""
        assert end is not None  # a map_seq run has an output for each input
        self.num_seqs = count
        for pos in [p for p, state in self.state.items() if p >= count and state is ASKED]:
            self.awaiting -= 1  # asked for, but they do not exist
            self._drop(pos)
        self.end = end
        for pos in [p for p, state in self.state.items() if p >= end and state in OPEN]:
            self._drop(pos)

    # ---- workers --------------------------------------------------------------------------
    def worker_lost(self, w: WorkerState, crashed: bool, workers: Workers, out: List[Instruction]) -> Optional[Failure]:
        for run, pos in sorted(w.tasks):
            if run == self.run:
                n = self._take_back(w, pos, "deaths" if crashed else None)
                if n is not None and n >= self.settings.max_seq_retries:
                    return _killed(self.run, pos, self.inputs.get(pos), n, w)
        return None

    def results_received(self, w: WorkerState, items: List[Item], bad: List[BadItem]) -> Optional[Failure]:
        worker, states, to, wid = self.worker, self.state, self._to, w.wid
        for item in items:
            pos = item.pos
            if worker.get(pos) != wid:
                continue  # late or duplicate: the seq was handed to another worker
            w.done += 1
            state = states[pos]
            if state is RUNNING:
                mapped = self.inputs[pos]
                to(pos, READY, w)
                self.results[pos] = item
                if item.skipped:
                    self.skips.append((pos, item.skipped, item.skipped_tags))
                if self.route is not None:
                    self.kept.keep(pos, mapped)  # a relayed seq may be lost too (a reset connection)
            else:
                to(pos, None, w)
                if state is REDOING:
                    self.late.append(item)  # released already: it goes to its consumer at once
        blamed: List[Tuple[int, str]] = [(b.pos, b.reason) for b in bad if b.pos is not None]
        if any(b.pos is None for b in bad):
            # a result that names no seq: every seq this worker holds is charged with it
            reason = next(b.reason for b in bad if b.pos is None)
            blamed += [(pos, reason) for run, pos in sorted(w.tasks) if run == self.run]
        for pos, reason in blamed:
            n = self._take_back(w, pos, "malformed", avoid=True)
            if n is not None and n >= self.settings.max_seq_retries:
                task = self.inputs.get(pos)
                what = f"{_what(pos, task)}: {n} malformed results ({reason})"
                return Failure(FailureKind.MAPPER, what, seq_tag=_tag(pos, task))
        if not any(run == self.run for run, _ in w.tasks):
            w.isolating = False
        return None

    def malformed_message(
        self, w: WorkerState, reason: str, workers: Workers, out: List[Instruction]
    ) -> Optional[Failure]:
        return self.results_received(w, [], [BadItem(None, reason)])

    def completed(self, w: WorkerState, done: CompletedReceived) -> None:
        """Results the worker sent to their consumers: a placeholder takes each one's turn in
        delivery order, and the input is kept until the consumer has taken the seq. `done.skipped[k]`:
        the seqs of result k the mapper skipped (empty: none), `done.skipped_tags[k]` a few of their tags."""
        worker, state, to, wid, keep = self.worker, self.state, self._to, w.wid, self.kept.keep
        positions, skipped, skipped_tags = done.positions, done.skipped, done.skipped_tags
        skips = len(skipped) == len(positions) and len(skipped_tags) == len(positions)
        for k, (pos, size) in enumerate(zip(positions, done.nbytes)):
            if worker.get(pos) != wid:
                continue  # late or duplicate
            w.done += 1
            if state[pos] is not RUNNING:
                to(pos, None, w)  # dropped meanwhile, or a lost one's redo that went direct after all
                continue
            item = self.inputs[pos]
            to(pos, READY, w)
            n = min(max(skipped[k], 0), item.seqs) if skips else 0
            self.results[pos] = Item(
                pos, {}, [], [], size, direct=True, size=None if item.seqs == 1 else item.seqs - n, skipped=n
            )
            if n:
                self.skips.append((pos, n, skipped_tags[k]))
            keep(pos, item)

    def inputs_lost(self, w: WorkerState, positions: List[int]) -> Tuple[int, Optional[Failure]]:
        """Tasks the worker could not read the inputs of: its slots are freed and the seqs still
        wanted go back to the queue (nobody is blamed). Returns how many go back, and the failure
        of the run if one seq's input could not be read `max_seq_retries` times."""
        redone = 0
        for pos in positions:
            n = self._take_back(w, pos, "unreadable")
            if n is None:
                continue  # late, duplicate, or no rank wants it any more
            if n >= self.settings.max_seq_retries:
                what = _what(pos, self.inputs.get(pos))
                return redone, Failure(FailureKind.SERVER, f"the input of {what} could not be read by {n} workers")
            redone += 1
        return redone, None

    def dropped(self, w: WorkerState, drop: Drop, workers: Workers, out: List[Instruction]) -> Optional[Failure]:
        """Tasks `w` dropped unread (their message did not decode, say; none named: every one of this
        run it holds): each goes to another worker if there is one. A seq whose task `max_seq_retries`
        workers dropped fails the run naming it: its input is what they cannot take."""
        for pos in drop.positions or [p for run, p in sorted(w.tasks) if run == self.run]:
            n = self._take_back(w, pos, "refused", avoid=True)
            if n is not None and n >= self.settings.max_seq_retries:
                tag = _tag(pos, self.inputs.get(pos))
                message = f"seq {tag!r} (position {pos}): {n} workers could not take its input ({drop.reason})"
                return Failure(FailureKind.DATASET, message, seq_tag=tag)
        return None

    def task_failed(self, w: WorkerState, pos: int) -> bool:
        """Whether a mapper failure the worker reports fails the run: not for a task it does not hold
        (late: redone elsewhere) nor for a position no one wants any more (its input may be gone)."""
        if not self._mine(w, pos):
            return False
        if self.state[pos] is ORPHAN:
            self._to(pos, None, w)
            return False
        return True

    # ---- dispatch -------------------------------------------------------------------------
    def dispatch(self, workers: Workers, out: List[Instruction]) -> None:
        """Send what the workers' credit allows: lowest positions first, to the worker with the most
        free credit, in chunks of half a worker's credit (or of the input bytes a message of its
        takes), so consecutive seqs spread over the workers and results come back close to
        delivery order. A seq whose result was malformed waits for another worker, unless there
        is none."""
        s = self.settings
        todo, state, charges = self.todo, self.state, self.charges
        if not todo or not any(w.free() > 0 and not w.isolating for w in workers.values()):
            return  # nothing to send, or no worker has room (an idle worker has room)
        chunk = max(1, min(s.buf_size // 2, s.max_dispatch_batch))
        deferred: List[int] = []
        while todo:
            head = todo[0]
            head_state = state.get(head)
            if head_state is not QUEUED and head_state is not REDO:
                heapq.heappop(todo)  # stale entry
                continue
            picked = _pick(workers, charges.get(head), chunk)
            if picked is Wait.NO_ROOM:
                break
            if picked is Wait.OTHERS_FIRST:
                deferred.append(heapq.heappop(todo))
                continue
            w, limit = picked
            self._send(w, limit, out)
        for pos in deferred:
            heapq.heappush(todo, pos)

    def _send(self, w: WorkerState, limit: int, out: List[Instruction]) -> None:
        """One message of up to `limit` tasks from the head of the queue to `w`."""
        todo, state, charges, route, strict = self.todo, self.state, self.charges, self.route, self.strict
        items: List[Item] = []  # the tasks' seqs (a batch's travel one after the other)
        to: List[bytes] = []  # on the wire, b"" means through the server
        direct = False
        tasks = 0
        nbytes = 0
        probe = False
        max_bytes = w.inputs.message_bytes(self.settings.dispatch_bytes)
        while todo and tasks < limit and nbytes < max_bytes:
            pos = todo[0]
            charged = charges.get(pos)
            if tasks and charged is not None and (charged.deaths or charged.avoid == w.wid):
                break
            heapq.heappop(todo)
            old = state.get(pos)
            if old is not QUEUED and old is not REDO:
                continue  # stale entry
            item = self.inputs[pos]
            new = RUNNING if old is QUEUED else REDOING
            if strict:
                self._check_move(pos, new, None)
            state[pos] = new  # (in place: its worker follows here)
            self.story.move(self.subject, pos, self.run, old, new, w.wid)
            self.worker[pos] = w.wid
            w.tasks.add((self.run, pos))
            tasks += 1
            seqs = item.items if isinstance(item, Batch) else [item]
            items += seqs
            probe = probe or (charged is not None and charged.deaths > 0 and isinstance(item, Batch))
            if route is not None:
                consumer = route(pos) if old is QUEUED else None  # a redo goes through the server
                if consumer is not None:
                    direct = True
                to += [b"" if consumer is None else consumer] * len(seqs)
            nbytes += item.nbytes
        if items:
            out.append(ToWorker(w.wid, Tasks(run=self.run, to=to if direct else [], probe=probe), items))

    # ---- delivery -------------------------------------------------------------------------
    def pop_next(self, out: List[Instruction], room: Room) -> Optional[Item]:
        """The next output in epoch order, if it is there and its rank has room; positions no one
        wants are passed over (and what was read of them dropped)."""
        state, results = self.state, self.results
        while self.end is None or self.next_out < self.end:
            pos = self.next_out
            if pos >= self.read_next:
                return None  # not asked for yet
            item = results.get(pos)  # (a result is there: READY, open)
            if item is None and state.get(pos) not in OPEN:
                # no one wanted it when it came up: never read (nor anything up to the next one read)
                asked = (p for p, st in state.items() if st in OPEN)
                self.next_out = max(pos + 1, min(asked, default=self.read_next))
                continue
            if not self.wanted(pos):
                self._drop(pos)  # its rank left after it was read
                self.next_out += 1
                continue
            if item is None or not room(pos):
                return None
            if self.strict:
                self._check_move(pos, None, None)
            del state[pos], results[pos]  # (in place: a READY seq holds nothing else)
            self.story.move(self.subject, pos, self.run, READY, DELIVERED)
            self.open -= 1
            self.next_out += 1
            return item
        return None

    def total(self) -> Optional[int]:
        return self.num_seqs

    def close(self, workers: Workers) -> None:
        super().close(workers)
        self.late.clear()

    def queues(self) -> Dict[str, int]:
        return {
            "fed": self.fed,
            "waiting_for_worker": len(self.todo),
            "in_flight": len(self.worker),
            "reorder_buffer": len(self.results),
            "kept_for_consumers": len(self.kept),
            "suspects": sum(1 for c in self.charges.values() if c.deaths),
        }


def _tag(pos: int, item: Optional[Input]) -> str:
    """The seq at `pos` as failures name it (a huge tag shortened: it must fit their message)."""
    tag = short_tag(item.seq_tag) if item is not None else None
    return tag if tag is not None else f"#{pos}"


def _what(pos: int, item: Optional[Input]) -> str:
    """The input at `pos` in words: a seq, or a batch and its seqs."""
    if isinstance(item, Batch):
        return f"batch {pos} (seqs {item.tags()})"
    return f"seq {_tag(pos, item)!r}"


def _killed(run: int, pos: int, item: Optional[Input], deaths: int, w: WorkerState) -> Failure:
    """The run's failure once the input at `pos` has been on `deaths` (max_seq_retries) workers
    that died; a probed batch names the seq its last worker was mapping."""
    if w.mapping is not None and w.mapping[:2] == (run, pos) and w.mapping[2] is not None:
        tag = w.mapping[2]
        return Failure(
            FailureKind.MAPPER,
            f"seq {tag!r} (of batch {pos}) was being mapped when the last of {deaths} workers that held its batch died",
            seq_tag=tag,
        )
    return Failure(
        FailureKind.MAPPER,
        f"{_what(pos, item)} was in flight on {deaths} workers that died processing it",
        _tag(pos, item),
    )


class Wait(enum.Enum):
    """Why the seq at the head of the queue is not sent now."""

    NO_ROOM = "no worker may take it now"
    OTHERS_FIRST = "only the worker it let down has room: the seqs behind it go first"


def _pick(workers: Workers, charged: Optional[Charges], chunk: int) -> Union[Tuple[WorkerState, int], Wait]:
    """The worker the seq at the head of the queue goes to, and how many tasks that message may
    hold: a suspect goes alone to an idle worker, the others to the worker with the most free
    credit, `chunk` at a time; a seq that let a worker down goes to another if one can take it."""
    avoid = charged.avoid if charged is not None and len(workers) > 1 else None
    if charged is not None and charged.deaths:
        idle = [w for w in workers.values() if not w.tasks and not w.retiring and w.wid != avoid]
        if idle:
            idle[0].isolating = True
            return idle[0], 1
        if avoid is not None and any(not w.tasks and not w.retiring for w in workers.values()):
            return Wait.OTHERS_FIRST
        return Wait.NO_ROOM
    free = [w for w in workers.values() if not w.isolating and w.free() > 0]
    candidates = [w for w in free if w.wid != avoid]
    if candidates:
        w = max(candidates, key=lambda w: w.free())
        return w, min(w.free(), chunk)
    return Wait.OTHERS_FIRST if free else Wait.NO_ROOM

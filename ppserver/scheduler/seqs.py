"""map_seq dispatch: every input is a task any worker may run; outputs leave in input order.

Only positions some rank wants are read (`wanted`: a resumed rank's skipped seqs and the
seqs of ranks that left are neither read nor mapped), at most `window` ahead of delivery.
Positions no one wants are passed over at once (`next_wanted`), not one by one: a run that
serves one of many lanes would otherwise pass over all the others' positions for each of its own.

Each position the run holds is in one state (seqstates.py: the run's SeqTable alone moves
them, and the window they lie in; this module decides, the table moves). An input stays until
its result arrives, so the tasks of a worker that dies are sent again elsewhere; which worker a
task goes to is one decision (placement.py). Every task lost in
a crash becomes suspect; a suspect later runs alone on an idle worker, so once a seq has been
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

from typing import Callable, List, Optional, Sequence, Tuple, Union

from ppclient.protocol import BadItem, Batch, FailureKind, Item, Tasks, short_tag
from ppserver.scheduler.dispatch import Drop, Room, SeqQueues, SeqWork, Workers
from ppserver.scheduler.events import CompletedReceived
from ppserver.scheduler.instructions import Instruction, ToWorker
from ppserver.scheduler.placement import Limits, Send, Wait, choose, may_send
from ppserver.scheduler.seqstates import OPEN, ORPHAN, REDOING, RUNNING, Charge, Input, SeqTable
from ppserver.scheduler.settings import Failure, Settings
from ppserver.scheduler.story import BATCH, POS, Story
from ppserver.scheduler.workers import WorkerState

BATCH_READ_SLACK = 4  # batches read beyond the workers' credit
BATCH_READ_STEP = 2


class SeqDispatch(SeqWork):
    """A map_seq run's dispatch over its table of positions (`table`, their only writer) and the
    placement of its tasks (placement.py)."""

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
        self.run = run
        self.table = SeqTable(
            run, width, strict, first, end, story if story is not None else Story(0), BATCH if batched else POS
        )
        self.num_seqs = num_seqs
        self.settings = settings
        self.limits = Limits.of(settings)
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
        after = self.table.received(items)
        if after > self.fed:
            self.fed = after

    def requests(self, capacity: int) -> List[int]:
        """Positions to read now: the wanted ones, at most the workers' credit plus a little slack
        ahead of delivery."""
        t = self.table
        window = capacity + self.slack
        if window - t.open < self.step and len(t.todo) >= self.slack // 2:
            return []  # enough inputs wait to be sent: ask for a step at a time (fewer wake-ups)
        out: List[int] = []
        wanted, next_wanted, end = self.wanted, self.next_wanted, t.end
        pos = t.read_next
        room = window - t.open
        rest_unwanted = False
        while room > 0 and (end is None or pos < end):
            if not wanted(pos):
                later = next_wanted(pos)
                if later is None or (end is not None and later >= end):
                    rest_unwanted = end is not None
                    break
                pos = later
            out.append(pos)
            pos += 1
            room -= 1
        t.ask(out)
        if rest_unwanted:  # no rank wants a position up to the end
            t.skip_rest()
        return out

    def inputs_ended(self, count: int, end: Optional[int]) -> None:
        """The dataset has `count` seqs (it could not say so in advance); `end`: the first position
        no rank gets (drop_last)."""
        assert end is not None  # a map_seq run has an output for each input
        self.num_seqs = count
        self.table.set_end(count, end)

    def reading_done(self) -> bool:
        return self.table.reading_done()

    # ---- workers --------------------------------------------------------------------------
    def worker_lost(self, w: WorkerState, crashed: bool) -> Optional[Failure]:
        t = self.table
        for pos in w.held_of(self.run):
            n = t.take_back(w, pos, Charge.DEATH if crashed else None)
            if n is not None and n >= self.settings.max_seq_retries:
                return _killed(self.run, pos, t.inputs.get(pos), n, w)
        return None

    def results_received(self, w: WorkerState, items: List[Item], bad: List[BadItem]) -> Optional[Failure]:
        t = self.table
        worker, states, ready, wid, keep = t.worker, t.state, t.ready, w.wid, self.route is not None
        for item in items:
            pos = item.pos
            if worker.get(pos) != wid:
                continue  # late or duplicate: the seq was handed to another worker
            w.done += 1
            state = states[pos]
            if state is RUNNING:
                ready(pos, w, item, keep)  # (kept: a relayed seq may be lost too, by a reset connection)
                if item.skipped:
                    self.skips.append((pos, item.skipped, item.skipped_tags))
            else:
                t.move(pos, None, w)
                if state is REDOING:
                    self.late.append(item)  # released already: it goes to its consumer at once
        blamed: List[Tuple[int, str]] = [(b.pos, b.reason) for b in bad if b.pos is not None]
        if any(b.pos is None for b in bad):
            # a result that names no seq: every seq this worker holds is charged with it
            reason = next(b.reason for b in bad if b.pos is None)
            blamed += [(pos, reason) for pos in w.held_of(self.run)]
        for pos, reason in blamed:
            n = t.take_back(w, pos, Charge.MALFORMED, avoid=True)
            if n is not None and n >= self.settings.max_seq_retries:
                task = t.inputs.get(pos)
                what = f"{_what(pos, task)}: {n} malformed results ({reason})"
                return Failure(FailureKind.MAPPER, what, seq_tag=_tag(pos, task))
        return None

    def malformed_message(self, w: WorkerState, reason: str) -> Optional[Failure]:
        return self.results_received(w, [], [BadItem(None, reason)])

    def completed(self, w: WorkerState, done: CompletedReceived) -> None:
        """Results the worker sent to their consumers: a placeholder takes each one's turn in
        delivery order, and the input is kept until the consumer has taken the seq. `done.skipped[k]`:
        the seqs of result k the mapper skipped (empty: none), `done.skipped_tags[k]` a few of their tags."""
        t = self.table
        worker, state, inputs, ready, wid = t.worker, t.state, t.inputs, t.ready, w.wid
        positions, skipped, skipped_tags = done.positions, done.skipped, done.skipped_tags
        skips = len(skipped) == len(positions) and len(skipped_tags) == len(positions)
        for k, (pos, size) in enumerate(zip(positions, done.nbytes)):
            if worker.get(pos) != wid:
                continue  # late or duplicate
            w.done += 1
            if state[pos] is not RUNNING:
                t.move(pos, None, w)  # dropped meanwhile, or a lost one's redo that went direct after all
                continue
            item = inputs[pos]
            n = min(max(skipped[k], 0), item.seqs) if skips else 0
            seqs = None if item.seqs == 1 else item.seqs - n
            ready(pos, w, Item(pos, {}, [], [], size, direct=True, size=seqs, skipped=n), True)
            if n:
                self.skips.append((pos, n, skipped_tags[k]))

    def inputs_lost(self, w: WorkerState, positions: List[int]) -> Tuple[int, Optional[Failure]]:
        """Tasks the worker could not read the inputs of: its slots are freed and the seqs still
        wanted go back to the queue (nobody is blamed). Returns how many go back, and the failure
        of the run if one seq's input could not be read `max_seq_retries` times."""
        t = self.table
        redone = 0
        for pos in positions:
            n = t.take_back(w, pos, Charge.UNREADABLE)
            if n is None:
                continue  # late, duplicate, or no rank wants it any more
            if n >= self.settings.max_seq_retries:
                what = _what(pos, t.inputs.get(pos))
                return redone, Failure(FailureKind.SERVER, f"the input of {what} could not be read by {n} workers")
            redone += 1
        return redone, None

    def dropped(self, w: WorkerState, drop: Drop) -> Optional[Failure]:
        """Tasks `w` dropped unread (their message did not decode, say; none named: every one of this
        run it holds): each goes to another worker if there is one. A seq whose task `max_seq_retries`
        workers dropped fails the run naming it: its input is what they cannot take."""
        t = self.table
        for pos in drop.positions or w.held_of(self.run):
            n = t.take_back(w, pos, Charge.REFUSED, avoid=True)
            if n is not None and n >= self.settings.max_seq_retries:
                tag = _tag(pos, t.inputs.get(pos))
                message = f"seq {tag!r} (position {pos}): {n} workers could not take its input ({drop.reason})"
                return Failure(FailureKind.DATASET, message, seq_tag=tag)
        return None

    def task_failed(self, w: WorkerState, pos: int) -> bool:
        """Whether a mapper failure the worker reports fails the run: not for a task it does not hold
        (late: redone elsewhere) nor for a position no one wants any more (its input may be gone)."""
        t = self.table
        if not t.mine(w, pos):
            return False
        if t.state[pos] is ORPHAN:
            t.move(pos, None, w)
            return False
        return True

    # ---- dispatch -------------------------------------------------------------------------
    def dispatch(self, workers: Workers, out: List[Instruction]) -> None:
        """Send what the workers' credit allows, lowest positions first, each message where
        placement.choose says (performing its decision: a worker that takes a suspect isolates)."""
        t = self.table
        candidates = workers.values()
        if not t.todo or not may_send(candidates):
            return  # nothing to send, or no worker has room (an idle worker has room)
        head_of, charges, limits = t.head, t.charges, self.limits
        while True:
            head = head_of()
            if head is None:
                break
            charged = charges.get(head)
            if charged is None:
                decision = choose(candidates, limits)
            else:
                decision = choose(candidates, limits, charged.deaths, charged.avoid)
            if decision is Wait.NO_ROOM:
                break
            if decision is Wait.OTHERS_FIRST:
                t.set_aside()
                continue
            w = workers[decision.wid]
            if decision.isolate:
                w.isolate(t.story, f"{t.subject} {head} of run {self.run}")
            self._send(w, decision, out)
        if t.aside:
            t.restore()

    def _send(self, w: WorkerState, send: Send, out: List[Instruction]) -> None:
        """One message to `w` of the tasks `send` allows from the head of the queue."""
        t = self.table
        inputs, state, charges, route = t.inputs, t.state, t.charges, self.route
        items: List[Item] = []  # the tasks' seqs (a batch's travel one after the other)
        to: List[bytes] = []  # on the wire, b"" means through the server
        direct = False
        probe = False
        for pos in t.take_for(w, send):
            item = inputs[pos]
            if isinstance(item, Batch):
                n = len(item.items)
                items += item.items
                charged = charges.get(pos)
                probe = probe or (charged is not None and charged.deaths > 0)
            else:
                n = 1
                items.append(item)
            if route is not None:
                consumer = route(pos) if state[pos] is RUNNING else None  # a redo goes through the server
                if consumer is None:
                    consumer = b""
                else:
                    direct = True
                if n == 1:
                    to.append(consumer)
                else:
                    to += [consumer] * n
        if items:
            out.append(ToWorker(w.wid, Tasks(run=self.run, to=to if direct else [], probe=probe), items))

    # ---- delivery -------------------------------------------------------------------------
    def pop_next(self, room: Room) -> Optional[Item]:
        """The next output in epoch order, if it is there and its rank has room; positions no one
        wants are passed over (and what was read of them dropped)."""
        t = self.table
        state, results = t.state, t.results
        while t.end is None or t.next_out < t.end:
            pos = t.next_out
            if pos >= t.read_next:
                return None  # not asked for yet
            item = results.get(pos)  # (a result is there: READY, open)
            if item is None and state.get(pos) not in OPEN:
                t.pass_over()  # no one wanted it when it came up: never read
                continue
            if not self.wanted(pos):
                t.drop_next()  # its rank left after it was read
                continue
            if item is None or not room(pos):
                return None
            t.release(pos)
            return item
        return None

    def total(self) -> Optional[int]:
        return self.num_seqs

    def forget(self, lane: int, upto: int) -> None:
        self.table.forget(lane, upto)

    def redo_lost(self, pos: int) -> bool:
        return self.table.redo_lost(pos)

    def close(self, workers: Workers) -> None:
        self.table.close(workers)
        self.late.clear()

    def queues(self) -> SeqQueues:
        t = self.table
        return SeqQueues(
            fed=self.fed,
            waiting_for_worker=len(t.todo),
            in_flight=self.in_flight(),
            reorder_buffer=len(t.results),
            kept_for_consumers=len(t.kept),
            suspects=sum(1 for c in t.charges.values() if c.deaths),
        )

    def in_flight(self) -> int:
        return len(self.table.worker)

    def holds(self) -> List[int]:
        return self.table.holds()

    def validate(self, workers: Workers) -> None:
        self.table.validate(workers)


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

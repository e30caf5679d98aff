"""map_seq dispatch: every input is a task any worker may run; outputs leave in input order.

Only positions some rank wants are read (`wanted`: a resumed rank's skipped seqs and the
seqs of ranks that left are neither read nor mapped), at most `window` ahead of delivery.
Positions no one wants are passed over at once (`next_wanted`), not one by one: a run that
serves one of many lanes would otherwise pass over all the others' positions for each of its own.

An input stays here until its result arrives, so the tasks of a worker that dies are sent
again elsewhere. Every task lost in a crash becomes suspect; a suspect later runs alone on an
idle worker, so once a seq has been charged `max_seq_retries` crashes it really is the one
that kills workers, and the run fails naming it. A malformed result is dropped and its seq
redone on another worker when there is one; `max_seq_retries` malformed results of one seq
fail the run too, so a broken worker cannot loop forever.

Batches: in a run that batches, a position is a batch of the epoch and an input is a Batch (its
seqs, cut by the reader); it travels as its seqs, each naming the batch, and comes back as one
padded result. A suspect batch is probed: its worker says which seq it maps before each one,
so a crash is charged to the batch and the failure names the seq that was being mapped.

Direct results: a task may name the consumer its result goes to (`route`); the worker sends
it there and tells the server only its position and size (`completed`). Its input is kept
until the consumer has taken the seq (`forget`), so a result lost on the way (`lost`: the
consumer reports it missing) is made again and sent through the server (`late`).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Set, Tuple, Union

from ppclient.protocol import BadItem, Batch, FailureKind, Item, Tasks, short_tag
from ppserver.scheduler.instructions import Instruction, ToWorker
from ppserver.scheduler.settings import Failure, Settings
from ppserver.scheduler.workers import WorkerState


class SeqDispatch:
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
        route: Optional[Callable[[int], bytes]] = None,
        width: int = 1,
    ):
        self.run = run
        self.num_seqs = num_seqs
        self.settings = settings
        self.wanted = wanted
        self.next_wanted = next_wanted  # the first position from p on that some rank wants (None: none)
        self.end = end  # positions from here on go to no one (drop_last); None: not known yet
        self.read_next = first  # the next position to consider reading
        self.requested: Set[int] = set()  # read or asked for, not yet released or dropped
        self.awaiting = 0  # asked for, not yet arrived
        self.fed = 0  # inputs received from the reader
        self.pending: Dict[int, Union[Item, Batch]] = {}  # inputs whose result has not arrived
        self.todo: List[int] = []  # heap of positions to send: redone ones come first, being lower
        self.inflight: Dict[int, bytes] = {}  # position -> worker running it
        self.results: Dict[int, Item] = {}  # results waiting for their turn
        self.deaths: Dict[int, int] = {}  # crashes charged to a position (suspects)
        self.malformed: Dict[int, int] = {}  # malformed results of a position
        self.avoid: Dict[int, bytes] = {}  # the worker that sent a malformed result of a position
        self.next_out = first  # the next position to release
        self.route = route  # position -> the consumer its result goes to directly (b"": the server)
        self.width = width  # lanes: position p belongs to lane p % width
        self.kept: Dict[int, Union[Item, Batch]] = {}  # inputs of direct results the consumer has not taken yet
        self.kept_order: Dict[int, Deque[int]] = {}  # lane -> its kept positions, in order
        self.relay: Set[int] = set()  # lost direct results, being made again to go through the server
        self.late: List[Item] = []  # such results, to send to their consumer now
        # inputs of in-flight tasks whose position was dropped: a worker reading the server's memory
        # may not have read them yet, so they stay until the task is settled
        self.orphans: Dict[int, Union[Item, Batch]] = {}
        self.unreadable: Dict[int, int] = {}  # times a position's input could not be read by its worker
        self.refused: Dict[int, int] = {}  # times a worker dropped a position's task unread

    # ---- inputs ---------------------------------------------------------------------------
    def add_inputs(self, items: List[Union[Item, Batch]]) -> None:
        for item in items:
            self.awaiting -= 1
            if item.pos not in self.requested:
                continue  # dropped meanwhile (its rank left)
            self.fed = max(self.fed, item.pos + 1)
            self.pending[item.pos] = item
            heapq.heappush(self.todo, item.pos)

    def requests(self, capacity: int) -> List[int]:
        """Positions to read now: the wanted ones, at most the workers' credit plus a little slack
        ahead of delivery."""
        s = self.settings
        window = capacity + s.read_slack
        if window - len(self.requested) < s.read_step and len(self.todo) >= s.read_slack // 2:
            return []  # enough inputs wait to be sent: ask for a step at a time (fewer wake-ups)
        out: List[int] = []
        while (self.end is None or self.read_next < self.end) and len(self.requested) < window:
            pos = self.read_next if self.wanted(self.read_next) else self.next_wanted(self.read_next)
            if pos is None or (self.end is not None and pos >= self.end):
                if self.end is not None:
                    self.read_next = self.end  # no one wants the rest
                break
            self.read_next = pos + 1
            self.requested.add(pos)
            out.append(pos)
        self.awaiting += len(out)
        return out

    def reading_done(self) -> bool:
        """Everything wanted has been read: the reader may move on to another epoch."""
        return self.end is not None and self.read_next >= self.end and self.awaiting == 0

    def inputs_ended(self, count: int, end: int) -> None:
        """The dataset has `count` seqs (it could not say so in advance); `end`: the first position
        no rank gets (drop_last)."""
        self.num_seqs = count
        for pos in [p for p in self.requested if p >= count]:  # asked for, but they do not exist
            self.requested.discard(pos)
            self.awaiting -= 1
        self.end = end
        for pos in [p for p in self.requested if p >= end]:
            self._drop(pos)

    # ---- workers --------------------------------------------------------------------------
    def assign(self, workers: Dict[bytes, WorkerState], out: List[Instruction]) -> None:
        """Tasks go to whichever worker has credit (see dispatch): nothing is owned in advance."""

    def worker_lost(
        self, w: WorkerState, crashed: bool, workers: Dict[bytes, WorkerState], out: List[Instruction]
    ) -> Optional[Failure]:
        for run, pos in sorted(w.tasks):
            if run != self.run or self.inflight.get(pos) != w.wid:
                continue
            del self.inflight[pos]
            if pos not in self.pending:
                continue  # dropped meanwhile: nothing to redo
            if crashed:
                self.deaths[pos] = self.deaths.get(pos, 0) + 1
                if self.deaths[pos] >= self.settings.max_seq_retries:
                    return self._killed(pos, w)
            heapq.heappush(self.todo, pos)
        return None

    def _tag(self, pos: int) -> str:
        """The seq at `pos` as failures name it (a huge tag shortened: it must fit their message)."""
        item = self.pending.get(pos)
        tag = short_tag(item.seq_tag) if item is not None else None
        return tag if tag is not None else f"#{pos}"

    def _what(self, pos: int) -> str:
        """The input at `pos` in words: a seq, or a batch and its seqs."""
        item = self.pending.get(pos)
        if isinstance(item, Batch):
            return f"batch {pos} (seqs {item.tags()})"
        return f"seq {self._tag(pos)!r}"

    def _killed(self, pos: int, w: WorkerState) -> Failure:
        """The run's failure once the input at `pos` has been on max_seq_retries workers that died; a
        probed batch names the seq its last worker was mapping."""
        n = self.deaths[pos]
        if w.mapping is not None and w.mapping[:2] == (self.run, pos) and w.mapping[2] is not None:
            tag = w.mapping[2]
            return Failure(
                FailureKind.MAPPER,
                f"seq {tag!r} (of batch {pos}) was being mapped when the last of {n} workers that held its batch died",
                seq_tag=tag,
            )
        return Failure(
            FailureKind.MAPPER,
            f"{self._what(pos)} was in flight on {n} workers that died processing it",
            self._tag(pos),
        )

    def results_received(self, w: WorkerState, items: List[Item], bad: List[BadItem]) -> Optional[Failure]:
        for item in items:
            if self.inflight.get(item.pos) != w.wid:
                continue  # late or duplicate: the seq was handed to another worker
            wanted = item.pos in self.pending
            task = self.pending.get(item.pos)
            self._settle(w, item.pos)
            w.done += 1
            if item.pos in self.relay:
                self.relay.discard(item.pos)
                if wanted:
                    self.late.append(item)  # released already: it goes to its consumer at once
            elif wanted:
                self.results[item.pos] = item
                if self.route is not None and task is not None:
                    self._keep(item.pos, task)  # a relayed seq may be lost too (a reset connection)
        blamed: List[Tuple[int, str]] = [(b.pos, b.reason) for b in bad if b.pos is not None]
        if any(b.pos is None for b in bad):
            # a result that names no seq: every seq this worker holds is charged with it
            reason = next(b.reason for b in bad if b.pos is None)
            blamed += [(pos, reason) for run, pos in sorted(w.tasks) if run == self.run]
        for pos, reason in blamed:
            if self.inflight.get(pos) != w.wid:
                continue
            if pos not in self.pending:
                self._settle(w, pos)  # dropped meanwhile
                continue
            self._settle(w, pos, keep_input=True)
            self.malformed[pos] = self.malformed.get(pos, 0) + 1
            if self.malformed[pos] >= self.settings.max_seq_retries:
                return Failure(
                    FailureKind.MAPPER,
                    f"{self._what(pos)}: {self.malformed[pos]} malformed results ({reason})",
                    seq_tag=self._tag(pos),
                )
            self.avoid[pos] = w.wid
            heapq.heappush(self.todo, pos)
        if not any(run == self.run for run, _ in w.tasks):
            w.isolating = False
        return None

    def completed(self, w: WorkerState, positions: List[int], sizes: List[int]) -> None:
        """Results the worker sent to their consumers: a placeholder takes each one's turn in
        delivery order, and the input is kept until the consumer has taken the seq."""
        for pos, size in zip(positions, sizes):
            if self.inflight.get(pos) != w.wid:
                continue  # late or duplicate
            item = self.pending.get(pos)
            self._settle(w, pos)
            w.done += 1
            if item is None or pos in self.relay:
                self.relay.discard(pos)
                continue  # dropped meanwhile, or a lost one's redo that went direct after all
            self.results[pos] = Item(pos, {}, [], [], size, direct=True, size=None if item.seqs == 1 else item.seqs)
            self._keep(pos, item)

    def inputs_lost(self, w: WorkerState, positions: List[int]) -> Tuple[int, Optional[Failure]]:
        """Tasks the worker could not read the inputs of: its slots are freed and the seqs still
        wanted go back to the queue (nobody is blamed). Returns how many go back, and the failure
        of the run if one seq's input could not be read `max_seq_retries` times."""
        redone = 0
        for pos in positions:
            if self.inflight.get(pos) != w.wid:
                continue  # late or duplicate
            wanted = pos in self.pending
            self._settle(w, pos, keep_input=wanted)
            if wanted:
                self.unreadable[pos] = self.unreadable.get(pos, 0) + 1
                if self.unreadable[pos] >= self.settings.max_seq_retries:
                    return redone, Failure(
                        FailureKind.SERVER,
                        f"the input of {self._what(pos)} could not be read by {self.unreadable[pos]} workers",
                    )
                heapq.heappush(self.todo, pos)
                redone += 1
        return redone, None

    def dropped(self, w: WorkerState, positions: List[int], reason: str) -> Optional[Failure]:
        """Tasks `w` dropped unread (their message did not decode, say; none named: every one of this
        run it holds): each goes to another worker if there is one. A seq whose task `max_seq_retries`
        workers dropped fails the run naming it: its input is what they cannot take."""
        for pos in positions or [p for run, p in sorted(w.tasks) if run == self.run]:
            if self.inflight.get(pos) != w.wid:
                continue  # late, or not this worker's
            if pos not in self.pending:
                self._settle(w, pos)  # dropped meanwhile
                continue
            self._settle(w, pos, keep_input=True)
            self.refused[pos] = self.refused.get(pos, 0) + 1
            if self.refused[pos] >= self.settings.max_seq_retries:
                tag = self._tag(pos)
                return Failure(
                    FailureKind.DATASET,
                    f"seq {tag!r} (position {pos}): {self.refused[pos]} workers could not take its input ({reason})",
                    seq_tag=tag,
                )
            self.avoid[pos] = w.wid
            heapq.heappush(self.todo, pos)
        return None

    def task_failed(self, w: WorkerState, pos: int) -> bool:
        """Whether a mapper failure the worker reports fails the run: not for a task it does not hold
        (late: redone elsewhere) nor for a position no one wants any more (its input may be gone)."""
        if self.inflight.get(pos) != w.wid:
            return False
        if pos not in self.pending:
            self._settle(w, pos)
            return False
        return True

    def _keep(self, pos: int, task: Union[Item, Batch]) -> None:
        self.kept[pos] = task
        self.kept_order.setdefault(pos % self.width, deque()).append(pos)

    def forget(self, lane: int, upto: int) -> None:
        """The consumer of `lane` has taken its seqs below index `upto`: their inputs go."""
        order = self.kept_order.get(lane)
        while order and order[0] // self.width < upto:
            self.kept.pop(order.popleft(), None)

    def lost(self, pos: int) -> bool:
        """A direct result its consumer never got: made again, to go through the server. False if
        the position is not one whose direct result was released (still on its way, or unknown)."""
        item = self.kept.get(pos)
        if item is None or pos in self.results or pos in self.inflight or pos in self.pending:
            return False
        self.pending[pos] = item
        self.relay.add(pos)
        heapq.heappush(self.todo, pos)
        return True

    def _settle(self, w: WorkerState, pos: int, keep_input: bool = False) -> None:
        del self.inflight[pos]
        self.orphans.pop(pos, None)
        w.tasks.discard((self.run, pos))
        if not w.tasks:
            w.isolating = False
        if not keep_input:
            self.deaths.pop(pos, None)
            self.malformed.pop(pos, None)
            self.unreadable.pop(pos, None)
            self.refused.pop(pos, None)
            self.avoid.pop(pos, None)
            self.pending.pop(pos, None)

    # ---- dispatch -------------------------------------------------------------------------
    def dispatch(self, workers: Dict[bytes, WorkerState], out: List[Instruction]) -> None:
        """Send what the workers' credit allows: lowest positions first, to the worker with the most
        free credit, in chunks of half a worker's credit (or dispatch_bytes of inputs that travel in
        the message), so consecutive seqs
        spread over the workers and results come back close to delivery order. A seq whose result
        was malformed waits for another worker, unless there is none."""
        s = self.settings
        if not self.todo or not any(w.free() > 0 and not w.isolating for w in workers.values()):
            return  # nothing to send, or no worker has room (an idle worker has room)
        chunk = max(1, min(s.buf_size // 2, s.max_dispatch_batch))
        deferred: List[int] = []
        while self.todo:
            head = self.todo[0]
            if head not in self.pending or head in self.inflight:
                heapq.heappop(self.todo)  # stale entry
                continue
            avoid = self.avoid.get(head) if len(workers) > 1 else None
            if head in self.deaths:  # a suspect goes alone to an idle worker
                idle = [w for w in workers.values() if not w.tasks and w.wid != avoid]
                if not idle:
                    if avoid is not None and any(not w.tasks for w in workers.values()):
                        deferred.append(heapq.heappop(self.todo))
                        continue
                    break
                w = idle[0]
                w.isolating = True
                limit = 1
            else:
                free = [w for w in workers.values() if not w.isolating and w.free() > 0]
                candidates = [w for w in free if w.wid != avoid]
                if not candidates:
                    if free:  # only the avoided worker has room: let the others go first
                        deferred.append(heapq.heappop(self.todo))
                        continue
                    break
                w = max(candidates, key=lambda w: w.free())
                limit = min(w.free(), chunk)
            items: List[Item] = []  # the tasks' seqs (a batch's travel one after the other)
            to: List[bytes] = []
            tasks = 0
            nbytes = 0
            probe = False
            max_bytes = s.dispatch_bytes if w.input_bytes is None else w.input_bytes
            while self.todo and tasks < limit and nbytes < max_bytes:
                pos = self.todo[0]
                if tasks and (pos in self.deaths or self.avoid.get(pos) == w.wid):
                    break
                heapq.heappop(self.todo)
                item = self.pending.get(pos)
                if item is None or pos in self.inflight:
                    continue
                self.inflight[pos] = w.wid
                w.tasks.add((self.run, pos))
                tasks += 1
                seqs = item.items if isinstance(item, Batch) else [item]
                items += seqs
                probe = probe or (pos in self.deaths and isinstance(item, Batch))
                if self.route is not None:
                    to += [b"" if pos in self.relay else self.route(pos)] * len(seqs)
                nbytes += item.nbytes
            if items:
                out.append(ToWorker(w.wid, Tasks(run=self.run, to=to if any(to) else [], probe=probe), items))
        for pos in deferred:
            heapq.heappush(self.todo, pos)

    # ---- delivery -------------------------------------------------------------------------
    def pop_next(self, out: List[Instruction], room: Callable[[int], bool]) -> Optional[Item]:
        """The next output in epoch order, if it is there and its rank has room; positions no one
        wants are passed over (and what was read of them dropped)."""
        while self.end is None or self.next_out < self.end:
            pos = self.next_out
            if pos >= self.read_next:
                return None  # not asked for yet
            if pos not in self.requested:
                # no one wanted it when it came up: never read (nor anything up to the next one read)
                self.next_out = max(pos + 1, min(self.requested, default=self.read_next))
                continue
            if not self.wanted(pos):
                self._drop(pos)  # its rank left after it was read
                self.next_out += 1
                continue
            item = self.results.get(pos)
            if item is None or not room(pos):
                return None
            del self.results[pos]
            self.requested.discard(pos)
            self.next_out += 1
            return item
        return None

    def _drop(self, pos: int) -> None:
        """Forget a position (an in-flight task keeps its worker's slot, and its input, until its
        result comes)."""
        self.requested.discard(pos)
        item = self.pending.pop(pos, None)
        if item is not None and pos in self.inflight:
            self.orphans[pos] = item
        self.results.pop(pos, None)
        self.deaths.pop(pos, None)
        self.malformed.pop(pos, None)
        self.unreadable.pop(pos, None)
        self.refused.pop(pos, None)
        self.avoid.pop(pos, None)

    def total(self) -> Optional[int]:
        return self.num_seqs

    def close(self, workers: Dict[bytes, WorkerState]) -> None:
        """Forget everything of the run (it ended); workers' slots are freed. The inputs of tasks in
        flight stay with their workers until each says it dropped the run (`run_dropped`): one
        reading the server's memory may not have read them yet."""
        for pos, wid in self.inflight.items():
            w = workers.get(wid)
            if w is not None:
                w.tasks.discard((self.run, pos))
                if not w.tasks:
                    w.isolating = False
                item = self.pending.get(pos) or self.orphans.get(pos)
                if item is not None:
                    w.retained.setdefault(self.run, []).append(item)
        self.pending.clear()
        self.orphans.clear()
        self.results.clear()
        self.todo.clear()
        self.inflight.clear()
        self.kept.clear()
        self.kept_order.clear()
        self.late.clear()

    def queues(self) -> Dict[str, int]:
        return {
            "fed": self.fed,
            "waiting_for_worker": len(self.todo),
            "in_flight": len(self.inflight),
            "reorder_buffer": len(self.results),
            "kept_for_consumers": len(self.kept),
            "suspects": len(self.deaths),
        }

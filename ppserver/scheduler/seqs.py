"""map_seq dispatch: every input is a task any worker may run; outputs leave in input order.

An input stays here until its result arrives, so the tasks of a worker that dies are sent
again elsewhere. Every task lost in a crash becomes suspect; a suspect later runs alone on an
idle worker, so once a seq has been charged `max_seq_retries` crashes it really is the one
that kills workers, and the run fails naming it. A malformed result is dropped and its seq
redone on another worker when there is one; `max_seq_retries` malformed results of one seq
fail the run too, so a broken worker cannot loop forever.
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Optional

from ppclient.protocol import BadItem, FailureKind, Item, Tasks

from .instructions import Instruction, ToWorker
from .settings import Failure, Settings
from .workers import WorkerState


class SeqDispatch:
    def __init__(self, run: int, num_seqs: int, settings: Settings):
        self.run = run
        self.num_seqs = num_seqs
        self.settings = settings
        self.fed = 0  # inputs received from the reader
        self.pending: Dict[int, Item] = {}  # inputs whose result has not arrived
        self.todo: List[int] = []  # heap of positions to send: redone ones come first, being lower
        self.inflight: Dict[int, bytes] = {}  # position -> worker running it
        self.results: Dict[int, Item] = {}  # results waiting for their turn
        self.deaths: Dict[int, int] = {}  # crashes charged to a position (suspects)
        self.malformed: Dict[int, int] = {}  # malformed results of a position
        self.avoid: Dict[int, bytes] = {}  # the worker that sent a malformed result of a position
        self.next_out = 0  # the next position to release

    # ---- inputs ---------------------------------------------------------------------------
    def add_inputs(self, items: List[Item]) -> None:
        for item in items:
            self.fed = max(self.fed, item.pos + 1)
            self.pending[item.pos] = item
            heapq.heappush(self.todo, item.pos)

    def inputs_ended(self, count: int) -> None:
        self.num_seqs = count

    def starving(self) -> bool:
        """No input is waiting to be sent: a worker may be about to run dry."""
        return not self.todo

    def read_limit(self, capacity: int) -> int:
        """Read only as far as the workers' credit plus a little slack ahead of delivery."""
        return min(self.num_seqs, self.next_out + capacity + self.settings.read_slack)

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
            if crashed:
                self.deaths[pos] = self.deaths.get(pos, 0) + 1
                if self.deaths[pos] >= self.settings.max_seq_retries:
                    tag = self._tag(pos)
                    return Failure(
                        FailureKind.MAPPER,
                        f"seq {tag!r} was in flight on {self.deaths[pos]} workers that died processing it",
                        seq_tag=tag,
                    )
            heapq.heappush(self.todo, pos)
        return None

    def _tag(self, pos: int) -> str:
        item = self.pending.get(pos)
        tag = item.seq_tag if item is not None else None
        return tag if tag is not None else f"#{pos}"

    def results_received(self, w: WorkerState, items: List[Item], bad: List[BadItem]) -> Optional[Failure]:
        for item in items:
            if self.inflight.get(item.pos) != w.wid:
                continue  # late or duplicate: the seq was handed to another worker
            self._settle(w, item.pos)
            w.done += 1
            self.results[item.pos] = item
        for b in bad:
            if b.pos is None or self.inflight.get(b.pos) != w.wid:
                continue
            self._settle(w, b.pos, keep_input=True)
            self.malformed[b.pos] = self.malformed.get(b.pos, 0) + 1
            if self.malformed[b.pos] >= self.settings.max_seq_retries:
                tag = self._tag(b.pos)
                return Failure(
                    FailureKind.MAPPER,
                    f"seq {tag!r}: {self.malformed[b.pos]} malformed results ({b.reason})",
                    seq_tag=tag,
                )
            self.avoid[b.pos] = w.wid
            heapq.heappush(self.todo, b.pos)
        if not any(run == self.run for run, _ in w.tasks):
            w.isolating = False
        return None

    def _settle(self, w: WorkerState, pos: int, keep_input: bool = False) -> None:
        del self.inflight[pos]
        w.tasks.discard((self.run, pos))
        if not w.tasks:
            w.isolating = False
        if not keep_input:
            self.deaths.pop(pos, None)
            self.malformed.pop(pos, None)
            self.avoid.pop(pos, None)
            self.pending.pop(pos, None)

    def owns_task(self, w: WorkerState, pos: int) -> bool:
        return self.inflight.get(pos) == w.wid

    # ---- dispatch -------------------------------------------------------------------------
    def dispatch(self, workers: Dict[bytes, WorkerState], out: List[Instruction]) -> None:
        """Send what the workers' credit allows: lowest positions first, to the worker with the most
        free credit, in chunks of half a worker's credit (or dispatch_bytes), so consecutive seqs
        spread over the workers and results come back close to delivery order. A seq whose result
        was malformed waits for another worker, unless there is none."""
        s = self.settings
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
            batch: List[Item] = []
            nbytes = 0
            while self.todo and len(batch) < limit and nbytes < s.dispatch_bytes:
                pos = self.todo[0]
                if batch and (pos in self.deaths or self.avoid.get(pos) == w.wid):
                    break
                heapq.heappop(self.todo)
                item = self.pending.get(pos)
                if item is None or pos in self.inflight:
                    continue
                self.inflight[pos] = w.wid
                w.tasks.add((self.run, pos))
                batch.append(item)
                nbytes += item.nbytes
            if batch:
                out.append(ToWorker(w.wid, Tasks(run=self.run), batch))
        for pos in deferred:
            heapq.heappush(self.todo, pos)

    # ---- delivery -------------------------------------------------------------------------
    def pop_next(self, out: List[Instruction]) -> Optional[Item]:
        item = self.results.pop(self.next_out, None)
        if item is not None:
            self.next_out += 1
        return item

    def total(self) -> Optional[int]:
        return self.num_seqs

    def close(self, workers: Dict[bytes, WorkerState]) -> None:
        """Forget everything of the run (it ended); workers' slots are freed."""
        for pos, wid in self.inflight.items():
            w = workers.get(wid)
            if w is not None:
                w.tasks.discard((self.run, pos))
                if not w.tasks:
                    w.isolating = False
        self.pending.clear()
        self.results.clear()
        self.todo.clear()
        self.inflight.clear()

    def queues(self) -> Dict[str, int]:
        return {
            "fed": self.fed,
            "waiting_for_worker": len(self.todo),
            "in_flight": len(self.inflight),
            "reorder_buffer": len(self.results),
            "suspects": len(self.deaths),
        }

"""map_seq_stream dispatch: input i belongs to partition i mod P; a partition is one stream on one
worker; outputs are merged round-robin across partitions (exhausted ones are skipped).

Credits bound memory both ways: the server sends a partition's owner at most `buf_size`
inputs it has not yet taken (StreamAck returns credit), and the owner sends at most
`buf_size` outputs the merge has not yet taken (StreamCredit returns it).

A partition whose worker dies restarts on another worker from its first input: the inputs
already sent are read again from the dataset (Replay, in chunks of `buf_size`), and the new
owner skips the outputs the server already received (StreamOpen.skip). `max_seq_retries`
crashes without progress in between fail the run.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Tuple

from ppclient.protocol import (
    BadItem,
    FailureKind,
    Item,
    StreamClose,
    StreamCredit,
    StreamEnd,
    StreamInputs,
    StreamOpen,
    short_tag,
)
from ppserver.scheduler.instructions import Instruction, Replay, ToWorker
from ppserver.scheduler.settings import Failure, Settings
from ppserver.scheduler.workers import WorkerState


@dataclass
class Partition:
    index: int
    wid: Optional[bytes] = None  # the owner
    queue: Deque[Item] = field(default_factory=deque)  # new inputs not yet sent
    fed: int = 0  # inputs of this partition received from the reader
    sent: int = 0  # inputs sent to the current owner (from the partition's first)
    in_credit: int = 0
    replay_until: int = 0  # inputs j < replay_until come from a replay, not the queue
    replay: Deque[Item] = field(default_factory=deque)  # replayed inputs not yet sent
    replay_ticket: int = 0  # the replay request whose answer is awaited (0: none)
    eof_sent: bool = False
    outputs: Deque[Tuple[Item, bytes]] = field(default_factory=deque)  # (output, the worker that made it)
    received: int = 0  # outputs received, across restarts
    done: bool = False
    deaths: int = 0
    received_at_death: int = -1
    last_tag: Optional[str] = None
    incarnation: int = 0  # counts the partition's starts; the owner echoes it

    def replaying(self) -> bool:
        return self.sent < self.replay_until


class StreamDispatch:
    def __init__(self, run: int, epoch: int, num_seqs: Optional[int], settings: Settings):
        self.run = run
        self.epoch = epoch
        self.num_seqs = num_seqs  # inputs
        self.settings = settings
        self.parts = [Partition(p) for p in range(settings.partitions)]
        self.fed = 0
        self.feed_done = num_seqs == 0
        self.rr = 0  # the partition whose output the merge takes next
        self.released = 0
        self.tickets = 0
        self.read_upto = 0  # positions asked of the reader

    # ---- inputs ---------------------------------------------------------------------------
    def add_inputs(self, items: List[Item]) -> None:
        n = len(self.parts)
        for item in items:
            self.fed = max(self.fed, item.pos + 1)
            part = self.parts[item.pos % n]
            part.fed += 1
            if not part.done:  # a stream that ended early never reads its remaining inputs
                part.queue.append(item)
        self.feed_done = self.num_seqs is not None and self.fed >= self.num_seqs

    def inputs_ended(self, count: int) -> None:
        self.num_seqs = count
        self.feed_done = self.fed >= count

    def read_limit(self, capacity: int) -> int:
        """Read on while a partition that can take inputs has none queued: each hungry partition
        may get what its credit allows; the others queue what comes meanwhile (their streams may
        need that lookahead before they yield)."""
        n = len(self.parts)
        limit = self.read_upto
        for part in self.parts:
            if part.wid is None or part.done or part.replaying():
                continue
            room = part.in_credit - len(part.queue)
            if room <= 0:
                continue
            first = self.read_upto + (part.index - self.read_upto) % n  # this partition's next position
            limit = max(limit, first + (room - 1) * n + 1)
        return limit if self.num_seqs is None else min(limit, self.num_seqs)

    def requests(self, capacity: int) -> List[int]:
        """The next positions to read: every input goes to some partition, in epoch order."""
        limit = self.read_limit(capacity)
        if limit <= self.read_upto:
            return []
        out = list(range(self.read_upto, limit))
        self.read_upto = limit
        return out

    def reading_done(self) -> bool:
        """No partition can need an input again (a partition that restarts replays its inputs)."""
        return all(part.done for part in self.parts)

    def replay_read(self, partition: int, ticket: int, items: List[Item]) -> None:
        part = self.parts[partition]
        if ticket != part.replay_ticket or part.wid is None:
            return  # answers a request of an earlier owner
        part.replay_ticket = 0
        part.replay.extend(items)

    # ---- workers --------------------------------------------------------------------------
    def assign(self, workers: Dict[bytes, WorkerState], out: List[Instruction]) -> None:
        """Partitions without an owner go to the workers running the fewest streams."""
        self._assign(workers, out)

    def worker_lost(
        self, w: WorkerState, crashed: bool, workers: Dict[bytes, WorkerState], out: List[Instruction]
    ) -> Optional[Failure]:
        """`workers` no longer holds `w`; its partitions restart elsewhere."""
        for run, p in sorted(w.partitions):
            if run != self.run or self.parts[p].wid != w.wid:
                continue
            failure = self._restart(self.parts[p], "killed {n} workers", counts=crashed)
            if failure is not None:
                return failure
        w.partitions = {(run, p) for run, p in w.partitions if run != self.run}
        self._assign(workers, out)
        return None

    def _restart(
        self, part: Partition, what: str, *, counts: bool, kind: FailureKind = FailureKind.MAPPER
    ) -> Optional[Failure]:
        """Take the partition from its owner; `counts`: charge it (a crash, a malformed output, an
        input the worker could not take), failing the run as `kind` once it has cost too many;
        `what` says what it cost, "{n}" standing for how many times."""
        if counts:
            if part.received > part.received_at_death:
                part.deaths = 0  # progress since the last failure: that one was not its fault
            part.deaths += 1
            part.received_at_death = part.received
            if part.deaths >= self.settings.max_seq_retries:
                tag = short_tag(part.last_tag) or f"partition {part.index}"
                cost = what.replace("{n}", str(part.deaths))
                return Failure(kind, f"stream partition {part.index} (last input {tag!r}) {cost}", seq_tag=tag)
        part.wid = None
        part.replay_until = part.fed - len(part.queue)
        part.replay.clear()
        part.replay_ticket = 0
        part.sent = 0
        part.in_credit = 0
        part.eof_sent = False
        return None

    def _assign(self, workers: Dict[bytes, WorkerState], out: List[Instruction], avoid: Optional[bytes] = None) -> None:
        if not workers:
            return
        for part in self.parts:
            if part.wid is not None or part.done:
                continue
            choices = [w for w in workers.values() if w.wid != avoid] or list(workers.values())
            w = min(choices, key=lambda w: (len(w.partitions), w.joined))
            part.wid = w.wid
            part.incarnation += 1
            w.partitions.add((self.run, part.index))
            part.in_credit = self.settings.buf_size
            out.append(
                ToWorker(
                    w.wid,
                    StreamOpen(
                        run=self.run,
                        partition=part.index,
                        skip=part.received,
                        credit=self.settings.buf_size,
                        incarnation=part.incarnation,
                    ),
                )
            )

    def owned(self, w: WorkerState, partition: int, incarnation: int) -> Optional[Partition]:
        """The partition, if `w` runs its current start (`incarnation`): else the message is stale."""
        if not 0 <= partition < len(self.parts):
            return None
        part = self.parts[partition]
        return part if part.wid == w.wid and part.incarnation == incarnation else None

    def acked(self, w: WorkerState, partition: int, incarnation: int, n: int) -> None:
        part = self.owned(w, partition, incarnation)
        if part is not None:
            part.in_credit += n

    def outputs_received(
        self,
        w: WorkerState,
        partition: int,
        incarnation: int,
        items: List[Item],
        bad: List[BadItem],
        workers: Dict[bytes, WorkerState],
        out: List[Instruction],
    ) -> Optional[Failure]:
        """Outputs arrive in stream order; a malformed one (or a gap) restarts the partition elsewhere."""
        part = self.owned(w, partition, incarnation)
        if part is None:
            return None
        broken = bool(bad)
        for item in items:
            if item.pos < part.received:
                continue  # a duplicate of an output already taken
            if item.pos > part.received or broken:
                broken = True  # a gap: something in between was lost
                break
            part.outputs.append((item, w.wid))
            part.received += 1
            w.done += 1
        if not broken:
            return None
        return self._take_back(w, part, "sent malformed outputs from {n} workers", workers, out)

    def _take_back(
        self,
        w: WorkerState,
        part: Partition,
        what: str,
        workers: Dict[bytes, WorkerState],
        out: List[Instruction],
        kind: FailureKind = FailureKind.MAPPER,
    ) -> Optional[Failure]:
        """`w` let the partition down: it restarts on another worker, charged."""
        failure = self._restart(part, what, counts=True, kind=kind)
        if failure is not None:
            return failure
        w.partitions.discard((self.run, part.index))
        out.append(ToWorker(w.wid, StreamClose(run=self.run, partition=part.index)))
        self._assign(workers, out, avoid=w.wid)
        return None

    def dropped(
        self,
        w: WorkerState,
        partition: Optional[int],
        reason: str,
        workers: Dict[bytes, WorkerState],
        out: List[Instruction],
    ) -> Optional[Failure]:
        """`w` dropped a message of the partition unread (None: of a partition of this run it runs):
        its stream misses what it carried, so it restarts elsewhere, charged; `max_seq_retries`
        such restarts without progress fail the run naming its last input."""
        mine = [p for run, p in sorted(w.partitions) if run == self.run]
        for p in mine if partition is None else [partition]:
            part = self.parts[p] if 0 <= p < len(self.parts) else None
            if part is None or part.wid != w.wid:
                continue  # not (or no longer) its partition
            what = f"could not be taken by {{n}} workers ({reason})"
            failure = self._take_back(w, part, what, workers, out, FailureKind.DATASET)
            if failure is not None:
                return failure
        return None

    def malformed_message(
        self, w: WorkerState, reason: str, workers: Dict[bytes, WorkerState], out: List[Instruction]
    ) -> Optional[Failure]:
        """A message from `w` did not decode: every partition it runs restarts elsewhere, charged."""
        for run, p in sorted(w.partitions):
            part = self.parts[p] if run == self.run else None
            if part is not None and part.wid == w.wid:
                failure = self.outputs_received(w, p, part.incarnation, [], [BadItem(None, reason)], workers, out)
                if failure is not None:
                    return failure
        return None

    def finished(self, w: WorkerState, partition: int, incarnation: int) -> None:
        part = self.owned(w, partition, incarnation)
        if part is None:
            return
        part.done = True
        part.wid = None
        part.queue.clear()
        part.replay.clear()
        w.partitions.discard((self.run, partition))

    # ---- dispatch -------------------------------------------------------------------------
    def dispatch(self, workers: Dict[bytes, WorkerState], out: List[Instruction]) -> None:
        n = len(self.parts)
        buf = self.settings.buf_size
        for part in self.parts:
            if part.wid is None:
                continue
            if part.replaying() and not part.replay and part.replay_ticket == 0:
                first = part.sent
                count = min(part.replay_until - first, max(part.in_credit, buf))
                self.tickets += 1
                part.replay_ticket = self.tickets
                out.append(
                    Replay(
                        self.run,
                        part.index,
                        [part.index + j * n for j in range(first, first + count)],
                        ticket=self.tickets,
                    )
                )
            batch: List[Item] = []
            while part.in_credit > 0:
                if part.replaying():
                    if not part.replay:
                        break
                    item = part.replay.popleft()
                elif part.queue:
                    item = part.queue.popleft()
                else:
                    break
                part.last_tag = item.seq_tag
                batch.append(item)
                part.sent += 1
                part.in_credit -= 1
            if batch:
                out.append(ToWorker(part.wid, StreamInputs(run=self.run, partition=part.index), batch))
            if self.feed_done and not part.eof_sent and part.sent >= part.fed and not part.queue:
                part.eof_sent = True
                out.append(ToWorker(part.wid, StreamEnd(run=self.run, partition=part.index)))

    # ---- delivery -------------------------------------------------------------------------
    def pop_next(self, out: List[Instruction], room: Callable[[int], bool]) -> Optional[Item]:
        """The next output of the round-robin merge, once it is known and its rank has room;
        `item.pos` becomes its position in the epoch."""
        n = len(self.parts)
        for _ in range(n):
            part = self.parts[self.rr]
            if part.outputs:
                if not room(self.released):
                    return None
                item, producer = part.outputs.popleft()
                item.pos = self.released
                if part.wid is not None and producer == part.wid:  # credit only for the owner's outputs
                    out.append(ToWorker(part.wid, StreamCredit(run=self.run, partition=part.index, n=1)))
                self.rr = (self.rr + 1) % n
                self.released += 1
                return item
            if not part.done:
                return None  # its next output decides what comes next
            self.rr = (self.rr + 1) % n
        return None

    def total(self) -> Optional[int]:
        if all(part.done and not part.outputs for part in self.parts):
            return self.released
        return None

    def close(self, workers: Dict[bytes, WorkerState]) -> None:
        for part in self.parts:
            if part.wid is not None and part.wid in workers:
                workers[part.wid].partitions.discard((self.run, part.index))
            part.wid = None
            part.queue.clear()
            part.outputs.clear()
            part.replay.clear()

    def queues(self) -> Dict[str, int]:
        return {
            "fed": self.fed,
            "waiting_for_worker": sum(len(p.queue) + len(p.replay) for p in self.parts),
            "in_flight": sum(1 for p in self.parts if p.wid is not None),
            "reorder_buffer": sum(len(p.outputs) for p in self.parts),
            "partitions_done": sum(1 for p in self.parts if p.done),
        }

"""Where seqs spend their time between the dataset and the trainer, as the server sees it.

The server's I/O thread calls these hooks as it hands events to the scheduler and performs
its instructions, with the time the scheduler's event carried; nothing here reads a clock.
Each stage sums seconds over seqs and counts the seqs:

- read: inside the dataset's get_seq (the reader thread measures it, see reader.py);
- wait_worker: an input read, not yet sent to a worker (none had room);
- mapper: inside the mappers, from the workers' heartbeats;
- transfer: a task sent until its result came back, less the mapper time: the network,
  (de)serialising and the time queued in the worker (map_seq only; approximate, since
  mapper time arrives with the next heartbeat);
- reorder: a result waiting for earlier seqs of the epoch (a slow or lost worker);
- wait_trainer: a result whose turn has come, waiting for its rank's credit.

Timestamps go into fixed rings indexed by a hash of (run, position), or of the item for
stream outputs (whose position changes on the way), so nothing is allocated per seq; a
collision only skews one seq's times. Counters grow per batch. In a job that batches, a
position is a batch: its seqs share its times, and what is counted after the workers
(transfer, reorder, wait_trainer, delivered) counts batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ppclient.protocol import Seqs, StreamInputs, Tasks
from ppserver.scheduler import Scheduler, ToClient, ToWorker
from ppserver.scheduler import events as ev

STAGES = ("read", "wait_worker", "mapper", "transfer", "reorder", "wait_trainer")
RING = 1 << 16
MASK = RING - 1
MAX_SERIES = 256  # label values kept per label (hosts, job/rank pairs); later ones count as "other"
UNKNOWN = math.inf  # a slot never stamped: its durations count as zero


@dataclass(slots=True)
class DirectLane:
    start: int
    rank: int  # the lane's index in its run
    width: int  # the run's lanes
    taken: int  # seqs the consumer said it took (from start)
    since: float  # when it last said so


def _salt(run: int) -> int:
    return (run * 0x9E3779B1) & MASK


class StageClock:
    def __init__(self, sched: Scheduler, reader: Any, *, stream: bool):
        self.sched = sched
        self.reader = reader  # its `seconds` and `calls` per dataset call
        self.stream = stream
        self.seconds: Dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self.seqs: Dict[str, int] = dict.fromkeys(STAGES, 0)
        self.worker_seconds = 0.0  # task sent -> result received, summed (map_seq)
        self.results = 0
        self._transfer = 0.0
        self.read_at: List[float] = [UNKNOWN] * RING
        self.sent_at: List[float] = [UNKNOWN] * RING
        self.got_at: List[float] = [UNKNOWN] * RING
        self.size_at: List[int] = [0] * RING  # direct results: bytes, from the worker's header
        self.prefix: Dict[int, float] = {}  # per run: when every seq up to the last one sent had arrived
        self.procs: Dict[bytes, Tuple[str, int]] = {}  # worker id -> (host, pid)
        self.beats: Dict[Tuple[str, int], Tuple[float, int]] = {}  # (host, pid) -> last (map_s, mapped)
        self.hosts: Dict[str, List[float]] = {}  # host -> [results, worker seconds, mapper seconds, mapped]
        self.delivered: Dict[Tuple[str, str], List[int]] = {}  # (job, rank) -> [seqs, bytes]
        self._by_consumer: Dict[bytes, List[int]] = {}
        self.run_delivered: Dict[int, int] = {}
        self.taken: Dict[Tuple[int, bytes], DirectLane] = {}  # direct lanes: what their credits said
        self.total_delivered = 0
        self._on = {
            ev.WorkerJoined: self._joined,
            ev.InputsRead: self._inputs,
            ev.ReplayRead: self._inputs,
            ev.ResultsReceived: self._results,
            ev.CompletedReceived: self._completed,
            ev.CreditGranted: self._credit,
            ev.StreamOutputsReceived: self._outputs,
        }

    # ---- hooks (the I/O thread) ---------------------------------------------------------------
    def on_event(self, event: ev.Event) -> None:
        """Before the scheduler handles the event (its instructions may send what arrived)."""
        hook = self._on.get(type(event))
        if hook is not None:
            hook(event)

    def to_worker(self, instr: ToWorker, now: float) -> None:
        msg = instr.msg
        if not isinstance(msg, (Tasks, StreamInputs)):
            return
        salt = _salt(msg.run)
        read_at, sent_at = self.read_at, self.sent_at
        waited = 0.0
        for item in instr.items:  # (the seqs of a batch share its position: its task's)
            k = (item.task + salt) & MASK
            t = now - read_at[k]
            if t > 0:
                waited += t
            sent_at[k] = now
        self.seconds["wait_worker"] += waited
        self.seqs["wait_worker"] += len(instr.items)

    def to_client(self, instr: ToClient, now: float) -> None:
        msg = instr.msg
        if not isinstance(msg, Seqs):
            return
        lane = self._lane(msg.run, instr.consumer)
        if lane is not None and lane.direct:
            return  # a direct consumer's seqs count when it says it took them (_credit)
        stream, salt = self.stream, _salt(msg.run)
        keys = [(id(item) >> 4) & MASK if stream else (item.pos + salt) & MASK for item in instr.items]
        self._delivered(msg.run, instr.consumer, keys, sum(item.nbytes for item in instr.items), [now] * len(keys))

    def _delivered(self, run: int, consumer: bytes, keys: List[int], nbytes: int, times: List[float]) -> None:
        """Seqs `keys` of `run` reached `consumer` at `times`, in their order."""
        got_at = self.got_at
        prefix = self.prefix.get(run, 0.0)
        credit = reorder = 0.0
        for k, now in zip(keys, times):
            got = got_at[k]
            if got > now:
                got = now
            if got > prefix:
                prefix = got  # every seq up to this one has arrived since then
            # Lanes report in their own order (a direct consumer's seqs are dated back over the
            # interval since its last credit), so another lane's may have moved the prefix past
            # this seq's time: then its whole wait after arriving counts as reorder.
            turn = prefix if prefix < now else now
            credit += now - turn
            reorder += turn - got
        n = len(keys)
        self.prefix[run] = prefix
        self.seconds["wait_trainer"] += credit
        self.seconds["reorder"] += reorder
        self.seqs["wait_trainer"] += n
        self.seqs["reorder"] += n
        slot = self._by_consumer.get(consumer)
        if slot is None:
            slot = self._slot(consumer)
        slot[0] += n
        slot[1] += nbytes
        self.run_delivered[run] = self.run_delivered.get(run, 0) + n
        self.total_delivered += n

    def heartbeat(self, wid: bytes, stats: Optional[Dict[str, Any]]) -> None:
        """A worker's cumulative mapper counters (see mapper_clock.py); what is new is added."""
        proc = self.procs.get(wid)
        if proc is None or not stats:
            return
        map_s, mapped = stats.get("map_s"), stats.get("mapped")
        if not isinstance(map_s, (int, float)) or not isinstance(mapped, int) or isinstance(mapped, bool):
            return
        if not (math.isfinite(map_s) and map_s >= 0 and mapped >= 0):
            return
        last_s, last_n = self.beats.get(proc, (0.0, 0))
        if map_s < last_s or mapped < last_n:
            last_s, last_n = 0.0, 0  # another process with that pid
        self.beats[proc] = (float(map_s), mapped)
        d_s, d_n = map_s - last_s, mapped - last_n
        self.seconds["mapper"] += d_s
        self.seqs["mapper"] += d_n
        host = self._host(proc[0])
        host[2] += d_s
        host[3] += d_n

    # ---- events ---------------------------------------------------------------------------------
    def _joined(self, e: ev.WorkerJoined) -> None:
        self.procs[e.wid] = (e.host, e.pid)

    def _inputs(self, e: Any) -> None:
        ring, salt, now = self.read_at, _salt(e.run), e.now
        for item in e.items:
            ring[(item.pos + salt) & MASK] = now

    def _results(self, e: ev.ResultsReceived) -> None:
        self._arrived(e.wid, e.run, [item.pos for item in e.items], e.now)

    def _completed(self, e: ev.CompletedReceived) -> None:
        """Results the worker sent to their consumers: "arrived", as far as the server can tell."""
        self._arrived(e.wid, e.run, e.positions, e.now)
        size_at, salt = self.size_at, _salt(e.run)
        for pos, nbytes in zip(e.positions, e.nbytes):
            size_at[(pos + salt) & MASK] = nbytes
        run = self.sched.state.runs.get(e.run)
        if run is not None and self.taken:
            for pos, nbytes in zip(e.positions, e.nbytes):  # taken before the server heard of it
                lane = run.lane_of(pos)
                consumer = lane.consumer if lane is not None else None
                if consumer is None:
                    continue
                taken = self.taken.get((e.run, consumer))
                if taken is not None and pos // run.width - taken.start < taken.taken:
                    size_at[(pos + salt) & MASK] = 0
                    slot = self._by_consumer.get(consumer)
                    if slot is not None:
                        slot[1] += nbytes

    def _credit(self, e: ev.CreditGranted) -> None:
        """A direct consumer's `consumed` count grew: those seqs were taken since its last credit.
        When exactly is not known; they are spread evenly over that interval, so a trainer that
        takes seqs as they come is not charged for the credit's cadence. The lane's shape is
        kept here, since the last credit may come after the run has ended."""
        if self.stream:
            return
        key = (e.run, e.consumer)
        lane = self.taken.get(key)
        if lane is None:
            found = self._lane(e.run, e.consumer)
            if found is None or not found.direct:
                return
            lane = self.taken[key] = DirectLane(found.start, found.index, self.sched.state.runs[e.run].width, 0, e.now)
        since, taken = lane.since, lane.taken
        lane.since = e.now
        consumed = min(e.consumed, taken + RING)  # a client's count is not trusted with memory
        if consumed <= taken:
            return
        lane.taken = consumed
        width, salt = lane.width, _salt(e.run)
        keys = [((lane.start + j) * width + lane.rank + salt) & MASK for j in range(taken, consumed)]
        size_at = self.size_at
        nbytes = 0
        for k in keys:
            nbytes += size_at[k]
            size_at[k] = 0  # a result whose header comes later adds its bytes then (_completed)
        n = len(keys)
        step = (e.now - since) / n
        self._delivered(e.run, e.consumer, keys, nbytes, [since + step * (i + 1) for i in range(n)])

    def _arrived(self, wid: bytes, run: int, positions: List[int], now: float) -> None:
        sent_at, got_at, salt = self.sent_at, self.got_at, _salt(run)
        busy = 0.0
        for pos in positions:
            k = (pos + salt) & MASK
            t = now - sent_at[k]
            if t > 0:
                busy += t
            got_at[k] = now
        self._received(wid, len(positions), busy)

    def _outputs(self, e: ev.StreamOutputsReceived) -> None:
        got_at, now = self.got_at, e.now
        for item in e.items:
            got_at[(id(item) >> 4) & MASK] = now
        self._received(e.wid, len(e.items), 0.0)

    def _received(self, wid: bytes, n: int, busy: float) -> None:
        self.worker_seconds += busy
        self.results += n
        proc = self.procs.get(wid)
        if proc is not None:
            host = self._host(proc[0])
            host[0] += n
            host[1] += busy

    def _lane(self, run_id: int, consumer: bytes) -> Any:
        run = self.sched.state.runs.get(run_id)
        if run is not None:
            for lane in run.lanes.values():
                if lane.consumer == consumer:
                    return lane
        return None

    # ---- labels ---------------------------------------------------------------------------------
    def _host(self, name: str) -> List[float]:
        host = self.hosts.get(name)
        if host is None:
            host = self.hosts.setdefault(name if len(self.hosts) < MAX_SERIES else "other", [0, 0.0, 0.0, 0])
        return host

    def _slot(self, consumer: bytes) -> List[int]:
        job = self.sched.state.job
        client = job.clients.get(consumer) if job is not None else None
        if job is None or client is None:
            label = ("", "")
        else:
            label = (job.name, str(job.reader_of(client.lane)[0]))
        if label not in self.delivered and len(self.delivered) >= MAX_SERIES:
            label = ("other", "other")
        slot = self.delivered.setdefault(label, [0, 0])
        if len(self._by_consumer) >= 4 * MAX_SERIES:
            self._by_consumer.clear()
        self._by_consumer[consumer] = slot
        return slot

    # ---- reading --------------------------------------------------------------------------------
    def prune(self, live_runs: Any) -> None:
        """Forget runs that ended and workers that left (called about once a second)."""
        for table in (self.prefix, self.run_delivered):
            for run in [r for r in table if r not in live_runs]:
                del table[run]
        latest = max((lane.since for lane in self.taken.values()), default=0.0)
        for key in [k for k, lane in self.taken.items() if k[0] not in live_runs and lane.since < latest - 30]:
            del self.taken[key]  # a final credit may come a little after its run ended
        workers = self.sched.state.workers
        for wid in [w for w in self.procs if w not in workers]:
            del self.procs[wid]
        alive = set(self.procs.values())
        for proc in [p for p in self.beats if p not in alive]:
            del self.beats[proc]

    def totals(self) -> Tuple[Dict[str, float], Dict[str, int]]:
        """Seconds and seqs per stage so far (they only grow)."""
        seconds, seqs = dict(self.seconds), dict(self.seqs)
        seconds["read"] = self.reader.seconds["get_seq"]
        seqs["read"] = self.reader.calls["get_seq"]
        if not self.stream:
            self._transfer = max(self._transfer, self.worker_seconds - self.seconds["mapper"])
            seconds["transfer"] = self._transfer
            seqs["transfer"] = self.results
        return seconds, seqs

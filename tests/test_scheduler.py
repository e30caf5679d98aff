"""The scheduler alone: scenarios as events in, instructions checked, no processes or sockets.

In the style of Dask's test_worker_state_machine.py: each test feeds a few events with the
time passed in and asserts on the instructions that come back. The property test at the end
plays random interleavings of results, deaths, joins, stalls and new epochs against a
simulated cluster and checks that every epoch that ends delivered each seq exactly once, in
order, with the bytes the mapper produced.
"""

from __future__ import annotations

import logging
from itertools import zip_longest
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Type

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppclient import protocol
from ppclient.protocol import BadItem, Item
from ppserver.scheduler import (
    MAX_READERS,
    Departure,
    InputPath,
    Instruction,
    Prepare,
    Read,
    Replay,
    Reply,
    RunState,
    Scheduler,
    Settings,
    StopReading,
    ToClient,
    ToWorker,
)
from ppserver.scheduler import events as ev
from ppserver.scheduler.dispatch import SeqQueues, StreamQueues
from ppserver.scheduler.jobs import ReadState
from ppserver.scheduler.status import RunStatus, SchedulerStatus
from ppserver.scheduler.story import Story
from ppserver.scheduler.streams import Partition, PartState
from ppserver.scheduler.workers import Isolation, WorkerState

pytestmark = pytest.mark.unit

CONSUMER = b"client-1"


# ---- helpers ----------------------------------------------------------------------------------
def item(pos: int, value: Optional[float] = None, tag: Optional[str] = None) -> Item:
    seq = {
        "data": np.full((2,), pos if value is None else value, dtype="float32"),
        "seq_tag": tag or f"s{pos}",
        "seq_idx": pos,
        "complete_frac": 0.0,
    }
    return protocol.seq_to_item(seq, pos)


def result(pos: int) -> Item:
    """What a worker's mapper makes of input `pos` in these tests: data * 10."""
    return item(pos, value=pos * 10.0)


def sent(out: Sequence[Instruction], kind: Type[protocol.Message], wid: Optional[bytes] = None) -> List[ToWorker]:
    return [i for i in out if isinstance(i, ToWorker) and isinstance(i.msg, kind) and (wid is None or i.wid == wid)]


def tasks(out: Sequence[Instruction], wid: Optional[bytes] = None) -> List[int]:
    return [it.pos for i in sent(out, protocol.Tasks, wid) for it in i.items]


def client_msgs(out: Sequence[Instruction], kind: Type[protocol.Message]) -> List[ToClient]:
    return [i for i in out if isinstance(i, ToClient) and isinstance(i.msg, kind)]


def delivered(out: Sequence[Instruction], consumer: Optional[bytes] = None) -> List[int]:
    return [it.pos for i in client_msgs(out, protocol.Seqs) if consumer in (None, i.consumer) for it in i.items]


def brief(instr: Instruction) -> Tuple[Any, ...]:
    """An instruction in a few words: to whom (a worker, a client, a requester) or for the reader,
    what (the message's kind), and the positions it carries, if any."""
    if isinstance(instr, (ToWorker, ToClient)):
        to = instr.wid if isinstance(instr, ToWorker) else instr.consumer
        return (to, instr.msg.kind, [it.pos for it in instr.items]) if instr.items else (to, instr.msg.kind)
    if isinstance(instr, Reply):
        return (instr.requester, instr.msg.kind)
    if isinstance(instr, Read):
        return ("read", instr.run, instr.positions)
    if isinstance(instr, Replay):
        return ("replay", instr.run, instr.partition, instr.positions)
    if isinstance(instr, Prepare):
        return ("prepare", instr.run, instr.epoch)
    if isinstance(instr, StopReading):
        return ("stop_reading", instr.run)
    raise AssertionError(f"no brief for {instr!r}")


def expect(out: Sequence[Instruction], *want: Tuple[Any, ...]) -> None:
    """`out` is exactly these instructions, in this order (as `brief` writes them): a stray one, a
    missing one or one out of order fails, as the type filters above would not."""
    assert [brief(i) for i in out] == list(want)


def refusal(out: Sequence[Instruction]) -> str:
    """The error of the one Reply in `out` (it must be a refusal)."""
    (reply,) = [i.msg for i in out if isinstance(i, Reply)]
    assert isinstance(reply, protocol.ErrorReply), reply
    return reply.error


def reads(out: Sequence[Instruction]) -> List[int]:
    return [p for i in out if isinstance(i, Read) for p in i.positions]


def status(sim: Sim) -> SchedulerStatus:
    return sim.s.status(sim.now)


def newest(sim: Sim) -> RunStatus:
    """The status of the newest run (there must be one)."""
    run = status(sim).newest
    assert run is not None
    return run


def suspects(sim: Sim) -> int:
    """The newest run's seqs charged with a worker's death, as status says (a map_seq run's)."""
    q = newest(sim).queues
    assert isinstance(q, SeqQueues)
    return q.suspects


def in_flight(sim: Sim) -> Dict[str, int]:
    """The workers, by name, and the tasks (and stream partitions) each holds, as status says."""
    return {w.id: w.in_flight for w in status(sim).workers}


class Sim:
    """A scheduler with a clock and shorthands for the events tests send. Strict: every seq's move
    is checked against its table, and every invariant after every event."""

    def __init__(self, **settings_kw):
        self.s = Scheduler(
            Settings(**{"buf_size": 2, "heartbeat_interval": 1.0, "heartbeat_timeout": 5.0, **settings_kw}),
            strict=True,
        )
        self.now = 0.0
        self.run = 0
        self.out: List[Instruction] = []
        self.fed: Set[Tuple[int, int]] = set()  # (run, pos) read

    def __call__(self, event_type, *args, **kw) -> List[Instruction]:
        out = self.s.handle(event_type(self.now, *args, **kw))
        self.s.validate()
        self.out.extend(out)
        return out

    def join(self, wid: bytes, pid: int = 1, **kw) -> List[Instruction]:
        return self(ev.WorkerJoined, wid, "host", pid, **kw)

    def request(self, epoch: int = 1, consumer: bytes = CONSUMER, **kw) -> Tuple[Optional[int], List[Instruction]]:
        """An epoch request; (the run it was given or None if refused, the instructions)."""
        out = self(ev.EpochRequested, b"req-" + consumer, consumer, epoch, **kw)
        replies = [i.msg for i in out if isinstance(i, Reply)]
        assert len(replies) == 1, out
        return getattr(replies[0], "run", None), out

    def start(
        self, num_seqs: int, epoch: int = 1, consumer: bytes = CONSUMER, credit: int = 100, **kw
    ) -> List[Instruction]:
        """Request, check, grant and start a new run (as the reader and a client would)."""
        run, out = self.request(epoch, consumer, **kw)
        assert run is not None, out
        self.run = run
        out += self(ev.RunChecked, run)
        out += self(ev.CreditGranted, consumer, run, credit)
        out += self(ev.RunStarted, run, epoch, num_seqs)
        return out

    def feed(self, positions, run: Optional[int] = None) -> List[Instruction]:
        run = run or self.run
        self.fed.update((run, p) for p in positions)
        return self(ev.InputsRead, run, [item(p) for p in positions])

    def results(
        self, wid: bytes, positions, run: Optional[int] = None, bad: Sequence[BadItem] = ()
    ) -> List[Instruction]:
        return self(ev.ResultsReceived, wid, run or self.run, [result(p) for p in positions], list(bad))


# ---- workers and liveness ------------------------------------------------------------------------
def test_join_opens_the_running_run_on_the_new_worker():
    sim = Sim()
    sim.start(4)
    out = sim.join(b"w1")
    expect(out, (b"w1", "run_open"))
    assert out[0].msg == protocol.RunOpen(run=1, epoch=1, check_tags=False)


def test_unknown_worker_is_told_so_and_nothing_else_happens():
    sim = Sim()
    out = sim(ev.HeartbeatReceived, b"ghost")
    assert out == [ToWorker(b"ghost", protocol.Unknown(), heartbeat=True)]
    out = sim(ev.ResultsReceived, b"ghost", 1, [result(0)], [])
    assert out == [ToWorker(b"ghost", protocol.Unknown())]
    assert sim(ev.WorkerLeft, b"ghost") == []


def test_heartbeats_and_expiry():
    sim = Sim(heartbeat_interval=1.0, heartbeat_timeout=3.0)
    sim.join(b"w1")
    sim.join(b"w2")
    out = sim(ev.Tick)
    assert {i.wid for i in out if isinstance(i, ToWorker) and i.heartbeat} == {b"w1", b"w2"}
    sim.now = 0.5
    assert sim(ev.Tick) == []  # not due yet
    sim.now = 2.0
    sim(ev.HeartbeatReceived, b"w1")
    sim.now = 3.5
    sim(ev.Tick)
    assert set(in_flight(sim)) == {"w1"}  # w2 silent for 3.5 s > 3 s
    assert status(sim).departures == {Departure.LOST: 1}


def test_a_worker_mapping_a_batch_shows_progress_in_the_keepalives_and_a_stuck_one_none():
    """Heartbeats say how many seqs of the task under way the worker mapped: more than it said last
    counts (the client takes it as progress); the same count, a task it does not hold, or one of
    another run does not."""
    sim = Sim()
    sim.join(b"w1")
    sim.start(4)
    sim.feed(range(4))
    assert tasks(sim.out, b"w1") == [0, 1]

    def mapped(*beats: Tuple[int, int, int]) -> int:
        for beat in beats:
            sim(ev.HeartbeatReceived, b"w1", beat)
        sim.now += 1.0
        return keepalive_to(sim(ev.Tick), CONSUMER).mapped

    run = sim.run
    assert mapped() == 0
    assert mapped((run, 0, 1), (run, 0, 2)) == 2
    assert mapped((run, 0, 2), (run, 0, 2)) == 2  # stuck: no more
    assert mapped((run, 3, 5), (run + 1, 0, 5)) == 2  # not its task, not a live run
    assert mapped((run, 1, 1)) == 3  # its next task
    sim.results(b"w1", [0, 1])
    assert mapped((run, 1, 4)) == 3  # done: no longer its task


def test_local_worker_exit_is_matched_by_index_and_pid():
    sim = Sim()
    sim.join(b"a", pid=11, local_index=0)
    sim.join(b"b", pid=12, local_index=1)
    sim.join(b"remote", pid=11)  # same pid on another host, not ours
    sim(ev.LocalWorkerExited, 0, 99, -9)  # a pid the index no longer has: nothing
    assert set(in_flight(sim)) == {"a", "b", "remote"}
    sim(ev.LocalWorkerExited, 0, 11, -9)
    assert set(in_flight(sim)) == {"b", "remote"}
    assert status(sim).departures == {Departure.EXITED: 1}


def test_reconnect_replaces_the_old_identity_and_redoes_its_work_at_once():
    sim = Sim(buf_size=2)
    sim.join(b"old", pid=7)
    sim.start(4)
    sim.feed(range(4))
    assert sorted(tasks(sim.out, b"old")) == [0, 1]
    out = sim.join(b"new", pid=7, replaces=b"old")
    expect(out, (b"new", "run_open"), (b"new", "tasks", [0]), (b"new", "tasks", [1]))
    assert in_flight(sim) == {"new": 2}
    assert status(sim).departures == {Departure.RECONNECTED: 1}
    assert sorted(tasks(out, b"new")) == [0, 1]  # both at once: not suspects (a reset is not a crash)
    assert suspects(sim) == 0


# ---- map_seq: credits, order, late results ------------------------------------------------------------
def test_credit_caps_in_flight_per_worker_and_delivery_per_client():
    sim = Sim(buf_size=3)
    sim.join(b"w1")
    out = sim.start(30, credit=4)
    slack = sim.s.state.settings.read_slack
    assert reads(out) == list(range(3 + slack))  # the workers' credit 3 + the reader's slack
    # buf_size 3, a message holding at most half of it
    expect(sim.feed(range(3 + slack)), (b"w1", "tasks", [0]), (b"w1", "tasks", [1]), (b"w1", "tasks", [2]))
    out = sim.results(b"w1", [0, 1, 2])
    expect(out, (b"w1", "tasks", [3]), (b"w1", "tasks", [4]), (b"w1", "tasks", [5]), (CONSUMER, "seqs", [0, 1, 2]))
    out = sim.results(b"w1", [3, 4, 5])  # the client granted 4
    expect(out, (b"w1", "tasks", [6]), (b"w1", "tasks", [7]), (b"w1", "tasks", [8]), (CONSUMER, "seqs", [3]))
    expect(sim(ev.CreditGranted, CONSUMER, 1, 10), (CONSUMER, "seqs", [4, 5]))


def test_the_reader_side_of_a_run_is_asked_accepted_open_then_stopped_and_told_to_stop_once():
    sim = Sim(buf_size=4)
    sim.join(b"w1")
    run, _ = sim.request()
    assert run is not None
    sim.run = run
    r = sim.s.state.runs[run]
    assert (r.reading, r.accepted) == (ReadState.ASKED, False)
    sim(ev.RunChecked, run)
    assert (r.reading, r.accepted) == (ReadState.ACCEPTED, True)
    sim(ev.CreditGranted, CONSUMER, run, 100)
    sim(ev.RunStarted, run, 1, 2)
    assert r.reading is ReadState.OPEN
    sim(ev.RunChecked, run)  # (a late word of the reader moves nothing back)
    assert r.reading is ReadState.OPEN
    out = sim.feed(range(2))  # every input read: the reader may move on
    expect(out, (b"w1", "tasks", [0, 1]), ("stop_reading", run))
    assert r.reading is ReadState.STOPPED
    out = sim.results(b"w1", [0, 1])  # the run ends: the reader is not told again
    expect(out, (CONSUMER, "seqs", [0, 1]), (CONSUMER, "end"), (b"w1", "run_close"))
    assert newest(sim).state is RunState.DONE
    with pytest.raises(AssertionError, match="reading stopped -> open is not a move"):
        r.open_reading()


def test_a_run_refused_while_it_prepares_stops_its_reading_once():
    sim = Sim()
    run, _ = sim.request()
    assert run is not None
    out = sim(ev.RunRejected, run, "no such epoch")
    expect(out, ("stop_reading", run))
    assert newest(sim).state is RunState.FAILED
    assert sim.s.state.last_run is not None and sim.s.state.last_run.reading is ReadState.STOPPED


def test_results_leave_in_order_whatever_order_they_arrive_in():
    sim = Sim(buf_size=4)
    sim.join(b"w1")
    sim.join(b"w2")
    sim.start(8)
    sim.feed(range(8))
    by_worker = {w: tasks(sim.out, w) for w in (b"w1", b"w2")}
    assert sorted(by_worker[b"w1"] + by_worker[b"w2"]) == list(range(8))
    first, second = (b"w1", b"w2") if 0 in by_worker[b"w2"] else (b"w2", b"w1")
    assert sim.results(first, by_worker[first]) == []  # seq 0 is still out
    out = sim.results(second, by_worker[second])
    expect(out, (CONSUMER, "seqs", list(range(8))), (CONSUMER, "end"), (b"w1", "run_close"), (b"w2", "run_close"))
    assert out[1].msg == protocol.End(run=1, count=8) and out[2].msg == protocol.RunClose(run=1)
    assert StopReading(1) in sim.out
    assert newest(sim).state is RunState.DONE


def direct_sim(num_seqs: int) -> Sim:
    """One worker, one client whose results come straight from the worker."""
    sim = Sim(buf_size=4)
    sim.join(b"w1")
    out = sim.start(num_seqs, direct="tcp://10.0.0.2:7000")
    routes = sent(out, protocol.ConsumerRoute, b"w1")
    assert routes and routes[0].msg.endpoint == "tcp://10.0.0.2:7000"
    return sim


def completed(sim: Sim, wid: bytes, positions: Sequence[int]) -> List[Instruction]:
    return sim(ev.CompletedReceived, wid, sim.run, list(positions), [8] * len(positions))


def test_direct_results_are_counted_not_sent_and_their_inputs_kept_until_taken():
    sim = direct_sim(6)
    sim.feed(range(6))
    assert all(t.msg.to == [CONSUMER] * len(t.items) for t in sent(sim.out, protocol.Tasks))
    out = completed(sim, b"w1", [0, 1, 2, 3])
    assert delivered(out) == []  # the client has them already
    assert tasks(out, b"w1") == [4, 5]
    assert sim.s.held_inputs(sim.run) == [0, 1, 2, 3, 4, 5]  # 4 and 5 in flight, the rest kept
    sim(ev.CreditGranted, CONSUMER, sim.run, 100, 3)  # it took 3
    assert sim.s.held_inputs(sim.run) == [3, 4, 5]
    assert sim(ev.MissingReported, CONSUMER, sim.run, 1) == []  # taken: nothing to make again
    out = sim(ev.MissingReported, CONSUMER, sim.run, 3)
    (redo,) = sent(out, protocol.Tasks, b"w1")
    assert [it.pos for it in redo.items] == [3] and redo.msg.to == []  # kept: made again, through the server


def test_a_direct_result_lost_after_the_end_is_made_again_and_relayed():
    sim = direct_sim(4)
    sim.feed(range(4))
    out = completed(sim, b"w1", [0, 1, 2, 3])
    assert client_msgs(out, protocol.End)[0].msg == protocol.End(run=sim.run, count=4)
    run = sim.run
    assert sent(sim.out, protocol.RunClose) == []  # every seq released, not yet taken: one may still be lost
    sim(ev.CreditGranted, CONSUMER, run, 100, 2)  # took 0 and 1; 2 never came
    out = sim(ev.MissingReported, CONSUMER, run, 2)
    assert tasks(out, b"w1") == [2]
    (redo,) = sent(out, protocol.Tasks, b"w1")
    assert not any(redo.msg.to)  # this time through the server
    out = sim.results(b"w1", [2])
    assert delivered(out, CONSUMER) == [2]
    sim.now += 1.5
    beat = sim(ev.Tick)
    assert client_msgs(beat, protocol.Keepalive)  # the client still hears the run live
    out = sim(ev.CreditGranted, CONSUMER, run, 100, 4)  # all taken: the run ends
    assert sent(out, protocol.RunClose, b"w1") and newest(sim).state is RunState.DONE


def test_workers_hear_whether_a_direct_consumer_closed_or_went_silent():
    """A client that closed takes no more blocks (its workers free those it never took); one that
    went silent may still be reading: only its exit frees them."""
    sim = direct_sim(4)
    out = sim(ev.ConsumerClosed, CONSUMER)
    assert [i.msg for i in sent(out, protocol.ConsumerGone, b"w1")] == [
        protocol.ConsumerGone(consumer=CONSUMER, closed=True)
    ]
    sim.start(4, epoch=2, consumer=b"client-2", direct="tcp://10.0.0.2:7001")
    sim.now += 31.0  # its timeout (30 s) without a keepalive
    sim(ev.HeartbeatReceived, b"w1")
    out = sim(ev.Tick)
    assert [i.msg for i in sent(out, protocol.ConsumerGone, b"w1")] == [
        protocol.ConsumerGone(consumer=b"client-2", closed=False)
    ]


def test_late_and_duplicate_results_are_dropped():
    sim = Sim(buf_size=2, heartbeat_timeout=2.0)
    sim.join(b"slow")
    sim.start(2)
    sim.feed(range(2))
    sim.join(b"fast")
    sim.now = 2.5
    sim(ev.HeartbeatReceived, b"fast")
    out = sim(ev.Tick)  # "slow" expires: its seqs are suspect and go to "fast" one at a time
    expect(out, (b"fast", "hb"), (CONSUMER, "keepalive"), (b"fast", "tasks", [0]))
    assert sim.results(b"slow", [0, 1]) == [ToWorker(b"slow", protocol.Unknown())]  # late: dropped
    out = sim.results(b"fast", [0, 0])  # a duplicate inside one message
    expect(out, (b"fast", "tasks", [1]), (CONSUMER, "seqs", [0]))
    out = sim.results(b"fast", [0, 1])  # a late duplicate of 0 with the result of 1
    expect(out, (CONSUMER, "seqs", [1]), (CONSUMER, "end"), (b"fast", "run_close"))
    assert delivered(sim.out) == [0, 1] and newest(sim).seqs_delivered == 2


def test_a_mapper_failure_fails_the_run_only_from_the_task_owner():
    sim = Sim(buf_size=1)
    sim.join(b"w1")
    sim.join(b"w2")
    sim.start(2)
    sim.feed(range(2))
    owner = {p: w for w in (b"w1", b"w2") for p in tasks(sim.out, w)}
    other = b"w1" if owner[0] == b"w2" else b"w2"
    assert sim(ev.TaskFailed, other, 1, 0, "s0", "boom", "tb") == []
    out = sim(ev.TaskFailed, owner[0], 1, 0, "s0", "boom", "tb")
    expect(out, (CONSUMER, "run_failed"), (b"w1", "run_close"), (b"w2", "run_close"))
    assert out[0].msg.seq_tag == "s0" and out[0].msg.failure == "mapper"


# ---- map_seq: crashes, suspects, blame ------------------------------------------------------------
def test_crash_makes_seqs_suspect_and_suspects_run_alone():
    sim = Sim(buf_size=4, max_seq_retries=3)
    sim.join(b"w1", pid=1, local_index=0)
    sim.join(b"w2", pid=2, local_index=1)
    sim.start(8)
    sim.feed(range(8))
    lost = tasks(sim.out, b"w1")
    out = sim(ev.LocalWorkerExited, 0, 1, -9)
    assert suspects(sim) == len(lost) == 4
    assert out == []  # w2 is busy: suspects wait for an idle worker
    out = sim.results(b"w2", tasks(sim.out, b"w2"))
    expect(out, (b"w2", "tasks", lost[:1]))  # one suspect, alone; nothing delivered (0 is a suspect)
    out = sim.results(b"w2", lost[:1])
    expect(out, (b"w2", "tasks", lost[1:2]), (CONSUMER, "seqs", [0]))  # and the next one, alone again


def test_a_seq_that_kills_max_seq_retries_workers_fails_the_run_naming_it():
    sim = Sim(buf_size=1, max_seq_retries=3)
    sim.start(3)
    sim.feed(range(3))
    for k in range(3):
        sim.join(b"w%d" % k, pid=k, local_index=k)
        assert tasks(sim.out, b"w%d" % k)[:1] == [0]
        out = sim(ev.LocalWorkerExited, k, k, -9)
    failed = client_msgs(out, protocol.RunFailed)
    assert len(failed) == 1 and failed[0].msg.seq_tag == "s0"
    assert "3 workers that died" in failed[0].msg.message


def test_departure_is_not_blamed():
    sim = Sim(buf_size=1, max_seq_retries=1)
    sim.join(b"w1")
    sim.start(2)
    sim.feed(range(2))
    sim(ev.WorkerLeft, b"w1")
    assert newest(sim).state is RunState.RUNNING and suspects(sim) == 0
    expect(sim.join(b"w2"), (b"w2", "run_open"), (b"w2", "tasks", [0]))


def test_a_retired_worker_gets_no_new_work_finishes_what_it_holds_and_is_told_to_exit():
    """Retiring is graceful: no new tasks from the moment the worker is chosen, nothing handed
    back, `retire` once it holds nothing, and its bye counts as retired."""
    sim = Sim(buf_size=2)
    sim.join(b"w1")
    sim.join(b"w2")
    sim.start(8)
    out = sim.feed(range(4))
    held = set(tasks(out, b"w1"))
    assert held and set(tasks(out, b"w2"))
    out = sim(ev.RetireWorker, b"w1")
    assert sent(out, protocol.Retire) == []  # it still holds tasks
    out = sim.feed(range(4, 8))
    assert tasks(out, b"w1") == []
    out = sim.results(b"w1", sorted(held)[:1])
    assert sent(out, protocol.Retire) == [] and tasks(out, b"w1") == []
    out = sim.results(b"w1", sorted(held)[1:])
    assert [i.wid for i in sent(out, protocol.Retire)] == [b"w1"]
    assert sent(sim(ev.Tick), protocol.Retire) == []  # told once
    sim(ev.WorkerLeft, b"w1")
    st = status(sim)
    assert st.departures == {Departure.RETIRED: 1} and st.handed_back == 0
    assert [w.id for w in st.workers] == ["w2"]


def test_a_worker_retired_while_idle_is_told_at_once_and_its_exit_is_no_crash():
    sim = Sim(buf_size=2)
    sim.join(b"w1", local_index=0, pid=7)
    sim.join(b"w2", local_index=1, pid=8)
    out = sim(ev.RetireWorker, b"w2")
    assert [i.wid for i in sent(out, protocol.Retire)] == [b"w2"]
    sim(ev.LocalWorkerExited, 1, 8, 3)  # its exit came before its bye
    assert status(sim).departures == {Departure.RETIRED: 1}


def test_a_retiring_worker_gets_no_stream_partition_and_leaves_when_its_own_are_done():
    sim = stream_sim(buf_size=2)
    sim.join(b"w1")
    sim.join(b"w2")
    out = sim.start(10)
    assert sorted((i.wid, i.msg.partition) for i in sent(out, protocol.StreamOpen)) == [(b"w1", 0), (b"w2", 1)]
    sim(ev.RetireWorker, b"w1")
    sim.join(b"w3")
    out = sim(ev.WorkerLeft, b"w2")  # partition 1 moves: not to the retiring w1
    assert [(i.wid, i.msg.partition) for i in sent(out, protocol.StreamOpen)] == [(b"w3", 1)]
    out = sim(ev.StreamFinished, b"w1", sim.run, 0, 1)
    assert [i.wid for i in sent(out, protocol.Retire)] == [b"w1"]


def test_malformed_result_is_redone_on_another_worker_then_fails_after_retries():
    sim = Sim(buf_size=1, max_seq_retries=2)
    sim.join(b"bad")
    sim.start(2)
    sim.feed(range(2))
    assert tasks(sim.out, b"bad") == [0]
    sim.join(b"good")
    assert tasks(sim.out, b"good") == [1]
    out = sim.results(b"bad", [], bad=[BadItem(0, "meta is not a map")])
    assert out == []  # "good" is busy; 0 waits for it rather than going back to "bad"
    expect(sim.results(b"good", [1]), (b"good", "tasks", [0]))  # 1 waits for 0 before it is delivered
    assert status(sim).malformed_results == 1
    out = sim.results(b"good", [], bad=[BadItem(0, "bytes do not fit")])
    expect(out, (CONSUMER, "run_failed"), (b"bad", "run_close"), (b"good", "run_close"))
    assert out[0].msg.message.startswith("seq 's0': 2 malformed results")


def test_undecodable_message_charges_every_seq_its_worker_holds():
    sim = Sim(buf_size=2, max_seq_retries=2)
    sim.join(b"bad")
    sim.start(4)
    sim.feed(range(4))
    sim.join(b"good")
    assert sorted(tasks(sim.out, b"bad")) == [0, 1] and sorted(tasks(sim.out, b"good")) == [2, 3]
    out = sim(ev.WorkerMessageMalformed, b"bad", "header of 2000122 bytes exceeds 1048576")
    assert out == [] and status(sim).malformed_results == 1  # "good" is busy: 0 and 1 wait for it
    assert in_flight(sim)["bad"] == 0
    expect(sim.results(b"good", [2, 3]), (b"good", "tasks", [0]), (b"good", "tasks", [1]))
    assert sim.results(b"bad", [0]) == []  # a late result of a seq handed over: dropped
    out = sim.results(b"good", [0, 1])
    expect(out, (CONSUMER, "seqs", [0, 1, 2, 3]), (CONSUMER, "end"), (b"bad", "run_close"), (b"good", "run_close"))
    assert out[1].msg.count == 4
    assert sim(ev.WorkerMessageMalformed, b"good", "junk") == []  # it held nothing
    assert status(sim).malformed_results == 1


def test_undecodable_messages_fail_the_seq_after_retries_naming_it():
    sim = Sim(buf_size=1, max_seq_retries=2)
    sim.join(b"only")
    sim.start(2)
    sim.feed(range(2))
    sim(ev.WorkerMessageMalformed, b"only", "undecodable header")
    assert tasks(sim.out, b"only") == [0, 0]  # no other worker: redone on the same one
    out = sim(ev.WorkerMessageMalformed, b"only", "undecodable header")
    (failed,) = client_msgs(out, protocol.RunFailed)
    assert failed.msg.seq_tag == "s0" and failed.msg.message == "seq 's0': 2 malformed results (undecodable header)"


def dropped(
    sim: Sim, wid: bytes, what: Optional[str], carried: ev.Carried, run: Optional[int], reason: str, **kw
) -> List[Instruction]:
    """`wid` dropped a message of kind `what` that carried `carried` (as the server tells it)."""
    return sim(ev.MessageDropped, wid, what, carried, run, reason=reason, **kw)


TASKS, STREAM, NOTHING, UNKNOWN = ev.Carried.TASKS, ev.Carried.STREAM, ev.Carried.NOTHING, ev.Carried.UNKNOWN


def test_tasks_a_worker_dropped_go_elsewhere_and_fail_the_seq_after_retries_naming_it():
    sim = Sim(buf_size=2, max_seq_retries=3)
    sim.join(b"a")
    sim.start(4)
    huge = "x" * 100_000
    sim(ev.InputsRead, sim.run, [item(0), item(1, tag=huge), item(2), item(3)])
    sim.join(b"b")
    assert sorted(tasks(sim.out, b"a")) == [0, 1] and sorted(tasks(sim.out, b"b")) == [2, 3]
    why = "header of 2000076 bytes exceeds 1048576"
    out = dropped(sim, b"a", "tasks", TASKS, sim.run, why, positions=[1])
    assert tasks(out) == [] and status(sim).dropped_by_workers == 1  # "b" is busy: 1 waits for it, not "a"
    out = sim.results(b"b", [2, 3])
    assert tasks(out, b"b") == [1]
    out = dropped(sim, b"b", "tasks", TASKS, sim.run, why, positions=[1])
    assert tasks(out, b"a") == [1]  # "a" has room again, and is not the one that dropped it last
    out = dropped(sim, b"a", "tasks", TASKS, sim.run, why, positions=[1])
    (failed,) = client_msgs(out, protocol.RunFailed)
    assert failed.msg.failure == "dataset"
    tag = protocol.short_tag(huge)
    assert tag is not None and len(tag) < 300 and failed.msg.seq_tag == tag
    assert failed.msg.message == f"seq {tag!r} (position 1): 3 workers could not take its input ({why})"


def test_a_message_a_worker_could_not_read_charges_what_it_holds_and_one_without_work_nothing(caplog):
    sim = Sim(buf_size=2)
    sim.join(b"a")
    sim.start(4)
    sim.feed(range(4))
    sim.join(b"b")
    before = list(sim.out)
    for what in ("route", "consumer_gone", "run_close"):  # they carried no work: nothing to redo
        assert dropped(sim, b"a", what, NOTHING, None, "junk") == []
    assert dropped(sim, b"a", "tasks", TASKS, sim.run + 7, "junk", positions=[0]) == []  # not a live run
    assert sim.out == before and status(sim).dropped_by_workers == 4
    with caplog.at_level(logging.WARNING, logger="ppserver.scheduler"):
        dropped(sim, b"a", None, UNKNOWN, None, "undecodable header")  # which? everything of "a"
    assert "worker a dropped a unreadable message from the server: undecodable header" in caplog.messages
    assert in_flight(sim)["a"] == 0
    out = sim.results(b"b", [2, 3])
    assert sorted(tasks(out, b"b")) == [0, 1]  # redone on "b"
    dropped(sim, b"b", "tasks", TASKS, sim.run, "an item without a position")  # every task of the run
    assert in_flight(sim)["b"] == 0
    assert sorted(tasks(sim.out, b"a")[-2:]) == [0, 1]


def test_a_stream_message_a_worker_dropped_restarts_its_partition_elsewhere():
    sim = stream_sim(buf_size=2, partitions=2, max_seq_retries=2)
    sim.join(b"a")
    sim.join(b"b")
    sim.start(4)
    sim.feed(range(4))
    owner = {i.msg.partition: i.wid for i in sent(sim.out, protocol.StreamOpen)}
    other = b"b" if owner[1] == b"a" else b"a"
    why = "header of 2000076 bytes exceeds 1048576"
    out = dropped(sim, owner[1], "stream_inputs", STREAM, 1, why, partition=1)
    expect(out, (owner[1], "stream_close"), (other, "stream_open"), ("replay", 1, 1, [1, 3]))
    assert out[0].msg == protocol.StreamClose(run=1, partition=1) and out[1].msg.partition == 1
    assert dropped(sim, owner[1], "stream_inputs", STREAM, 1, "late", partition=1) == []  # not its partition now
    out = dropped(sim, other, "stream_inputs", STREAM, 1, why, partition=1)
    expect(out, (CONSUMER, "run_failed"), ("stop_reading", 1), (b"a", "run_close"), (b"b", "run_close"))
    failed = out[0]
    assert failed.msg.failure == "dataset"
    assert failed.msg.message == f"stream partition 1 (last input 's3') could not be taken by 2 workers ({why})"


def test_a_message_of_the_other_mapper_style_is_nothing_to_a_run():
    """A map_seq run takes no stream message, a stream run no map_seq one (a worker of another
    config, or a late word): nothing changes, nothing is sent, the run goes on."""
    sim = Sim(buf_size=2)
    sim.join(b"a")
    sim.start(4)
    sim.feed(range(4))
    run = sim.run
    held = in_flight(sim)
    for event, *args in (
        (ev.StreamAcked, b"a", run, 0, 1, 1),
        (ev.StreamOutputsReceived, b"a", run, 0, 1, [item(0)], []),
        (ev.StreamFinished, b"a", run, 0, 1),
        (ev.StreamFailed, b"a", run, 0, 1, "s0", "boom", ""),
        (ev.MessageDropped, b"a", "stream_inputs", STREAM, run, 0, [], "junk"),
    ):
        assert sim(event, *args) == []
    assert in_flight(sim) == held and sim.s.state.runs[run].live

    sim = stream_sim(buf_size=2, partitions=1)
    sim.join(b"a")
    sim.start(4)
    sim.feed(range(2))
    run = sim.run
    for event, *args in (
        (ev.ResultsReceived, b"a", run, [result(0)], []),
        (ev.CompletedReceived, b"a", run, [0], [10]),
        (ev.InputsLost, b"a", run, [0], "gone"),
        (ev.TaskFailed, b"a", run, 0, "s0", "boom", ""),
        (ev.MessageDropped, b"a", "tasks", TASKS, run, None, [0], "junk"),
    ):
        assert sim(event, *args) == []
    assert sim.s.state.runs[run].live and status(sim).lost_inputs == 0
    expect(outputs(sim, b"a", 0, [0]), (b"a", "stream_credit"), (CONSUMER, "seqs", [0]))


def test_a_stream_partition_moves_only_along_its_table_keeping_its_owners_set_and_its_story():
    story = Story(20)
    part = Partition(0, 1, story)
    w, v = (WorkerState(wid, "host", 1, None, 2, 0.0, 0.0) for wid in (b"w", b"v"))
    with pytest.raises(AssertionError, match="stream partition 0: unowned -> done is not a move"):
        part.finish(w)
    part.open(w, 2)
    assert (part.state, part.wid, part.incarnation, w.partitions) == (PartState.OWNED, b"w", 1, {(1, 0)})
    with pytest.raises(AssertionError, match="owned -> owned is not a move"):
        part.open(v, 2)
    assert v.partitions == set()
    assert [part.charge(), part.charge()] == [1, 2]  # no output in between: its fault
    part.received += 1
    assert part.charge() == 1  # progress since: the count starts again
    with pytest.raises(AssertionError, match="owned by b'w', not b'v'"):
        part.disown(v, let_down=False)
    part.disown(w, let_down=True)
    assert (part.state, part.wid, part.avoid, w.partitions) == (PartState.UNOWNED, None, b"w", set())
    part.wid = b"w"
    with pytest.raises(AssertionError, match="unowned, owner b'w'"):
        part.validate({})
    part.wid = None
    part.open(v, 2)
    assert (part.avoid, v.partitions) == (None, {(1, 0)})
    part.finish(v)
    assert (part.state, part.wid, part.incarnation, v.partitions) == (PartState.DONE, None, 2, set())
    part.validate({})
    for move in (lambda: part.disown(v, let_down=False), lambda: part.open(w, 2)):
        with pytest.raises(AssertionError, match="done -> "):
            move()
    assert w.partitions == v.partitions == set()
    assert [(e.key, e.run, e.from_, e.to, e.worker, e.note) for e in story.select([("partition", 0)])[0]] == [
        (0, 1, "unowned", "owned", "w", "start 1"),
        (0, 1, "owned", "unowned", "w", ""),
        (0, 1, "unowned", "owned", "v", "start 2"),
        (0, 1, "owned", "done", "v", ""),
    ]


# ---- runs: preparing, superseding, refusing -----------------------------------------------------
def test_started_and_failures_wait_for_the_data_socket():
    sim = Sim()
    run, _ = sim.request(3)
    out = sim(ev.RunRejected, run, "unknown seq tag 'x'")
    expect(out, ("stop_reading", run))  # no run_failed: the client has not connected yet
    out = sim(ev.CreditGranted, CONSUMER, run, 32)
    expect(out, (CONSUMER, "run_failed"))
    assert out[0].msg.failure == "request" and "unknown seq tag" in out[0].msg.message


def test_new_run_supersedes_the_old_one_once_checked_not_at_request():
    sim = Sim(buf_size=2)
    sim.join(b"w1")
    sim.start(10, epoch=1)
    sim.feed(range(4))
    run2, out = sim.request(2, consumer=b"client-2")
    assert Prepare(run2, 2) in out and StopReading(1) not in sim.out  # still running while run 2 is checked
    assert sim(ev.CreditGranted, b"client-2", run2, 32) == []
    out = sim(ev.RunChecked, run2)
    expect(out, (CONSUMER, "superseded"), ("stop_reading", 1), (b"w1", "run_close"))
    assert out[0].msg == protocol.Superseded(run=1, epoch=2) and out[2].msg == protocol.RunClose(run=1)
    assert in_flight(sim) == {"w1": 0}  # run 1's slots are free for run 2
    out = sim(ev.RunStarted, run2, 2, 5)
    expect(out, (b"client-2", "started"), (b"w1", "run_open"), ("read", run2, [0, 1, 2, 3, 4]))
    assert out[0].msg == protocol.Started(run=run2, num_seqs=5)
    assert sim.results(b"w1", [0, 1], run=1) == []  # late: of a run that ended


def test_a_refused_request_leaves_the_running_epoch_alone():
    sim = Sim(buf_size=2)
    sim.join(b"w1")
    sim.start(10, epoch=1)
    sim.feed(range(4))
    run2, _ = sim.request(2, consumer=b"client-2")
    out = sim(ev.RunRejected, run2, "unknown seq tag 'nope'")
    expect(out, ("stop_reading", run2))  # only the refused run stops
    out = sim.results(b"w1", [0, 1], run=1)
    expect(out, (b"w1", "tasks", [2]), (b"w1", "tasks", [3]), (CONSUMER, "seqs", [0, 1]))


def test_keepalives_say_what_the_run_waits_for():
    sim = Sim()
    run, _ = sim.request(1)
    sim(ev.CreditGranted, CONSUMER, run, 32)
    out = sim(ev.Tick, reader_busy="in init_seq_order(epoch=1) for 4.0 s")
    alive = client_msgs(out, protocol.Keepalive)[0].msg
    assert alive.waiting_for == "the dataset to set up the epoch (in init_seq_order(epoch=1) for 4.0 s)"
    assert alive.workers == 0
    sim.now = 1.0
    alive = client_msgs(sim(ev.Tick), protocol.Keepalive)[0].msg  # the reader's call is over (or short)
    assert alive.waiting_for == "the dataset to set up the epoch"
    sim(ev.RunStarted, run, 1, 3)
    sim.now = 2.0
    assert "none is connected" in client_msgs(sim(ev.Tick), protocol.Keepalive)[0].msg.waiting_for


def test_read_failure_fails_the_run():
    sim = Sim()
    sim.start(5)
    out = sim(ev.ReadFailed, 1, "dataset failed: disk gone", "tb")
    expect(out, (CONSUMER, "run_failed"), ("stop_reading", 1))
    assert out[0].msg.failure == "dataset"


def test_empty_epoch_ends_at_once():
    sim = Sim()
    out = sim.start(0)
    expect(out[-3:], (CONSUMER, "started"), (CONSUMER, "end"), ("stop_reading", 1))  # after the request's
    assert out[-2].msg == protocol.End(run=1, count=0)


# ---- jobs and ranks -----------------------------------------------------------------------------------
def ranks_sim(
    world: int, num_seqs: Optional[int], drop_last: bool = True, credit: int = 100, timeout: float = 30.0, **kw
) -> Sim:
    """W ranks of job "train" on one 2-worker scheduler, all of them started on epoch 1."""
    sim = Sim(**{"buf_size": 4, **kw})
    sim.join(b"w1")
    sim.join(b"w2")
    for rank in range(world):
        run, _ = sim.request(
            1, consumer=b"r%d" % rank, job="train", rank=rank, world_size=world, drop_last=drop_last, timeout=timeout
        )
        sim(ev.CreditGranted, b"r%d" % rank, run, credit)
        if rank == 0:
            sim.run = run
            sim(ev.RunChecked, run)
            sim(ev.RunStarted, run, 1, num_seqs)
        assert run == sim.run  # every rank joins the one run of the epoch
    return sim


def finish(sim: Sim, run: int, count: Optional[int] = None) -> None:
    """Workers answer every task of `run` and the reader reads its positions (those below `count`,
    the epoch's inputs, when it said so), until nothing changes."""
    done = sim.__dict__.setdefault("_done", set())
    for _ in range(1000):
        before = len(sim.out)
        asked = [p for i in sim.out if isinstance(i, Read) and i.run == run for p in i.positions]
        todo = [p for p in asked if (run, p) not in sim.fed and (count is None or p < count)]
        if todo:
            sim.feed(todo, run=run)
        for wid in (b"w1", b"w2"):
            mine = [it.pos for i in sent(sim.out, protocol.Tasks, wid) if i.msg.run == run for it in i.items]
            pending = [p for p in mine if (run, wid, p) not in done]
            done.update((run, wid, p) for p in pending)
            if pending:
                sim.results(wid, pending, run=run)
        if len(sim.out) == before:
            return


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [True, False])
def test_ranks_get_strided_shards_of_one_run(world, drop_last):
    n = 22
    sim = ranks_sim(world, n, drop_last=drop_last)
    finish(sim, sim.run)
    shards = {r: delivered(sim.out, b"r%d" % r) for r in range(world)}
    end = n // world * world if drop_last else n
    for r in range(world):
        assert shards[r] == list(range(r, end, world))
    started = {i.consumer: i.msg.num_seqs for i in client_msgs(sim.out, protocol.Started)}
    assert started == {b"r%d" % r: len(shards[r]) for r in range(world)}
    ends = {i.consumer: i.msg.count for i in client_msgs(sim.out, protocol.End)}
    assert ends == {b"r%d" % r: len(shards[r]) for r in range(world)}
    assert sorted(p for ps in shards.values() for p in ps) == list(range(end))
    assert set(reads(sim.out)) == set(range(end))  # the dropped remainder is never read


def test_a_slow_rank_holds_the_others_back_only_by_its_window():
    sim = ranks_sim(2, 40, credit=0)
    sim(ev.CreditGranted, b"r0", 1, 40)
    sim(ev.CreditGranted, b"r1", 1, 3)  # rank 1 takes only 3
    finish(sim, 1)
    assert delivered(sim.out, b"r1") == [1, 3, 5]
    # rank 0 got what was released before rank 1's fourth seq; the reader stopped a window later
    assert delivered(sim.out, b"r0") == [0, 2, 4, 6]
    assert max(reads(sim.out)) < 7 + 2 * 4 + sim.s.state.settings.read_slack
    sim(ev.CreditGranted, b"r1", 1, 20)
    finish(sim, 1)
    assert delivered(sim.out, b"r0") == list(range(0, 40, 2))
    assert delivered(sim.out, b"r1") == list(range(1, 40, 2))


def test_another_job_is_refused_while_a_client_of_this_one_lives():
    sim = ranks_sim(2, 10)
    run, out = sim.request(1, consumer=b"other", job="eval", world_size=1)
    assert run is None and "job 'train' is running with 2 live clients" in refusal(out)
    assert "a request of job 'eval' must wait until they are gone" in refusal(out)
    assert "silent for their client timeout of 30 s" in refusal(out)
    assert [i.msg.reason for i in out] == [
        protocol.RefusalReason.JOB.value
    ]  # a conflict with the job: the client asks again for a moment
    run, out = sim.request(1, consumer=b"x", job="train", rank=0, world_size=4)
    assert run is None and "this request of job 'train' conflicts" in refusal(out)  # the same job, not another
    assert "world_size 4, where the job has world_size 2" in refusal(out)
    sim(ev.ConsumerClosed, b"r0")
    sim.now = 100.0  # r1 went silent long ago (its timeout is 30 s)
    sim(ev.Tick)
    run, out = sim.request(1, consumer=b"other", job="eval", world_size=1)
    assert run is not None and status(sim).job.name == "eval"


def test_a_job_of_more_readers_than_max_readers_is_refused_at_once_and_a_running_epoch_goes_on():
    sim = Sim(buf_size=4)
    sim.join(b"w1")
    for world, parts in [(MAX_READERS + 1, 1), (MAX_READERS // 4, 8), (10**12, 1)]:
        run, out = sim.request(1, consumer=b"big", job="big", world_size=world, subshards=parts)
        assert run is None and out == [
            Reply(b"req-big", protocol.ErrorReply(error=refusal(out), reason=protocol.RefusalReason.REQUEST.value))
        ]
        assert f"above the {MAX_READERS}" in refusal(out) and f"{world * parts} " in refusal(out) + " "
        assert status(sim).job is None  # nothing was made for it
    sim.start(8)
    sim.feed(range(4))
    assert delivered(sim.results(b"w1", [0, 1])) == [0, 1]
    # a request of the running job's name: refused for its size, before it could conflict with the job
    run, out = sim.request(1, consumer=b"big", world_size=MAX_READERS * 2)
    assert run is None and len(out) == 1 and f"world_size {MAX_READERS * 2} is above the" in refusal(out)
    assert delivered(sim.results(b"w1", [2, 3])) == [2, 3]
    job = status(sim).job
    assert job is not None and job.world_size == 1 and job.clients == 1 and status(sim).ranks[0].rank == 0


def test_a_job_of_max_readers_has_state_only_for_the_readers_that_came():
    sim = Sim(buf_size=4)
    sim.join(b"w1")
    sim.join(b"w2")
    world, parts = MAX_READERS // 4, 4

    def come(rank: int, part: int) -> int:
        consumer = b"r%d-s%d" % (rank, part)
        run, _ = sim.request(
            1, consumer=consumer, job="big", rank=rank, world_size=world, subshard=part, subshards=parts
        )
        assert run is not None
        sim(ev.CreditGranted, consumer, run, 100)
        return run

    sim.run = run = come(0, 0)
    sim(ev.RunChecked, run)
    sim(ev.RunStarted, run, 1, 3 * MAX_READERS)
    assert come(1, 0) == run
    finish(sim, run)
    # positions 0 and 1 went to their readers; position 2's reader has not come, so the release waits
    # there, and the reader read a window ahead, not the epoch
    assert delivered(sim.out, b"r0-s0") == [0] and delivered(sim.out, b"r1-s0") == [1]
    assert max(reads(sim.out)) < 64
    assert sim.s.lanes(run) == {0: "reading", 1: "reading"}
    sim.now = 1.0
    alive = keepalive_to(sim(ev.Tick), b"r0-s0")
    assert "rank(s) 2, 3, 4, 5, 6, 7, 8, 9 of job 'big' to connect" in alive.waiting_for
    # the last reader of the last rank comes; its lane is the only one more with state
    last = come(world - 1, parts - 1)
    assert last == run and sim.s.lanes(run) == {0: "reading", 1: "reading", MAX_READERS - 1: "reading"}
    # the readers leave: the job's state goes with them, and a job of one reader runs at once
    for consumer in (b"r0-s0", b"r1-s0", b"r%d-s%d" % (world - 1, parts - 1)):
        sim(ev.ConsumerClosed, consumer)
    assert sim.s.lanes(run) == {0: "gone", 1: "gone", MAX_READERS - 1: "gone"}
    out = sim.start(4, consumer=b"small", job="small")
    assert client_msgs(out, protocol.Superseded) == [] and status(sim).job.name == "small"
    finish(sim, sim.run)
    assert delivered(sim.out, b"small") == [0, 1, 2, 3]


def test_a_solo_run_of_one_of_max_readers_lanes_reads_only_its_positions():
    sim = Sim(buf_size=4)
    sim.join(b"w1")
    sim.join(b"w2")
    kw = dict(job="big", world_size=MAX_READERS)
    run, _ = sim.request(1, consumer=b"r0", rank=0, **kw)
    sim(ev.CreditGranted, b"r0", run, 100)
    run1, _ = sim.request(1, consumer=b"r1", rank=1, **kw)
    sim(ev.CreditGranted, b"r1", run1, 100)
    sim.run = run
    sim(ev.RunChecked, run)
    sim(ev.RunStarted, run, 1, 4 * MAX_READERS)
    finish(sim, run)
    assert delivered(sim.out, b"r0") == [0] and delivered(sim.out, b"r1") == [1]
    # rank 0 restarts from the start of its shard, behind what was released to it: a solo run
    solo, _ = sim.request(1, consumer=b"r0b", rank=0, **kw)
    assert solo != run
    sim(ev.CreditGranted, b"r0b", solo, 100)
    sim(ev.RunChecked, solo)
    sim(ev.RunStarted, solo, 1, 4 * MAX_READERS)
    finish(sim, solo)
    shard = list(range(0, 4 * MAX_READERS, MAX_READERS))
    assert delivered(sim.out, b"r0b") == shard
    assert [(i.consumer, i.msg.count) for i in client_msgs(sim.out, protocol.End)] == [(b"r0b", 4)]
    assert sorted(p for i in sim.out if isinstance(i, Read) and i.run == solo for p in i.positions) == shard


def test_keepalives_keep_a_busy_client_alive():
    sim = ranks_sim(1, 10, timeout=2.0)
    for t in range(1, 10):
        sim.now = float(t)
        sim(ev.ConsumerAlive, b"r0")
        sim(ev.Tick)
    assert status(sim).job.clients == 1
    sim.now = 12.5
    out = sim(ev.Tick)
    expect(out, ("stop_reading", 1))  # the client is gone: no message to it
    assert status(sim).job.clients == 0 and newest(sim).state is RunState.SUPERSEDED


def test_a_rank_ahead_by_an_epoch_waits_and_disturbs_no_one():
    sim = ranks_sim(2, 8, credit=0)
    sim(ev.CreditGranted, b"r0", 1, 100)
    sim(ev.CreditGranted, b"r1", 1, 3)
    finish(sim, 1)
    assert delivered(sim.out, b"r0") == [0, 2, 4, 6] and delivered(sim.out, b"r1") == [1, 3, 5]
    assert [i.consumer for i in client_msgs(sim.out, protocol.End)] == [b"r0"]
    run2, out = sim.request(2, consumer=b"r0", job="train", rank=0, world_size=2)
    assert Prepare(run2, 2) in out and sim.s.lanes(1) == {0: "done", 1: "reading"}  # epoch 1 lives on for rank 1
    out = sim(ev.RunChecked, run2)
    assert client_msgs(out, protocol.Superseded) == []  # rank 0 had finished epoch 1
    assert StopReading(1) in sim.out  # epoch 1 is read: the reader may set up epoch 2
    _, out = sim.request(4, consumer=b"r1", job="train", rank=1, world_size=2)
    assert "at most one epoch apart" in refusal(out)
    assert [i.msg.reason for i in out] == [
        protocol.RefusalReason.EPOCH.value
    ]  # not a conflict with other clients: refused at once
    _, out = sim.request(0, consumer=b"r1", job="train", rank=1, world_size=2)
    assert "epoch 0 is over" in refusal(out)
    sim(ev.CreditGranted, b"r1", 1, 10)
    finish(sim, 1)
    assert delivered(sim.out, b"r1") == [1, 3, 5, 7] and ToWorker(b"w1", protocol.RunClose(run=1)) in sim.out


def test_a_suspect_stays_alone_on_its_worker_when_a_late_result_of_another_run_comes():
    sim = ranks_sim(2, 8, credit=0)
    sim(ev.CreditGranted, b"r0", 1, 100)
    sim(ev.CreditGranted, b"r1", 1, 3)
    finish(sim, 1)  # epoch 1 lives on for rank 1
    run2, _ = sim.request(2, consumer=b"r0", job="train", rank=0, world_size=2)
    sim(ev.RunChecked, run2)
    sim(ev.CreditGranted, b"r0", run2, 100)
    sim(ev.RunStarted, run2, 2, 8)
    out = sim.feed(range(4), run=run2)
    assert tasks(out, b"w1") == [0, 1] and tasks(out, b"w2") == [2, 3]
    sim.results(b"w2", [3], run=run2)
    sim.now = 6.0
    sim(ev.HeartbeatReceived, b"w1")
    sim(ev.Tick)  # w2 lost: 2 is a suspect
    out = sim.results(b"w1", [0, 1], run=run2)
    assert tasks(out, b"w1") == [2] and sim.s.state.workers[b"w1"].isolation is Isolation.ISOLATING
    assert sim.results(b"w1", [1], run=1) == []  # late: epoch 1's seq 1 was answered long ago
    out = sim.feed(range(4, 8), run=run2)
    assert tasks(out) == [] and sim.s.state.workers[b"w1"].tasks == {(run2, 2)}  # the suspect runs alone still


def test_resume_at_or_ahead_of_what_was_released_takes_the_lane_over():
    sim = ranks_sim(2, 20, credit=0)
    sim(ev.CreditGranted, b"r0", 1, 100)
    sim(ev.CreditGranted, b"r1", 1, 2)
    finish(sim, 1)
    assert delivered(sim.out, b"r1") == [1, 3]
    # rank 1 restarts (a new process) and resumes after the 2 seqs it took: nothing is redone
    run, out = sim.request(1, consumer=b"r1-new", job="train", rank=1, world_size=2, start=2)
    assert run == 1 and Prepare(run, 1) not in out
    assert [(i.consumer, i.msg.kind) for i in client_msgs(out, protocol.Superseded)] == [(b"r1", "superseded")]
    sim(ev.CreditGranted, b"r1-new", 1, 100)
    finish(sim, 1)
    assert delivered(sim.out, b"r1-new") == list(range(5, 20, 2))


def test_resume_behind_what_was_released_gets_a_solo_run_of_its_shard():
    sim = ranks_sim(2, 20)
    finish(sim, 1)
    assert delivered(sim.out, b"r1") == list(range(1, 20, 2))
    before = len(sim.out)
    run, out = sim.request(1, consumer=b"r1-new", job="train", rank=1, world_size=2, start=6)
    assert run != 1 and Prepare(run, 1) in out
    sim(ev.RunChecked, run)
    sim(ev.CreditGranted, b"r1-new", run, 100)
    sim(ev.RunStarted, run, 1, 20)
    finish(sim, run)
    assert delivered(sim.out[before:], b"r1-new") == list(range(13, 20, 2))
    assert reads(sim.out[before:]) == list(range(13, 20, 2))  # only its own seqs are read again


def test_stream_outputs_are_sharded_by_output_position():
    sim = Sim(stream=True, partitions=1, buf_size=8, preserves_num_seqs=False)
    sim.join(b"w1")
    for rank in range(2):
        run, _ = sim.request(1, consumer=b"r%d" % rank, job="train", rank=rank, world_size=2)
        sim(ev.CreditGranted, b"r%d" % rank, run, 100)
    sim(ev.RunChecked, run)
    out = sim(ev.RunStarted, run, 1, 6)
    assert {i.msg.num_seqs for i in client_msgs(out, protocol.Started)} == {None}  # the count is not known
    sim.feed(range(6), run=run)
    out = sim(ev.StreamOutputsReceived, b"w1", run, 0, 1, [item(p) for p in range(5)], [])
    # with drop_last a group of two goes out once it is complete; the fifth waits
    assert delivered(out, b"r0") == [0, 2] and delivered(out, b"r1") == [1, 3]
    out = sim(ev.StreamFinished, b"w1", run, 0, 1)
    assert delivered(out) == []  # 5 outputs: the fifth is the dropped remainder
    assert {i.msg.count for i in client_msgs(out, protocol.End)} == {2}


# ---- map_seq_stream ------------------------------------------------------------------------------
def stream_sim(**kw) -> Sim:
    """Stream mode; the mappers here may change the number of seqs."""
    return Sim(**{"stream": True, "partitions": 2, "preserves_num_seqs": False, **kw})


def outputs(sim: Sim, wid: bytes, partition: int, positions, run: int = 1, incarnation: int = 1) -> List[Instruction]:
    items = [item(p, value=100 + p) for p in positions]
    return sim(ev.StreamOutputsReceived, wid, run, partition, incarnation, items, [])


def test_stream_partitions_are_spread_and_fed_within_credit():
    sim = stream_sim(buf_size=2)
    sim.join(b"w1")
    sim.join(b"w2")
    out = sim.start(10)
    opens = sent(out, protocol.StreamOpen)
    assert sorted((i.wid, i.msg.partition) for i in opens) == [(b"w1", 0), (b"w2", 1)]
    assert reads(out) == [0, 1, 2, 3]  # 2 inputs for each partition
    out = sim.feed(range(6))
    expect(out, (b"w1", "stream_inputs", [0, 2]), (b"w2", "stream_inputs", [1, 3]))
    assert [i.msg.partition for i in out] == [0, 1]
    assert newest(sim).queues == StreamQueues(
        fed=6, waiting_for_worker=2, in_flight=2, reorder_buffer=0, partitions_done=0
    )  # 4 and 5 wait for their partition's credit
    assert sim(ev.StreamAcked, b"w1", 1, 0, 7, 1) == []  # of another start of the partition: stale
    expect(sim(ev.StreamAcked, b"w1", 1, 0, 1, 1), (b"w1", "stream_inputs", [4]))


def test_stream_merge_is_round_robin_and_credit_goes_to_the_owner_only():
    sim = stream_sim(buf_size=3)
    sim.join(b"w1")
    sim.join(b"w2")
    sim.start(4)
    out = outputs(sim, b"w2", 1, [0])
    assert delivered(out) == []  # partition 0 goes first
    out = outputs(sim, b"w1", 0, [0, 1, 2])
    assert delivered(out) == [0, 1, 2]  # p0#0, p1#0, p0#1; p0#2 waits for p1's next output
    assert [(i.wid, i.msg.partition) for i in sent(out, protocol.StreamCredit)] == [(b"w1", 0), (b"w2", 1), (b"w1", 0)]
    sim.join(b"w3")
    out = sim(ev.WorkerLeft, b"w1")  # p0 moves on while its output #2 (made by w1) waits in the merge
    (moved,) = sent(out, protocol.StreamOpen)
    assert moved.msg.skip == 3 and moved.wid != b"w1"
    out = outputs(sim, b"w2", 1, [1])
    assert delivered(out) == [3, 4]  # p0#2, p1#1
    assert [(i.wid, i.msg.partition) for i in sent(out, protocol.StreamCredit)] == [(b"w2", 1)]  # none for w1's
    out = sim(ev.StreamFinished, b"w2", 1, 1, 1)
    assert delivered(out) == []
    out = outputs(sim, moved.wid, 0, [3], incarnation=moved.msg.incarnation)
    assert delivered(out) == [5]  # p1 is exhausted: skipped from now on
    out = sim(ev.StreamFinished, moved.wid, 1, 0, moved.msg.incarnation)
    assert client_msgs(out, protocol.End)[0].msg.count == 6


def test_stream_partition_replays_on_another_worker_and_skips_what_arrived():
    sim = stream_sim(buf_size=2, partitions=1)
    sim.join(b"w1", pid=1, local_index=0)
    sim.start(6)
    sim.feed(range(2))
    outputs(sim, b"w1", 0, [0])
    sim(ev.StreamAcked, b"w1", 1, 0, 1, 2)
    sim.feed(range(2, 4))
    sim.join(b"w2", pid=2)
    out = sim(ev.LocalWorkerExited, 0, 1, -9)
    expect(out, (b"w2", "stream_open"), ("replay", 1, 0, [0, 1]))  # 4 were sent; replayed in chunks
    assert out[0].msg == protocol.StreamOpen(run=1, partition=0, skip=1, credit=2, incarnation=2)
    ticket = out[1].ticket
    expect(sim(ev.ReplayRead, 1, 0, ticket, [item(0), item(1)]), (b"w2", "stream_inputs", [0, 1]))
    stale = sim(ev.ReplayRead, 1, 0, ticket, [item(0)])  # answered already: its items are ignored
    # (the next chunk is asked for by the dispatch after the one that handed the first chunk over)
    expect(stale, ("replay", 1, 0, [2, 3]))
    out = outputs(sim, b"w2", 0, [0, 1], incarnation=2)  # output 0 is a duplicate of the one received
    expect(out, (b"w2", "stream_credit"), (CONSUMER, "seqs", [1]))
    assert delivered(sim.out) == [0, 1]


def test_stream_partition_that_kills_workers_without_progress_fails_the_run():
    sim = stream_sim(buf_size=1, partitions=1, max_seq_retries=2)
    sim.start(3)
    sim.feed(range(1))
    for k in range(2):
        sim.join(b"w%d" % k, pid=k, local_index=k)
        out = sim(ev.LocalWorkerExited, k, k, -9)
    assert "killed 2 workers" in client_msgs(out, protocol.RunFailed)[0].msg.message


def test_stream_malformed_output_restarts_the_partition_elsewhere():
    sim = stream_sim(buf_size=2, partitions=1)
    sim.join(b"bad")
    sim.join(b"good")
    sim.start(2)
    sim.feed(range(2))
    out = sim(ev.StreamOutputsReceived, b"bad", 1, 0, 1, [], [BadItem(0, "meta is not a map")])
    expect(out, (b"bad", "stream_close"), (b"good", "stream_open"), ("replay", 1, 0, [0, 1]))
    assert out[0].msg == protocol.StreamClose(run=1, partition=0)


def test_a_partition_let_down_by_the_only_worker_restarts_there_after_it_is_told_to_close():
    sim = stream_sim(buf_size=2, partitions=1)
    sim.join(b"w")
    sim.start(2)
    sim.feed(range(2))
    out = sim(ev.StreamOutputsReceived, b"w", 1, 0, 1, [], [BadItem(0, "meta is not a map")])
    expect(out, (b"w", "stream_close"), (b"w", "stream_open"), ("replay", 1, 0, [0, 1]))
    assert out[1].msg == protocol.StreamOpen(run=1, partition=0, skip=0, credit=2, incarnation=2)
    sim.join(b"v")  # a worker that came later is no reason to move it again
    out = sim(ev.StreamOutputsReceived, b"w", 1, 0, 2, [item(0)], [])
    assert sent(out, protocol.StreamOpen) == [] and sent(out, protocol.StreamClose) == []


def test_stream_undecodable_message_restarts_the_workers_partitions_elsewhere():
    sim = stream_sim(buf_size=2, partitions=2)
    sim.join(b"bad")
    sim.start(4)
    sim.feed(range(4))
    sim.join(b"good")
    out = sim(ev.WorkerMessageMalformed, b"bad", "undecodable header")
    assert {i.msg for i in sent(out, protocol.StreamClose, b"bad")} == {
        protocol.StreamClose(run=1, partition=0),
        protocol.StreamClose(run=1, partition=1),
    }
    assert sorted(i.msg.partition for i in sent(out, protocol.StreamOpen, b"good")) == [0, 1]
    assert status(sim).malformed_results == 1


# ---- the property: exactly once, in order ------------------------------------------------------------
class Cluster:
    """Workers that run tasks in arrival order, a reader that reads what it is asked, a client that pulls."""

    def __init__(self, sim: Sim):
        self.sim = sim
        self.queues: Dict[bytes, List[Tuple[int, int]]] = {}  # wid -> [(run, pos)]
        self.runs_open: Dict[bytes, set] = {}
        self.read: Dict[int, int] = {}  # run -> positions read
        self.to_read: Dict[int, List[int]] = {}
        self.num_seqs: Dict[int, int] = {}
        self.got: Dict[int, List[Item]] = {}
        self.ended: Dict[int, int] = {}
        self.failed: Dict[int, str] = {}
        self.failures: Dict[int, protocol.RunFailed] = {}
        self.granted: Dict[int, int] = {}
        self.next_wid = 0
        self.kills = 0

    def apply(self, out: List[Instruction]) -> None:
        pending = list(out)
        while pending:
            instr = pending.pop(0)
            if isinstance(instr, Read):
                self.to_read.setdefault(instr.run, []).extend(instr.positions)
            elif isinstance(instr, ToWorker) and instr.wid in self.queues:
                msg = instr.msg
                if isinstance(msg, protocol.RunOpen):
                    self.runs_open[instr.wid].add(msg.run)
                elif isinstance(msg, protocol.RunClose):
                    self.runs_open[instr.wid].discard(msg.run)
                    self.queues[instr.wid] = [t for t in self.queues[instr.wid] if t[0] != msg.run]
                elif isinstance(msg, protocol.Tasks):
                    self.queues[instr.wid].extend((msg.run, it.pos) for it in instr.items)
            elif isinstance(instr, ToClient):
                msg = instr.msg
                if isinstance(msg, protocol.Seqs):
                    self.got.setdefault(msg.run, []).extend(instr.items)
                elif isinstance(msg, protocol.End):
                    self.ended[msg.run] = msg.count
                elif isinstance(msg, (protocol.RunFailed, protocol.Superseded)):
                    self.failed[msg.run] = msg.kind
                    if isinstance(msg, protocol.RunFailed):
                        self.failures[msg.run] = msg

    def handle(self, event_type, *args, **kw) -> None:
        self.apply(self.sim(event_type, *args, **kw))

    def step(self, action: Tuple[str, int]) -> None:
        what, k = action
        sim = self.sim
        sim.now += 0.01
        live = sorted(self.queues)
        if what == "join":
            self.next_wid += 1
            wid = b"w%d" % self.next_wid
            self.queues[wid] = []
            self.runs_open[wid] = set()
            self.handle(ev.WorkerJoined, wid, "h", self.next_wid, local_index=self.next_wid)
        elif what in ("kill", "leave") and live:
            wid = live[k % len(live)]
            del self.queues[wid]
            del self.runs_open[wid]
            if what == "kill":
                self.kills += 1
                self.handle(ev.LocalWorkerExited, int(wid[1:]), int(wid[1:]), -9)
            else:
                self.handle(ev.WorkerLeft, wid)
        elif what == "work" and live:
            wid = live[k % len(live)]
            queue = self.queues[wid]
            n = 1 + k % 3
            done, self.queues[wid] = queue[:n], queue[n:]
            for run in sorted({r for r, _ in done}):
                self.handle(ev.ResultsReceived, wid, run, [result(p) for r, p in done if r == run], [])
        elif what == "read":
            for run, queue in list(self.to_read.items()):
                take, self.to_read[run] = queue[: 1 + k % 5], queue[1 + k % 5 :]
                if take:
                    self.handle(ev.InputsRead, run, [item(p) for p in take])
        elif what == "credit" and sim.s.state.runs:
            run = max(sim.s.state.runs)
            self.granted[run] = self.granted.get(run, 0) + 1 + k % 4
            self.handle(ev.CreditGranted, CONSUMER, run, self.granted[run])
        elif what == "epoch":
            self.start(5 + k % 20)

    def start(self, num_seqs: int) -> None:
        sim = self.sim
        sim.run += 1
        self.num_seqs[sim.run] = num_seqs
        self.granted[sim.run] = 3
        out = sim(ev.EpochRequested, b"req", CONSUMER, sim.run)
        self.apply(out)
        (reply,) = [i.msg for i in out if isinstance(i, Reply)]
        assert reply.run == sim.run
        self.handle(ev.RunChecked, sim.run)
        self.handle(ev.CreditGranted, CONSUMER, sim.run, 3)
        self.handle(ev.RunStarted, sim.run, sim.run, num_seqs)


ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(
            ["join", "kill", "kill", "leave", "work", "work", "work", "read", "read", "credit", "credit", "epoch"]
        ),
        st.integers(0, 100),
    ),
    min_size=4,
    max_size=120,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    first=st.integers(1, 30),
    workers=st.integers(0, 2),
    actions=ACTIONS,
    buf_size=st.integers(1, 4),
    retries=st.integers(1, 3),
)
def test_any_interleaving_delivers_each_seq_once_in_order(first, workers, actions, buf_size, retries):
    """Also where a few deaths fail a run (max_seq_retries 1 to 3): a run then ends failed, naming
    the seq, and what it delivered before is still each seq once, in order; validate() holds after
    every event (Sim)."""
    sim = Sim(buf_size=buf_size, max_seq_retries=retries)
    cluster = Cluster(sim)
    cluster.start(first)
    for _ in range(workers):
        cluster.step(("join", 0))
    for action in actions:
        cluster.step(action)
    # then a calm finish: a worker, and everything runs to the end
    cluster.step(("join", 0))
    for _ in range(2000):
        if not sim.s.state.runs:
            break
        for action in (("read", 4), ("credit", 3), ("work", 2)):
            for k in range(len(cluster.queues)):
                cluster.step((action[0], k if action[0] == "work" else action[1]))
    assert not sim.s.state.runs, "a run never ended"
    last = sim.run
    for run, num_seqs in cluster.num_seqs.items():
        got = cluster.got.get(run, [])
        assert [it.pos for it in got] == list(range(len(got))), "delivered out of order or twice"
        assert all(
            np.array_equal(protocol.item_to_seq(it)["data"], np.full((2,), it.pos * 10.0, "float32")) for it in got
        )
        if run in cluster.ended:
            assert cluster.ended[run] == len(got) == num_seqs and run not in cluster.failed
        elif run in cluster.failures:  # a seq was on `retries` workers that died
            failure = cluster.failures[run]
            assert cluster.kills >= retries and failure.failure == "mapper", failure
            assert failure.message.endswith(f"in flight on {retries} workers that died processing it"), failure
            assert failure.seq_tag is not None and len(got) < num_seqs
        else:
            assert cluster.failed.get(run) == "superseded" and run != last  # only an older epoch
    assert last in cluster.ended or last in cluster.failures


class StreamCluster:
    """Stream workers whose mapper drops every input with pos % 3 == 2 and maps the rest to pos * 10."""

    def __init__(self, sim: Sim, num_seqs: int):
        self.sim = sim
        self.num_seqs = num_seqs
        self.parts: Dict[bytes, Dict[int, dict]] = {}  # wid -> partition -> state
        self.to_read: List[int] = []
        self.replays: List[Replay] = []
        self.got: List[Item] = []
        self.ended: Optional[int] = None
        self.failed: Optional[str] = None
        self.granted = 3
        self.next_wid = 0
        self.kills = 0

    def apply(self, out: List[Instruction]) -> None:
        for instr in out:
            if isinstance(instr, Read):
                self.to_read.extend(instr.positions)
            elif isinstance(instr, Replay):
                self.replays.append(instr)
            elif isinstance(instr, ToWorker) and instr.wid in self.parts:
                msg, parts = instr.msg, self.parts[instr.wid]
                if isinstance(msg, protocol.StreamOpen):
                    parts[msg.partition] = {
                        "inputs": [],
                        "eof": False,
                        "credit": msg.credit,
                        "skip": msg.skip,
                        "emitted": 0,
                        "incarnation": msg.incarnation,
                    }
                elif isinstance(msg, (protocol.StreamClose, protocol.RunClose)):
                    for p in [p for p in parts if isinstance(msg, protocol.RunClose) or p == msg.partition]:
                        del parts[p]
                elif isinstance(msg, protocol.StreamInputs) and msg.partition in parts:
                    parts[msg.partition]["inputs"].extend(it.pos for it in instr.items)
                elif isinstance(msg, protocol.StreamEnd) and msg.partition in parts:
                    parts[msg.partition]["eof"] = True
                elif isinstance(msg, protocol.StreamCredit) and msg.partition in parts:
                    parts[msg.partition]["credit"] += msg.n
            elif isinstance(instr, ToClient):
                if isinstance(instr.msg, protocol.Seqs):
                    self.got.extend(instr.items)
                elif isinstance(instr.msg, protocol.End):
                    self.ended = instr.msg.count
                elif isinstance(instr.msg, protocol.RunFailed):
                    self.failed = instr.msg.message

    def handle(self, event_type, *args, **kw) -> None:
        self.apply(self.sim(event_type, *args, **kw))

    def work(self, wid: bytes, k: int) -> None:
        parts = self.parts[wid]
        if not parts:
            return
        p = sorted(parts)[k % len(parts)]
        state = parts[p]
        if state["inputs"]:
            if state["credit"] <= 0 and state["emitted"] >= state["skip"]:
                return
            pos = state["inputs"].pop(0)
            self.handle(ev.StreamAcked, wid, 1, p, state["incarnation"], 1)
            if p not in parts or pos % 3 == 2:
                return
            index = state["emitted"]
            state["emitted"] += 1
            if index >= state["skip"]:
                state["credit"] -= 1
                self.handle(
                    ev.StreamOutputsReceived,
                    wid,
                    1,
                    p,
                    state["incarnation"],
                    [protocol.seq_to_item({"data": np.full((2,), pos * 10.0, "float32"), "seq_tag": f"s{pos}"}, index)],
                    [],
                )
        elif state["eof"]:
            del parts[p]
            self.handle(ev.StreamFinished, wid, 1, p, state["incarnation"])

    def step(self, action: Tuple[str, int]) -> None:
        what, k = action
        self.sim.now += 0.01
        live = sorted(self.parts)
        if what == "join":
            self.next_wid += 1
            wid = b"w%d" % self.next_wid
            self.parts[wid] = {}
            self.handle(ev.WorkerJoined, wid, "h", self.next_wid, local_index=self.next_wid)
        elif what in ("kill", "leave") and live:
            wid = live[k % len(live)]
            del self.parts[wid]
            if what == "kill":
                self.kills += 1
                self.handle(ev.LocalWorkerExited, int(wid[1:]), int(wid[1:]), -9)
            else:
                self.handle(ev.WorkerLeft, wid)
        elif what == "work" and live:
            self.work(live[k % len(live)], k)
        elif what == "read":
            if self.replays:
                r = self.replays.pop(0)
                self.handle(ev.ReplayRead, r.run, r.partition, r.ticket, [item(pos) for pos in r.positions])
            take, self.to_read = self.to_read[: 1 + k % 5], self.to_read[1 + k % 5 :]
            if take:
                self.handle(ev.InputsRead, 1, [item(pos) for pos in take])
        elif what == "credit":
            self.granted += 1 + k % 4
            self.handle(ev.CreditGranted, CONSUMER, 1, self.granted)


def expected_stream(num_seqs: int, partitions: int) -> List[float]:
    outs = [[pos * 10.0 for pos in range(p, num_seqs, partitions) if pos % 3 != 2] for p in range(partitions)]
    merged, k = [], 0
    while any(k < len(o) for o in outs):
        merged.extend(o[k] for o in outs if k < len(o))
        k += 1
    return merged


STREAM_ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(
            ["join", "kill", "kill", "leave", "work", "work", "work", "work", "read", "read", "credit", "credit"]
        ),
        st.integers(0, 100),
    ),
    min_size=4,
    max_size=150,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_seqs=st.integers(0, 30),
    partitions=st.integers(1, 3),
    buf_size=st.integers(1, 3),
    retries=st.integers(1, 3),
    actions=STREAM_ACTIONS,
)
def test_any_interleaving_in_stream_mode_delivers_the_merge_exactly_once(
    num_seqs, partitions, buf_size, retries, actions
):
    """Also where deaths fail the run (max_seq_retries 1 to 3): what it delivered before is a
    prefix of the merge, exactly once."""
    sim = Sim(stream=True, partitions=partitions, buf_size=buf_size, max_seq_retries=retries, preserves_num_seqs=False)
    cluster = StreamCluster(sim, num_seqs)
    sim.run = 1
    cluster.handle(ev.EpochRequested, b"req", CONSUMER, 1)
    cluster.handle(ev.RunChecked, 1)
    cluster.handle(ev.CreditGranted, CONSUMER, 1, 3)
    cluster.handle(ev.RunStarted, 1, 1, num_seqs)
    for action in actions:
        cluster.step(action)
    cluster.step(("join", 0))
    for _ in range(3000):
        if not sim.s.state.runs:
            break
        cluster.step(("read", 4))
        cluster.step(("credit", 3))
        for wid in sorted(cluster.parts):
            for p in range(partitions):
                cluster.work(wid, p)
    assert not sim.s.state.runs, "the run never ended"
    want = expected_stream(num_seqs, partitions)
    got = cluster.got
    assert [it.pos for it in got] == list(range(len(got)))
    assert [float(protocol.item_to_seq(it)["data"][0]) for it in got] == want[: len(got)]
    if cluster.failed is None:
        assert cluster.ended == len(got) == len(want)
    else:  # a partition was on `retries` workers that died without its making progress
        assert cluster.ended is None and cluster.kills >= retries
        assert f"killed {retries} workers" in cluster.failed, cluster.failed


class RanksCluster(Cluster):
    """World-size W clients over one epoch, which crash and resume (from where they were, or from
    an earlier checkpoint); the workers are those of Cluster."""

    def __init__(self, sim: Sim, world: int, num_seqs: int):
        super().__init__(sim)
        self.world = world
        self.n = num_seqs
        self.session: Dict[int, bytes] = {}  # rank -> its live client
        self.sessions: Dict[bytes, Tuple[int, int, int]] = {}  # client -> (rank, run, start)
        self.got_by: Dict[bytes, List[int]] = {}
        self.credit: Dict[bytes, int] = {}
        self.count = 0

    def apply(self, out: List[Instruction]) -> None:
        super().apply(out)
        for instr in out:
            if isinstance(instr, ToClient) and isinstance(instr.msg, protocol.Seqs):
                self.got_by.setdefault(instr.consumer, []).extend(it.pos for it in instr.items)

    def connect(self, rank: int, start: int) -> None:
        self.count += 1
        consumer = b"c%d-r%d" % (self.count, rank)
        out = self.sim(ev.EpochRequested, b"req", consumer, 1, job="j", rank=rank, world_size=self.world, start=start)
        self.apply(out)
        (reply,) = [i.msg for i in out if isinstance(i, Reply)]
        assert isinstance(reply, protocol.EpochAccepted), reply
        run = reply.run
        self.session[rank] = consumer
        self.sessions[consumer] = (rank, run, start)
        self.credit[consumer] = 2
        if run not in self.num_seqs:
            self.num_seqs[run] = self.n
            self.handle(ev.RunChecked, run)
            self.handle(ev.RunStarted, run, 1, self.n)
        self.handle(ev.CreditGranted, consumer, run, 2)

    def stop_on_failure(self) -> None:
        """Once a run failed, the trainer raises: every rank's client closes."""
        if self.failures and self.session:
            for consumer in list(self.session.values()):
                self.handle(ev.ConsumerClosed, consumer)
            self.session.clear()

    def position(self, rank: int) -> int:
        consumer = self.session[rank]
        return self.sessions[consumer][2] + len(self.got_by.get(consumer, []))

    def rank_step(self, what: str, k: int) -> None:
        rank = k % self.world
        if rank not in self.session:
            return
        consumer = self.session[rank]
        _, run, _ = self.sessions[consumer]
        if what == "pull":
            self.credit[consumer] += 1 + k % 3
            self.handle(ev.CreditGranted, consumer, run, self.credit[consumer])
        elif what in ("crash", "rewind"):
            where = self.position(rank)
            self.handle(ev.ConsumerClosed, consumer)
            del self.session[rank]
            self.connect(rank, where if what == "crash" else max(0, where - 1 - k % 4))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=st.integers(1, 3),
    n=st.integers(0, 30),
    buf_size=st.integers(1, 3),
    actions=st.lists(
        st.tuples(
            st.sampled_from(
                ["join", "kill", "kill", "work", "work", "work", "read", "read", "pull", "pull", "crash", "rewind"]
            ),
            st.integers(0, 100),
        ),
        max_size=120,
    ),
    workers=st.integers(0, 2),
    retries=st.integers(1, 3),
)
def test_ranks_that_crash_and_resume_get_their_shard_exactly(world, n, buf_size, actions, workers, retries):
    """Also where a few deaths fail a run (max_seq_retries 1 to 3): the trainer then stops (every
    client closes), the failure names the seq, and what each client got before is its slice of
    the shard, in order."""
    sim = Sim(buf_size=buf_size, max_seq_retries=retries)
    cluster = RanksCluster(sim, world, n)
    for rank in range(world):
        cluster.connect(rank, 0)
    for _ in range(workers):
        cluster.step(("join", 0))
    for what, k in actions:
        if what in ("pull", "crash", "rewind"):
            cluster.rank_step(what, k)
        else:
            cluster.step((what, k))
        cluster.stop_on_failure()
    cluster.step(("join", 0))
    for _ in range(3000):
        if not sim.s.state.runs:
            break
        cluster.step(("read", 4))
        for rank in range(world):
            cluster.rank_step("pull", rank)
        for k in range(len(cluster.queues)):
            cluster.step(("work", k))
        cluster.stop_on_failure()
    assert not sim.s.state.runs, "a run never ended"
    for failure in cluster.failures.values():  # a seq was on `retries` workers that died
        assert cluster.kills >= retries and failure.failure == "mapper", failure
        assert failure.message.endswith(f"in flight on {retries} workers that died processing it"), failure
        assert failure.seq_tag is not None
    assert not (cluster.failures and cluster.session)  # a failure stopped every client
    end = n // world * world
    for consumer, (rank, _, start) in cluster.sessions.items():
        got = cluster.got_by.get(consumer, [])
        shard = list(range(rank, end, world))
        assert got == shard[start : start + len(got)], (consumer, got)  # its slice of the shard, in order
        if cluster.session.get(rank) == consumer:
            assert start + len(got) == len(shard), (consumer, "the last client of the rank got to the end")


def keepalive_to(out: Sequence[Instruction], consumer: bytes) -> protocol.Keepalive:
    (alive,) = [i.msg for i in client_msgs(out, protocol.Keepalive) if i.consumer == consumer]
    return alive


def test_a_reader_held_back_by_another_ones_window_hears_that_it_waits_on_a_live_reader():
    sim = ranks_sim(2, 20, credit=2)
    finish(sim, sim.run)
    assert delivered(sim.out, b"r0") == [0, 2] and delivered(sim.out, b"r1") == [1, 3]
    sim(ev.CreditGranted, b"r0", sim.run, 10, 2)  # rank 0 wants more; rank 1 (paused) takes nothing
    finish(sim, sim.run)
    assert delivered(sim.out, b"r0") == [0, 2, 4]
    sim.now = 1.0
    alive = keepalive_to(sim(ev.Tick), b"r0")
    assert alive.waits_on_readers and "rank 1 of job 'train' to take its seqs" in alive.waiting_for
    sim(ev.ConsumerClosed, b"r1")  # its seqs go to no one now
    finish(sim, sim.run)
    assert delivered(sim.out, b"r0")[:6] == [0, 2, 4, 6, 8, 10]


def test_subshards_split_a_rank_and_drop_last_follows_the_ranks():
    sim = Sim(buf_size=4)
    sim.join(b"w1")
    sim.join(b"w2")
    n, world, parts = 23, 2, 2
    for rank in range(world):
        for part in range(parts):
            c = b"r%d-s%d" % (rank, part)
            run, _ = sim.request(
                1, consumer=c, job="train", rank=rank, world_size=world, subshard=part, subshards=parts
            )
            sim(ev.CreditGranted, c, run, 100)
    sim.run = run
    sim(ev.RunChecked, run)
    sim(ev.RunStarted, run, 1, n)
    finish(sim, run)
    for rank in range(world):
        lanes = [delivered(sim.out, b"r%d-s%d" % (rank, part)) for part in range(parts)]
        merged = [p for group in zip_longest(*lanes) for p in group if p is not None]  # a DataLoader's turns
        assert merged == list(range(rank, 22, world))  # the rank's shard, in order; 22: drop_last of 2 ranks
    _, out = sim.request(1, consumer=b"x", job="train", rank=0, world_size=2, subshard=0, subshards=3)
    assert "3 readers per rank, i.e. DataLoader num_workers 3, where the job has 2 readers per rank" in refusal(out)
    assert "subshard" not in refusal(out)


@pytest.mark.parametrize("world, drop_last", [(1, True), (2, True), (2, False)])
def test_an_epoch_whose_count_is_learnt_by_reading(world, drop_last):
    sim = Sim(buf_size=4)
    sim.join(b"w1")
    sim.join(b"w2")
    for rank in range(world):
        run, _ = sim.request(1, consumer=b"r%d" % rank, job="j", rank=rank, world_size=world, drop_last=drop_last)
        sim(ev.CreditGranted, b"r%d" % rank, run, 100)
    sim.run = run
    sim(ev.RunChecked, run)
    out = sim(ev.RunStarted, run, 1, None)
    assert {i.msg.num_seqs for i in client_msgs(out, protocol.Started)} == {None}
    asked = reads(sim.out)
    assert asked == list(range(len(asked))) and len(asked) >= 7  # it reads on without knowing the end
    sim.feed(range(7), run=run)
    sim(ev.InputsEnded, run, 7)  # the dataset has 7 seqs
    sim(ev.InputsEnded, run, 9)  # a late, contradicting answer changes nothing: the first end stands
    finish(sim, run, count=7)
    end = 6 if drop_last and world == 2 else 7
    for rank in range(world):
        assert delivered(sim.out, b"r%d" % rank) == list(range(rank, end, world))
    ends = {i.consumer: i.msg.count for i in client_msgs(sim.out, protocol.End)}
    assert ends == {b"r%d" % r: len(range(r, end, world)) for r in range(world)}
    assert newest(sim).state is RunState.DONE


def test_inputs_a_worker_could_not_read_are_taken_back_and_redone():
    sim = Sim(buf_size=2)
    sim.join(b"w1")
    sim.start(4)
    sim.feed(range(4))
    assert tasks(sim.out, b"w1") == [0, 1]
    out = sim(ev.InputsLost, b"w1", sim.run, [0, 1], "gone")
    expect(out, (b"w1", "tasks", [0]), (b"w1", "tasks", [1]))  # its slots are free again, the seqs still wanted
    assert status(sim).lost_inputs == 2
    assert sim(ev.InputsLost, b"w1", sim.run, [3], "late") == []  # not a task it holds: nothing
    out = sim.results(b"w1", [0, 1])
    expect(out, (b"w1", "tasks", [2]), (b"w1", "tasks", [3]), (CONSUMER, "seqs", [0, 1]))
    assert status(sim).lost_inputs == 2


def test_inputs_stay_while_a_worker_may_read_them_and_failures_of_dropped_seqs_are_ignored():
    """A worker reading the server's memory reads a task's input when the message arrives: the
    input stays while the task is in flight, also after its rank left (its failure then fails
    nothing) and after the run ended, until the worker says it dropped the run."""
    sim = ranks_sim(2, 8, buf_size=2)
    sim.feed(range(4))
    held = {wid: tasks(sim.out, wid) for wid in (b"w1", b"w2")}
    rank1 = [p for ps in held.values() for p in ps if p % 2 == 1]
    assert rank1, held
    sim(ev.ConsumerClosed, b"r1")  # rank 1 leaves: its seqs are dropped while in flight
    sim.results(b"w1", [p for p in held.get(b"w1", []) if p % 2 == 0])
    sim.results(b"w2", [p for p in held.get(b"w2", []) if p % 2 == 0])
    sim(ev.CreditGranted, b"r0", sim.run, 100, 2)  # rank 0 took its two: their inputs go
    assert sim.s.held_inputs(sim.run) == sorted(rank1)  # no rank wants them, but a worker may still read them
    pos = rank1[0]
    wid = b"w1" if pos in held.get(b"w1", []) else b"w2"
    out = sim(ev.TaskFailed, wid, sim.run, pos, f"s{pos}", "garbage in", "")
    assert not client_msgs(out, protocol.RunFailed)  # a dropped seq fails nothing
    assert sim.s.held_inputs(sim.run) == sorted(rank1[1:])
    assert in_flight(sim)[wid.decode()] == len([p for p in rank1[1:] if p in held[wid]])
    # the run ends (superseded) with tasks in flight: their inputs stay with their workers
    left = {(w, p) for w, ps in held.items() for p in ps if p in rank1[1:]}
    out = sim(ev.ConsumerClosed, b"r0")
    expect(out, ("stop_reading", sim.run), (b"w1", "run_close"), (b"w2", "run_close"))
    assert newest(sim).state is RunState.SUPERSEDED
    assert sim.s.held_inputs(sim.run) == sorted(p for _, p in left)
    for w in (b"w1", b"w2"):
        sim(ev.RunDropped, w, sim.run)
        assert sim.s.held_inputs(sim.run) == sorted(p for v, p in left if v > w)  # the others' still


def test_a_seq_whose_input_cannot_be_read_fails_after_max_seq_retries():
    sim = Sim(buf_size=1, max_seq_retries=3)
    sim.join(b"w1")
    sim.start(2)
    sim.feed(range(2))
    for _ in range(2):
        expect(sim(ev.InputsLost, b"w1", sim.run, [0], "gone"), (b"w1", "tasks", [0]))
    out = sim(ev.InputsLost, b"w1", sim.run, [0], "gone")
    expect(out, (CONSUMER, "run_failed"), (b"w1", "run_close"))
    assert out[0].msg.message == "the input of seq 's0' could not be read by 3 workers"


def test_each_kind_of_charge_counts_on_its_own():
    """An unreadable input, a malformed result and a task dropped unread are three charges:
    the seq fails only when one of them reaches max_seq_retries, and names that one."""
    sim = Sim(buf_size=1, max_seq_retries=2)
    sim.join(b"only")
    sim.start(2)
    sim.feed(range(2))
    expect(sim(ev.InputsLost, b"only", sim.run, [0], "gone"), (b"only", "tasks", [0]))
    expect(sim(ev.WorkerMessageMalformed, b"only", "junk"), (b"only", "tasks", [0]))
    expect(dropped(sim, b"only", "tasks", TASKS, sim.run, "too big", positions=[0]), (b"only", "tasks", [0]))
    out = sim(ev.InputsLost, b"only", sim.run, [0], "gone")
    expect(out, (CONSUMER, "run_failed"), (b"only", "run_close"))
    assert out[0].msg.message == "the input of seq 's0' could not be read by 2 workers"


def test_how_a_worker_gets_its_inputs_caps_its_batches():
    """In the messages: dispatch_bytes; in shared memory: what the segment holds well; read in
    the server's memory: no cap but the credit."""
    sim = Sim(buf_size=8, dispatch_bytes=16)  # 8 bytes of data per seq in these tests
    sim.join(b"w1")
    sim.start(24)
    sim.feed(range(24))
    assert [len(i.items) for i in sent(sim.out, protocol.Tasks)] == [2, 2, 2, 2]  # cut at 16 bytes
    sim(ev.InputsShared, b"w1", InputPath.shared_memory(24))
    out = sim.results(b"w1", [0, 1, 2, 3])
    assert [len(i.items) for i in sent(out, protocol.Tasks)] == [3, 1]  # 24 bytes a message
    sim(ev.InputsShared, b"w1", InputPath.by_address())
    out = sim.results(b"w1", [4, 5, 6, 7])
    assert [len(i.items) for i in sent(out, protocol.Tasks)] == [4]  # half the credit, as always
    sim(ev.InputsShared, b"w1", InputPath.message())
    out = sim.results(b"w1", [8, 9, 10, 11])
    assert [len(i.items) for i in sent(out, protocol.Tasks)] == [2, 2]

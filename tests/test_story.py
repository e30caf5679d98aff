"""The scheduler's story: each move of a seq, batch, stream partition, run and worker is kept with
the stimulus id of the event that caused it, and every instruction carries its event's; a handler
that raises halfway fails its run as an internal error and keeps what it built. Events in,
instructions and `Scheduler.story` out, as in tests/test_scheduler.py."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import pytest

from ppclient import protocol
from ppclient.protocol import Item
from ppserver.scheduler import Instruction, Reply, Scheduler, Settings, StopReading, ToClient, ToWorker
from ppserver.scheduler import events as ev
from ppserver.scheduler.story import parse_key
from ppserver.scheduler.workers import Isolation, Retirement

pytestmark = pytest.mark.unit


def item(pos: int, value: Optional[float] = None) -> Item:
    seq = {"data": np.full((2,), pos if value is None else value, dtype="float32"), "seq_tag": f"s{pos}"}
    return protocol.seq_to_item({**seq, "seq_idx": pos, "complete_frac": 0.0}, pos)


class Sim:
    """A scheduler driven by named events: `sim("results-7", ev.ResultsReceived, ...)`."""

    def __init__(self, strict: bool = True, **settings_kw):
        settings = {"buf_size": 2, "heartbeat_interval": 1.0, "heartbeat_timeout": 5.0, **settings_kw}
        self.s = Scheduler(Settings(**settings), strict=strict)
        self.now = 0.0

    def __call__(self, stimulus: str, event_type, *args, **kw) -> List[Instruction]:
        out = self.s.handle(event_type(self.now, *args, stimulus=stimulus, **kw))
        self.s.validate()
        return out

    def start(self, num_seqs: int, consumer: bytes = b"c0", rank: int = 0, world_size: int = 1) -> int:
        out = self(
            f"epoch-{consumer.decode()}",
            ev.EpochRequested,
            b"req-" + consumer,
            consumer,
            1,
            rank=rank,
            world_size=world_size,
        )
        (reply,) = [i.msg for i in out if isinstance(i, Reply)]
        run = reply.run
        self(f"credit-{consumer.decode()}", ev.CreditGranted, consumer, run, 100)
        if rank == 0:
            self("checked", ev.RunChecked, run)
            self("started", ev.RunStarted, run, 1, num_seqs)
        return run


def moves(sim: Sim, *keys) -> List[Tuple[str, str, str, str]]:
    """(from, to, worker, stimulus) of each move the story keeps of `keys`."""
    return [(e.from_, e.to, e.worker, e.stimulus) for e in sim.s.story(*keys)]


def tasks(out: Sequence[Instruction], wid: bytes) -> List[int]:
    return [
        it.pos
        for i in out
        if isinstance(i, ToWorker) and i.wid == wid and isinstance(i.msg, protocol.Tasks)
        for it in i.items
    ]


def test_a_seqs_story_tells_each_move_with_the_event_that_caused_it():
    sim = Sim()
    sim("hello-1", ev.WorkerJoined, b"w1", "host", 11)
    run = sim.start(4)
    sim("read-2", ev.InputsRead, run, [item(p) for p in range(2)])
    sim.now = 1.0
    sim("results-3", ev.ResultsReceived, b"w1", run, [item(1, 10.0)])  # 1 waits for 0
    sim.now = 2.0
    sim("results-4", ev.ResultsReceived, b"w1", run, [item(0, 0.0)])
    assert moves(sim, 1) == [
        ("-", "asked", "", "started"),
        ("asked", "queued", "", "read-2"),
        ("queued", "running", "w1", "read-2"),
        ("running", "ready", "w1", "results-3"),
        ("ready", "delivered", "", "results-4"),
    ]
    assert [(e.run, e.time) for e in sim.s.story(1)] == [(run, 0.0)] * 3 + [(run, 1.0), (run, 2.0)]
    assert [(e.from_, e.to, e.stimulus, e.note) for e in sim.s.story(f"run:{run}")] == [
        ("-", "preparing", "epoch-c0", "epoch 1"),
        ("asked", "accepted", "checked", "reader"),  # the reader's side of the run
        ("accepted", "open", "started", "reader"),
        ("preparing", "running", "started", ""),
    ]
    assert [(e.key, e.from_, e.to, e.stimulus) for e in sim.s.story(f"lane:{run}/0")] == [
        (f"{run}/0", "awaited", "reading", "epoch-c0")
    ]
    assert [e.key for e in sim.s.story(0, 1)] == [0, 1, 0, 1, 0, 1, 1, 0, 0, 1]  # oldest first
    worker = sim.s.story("worker:w1")
    assert (worker[0].to, worker[0].stimulus, worker[0].note) == ("joined", "hello-1", "host host pid 11")
    assert {(e.subject, e.key) for e in worker[1:]} == {("pos", 0), ("pos", 1)}  # the seqs it mapped


def test_instructions_carry_the_stimulus_of_their_event_and_unnamed_events_get_one():
    sim = Sim()
    sim("hello-1", ev.WorkerJoined, b"w1", "host", 11)
    run = sim.start(4)
    out = sim("read-2", ev.InputsRead, run, [item(p) for p in range(4)])
    assert tasks(out, b"w1") == [0, 1] and {i.stimulus for i in out} == {"read-2"}
    out = sim.s.handle(ev.ResultsReceived(0.0, b"w1", run, [item(0, 0.0)]))
    assert out and {i.stimulus for i in out} == {out[0].stimulus}
    assert out[0].stimulus == "results-received-1"  # the scheduler counts only the events it names
    assert sim.s.story(0)[-1].stimulus == out[0].stimulus
    again = sim.s.handle(ev.Tick(0.0))
    assert again == [] or again[0].stimulus != out[0].stimulus


def test_a_worker_death_tells_the_moves_back_to_the_queue_and_the_orphans_with_its_stimulus():
    sim = Sim(buf_size=4)
    sim("hello-1", ev.WorkerJoined, b"w1", "host", 11)
    run = sim.start(8, b"c0", rank=0, world_size=2)
    assert sim.start(8, b"c1", rank=1, world_size=2) == run
    out = sim("read-2", ev.InputsRead, run, [item(p) for p in range(4)])
    assert tasks(out, b"w1") == [0, 1, 2, 3]
    sim("bye-c1", ev.ConsumerClosed, b"c1")  # rank 1 leaves: its seqs are dropped as they come up
    sim("results-3", ev.ResultsReceived, b"w1", run, [item(0, 0.0)])
    assert moves(sim, 1)[-1] == ("running", "orphan", "", "results-3")  # w1 maps it still
    sim("hello-4", ev.WorkerJoined, b"w2", "host", 12)
    sim.now = 6.0
    sim("hb-5", ev.HeartbeatReceived, b"w2")
    out = sim("tick-6", ev.Tick)  # w1 has not been heard for 6 s: lost
    assert tasks(out, b"w2") == [2]  # suspects now: one at a time
    assert moves(sim, 2)[-2:] == [("running", "queued", "w1", "tick-6"), ("queued", "running", "w2", "tick-6")]
    assert moves(sim, 3)[-1] == ("running", "queued", "w1", "tick-6")
    assert moves(sim, 1)[-1] == ("orphan", "-", "w1", "tick-6")
    (left,) = [e for e in sim.s.story("worker:w1") if e.subject == "worker" and e.from_ == "joined"]
    assert (left.to, left.stimulus, left.note) == ("lost", "tick-6", "3 tasks, 0 partitions handed back")
    assert [e.stimulus for e in sim.s.story("worker:w1")].count("tick-6") == 4  # it left; 1, 2 and 3 moved off


def test_a_stream_partitions_story_tells_its_owners():
    sim = Sim(stream=True, partitions=2, preserves_num_seqs=False)
    sim("hello-1", ev.WorkerJoined, b"w1", "host", 11)
    sim("hello-2", ev.WorkerJoined, b"w2", "host", 12)
    sim.start(10)
    sim("bye-7", ev.WorkerLeft, b"w1")
    assert moves(sim, "partition:0") == [
        ("unowned", "owned", "w1", "started"),
        ("owned", "unowned", "w1", "bye-7"),
        ("unowned", "owned", "w2", "bye-7"),
    ]


def test_a_stream_runs_close_lets_its_owned_partitions_go_through_their_move():
    """A run that ends with partitions owned: each moves owned -> unowned ("run closed"), so no
    worker's set keeps a partition of it, also when its owner's loss is what failed the run."""
    sim = Sim(stream=True, partitions=2, preserves_num_seqs=False, max_seq_retries=1)
    sim("hello-1", ev.WorkerJoined, b"w1", "host", 11)
    sim("hello-2", ev.WorkerJoined, b"w2", "host", 12)
    run = sim.start(10)
    sim.now = 10.0
    sim("tick-3", ev.Tick)  # both lost: w1's partition's loss fails the run, w2 still owns the other
    assert sim.s.state.runs == {} and sim.s.state.workers == {}
    for p, wid in ((0, "w1"), (1, "w2")):  # w1's loss failed the run: it was forgotten before the close
        assert moves(sim, f"partition:{p}") == [
            ("unowned", "owned", wid, "started"),
            ("owned", "unowned", wid, "tick-3"),
        ]
        assert sim.s.story(f"partition:{p}")[-1].note == "run closed" and sim.s.story(f"partition:{p}")[-1].run == run


def test_the_story_keeps_only_its_length():
    sim = Sim(story_length=7)
    sim("hello-1", ev.WorkerJoined, b"w1", "host", 11)
    run = sim.start(6)
    sim("read-2", ev.InputsRead, run, [item(p) for p in range(6)])
    sim("results-3", ev.ResultsReceived, b"w1", run, [item(0, 0.0), item(1, 1.0)])
    assert len(sim.s.state.story_log) == 7
    entries, total = sim.s.state.story_log.select([("pos", 0), ("pos", 1)], last=2)
    kept = sim.s.story(0, 1)
    assert total == len(kept) > 2 and entries == kept[-2:]
    assert [(e.key, e.to) for e in entries] == [(0, "delivered"), (1, "delivered")]
    assert [e.to for e in sim.s.story(f"run:{run}")] == ["stopped"]  # its earlier moves came first: forgotten
    assert moves(sim, 1)[-1] == ("ready", "delivered", "", "results-3")
    none = Sim(story_length=0)
    none("hello-1", ev.WorkerJoined, b"w1", "host", 11)
    run = none.start(6)
    assert tasks(none("read-2", ev.InputsRead, run, [item(p) for p in range(6)]), b"w1") == [0, 1]
    assert len(none.s.state.story_log) == 0 and none.s.story(0, f"run:{run}", "worker:w1") == []


def test_story_keys_as_users_write_them():
    assert [parse_key(k) for k in (3, "3", "batch:4", "run:77", "worker:vm:1:ab", "partition:2", "lane:77/03")] == [
        ("pos", 3),
        ("pos", 3),
        ("batch", 4),
        ("run", 77),
        ("worker", "vm:1:ab"),
        ("partition", 2),
        ("lane", "77/3"),
    ]
    for bad in ("seq:3", "run:x", "worker:", "x", "lane:3", "lane:3/x", "run:3/1"):
        with pytest.raises(ValueError, match="is not"):
            parse_key(bad)


class Exploding(Exception):
    pass


def test_a_handler_that_raises_halfway_fails_its_run_and_keeps_what_it_built():
    sim = Sim(strict=False)
    sim("hello-1", ev.WorkerJoined, b"w1", "host", 11)
    run = sim.start(6)
    d = sim.s.dispatch_of(run)
    assert d is not None
    sends = d.dispatch

    def dispatch_then_raise(workers, out):  # moves seqs to the worker, builds their Tasks, then raises
        sends(workers, out)
        raise Exploding("after the tasks were built")

    d.dispatch = dispatch_then_raise  # type: ignore[method-assign]
    out = sim.s.handle(ev.InputsRead(0.0, run, [item(p) for p in range(2)], stimulus="read-9"))
    assert [type(i) for i in out] == [ToWorker, ToWorker, ToClient, StopReading, ToWorker]
    assert tasks(out, b"w1") == [0, 1]  # performed: the state says w1 maps them
    failed = out[2].msg
    assert isinstance(failed, protocol.RunFailed) and out[2].consumer == b"c0"
    assert failed.failure == "server"
    assert failed.message == "internal server error handling read-9: Exploding: after the tasks were built"
    assert isinstance(out[4].msg, protocol.RunClose) and out[4].wid == b"w1"
    assert {i.stimulus for i in out} == {"read-9"}
    assert sim.s.state.runs == {} and sim.s.status(0.0).internal_errors == 1
    assert moves(sim, f"run:{run}")[-2:] == [("running", "failed", "", "read-9"), ("open", "stopped", "", "read-9")]
    assert sim.s.story(f"run:{run}")[-2].note == failed.message
    sim.s.validate()


def test_a_strict_scheduler_lets_a_handler_error_raise():
    sim = Sim()
    sim("hello-1", ev.WorkerJoined, b"w1", "host", 11)
    run = sim.start(6)
    d = sim.s.dispatch_of(run)
    assert d is not None

    def explode(workers, out):
        raise Exploding("boom")

    d.dispatch = explode  # type: ignore[method-assign]
    with pytest.raises(Exploding):
        sim.s.handle(ev.InputsRead(0.0, run, [item(0)]))


def test_a_worker_that_takes_a_suspect_isolates_until_it_is_settled_and_its_story_tells_it():
    sim = Sim()  # buf_size 2
    sim("hello-1", ev.WorkerJoined, b"w1", "host", 11)
    run = sim.start(4)
    assert tasks(sim("read-2", ev.InputsRead, run, [item(0), item(1)]), b"w1") == [0, 1]
    sim("hello-3", ev.WorkerJoined, b"w2", "host", 12)
    sim.now = 6.0
    sim("hb-4", ev.HeartbeatReceived, b"w2")
    w2 = sim.s.state.workers[b"w2"]
    assert tasks(sim("tick-5", ev.Tick), b"w2") == [0]  # w1 lost: 0 and 1 are suspects, each alone
    assert w2.isolation is Isolation.ISOLATING
    assert tasks(sim("results-6", ev.ResultsReceived, b"w2", run, [item(0, 0.0)]), b"w2") == [1]
    assert w2.isolation is Isolation.ISOLATING
    sim("results-7", ev.ResultsReceived, b"w2", run, [item(1, 1.0)])
    assert w2.isolation is Isolation.NORMAL
    assert tasks(sim("read-8", ev.InputsRead, run, [item(2), item(3)]), b"w2") == [2, 3]  # no suspect: its credit
    told = [(e.from_, e.to, e.stimulus, e.note) for e in sim.s.story("worker:w2") if e.subject == "worker"]
    assert told == [
        ("-", "joined", "hello-3", "host host pid 12"),
        ("normal", "isolating", "tick-5", f"pos 0 of run {run}"),
        ("isolating", "normal", "results-6", ""),
        ("normal", "isolating", "results-6", f"pos 1 of run {run}"),
        ("isolating", "normal", "results-7", ""),
    ]


def test_a_handler_that_raises_on_an_event_about_one_run_fails_that_run_alone():
    """An event that names a run (events.RunEvent) fails only that run when its handler raises;
    one that names none fails every live run."""
    sim = Sim(strict=False)
    sim("hello-1", ev.WorkerJoined, b"w1", "host", 11)
    first = sim.start(4)
    (reply,) = [i.msg for i in sim("epoch-2", ev.EpochRequested, b"req-c0", b"c0", 2) if isinstance(i, Reply)]
    second = reply.run
    assert set(sim.s.state.runs) == {first, second}

    def explode(e, out):
        raise Exploding("boom")

    sim.s._handlers[ev.MissingReported] = explode
    assert sim("missing-3", ev.MissingReported, b"c0", second, 0) == [StopReading(second)]  # it was preparing
    assert set(sim.s.state.runs) == {first}
    assert moves(sim, f"run:{second}")[-2:] == [
        ("preparing", "failed", "", "missing-3"),
        ("asked", "stopped", "", "missing-3"),
    ]
    sim.s._handlers[ev.ConsumerAlive] = explode
    out = sim("alive-4", ev.ConsumerAlive, b"c0")
    failed = protocol.RunFailed(
        run=first, failure="server", message="internal server error handling alive-4: Exploding: boom"
    )
    assert out == [ToClient(b"c0", failed), StopReading(first), ToWorker(b"w1", protocol.RunClose(run=first))]
    assert sim.s.state.runs == {} and sim.s.state.internal_errors == 2


def test_a_worker_that_leaves_while_isolating_ends_its_story_with_its_departure():
    sim = Sim()  # buf_size 2
    sim("hello-1", ev.WorkerJoined, b"w1", "host", 11)
    run = sim.start(4)
    sim("read-2", ev.InputsRead, run, [item(0), item(1)])
    sim("hello-3", ev.WorkerJoined, b"w2", "host", 12)
    sim.now = 6.0
    sim("hb-4", ev.HeartbeatReceived, b"w2")
    assert tasks(sim("tick-5", ev.Tick), b"w2") == [0]  # w1 lost: w2 runs suspect 0 alone
    sim("bye-6", ev.WorkerLeft, b"w2")
    story = sim.s.story("worker:w2")
    assert [(e.subject, e.key, e.from_, e.to, e.stimulus) for e in story[-3:]] == [
        ("pos", 0, "running", "queued", "bye-6"),
        ("worker", "w2", "isolating", "normal", "bye-6"),
        ("worker", "w2", "joined", "departed", "bye-6"),
    ]


def test_a_retired_worker_tells_its_retirement_in_its_story():
    sim = Sim()  # buf_size 2
    sim("hello-1", ev.WorkerJoined, b"w1", "host", 11)
    sim("hello-2", ev.WorkerJoined, b"w2", "host", 12)
    run = sim.start(4)
    assert tasks(sim("read-3", ev.InputsRead, run, [item(p) for p in range(4)]), b"w1") == [0, 2]
    w1 = sim.s.state.workers[b"w1"]
    assert sim("retire-4", ev.RetireWorker, b"w1") == []
    assert w1.retirement is Retirement.RETIRING and w1.retiring
    out = sim("results-5", ev.ResultsReceived, b"w1", run, [item(0, 0.0)])
    assert w1.retirement is Retirement.RETIRING and not [i for i in out if isinstance(i.msg, protocol.Retire)]
    out = sim("results-6", ev.ResultsReceived, b"w1", run, [item(2, 2.0)])
    assert [i for i in out if isinstance(i.msg, protocol.Retire)] == [ToWorker(b"w1", protocol.Retire())]
    assert w1.retirement is Retirement.TOLD
    sim("bye-7", ev.WorkerLeft, b"w1")
    told = [(e.from_, e.to, e.stimulus, e.note) for e in sim.s.story("worker:w1") if e.subject == "worker"]
    assert told == [
        ("-", "joined", "hello-1", "host host pid 11"),
        ("serving", "retiring", "retire-4", "2 tasks, 0 partitions to finish"),
        ("retiring", "told to retire", "results-6", ""),
        ("joined", "retired", "bye-7", "0 tasks, 0 partitions handed back"),
    ]


def test_a_lanes_story_tells_its_reader_coming_ending_and_leaving():
    """lane:RUN/INDEX keeps the moves of one reader's lane: a rank that never came has none, so a
    run waiting on it shows which rank it waits for."""
    sim = Sim()
    sim("hello-1", ev.WorkerJoined, b"w1", "host", 11)
    run = sim.start(2, world_size=2)
    sim("read-2", ev.InputsRead, run, [item(p) for p in range(2)])
    sim("results-3", ev.ResultsReceived, b"w1", run, [item(0, 0.0), item(1, 1.0)])
    lane = [(e.key, e.from_, e.to, e.stimulus, e.note) for e in sim.s.story(f"lane:{run}/0")]
    assert lane == [
        (f"{run}/0", "awaited", "reading", "epoch-c0", "from index 0"),
        (f"{run}/0", "reading", "done", "results-3", "1 sent"),
    ]
    assert sim.s.story(f"lane:{run}/1") == []  # rank 1 has not come: the run waits for it
    solo = Sim()
    first = solo.start(4)
    out = solo("epoch-5", ev.EpochRequested, b"req-c0", b"c0", 2)  # the reader moves on to epoch 2
    (reply,) = [i.msg for i in out if isinstance(i, Reply)]
    solo("checked-6", ev.RunChecked, reply.run)  # accepted: its reader leaves the first run
    assert moves(solo, f"lane:{first}/0") == [
        ("awaited", "reading", "", "epoch-c0"),
        ("reading", "gone", "", "checked-6"),
    ]

"""A lane's state (jobs.LaneState): awaited, reading, done or gone, moved only by the lane's
attach, end and leave, along its table. The lane alone, then the scheduler driven by events
(strict, `validate` after every event) with `Scheduler.lanes`, the run's end and each event's
exact instructions checked."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import pytest
from test_scheduler import expect

from ppclient import protocol
from ppclient.protocol import Item
from ppserver.scheduler import Instruction, Lane, LaneState, Reply, Scheduler, Settings
from ppserver.scheduler import events as ev
from ppserver.scheduler.jobs import RunState

pytestmark = pytest.mark.unit

AWAITED, READING, DONE, GONE = LaneState


def item(pos: int, value: Optional[float] = None) -> Item:
    seq = {"data": np.full((2,), pos if value is None else value, dtype="float32"), "seq_tag": f"s{pos}"}
    return protocol.seq_to_item({**seq, "seq_idx": pos, "complete_frac": 0.0}, pos)


# ---- the lane alone ---------------------------------------------------------------------------
def test_a_lane_is_awaited_then_reading_done_gone_and_read_again_by_its_methods():
    lane = Lane(index=1)
    assert lane.state is AWAITED and not lane.live and not lane.settled
    lane.attach(b"c0", 2, now=5.0, lanes=2)
    assert (lane.state, lane.consumer, lane.start, lane.attached_at) == (READING, b"c0", 2, 5.0)
    assert lane.live and not lane.done and not lane.gone and not lane.settled
    lane.end()
    assert lane.state is DONE and lane.done and lane.ended and not lane.live and lane.settled
    lane.leave()
    assert lane.state is GONE and lane.gone and lane.ended and lane.settled  # it had ended: the run is done
    assert lane.consumer == b"c0"  # kept: its client's late words still find the lane
    lane.attach(b"c1", 3, now=6.0, lanes=2)  # (a solo run's own lane, made up gone, is taken so)
    assert (lane.state, lane.consumer, lane.ended) == (READING, b"c1", False)


def test_a_client_taking_a_reading_lane_over_starts_it_afresh_and_keeps_what_it_still_wants():
    lane = Lane(index=0)
    lane.attach(b"old", 0, now=0.0, lanes=2)
    lane.granted, lane.delivered, lane.connected = 8, 3, True
    lane.ready.extend([item(6), item(8)])  # indices 3 and 4 of lane 0 of 2
    lane.attach(b"new", 4, now=1.0, lanes=2)
    assert lane.state is READING and lane.consumer == b"new"
    assert (lane.granted, lane.delivered, lane.connected) == (0, 0, False)
    assert [it.pos for it in lane.ready] == [8]  # index 3 is before its start: dropped


def test_a_done_direct_lane_is_settled_only_once_its_consumer_took_every_seq():
    lane = Lane(index=0)
    lane.attach(b"c0", 0, now=0.0, lanes=1)
    lane.direct, lane.granted, lane.delivered, lane.consumed = True, 4, 4, 3
    lane.end()
    assert lane.done and not lane.settled
    lane.consumed = 4
    assert lane.settled


@pytest.mark.parametrize(
    "state, move",
    [(AWAITED, "end"), (DONE, "end"), (GONE, "end"), (GONE, "leave")],
)
def test_a_move_off_the_table_raises_and_leaves_the_lane_as_it_was(state: LaneState, move: str):
    consumer = None if state is AWAITED else b"c0"
    lane = Lane(index=3, state=state, consumer=consumer, ended=state is DONE)
    with pytest.raises(AssertionError, match=f"lane 3: {state.value} -> .* is not a move of a lane"):
        getattr(lane, move)()
    assert (lane.state, lane.consumer, lane.ended) == (state, consumer, state is DONE)


@pytest.mark.parametrize("state", list(LaneState))
def test_every_state_may_be_attached_and_every_one_but_gone_may_leave(state: LaneState):
    consumer = None if state is AWAITED else b"c0"
    lane = Lane(index=0, state=state, consumer=consumer)
    lane.attach(b"c9", 0, now=0.0, lanes=1)
    assert lane.state is READING
    if state is not GONE:
        left = Lane(index=0, state=state, consumer=consumer)
        left.leave()
        assert left.state is GONE


# ---- the scheduler ----------------------------------------------------------------------------
class Sim:
    """A strict scheduler of two ranks of job "train" and one worker; `validate` after every event."""

    def __init__(self) -> None:
        settings = Settings(buf_size=8, heartbeat_interval=1.0, heartbeat_timeout=5.0)
        self.s = Scheduler(settings, strict=True)
        self.now = 0.0
        self.out: List[Instruction] = []
        self("join", ev.WorkerJoined, b"w1", "host", 1)

    def __call__(self, stimulus: str, event_type, *args, **kw) -> List[Instruction]:
        out = self.s.handle(event_type(self.now, *args, stimulus=stimulus, **kw))
        self.s.validate()
        self.out += out
        return out

    def request(self, consumer: bytes, rank: int, epoch: int = 1, start: int = 0, prepares: bool = False) -> int:
        """Rank `rank` asks for `epoch` from `start`: accepted, with the dataset set up for a new
        run first if it `prepares` one. The run it reads."""
        out = self(
            f"epoch-{consumer.decode()}",
            ev.EpochRequested,
            b"req-" + consumer,
            consumer,
            epoch,
            job="train",
            rank=rank,
            world_size=2,
            start=start,
        )
        reply = out[-1]
        assert isinstance(reply, Reply) and isinstance(reply.msg, protocol.EpochAccepted), reply
        expect(out[:-1], *([("prepare", reply.msg.run, epoch)] if prepares else []))
        return reply.msg.run

    def work(self, run: int, positions: Sequence[int]) -> Tuple[List[Instruction], List[Instruction]]:
        """The reader reads `positions` and the worker maps them: what each of the two causes."""
        read = self("read", ev.InputsRead, run, [item(p) for p in positions])
        return read, self("results", ev.ResultsReceived, b"w1", run, [item(p, p * 10.0) for p in positions], [])


def two_ranks(num_seqs: int, credit1: int) -> Sim:
    """Ranks 0 and 1 read run 1, rank 0 with credit for its shard, rank 1 with `credit1`."""
    sim = Sim()
    assert sim.request(b"r0", 0, prepares=True) == 1 and sim.request(b"r1", 1) == 1
    assert sim.s.lanes(1) == {0: "reading", 1: "reading"}
    expect(sim("credit-r0", ev.CreditGranted, b"r0", 1, 100))
    expect(sim("credit-r1", ev.CreditGranted, b"r1", 1, credit1))
    expect(sim("checked", ev.RunChecked, 1))
    out = sim("started", ev.RunStarted, 1, 1, num_seqs)
    expect(out, (b"r0", "started"), (b"r1", "started"), (b"w1", "run_open"), ("read", 1, list(range(num_seqs))))
    return sim


def test_lanes_report_reading_done_and_gone_and_a_run_one_of_whose_ranks_ended_before_leaving_is_done():
    sim = two_ranks(4, credit1=1)
    read, results = sim.work(1, range(4))
    expect(read, (b"w1", "tasks", [0, 1, 2, 3]), ("stop_reading", 1))
    # rank 1 has credit for one of its two seqs: only rank 0 ends
    expect(results, (b"r0", "seqs", [0, 2]), (b"r1", "seqs", [1]), (b"r0", "end"))
    assert sim.s.lanes(1) == {0: "done", 1: "reading"}
    expect(sim("closed-r0", ev.ConsumerClosed, b"r0"))
    assert sim.s.lanes(1) == {0: "gone", 1: "reading"}  # rank 0 ended, then left
    expect(sim("closed-r1", ev.ConsumerClosed, b"r1"), (b"w1", "run_close"))  # before its shard was out
    assert (
        sim.s.lanes(1) == {} and sim.s.status(sim.now).newest.state is RunState.DONE
    )  # one ended: done, not superseded


def test_a_run_whose_ranks_all_left_before_any_ended_is_superseded():
    sim = two_ranks(4, credit1=1)
    read, results = sim.work(1, [0, 1])
    expect(read, (b"w1", "tasks", [0, 1]))
    expect(results, (b"r0", "seqs", [0]), (b"r1", "seqs", [1]))
    expect(sim("closed-r0", ev.ConsumerClosed, b"r0"))
    assert sim.s.lanes(1) == {0: "gone", 1: "reading"}
    expect(sim("closed-r1", ev.ConsumerClosed, b"r1"), ("stop_reading", 1), (b"w1", "run_close"))  # no end
    assert sim.s.status(sim.now).newest.state is RunState.SUPERSEDED


def test_a_rank_resuming_behind_its_release_leaves_the_main_run_for_a_solo_run_of_its_own_lane():
    sim = two_ranks(8, credit1=100)
    sim.work(1, range(4))
    solo = sim.request(b"r1b", 1, start=0, prepares=True)  # positions 1 and 3 went to rank 1 already
    assert solo != 1
    assert sim.s.lanes(solo) == {1: "reading"}  # its other lane is gone from the start: not kept
    assert sim.s.lanes(1) == {0: "reading", 1: "reading"}  # it leaves once the reader checked it
    expect(sim("checked-solo", ev.RunChecked, solo), (b"r1", "superseded"))  # its old client hears it
    assert sim.s.lanes(1) == {0: "reading", 1: "gone"}


def test_a_run_of_the_next_epoch_awaits_a_rank_still_reading_the_last_one():
    sim = two_ranks(2, credit1=0)
    _, results = sim.work(1, [0, 1])
    expect(results, (b"r0", "seqs", [0]), (b"r0", "end"))
    assert sim.s.lanes(1) == {0: "done", 1: "reading"}
    run2 = sim.request(b"r0", 0, epoch=2, prepares=True)
    assert sim.s.lanes(run2) == {0: "reading"}  # rank 1 has no state of its own there: awaited
    assert sim.s.state.runs[run2].view(1).state is AWAITED and sim.s.state.runs[run2].awaited(8) == [1]
    expect(sim("checked-2", ev.RunChecked, run2))
    assert sim.s.lanes(1) == {0: "gone", 1: "reading"}  # rank 0 left epoch 1, which it had finished


def test_a_new_run_of_an_epoch_a_rank_finished_has_that_lane_gone_from_the_start():
    sim = two_ranks(2, credit1=0)
    sim.work(1, [0, 1])
    expect(sim("closed-r1", ev.ConsumerClosed, b"r1"), (b"w1", "run_close"))
    assert sim.s.state.runs == {} and sim.s.status(sim.now).newest.state is RunState.DONE  # rank 0 ended, rank 1 left
    run = sim.request(b"r1b", 1, prepares=True)  # rank 1 comes back for epoch 1: a new run, which rank 0 will not read
    assert run != 1 and sim.s.lanes(run) == {0: "gone", 1: "reading"}


def test_validate_names_a_lane_whose_fields_disagree_with_its_state():
    sim = two_ranks(4, credit1=1)
    lane = sim.s.state.runs[1].lanes[1]
    lane.consumer = None
    with pytest.raises(AssertionError, match="run 1, lane 1: reading, with client None"):
        sim.s.validate()
    lane.consumer = b"r1"
    lane.ended = True
    with pytest.raises(AssertionError, match="run 1, lane 1: reading, yet End was sent"):
        sim.s.validate()

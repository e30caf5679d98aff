"""The scheduler's parts work on its state (scheduler/state.py) and the parts handed to them, not
on the Scheduler: built over a `SchedulerState` alone, they take a run from request to its first
output word, with the instructions the Scheduler's event table would give."""

from __future__ import annotations

from typing import List

import pytest

from ppclient.protocol import EpochAccepted, RunOpen, Started
from ppserver.scheduler import Instruction, Prepare, Reply, Scheduler, SchedulerState, Settings, ToClient, ToWorker
from ppserver.scheduler import events as ev
from ppserver.scheduler.delivery import Delivery
from ppserver.scheduler.invariants import validate
from ppserver.scheduler.requests import Requests
from ppserver.scheduler.runs import Lifecycle
from ppserver.scheduler.skips import Skips
from ppserver.scheduler.workers import RETIRING, SERVING, TOLD, Departure, WorkerState

pytestmark = pytest.mark.unit


def test_the_parts_take_a_run_from_request_to_start_over_the_state_alone():
    state = SchedulerState(Settings(fingerprint="fp", instance="i"), strict=True, next_run=41)
    skips = Skips(state)
    life = Lifecycle(state, skips)
    delivery = Delivery(state, life)
    requests = Requests(state, life)
    state.workers[b"w"] = WorkerState(wid=b"w", host="h", pid=1, local_index=None, capacity=1, joined=0, last_seen=0)

    out: List[Instruction] = []
    requests.request(ev.EpochRequested(0.0, b"req", b"c0", 3), out)
    assert out == [Prepare(41, 3), Reply(b"req", EpochAccepted(run=41, instance="i", fingerprint="fp"))]
    run = state.runs[41]
    assert state.last_run is run and state.job is run.job and state.next_run == 42

    out = []
    life.started(ev.RunStarted(1.0, 41, 3, 2), out)  # the client has not connected: its Started waits
    assert out == [ToWorker(b"w", RunOpen(run=41, epoch=3, check_tags=False, pad={}))]

    out = []
    delivery.credit(ev.CreditGranted(2.0, b"c0", 41, 10), out)  # it has: what waited goes out
    assert out == [ToClient(b"c0", Started(run=41, num_seqs=2, fingerprint="fp", batching=None))]
    assert state.job is not None and state.job.clients[b"c0"].alive_at == 2.0  # credit is a sign of life
    validate(state)


def test_the_scheduler_owns_one_state_its_parts_share():
    sched = Scheduler(Settings(), strict=True)
    state = sched.state
    assert sched.requests.state is state and sched.lifecycle.state is state
    assert sched.delivery.state is state and sched.skips.state is state
    assert sched.requests.lifecycle is sched.lifecycle and sched.delivery.lifecycle is sched.lifecycle
    sched.handle(ev.EpochRequested(0.0, b"req", b"c0", 1))
    assert list(state.runs) == [1] and sched.status(0.0).newest is not None and sched.status(0.0).newest.run == 1


def test_the_scheduler_is_given_its_first_run_id_and_counts_on_from_it():
    sched = Scheduler(Settings(), strict=True, first_run=1 << 39)
    for consumer, epoch in ((b"c0", 1), (b"c1", 2)):
        out = sched.handle(ev.EpochRequested(0.0, b"req", consumer, epoch))
        assert [i.msg.run for i in out if isinstance(i, Reply)] == [(1 << 39) + epoch - 1]
    assert list(sched.state.runs) == [1 << 39, (1 << 39) + 1] and sched.state.next_run == (1 << 39) + 2


def test_a_workers_retirement_moves_once_each_way_and_validate_holds_it_to_what_it_holds():
    """SERVING -> RETIRING -> TOLD, each move in the story; a retiring worker holding nothing (it
    should have been told) and a told one holding work are errors validate names."""
    state = SchedulerState(Settings(), strict=True)
    w = state.workers[b"w"] = WorkerState(
        wid=b"w", host="h", pid=1, local_index=None, capacity=2, joined=0, last_seen=0
    )
    story = state.story_log
    assert w.retirement is SERVING and not w.retiring and w.free() == 2
    w.tasks.add((1, 0))
    with pytest.raises(AssertionError, match="worker w: serving -> told to retire"):
        w.tell_to_retire(story)
    w.retire(story)
    assert w.retirement is RETIRING and w.retiring and w.free() == 1  # its credit; placement gives it nothing
    with pytest.raises(AssertionError, match="worker w: retiring -> retiring"):
        w.retire(story)
    with pytest.raises(AssertionError, match="worker w: retiring -> told to retire, holding 1 tasks, 0 partitions"):
        w.tell_to_retire(story)
    w.tasks.clear()
    with pytest.raises(AssertionError, match="worker w retires and holds nothing, yet was not told to"):
        validate(state)
    w.tell_to_retire(story)
    assert w.retirement is TOLD and w.retiring
    validate(state)
    w.partitions.add((1, 0))
    with pytest.raises(AssertionError, match="worker w was told to retire, yet holds work"):
        validate(state)
    rows = [(e.from_, e.to, e.note) for e in story.select([("worker", "w")])[0]]
    assert rows == [("serving", "retiring", "1 tasks, 0 partitions to finish"), ("retiring", "told to retire", "")]


def test_a_worker_drops_its_tasks_one_by_one_and_rejoins_when_its_suspect_leaves():
    """held_of lists one run's tasks (or partitions), ascending; drop_task frees a slot, and an
    isolating worker whose last task left rejoins, told to the story between its joining and leaving."""
    state = SchedulerState(Settings(), strict=True)
    story = state.story_log
    w = WorkerState(wid=b"w", host="h", pid=7, local_index=None, capacity=3, joined=0, last_seen=0)
    w.join(story)
    w.tasks.update({(2, 9), (1, 4), (2, 3)})
    w.partitions.add((5, 1))
    assert w.held_of(2) == [3, 9] and w.held_of(1) == [4] and w.held_of(5) == [1] and w.held_of(6) == []
    w.drop_task(2, 9, story)
    w.drop_task(2, 3, story)
    assert w.held_of(2) == [] and w.free() == 2
    w.drop_task(1, 4, story)  # its last task, not a suspect: nothing to rejoin
    w.isolate(story, "seq 8 of run 2")
    w.tasks.add((2, 8))
    w.drop_task(2, 8, story)
    assert w.isolation.value == "normal" and not w.tasks
    w.leave(story, Departure.LOST, "0 tasks, 1 partitions handed back")
    rows = [(e.from_, e.to, e.note) for e in story.select([("worker", "w")])[0]]
    assert rows == [
        ("-", "joined", "host h pid 7"),
        ("normal", "isolating", "seq 8 of run 2"),
        ("isolating", "normal", ""),
        ("joined", "lost", "0 tasks, 1 partitions handed back"),
    ]

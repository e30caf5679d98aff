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
from ppserver.scheduler.workers import WorkerState

pytestmark = pytest.mark.unit


def test_the_parts_take_a_run_from_request_to_start_over_the_state_alone():
    state = SchedulerState(Settings(fingerprint="fp", instance="i"), strict=True)
    skips = Skips(state)
    life = Lifecycle(state, skips)
    delivery = Delivery(state, life)
    requests = Requests(state, life)
    state.next_run = 40
    state.workers[b"w"] = WorkerState(wid=b"w", host="h", pid=1, local_index=None, capacity=1, joined=0, last_seen=0)

    out: List[Instruction] = []
    requests.request(ev.EpochRequested(0.0, b"req", b"c0", 3), out)
    assert out == [Prepare(41, 3), Reply(b"req", EpochAccepted(run=41, instance="i", fingerprint="fp"))]
    run = state.runs[41]
    assert state.last_run is run and state.job is run.job and state.next_run == 41

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

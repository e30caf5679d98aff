"""What `Scheduler.validate` checks: the invariants the scheduler's docstrings state, over its
whole state (tests call it after every event; it costs what the state holds, so the server
never does).

Workers: a worker holds at most its credit (buf_size) of tasks, one that isolates its suspect alone; every task and
stream partition it holds belongs to a live run's dispatch, which says the same (each dispatch
checks its own side: `Dispatch.validate`); it retains inputs only of runs that ended. A
retiring worker is told to exit once it holds nothing, at once (between events none waits), and
one told holds nothing.
Runs: the live runs are the job's, preparing (no dispatch yet) or running; an ended run holds
nothing. Lanes: a lane's index is its key; its fields agree with its state (a client while
reading or done, End sent exactly when done, unless it left since); its consumer has taken no
more than it was sent, and was sent no more than it granted, all of it released from its start
on; nothing waits to be sent between events; messages are held only for a client that has not
connected.
"""

from __future__ import annotations

from ppserver.scheduler.delivery import MAX_GRANT_AHEAD
from ppserver.scheduler.jobs import DONE, GONE, READ_STATES_OF, READING, Lane, Run, RunState
from ppserver.scheduler.state import SchedulerState
from ppserver.scheduler.workers import NORMAL, RETIRING, TOLD


def validate(s: SchedulerState) -> None:
    _workers(s)
    job = s.job
    if job is not None:
        assert job.runs.keys() == s.runs.keys(), (
            f"the job's runs {sorted(job.runs)} are not the live ones {sorted(s.runs)}"
        )
        for consumer, client in job.clients.items():
            assert 0 <= client.lane < job.lanes, f"client {consumer!r} reads lane {client.lane} of {job.lanes}"
    else:
        assert not s.runs, f"live runs {sorted(s.runs)} without a job"
    for run in s.runs.values():
        _run(s, run)
        if run.dispatch is not None:
            run.dispatch.validate(s.workers)
    ended = [run for run, _ in s.unheard.values()] + ([s.last_run] if s.last_run is not None else [])
    for run in ended:
        if not run.live:
            assert run.dispatch is None or not run.dispatch.holds(), f"run {run.run} ended, yet holds inputs"
            assert all(not lane.ready for lane in run.lanes.values()), f"run {run.run} ended, yet releases outputs"
            assert run.reading in READ_STATES_OF[run.state], f"run {run.run} ended, yet reading {run.reading.value}"
    for (run_id, consumer), (run, lane) in s.unheard.items():
        assert run.run == run_id and lane.consumer == consumer, f"run {run_id}: unheard lane of another"
        assert not run.live and lane.held and not lane.connected, f"run {run_id}: unheard, yet live or heard"


def _workers(s: SchedulerState) -> None:
    for wid, w in s.workers.items():
        assert w.retirement is not RETIRING or not w.holds_nothing, (
            f"worker {w.name} retires and holds nothing, yet was not told to"
        )
        assert w.retirement is not TOLD or w.holds_nothing, f"worker {w.name} was told to retire, yet holds work"
        assert w.wid == wid, f"worker {wid!r} registered as {w.wid!r}"
        assert len(w.tasks) <= w.capacity, f"worker {w.name} holds {len(w.tasks)} tasks, above its credit {w.capacity}"
        assert w.isolation is NORMAL or len(w.tasks) == 1, f"worker {w.name} isolates, yet holds {len(w.tasks)} tasks"
        for run_id, _ in w.tasks | w.partitions:
            run = s.runs.get(run_id)
            assert run is not None and run.dispatch is not None, (
                f"worker {w.name} holds work of run {run_id}, not running"
            )
        live = [run_id for run_id in w.retained if run_id in s.runs]
        assert not live, f"worker {w.name} retains inputs of live runs {live}"


def _run(s: SchedulerState, run: Run) -> None:
    where = f"run {run.run}"
    assert run.live and run.job is s.job, f"{where}: {run.state.value}, yet among the live runs"
    assert (run.dispatch is None) == (run.state is RunState.PREPARING), (
        f"{where}: {run.state.value}, dispatch {run.dispatch}"
    )
    assert run.reading in READ_STATES_OF[run.state], f"{where}: {run.state.value}, yet reading {run.reading.value}"
    assert len(run.group) < run.job.world or not run.group, f"{where}: a complete group of ranks not released"
    for index, lane in run.lanes.items():
        assert lane.index == index and 0 <= index < run.width, f"{where}: lane {lane.index} under {index}"
        _lane(s, run, lane)


def _lane(s: SchedulerState, run: Run, lane: Lane) -> None:
    where = f"run {run.run}, lane {lane.index}"
    assert not lane.ready, f"{where}: {len(lane.ready)} outputs released and not sent"
    assert 0 <= lane.consumed <= lane.delivered, f"{where}: {lane.consumed} taken of {lane.delivered} sent"
    assert lane.delivered <= lane.granted, f"{where}: {lane.delivered} sent, {lane.granted} granted"
    assert lane.granted <= lane.delivered + MAX_GRANT_AHEAD, f"{where}: {lane.granted} granted, beyond the cap"
    assert lane.start + lane.delivered <= max(lane.start, lane.released), (
        f"{where}: {lane.delivered} sent from index {lane.start}, yet only {lane.released} released"
    )
    state = lane.state
    assert state is GONE or (lane.consumer is not None) == (state is READING or state is DONE), (
        f"{where}: {state.value}, with client {lane.consumer!r}"
    )
    sent = "was" if lane.ended else "not"
    assert state is GONE or lane.ended == (state is DONE), f"{where}: {state.value}, yet End {sent} sent"
    assert not lane.connected or lane.consumer is not None, f"{where}: connected without a client"
    assert not lane.held or not lane.connected, f"{where}: messages held for a client that connected"
    job = run.job
    if state is READING or state is DONE:
        assert lane.consumer in job.clients, f"{where}: its client {lane.consumer!r} is gone, yet the lane is not"

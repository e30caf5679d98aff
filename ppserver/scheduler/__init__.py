"""The scheduler, a pure state machine: `Scheduler.handle(event) -> instructions`.

`events` lists what can happen, `instructions` what the server is asked to do. `core` holds the
event table and the workers; `state` what the scheduler holds between events (`Scheduler.state`),
which the parts work on: `requests` the job and who reads which run, `runs` a run's life,
`delivery` the release into the lanes, `skips` the seqs map_seq skipped, `status` what it tells,
`invariants` what `validate` checks. `jobs` holds the job's runs and their per-rank lanes, with the states of both;
`dispatch` the interface of a run's
dispatch, common and per mapper style, implemented by `seqs` (with its states in `seqstates`)
and `streams`; `placement` decides where work goes: which worker takes the next tasks (`seqs`)
and which runs a stream partition (`streams`).
`elastic` is a pure state machine of its own beside it: how many workers the pool should have.
"""

from ppserver.scheduler import events
from ppserver.scheduler.core import MAX_READERS, Scheduler
from ppserver.scheduler.dispatch import Dispatch
from ppserver.scheduler.instructions import Instruction, Prepare, Read, Replay, Reply, StopReading, ToClient, ToWorker
from ppserver.scheduler.jobs import Job, Lane, LaneState, Run, RunState
from ppserver.scheduler.settings import Failure, Settings
from ppserver.scheduler.state import SchedulerState
from ppserver.scheduler.workers import Departure, InputPath, InputWay, WorkerState

__all__ = [
    "events",
    "MAX_READERS",
    "Scheduler",
    "Dispatch",
    "Instruction",
    "Prepare",
    "Read",
    "Replay",
    "Reply",
    "StopReading",
    "ToClient",
    "ToWorker",
    "Job",
    "Lane",
    "LaneState",
    "Run",
    "RunState",
    "Failure",
    "Settings",
    "SchedulerState",
    "Departure",
    "InputPath",
    "InputWay",
    "WorkerState",
]

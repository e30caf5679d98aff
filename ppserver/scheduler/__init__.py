"""The scheduler, a pure state machine: `Scheduler.handle(event) -> instructions`.

`events` lists what can happen, `instructions` what the server is asked to do, `core` holds
workers, the job and delivery, `jobs` the job's runs and their per-rank lanes, `seqs` and
`streams` the dispatch of the two mapper styles.
"""

from ppserver.scheduler import events
from ppserver.scheduler.core import MAX_READERS, Scheduler
from ppserver.scheduler.instructions import Instruction, Prepare, Read, Replay, Reply, StopReading, ToClient, ToWorker
from ppserver.scheduler.jobs import Job, Lane, Run
from ppserver.scheduler.settings import Failure, Settings
from ppserver.scheduler.workers import Departure, WorkerState

__all__ = [
    "events",
    "MAX_READERS",
    "Scheduler",
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
    "Run",
    "Failure",
    "Settings",
    "Departure",
    "WorkerState",
]

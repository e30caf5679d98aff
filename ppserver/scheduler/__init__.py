"""The scheduler, a pure state machine: `Scheduler.handle(event) -> instructions`.

`events` lists what can happen, `instructions` what the server is asked to do, `core` holds
workers, runs and delivery, `seqs` and `streams` the dispatch of the two mapper styles.
"""

from . import events
from .core import Run, Scheduler
from .instructions import Instruction, ReadUpTo, Replay, StopReading, ToClient, ToWorker
from .settings import Failure, Settings
from .workers import Departure, WorkerState

__all__ = [
    "events",
    "Run",
    "Scheduler",
    "Instruction",
    "ReadUpTo",
    "Replay",
    "StopReading",
    "ToClient",
    "ToWorker",
    "Failure",
    "Settings",
    "Departure",
    "WorkerState",
]

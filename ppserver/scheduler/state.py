"""What the scheduler holds between events, owned in one place.

`Scheduler` (core.py) keeps one `SchedulerState`; its parts (requests, runs, delivery, skips)
and what reads it (status, invariants) are handed this object and the parts they call, never
the Scheduler, so none of them reaches back into the event table. Runs, lanes and the job are
jobs.py's, a worker's view is workers.py's, a task's state is its run's dispatch's: this is the
scheduler's index of them, its counters for status, and the time and name of the event being
handled (kept once, in the story, which stamps every move with them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Counter, Dict, Optional, Tuple

from ppserver.scheduler.events import Stimuli
from ppserver.scheduler.jobs import Job, Lane, Run
from ppserver.scheduler.settings import Settings
from ppserver.scheduler.story import Story
from ppserver.scheduler.workers import Departure, WorkerState


@dataclass(eq=False, slots=True)
class SchedulerState:
    """The scheduler's state; each field says why it is kept."""

    # The server's plain settings (settings.py): credit, timeouts, mapper mode, what to keep.
    settings: Settings
    # Check every seq's move against its table (tests); the server's hot path skips it.
    strict: bool = False
    # The registered workers by id: who may get work, and whose work is handed back when it goes.
    workers: Dict[bytes, WorkerState] = field(default_factory=dict)
    # The one job served (None: none yet); another is refused while its clients live.
    job: Optional[Job] = None
    # The job's live runs by id (preparing or running): what events about a run find.
    runs: Dict[int, Run] = field(default_factory=dict)
    # Ended lanes whose client has not connected yet: their last words wait for it (briefly).
    unheard: Dict[Tuple[int, bytes], Tuple[Run, Lane]] = field(default_factory=dict)
    # The newest run, live or not: what status tells about once it ended.
    last_run: Optional[Run] = None
    # The id the next run gets: the Scheduler is given the first (the server's is random, so a
    # restart never reuses an id a client may still hold data for).
    next_run: int = 1
    # Counters over every run, for status: seqs sent to clients, seqs map_seq skipped, ...
    total_delivered: int = 0
    skipped_total: int = 0
    malformed_results: int = 0  # results (and worker messages) that did not decode
    lost_direct: int = 0  # direct results a consumer reported missing (made again)
    lost_inputs: int = 0  # inputs a worker could not read (made again)
    dropped_by_workers: int = 0  # messages workers dropped unread (what they carried redone)
    # Why workers left, counted (status).
    departures: Counter[Departure] = field(default_factory=Counter)
    # Tasks and stream partitions taken back from workers that left (status).
    handed_back: int = 0
    # When workers and clients were last sent a heartbeat or keepalive: one per heartbeat_interval.
    last_beat: float = float("-inf")
    # What the reader is doing, as the last Tick said (None: idle): what a preparing run waits for.
    reader_busy: Optional[str] = None
    # Names events that come without a stimulus id (tests; the server names its own).
    stimuli: Stimuli = field(default_factory=Stimuli)
    # The moves, with their stimuli (story.py): sized by settings.story_length, allocated once;
    # it keeps the time and stimulus of the event being handled (`now`, `stimulus` below).
    story_log: Story = field(init=False)
    # Handlers that raised (Scheduler.handle contains them): each failed its run.
    internal_errors: int = 0

    def __post_init__(self) -> None:
        self.story_log = Story(self.settings.story_length)

    def begin(self, now: float, stimulus: str) -> None:
        """The event handled next: its time (events carry it; the scheduler has no clock) and name."""
        story = self.story_log
        story.now = now
        story.stimulus = stimulus

    @property
    def now(self) -> float:
        """The time of the event being handled."""
        return self.story_log.now

    @property
    def stimulus(self) -> str:
        """The stimulus id of the event being handled."""
        return self.story_log.stimulus

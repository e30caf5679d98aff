"""Seqs map_seq skipped (it returned None): counted for each run and in all, logged (at most a line
a second, whatever their rate), and a run failed once they exceed `max_skipped` of its epoch's seqs.

Which seqs are skipped depends only on the mapper's result, so the count a run reaches is the same
for any worker count; only when the run notices that the count is over the limit depends on timing.
The limit is checked as each skip arrives, and again once the epoch's count of seqs is known (a
dataset that learns it by reading).
"""

from __future__ import annotations

import functools
import logging
from typing import List, Optional

from ppclient.protocol import FailureKind
from ppclient.throttle import Throttled
from ppserver.scheduler.dispatch import SeqWork
from ppserver.scheduler.jobs import Run
from ppserver.scheduler.settings import Failure
from ppserver.scheduler.state import SchedulerState

log = logging.getLogger("ppserver.scheduler")

NAMED = 8  # tags a run keeps of its skipped seqs, for the error that fails it


class Skips:
    """The skipped seqs of the scheduler's runs (their count over every run: `state.skipped_total`)."""

    def __init__(self, state: SchedulerState):
        self.state = state
        self.logged = Throttled(log, "map_seq skipped seqs (returned None)")

    def taken(self, run: Run, now: float) -> Optional[Failure]:
        """Count what the run's dispatch accepted since the last event; the failure if the run
        skipped more than it may."""
        d = run.dispatch
        if not isinstance(d, SeqWork) or not d.skips:
            return None
        for pos, n, tags in d.skips:
            run.skipped += n
            self.state.skipped_total += n
            room = NAMED - len(run.skipped_tags)
            if room > 0:
                run.skipped_tags += tags[:room]
            self.logged.hit(functools.partial(_line, run, pos, n, tags), n, now=now)
        d.skips.clear()
        return self.over(run)

    def over(self, run: Run) -> Optional[Failure]:
        """The run's failure if its skipped seqs exceed max_skipped of its epoch's (None while that
        count is not known)."""
        limit = self.state.settings.max_skipped
        seqs = run.seqs
        if not run.skipped or seqs is None or run.skipped <= limit * seqs:
            return None
        tags = ", ".join(repr(t) for t in run.skipped_tags)
        more = run.skipped - len(run.skipped_tags)
        named = f": {tags}" + (f" and {more} more" if more > 0 else "") if tags else ""
        message = (
            f"map_seq skipped {run.skipped} seqs of epoch {run.epoch} (returned None), more than max_skipped "
            f"({limit:g} of its {seqs} seqs){named}"
        )
        return Failure(FailureKind.MAPPER, message, seq_tag=run.skipped_tags[0] if run.skipped_tags else None)


def _line(run: Run, pos: int, n: int, tags: List[str]) -> str:
    what = f"seq {tags[0]!r}" if n == 1 and tags else f"{n} seqs ({', '.join(map(repr, tags))})"
    where = "batch" if run.job.batching is not None else "position"
    return f"{what} of epoch {run.epoch} ({where} {pos}, run {run.run})"

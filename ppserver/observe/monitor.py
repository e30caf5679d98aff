"""What the server tells about its progress: stage timings, status fields, progress log lines
and, with --metrics, Prometheus metrics. One object, so the server's loop has a few hooks.

Everything runs in the I/O thread with the loop's clock passed in; the metrics endpoint
only reads what `tick` publishes.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Tuple

from ppserver.observe.progress import Progress, Sample, Window, progress_line, status_fields
from ppserver.observe.stages import StageClock
from ppserver.observe.status import ServerStatus
from ppserver.scheduler import RunState, Scheduler
from ppserver.scheduler.status import SchedulerStatus

log = logging.getLogger("ppserver.progress")


class Monitor:
    def __init__(
        self,
        sched: Scheduler,
        reader: Any,
        *,
        stream: bool,
        progress_interval: float,
        metrics: Optional[Tuple[str, int]] = None,
    ):
        self.sched = sched
        self.stages = StageClock(sched, reader, stream=stream)
        self.window = Window()
        self.interval = progress_interval
        self.logged_at: Optional[float] = None
        self.metrics_address = metrics
        self.exporter: Any = None
        self.failed_at = float("-inf")

    def start(self) -> None:
        """Serve the metrics (if asked to); raises OSError if the address cannot be bound."""
        if self.metrics_address is not None and self.exporter is None:
            from ppserver.observe.metrics import Exporter

            self.exporter = Exporter(*self.metrics_address)

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None

    def _running(self) -> Dict[int, int]:
        return {r.run: r.epoch for r in self.sched.state.runs.values() if r.state is RunState.RUNNING}

    def tick(self, now: float, status: Callable[[], ServerStatus]) -> None:
        """Called by the loop's housekeeping; samples about once a second, logs every interval.
        A failure here is logged (at most once a minute) and never touches the epochs."""
        try:
            self._tick(now, status)
        except Exception:
            if now - self.failed_at >= 60.0:
                self.failed_at = now
                log.exception("progress and metrics failed")

    def _tick(self, now: float, status: Callable[[], ServerStatus]) -> None:
        if self.window.due(now):
            stages = self.stages
            stages.prune(self.sched.state.runs)
            seconds, seqs = stages.totals()
            self.window.add(Sample(now, stages.total_delivered, dict(stages.run_delivered), seconds, seqs))
            if self.exporter is not None:
                from ppserver.observe.metrics import families

                self.exporter.publish(families(stages, status()))
        if self.interval > 0:
            if self.logged_at is None:
                self.logged_at = now
            elif now - self.logged_at >= self.interval:
                self.logged_at = now
                self._log(status())

    def _log(self, st: ServerStatus) -> None:
        for run in st.progress.progress:
            log.info("%s", progress_line(run, st.progress.held_back_by))

    def status(self, st: SchedulerStatus) -> Progress:
        """The fields `ppserver status` adds to the scheduler's (see progress.status_fields)."""
        return status_fields(st, self.window, self._running())

"""Rolling rates, ETAs and which side holds an epoch back, from samples of the stage timings.

The server samples its counters about once a second (time passed in, as everywhere in the
scheduler's world); the last WINDOW_S seconds give the rolling rate, the mean time per seq
in each stage (stages.py) and so the side that holds the epoch back:

- the trainer, when seqs whose turn has come wait for credit;
- the workers, when inputs wait for a worker or results wait for a slower one;
- the dataset, when neither waits and the reader spends its time inside the dataset.

Stage times are counted when a seq leaves a stage, so a stall shows in none of them: when
nothing was delivered lately, the side of the scheduler's holdup (what the run waits for, the
words keepalives carry) decides instead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Optional, Sequence, Tuple

from ppserver.scheduler.status import Holdup, RankStatus, SchedulerStatus, Side

SAMPLE_S = 1.0
WINDOW_S = 20.0
FLOWING_S = 3.0  # something delivered within this long: the stage times can tell
SATURATED = 0.5  # seqs waiting on average (or the reader's busy fraction) that mark a side


@dataclass(frozen=True)
class Sample:
    t: float
    delivered: int  # seqs sent to clients, all runs
    runs: Dict[int, int]  # seqs sent per live run
    seconds: Dict[str, float]  # per stage
    seqs: Dict[str, int]


class Window:
    def __init__(self, span: float = WINDOW_S, step: float = SAMPLE_S):
        self.span_s = span
        self.step = step
        self.samples: Deque[Sample] = deque()

    def due(self, now: float) -> bool:
        return not self.samples or now - self.samples[-1].t >= self.step

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)
        while len(self.samples) > 2 and self.samples[1].t <= sample.t - self.span_s:
            self.samples.popleft()

    def span(self) -> float:
        return self.samples[-1].t - self.samples[0].t if self.samples else 0.0

    def rate(self) -> Optional[float]:
        """Seqs per second delivered over the window (None before two samples)."""
        span = self.span()
        if span <= 0:
            return None
        return (self.samples[-1].delivered - self.samples[0].delivered) / span

    def run_rate(self, run: int) -> Optional[float]:
        """Seqs per second of one run, since the window's first sample that knows it."""
        first = next((s for s in self.samples if run in s.runs), None)
        last = self.samples[-1] if self.samples else None
        if first is None or last is None or last.t <= first.t:
            return None
        return (last.runs.get(run, first.runs[run]) - first.runs[run]) / (last.t - first.t)

    def stage_ms(self) -> Dict[str, Optional[float]]:
        """Mean milliseconds per seq in each stage over the window (None: no seq passed it)."""
        if len(self.samples) < 2:
            return {}
        old, new = self.samples[0], self.samples[-1]
        out: Dict[str, Optional[float]] = {}
        for stage, seconds in new.seconds.items():
            n = new.seqs[stage] - old.seqs.get(stage, 0)
            out[stage] = round((seconds - old.seconds.get(stage, 0.0)) / n * 1e3, 3) if n > 0 else None
        return out

    def load(self, run: Optional[int] = None) -> Dict[str, float]:
        """Seq-seconds per second in each stage over the window: how many seqs sat there on average
        (for `read`: the fraction of the time the reader was inside the dataset). With `run`: since
        the first sample that knows it, so that the idle time before an epoch does not count."""
        old = next((s for s in self.samples if run in s.runs), None) if run is not None else None
        if old is None or old is self.samples[-1]:
            old = self.samples[0] if self.samples else None
        if old is None or self.samples[-1].t <= old.t:
            return {}
        new = self.samples[-1]
        span = new.t - old.t
        return {stage: (s - old.seconds.get(stage, 0.0)) / span for stage, s in new.seconds.items()}

    def flowing(self) -> bool:
        """Whether seqs were delivered within the last FLOWING_S."""
        if len(self.samples) < 2:
            return False
        new = self.samples[-1]
        for s in reversed(self.samples):
            if new.t - s.t >= FLOWING_S or s is self.samples[0]:
                return new.delivered > s.delivered
        return False


def held_back_by(window: Window, waiting_for: Optional[Holdup], run: Optional[int] = None) -> Optional[Side]:
    """The side holding the live run back: from where seqs waited in the window (since `run`
    started), else from the scheduler's holdup (a stall, or no side saturated). None when no run
    is live."""
    if waiting_for is None:
        return None
    if window.flowing():
        load = window.load(run)
        trainer = load.get("wait_trainer", 0.0)
        workers = load.get("wait_worker", 0.0) + load.get("reorder", 0.0)
        if trainer >= SATURATED and trainer >= workers:
            return Side.TRAINER
        if workers >= SATURATED:
            return Side.WORKERS
        if load.get("read", 0.0) >= SATURATED:
            return Side.DATASET
    return waiting_for.side


@dataclass(frozen=True)
class RunProgress:
    """A running run: seqs delivered and due, rolling rate and ETA (None: not known)."""

    epoch: int
    run: int
    seqs_done: int
    seqs_total: Optional[int]
    seqs_per_sec: Optional[float]
    eta_s: Optional[float]


@dataclass(frozen=True)
class Progress:
    """What the server adds to the scheduler's status: rate, ETA, holdup, stage times."""

    rate_seqs_per_sec: float
    rate_window_s: float
    eta_s: Optional[float]  # of the newest run
    held_back_by: Optional[Side]  # None when no run is live
    advice: Optional[str]
    stage_ms: Dict[str, Optional[float]]
    progress: Tuple[RunProgress, ...]  # the running runs


def run_progress(ranks: Sequence[RankStatus], window: Window, running: Dict[int, int]) -> Tuple[RunProgress, ...]:
    """Per running run (run id -> epoch): seqs delivered and due (over its connected ranks, from
    the status's `ranks`), rolling rate and ETA (None when the count or the rate is not known)."""
    out = []
    for run, epoch in sorted(running.items()):
        mine = [r for r in ranks if r.run == run]
        done = sum(r.position for r in mine)
        sizes = [r.shard_size for r in mine]
        total = sum(s for s in sizes if s is not None) if mine and None not in sizes else None
        rate = window.run_rate(run)
        eta: Optional[float] = None
        if total is not None:
            left = sum(max((r.shard_size or 0) - r.position, 0) for r in mine if not r.done)
            eta = 0.0 if left == 0 else left / rate if rate else None
        out.append(
            RunProgress(
                epoch=epoch,
                run=run,
                seqs_done=done,
                seqs_total=total,
                seqs_per_sec=None if rate is None else round(rate, 2),
                eta_s=None if eta is None else round(eta, 1),
            )
        )
    return tuple(out)


def status_fields(st: SchedulerStatus, window: Window, running: Dict[int, int]) -> Progress:
    """What `ppserver status` adds to the scheduler's status: rate, ETA, holdup, stage times."""
    runs = run_progress(st.ranks, window, running)
    newest = st.newest.run if st.newest is not None else None
    last = next((r for r in runs if r.run == newest), None)
    rate = window.rate()
    held = held_back_by(window, st.newest.waiting_for if st.newest is not None else None, newest)
    stages = window.stage_ms()
    return Progress(
        rate_seqs_per_sec=round(rate, 2) if rate is not None else 0.0,
        rate_window_s=round(window.span(), 1),
        eta_s=last.eta_s if last is not None else None,
        held_back_by=held,
        advice=advice(held, stages),
        stage_ms=stages,
        progress=runs,
    )


def advice(held_back: Optional[Side], stage_ms: Dict[str, Optional[float]]) -> Optional[str]:
    """What to do about the side holding the epoch back, where ppserver can tell: the dataset, whose
    reading runs in the server's one reader thread, so more workers do not help."""
    if held_back is not Side.DATASET:
        return None
    read = stage_ms.get("read")
    per_seq = f" ({read:.1f} ms per seq)" if read is not None else ""
    return (
        f"the reader holds the epoch back: its dataset computes in the server's one reader thread{per_seq}, "
        "which more workers do not speed up; move that work into map_seq, which the workers run "
        "(docs/returnn.md: work in the reader)"
    )


def format_eta(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def progress_line(run: RunProgress, held_back: Optional[Side]) -> str:
    """One running epoch in one line (the server logs it every progress_interval)."""
    total = "?" if run.seqs_total is None else run.seqs_total
    rate = "?" if run.seqs_per_sec is None else f"{run.seqs_per_sec:.1f}"
    held = f", held back by the {held_back.value}" if held_back is not None else ""
    return (
        f"epoch {run.epoch} (run {run.run}): {run.seqs_done}/{total} seqs, {rate} seqs/s, "
        f"ETA {format_eta(run.eta_s)}{held}"
    )

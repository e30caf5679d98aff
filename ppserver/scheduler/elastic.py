"""How many workers the trainer needs: a pure policy, samples in (time passed in), decisions out.

The server samples what it observes (seqs delivered, the side holding the epoch back, the
workers serving, the seconds they spent inside the mappers) and the policy answers add,
retire or hold, with a reason. It never acts on a single sample: after each change it waits
for the pool to reach its new size and `settle_s` more, then measures for `window_s`, and
decides from that window alone:

- the workers hold the epoch back (seqs wait for one): add a worker;
- the trainer holds it back, and the pool would have room without one worker (the seconds
  spent mapping over the window fit into `SPARE` of one worker less), twice in a row: retire one;
- an add is kept if it raised the delivered rate by more than `GAIN` or the trainer holds the
  epoch back since; else it is undone and the pool stays below that size for `hold_windows`
  windows (then it tries again);
- a retire is kept unless the workers hold the epoch back since and the rate fell by more than
  `LOSS`; then it is undone, and the pool stays above that size for `hold_windows` windows.

The rate decides only where the side does not: an add the trainer takes all of, or a retire
it does not notice, stands whatever the rate did (a trainer that takes seqs in bursts makes
the rate of a short window noisy).

So the pool grows one worker per window while a worker helps, stops where the trainer takes
all it gets or where another worker gains nothing (the CPUs are full), and shrinks only with
room to spare: a size that is just enough is never probed downwards, and noise on the rate
cannot turn into oscillation. Wanting more than the pool can hold (`capacity`) is stated, not
done: an outside scaler may add hosts (see `wanted`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ppserver.scheduler.status import Side

GAIN = 0.07  # an added worker must raise the rate by more than this (Cachew's)
LOSS = 0.03  # a retired worker may cost the rate at most this
SPARE = 0.85  # retire only if the work fits into this much of one worker less
RETIRE_WINDOWS = 2  # windows in a row the trainer must hold back before a retire
HOLD_WINDOWS = 20  # windows an undone change is not tried again
GIVE_UP_WINDOWS = 4  # windows to wait for the pool to reach the size asked for


class Action(str, enum.Enum):
    ADD = "add"
    RETIRE = "retire"
    HOLD = "hold"


class Reason(str, enum.Enum):
    """Why the pool changed (the label of ppserver_pool_changes_total)."""

    WORKERS_HOLD_BACK = "workers_hold_back"
    TRAINER_HOLDS_BACK = "trainer_holds_back"
    NO_GAIN = "no_gain"  # the last add did not raise the rate: undone
    RATE_LOST = "rate_lost"  # the last retire cost rate: undone
    BELOW_MIN = "below_min"
    ABOVE_MAX = "above_max"


@dataclass(frozen=True)
class Limits:
    min_workers: int = 1
    max_workers: int = 1
    settle_s: float = 2.0
    window_s: float = 5.0
    hold_windows: int = HOLD_WINDOWS


@dataclass(frozen=True)
class PoolSample:
    now: float
    delivered: int  # seqs (or batches) mapped for the trainer, cumulative
    held_back: Optional[Side]  # None: no live run
    workers: int  # workers serving (registered, not retiring)
    busy_s: float  # seconds inside the mappers, cumulative over every worker
    capacity: int  # workers the pool can hold now (local room plus the hosts that size themselves)
    starting: int = 0  # workers started that have not registered yet


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: Optional[Reason]
    text: str  # the reason in words, for the log and `ppserver status`
    wanted: int  # the workers the policy wants (may exceed the capacity: then more hosts would help)


@dataclass
class _Window:
    first: PoolSample
    last: PoolSample
    sides: List[Optional[Side]]

    def rate(self) -> float:
        span = self.last.now - self.first.now
        return (self.last.delivered - self.first.delivered) / span if span > 0 else 0.0

    def busy(self) -> float:
        """Workers busy mapping, on average."""
        span = self.last.now - self.first.now
        return (self.last.busy_s - self.first.busy_s) / span if span > 0 else 0.0

    def side(self) -> Optional[Side]:
        """The side most samples blamed (None: no live run in most of them)."""
        counts = {s: self.sides.count(s) for s in set(self.sides)}
        return max(counts, key=lambda s: (counts[s], s is not None)) if counts else None


class Elastic:
    """Feed it `sample` about every `settle_s / 4`; it returns a Decision for every sample (HOLD
    while it settles or measures). `wanted` and `why` say what it wants now."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.wanted = limits.min_workers
        self.why = "starting"
        self.since = float("-inf")  # when the pool last changed size, or the policy changed it
        self.window: Optional[_Window] = None
        self.probe: Optional[Tuple[Action, float]] = None  # (action, rate before) of the change under test
        self.last_rate: Optional[float] = None  # the last window's rate at this size
        self.ceiling: Optional[Tuple[int, float]] = None  # (size, until): stay below size until then
        self.floor: Optional[Tuple[int, float]] = None  # (size, until): stay above size until then
        self.trainer_windows = 0
        self.seen_workers: Optional[int] = None

    def sample(self, s: PoolSample) -> Decision:
        lim = self.limits
        if s.workers != self.seen_workers:  # the pool changed size: measure afresh from now
            seen, self.seen_workers = self.seen_workers, s.workers
            toward = seen is not None and min(seen, self.wanted) <= s.workers <= max(seen, self.wanted)
            if not toward:  # not a change it asked for (a host came or went): take the pool as it is
                self.wanted = s.workers
                self.probe = None
            self.since = s.now
            self.window = None
        if s.workers + s.starting < lim.min_workers and self.wanted <= s.workers:
            return self._change(s, Action.ADD, Reason.BELOW_MIN, f"fewer than min_workers ({lim.min_workers})")
        if s.workers > lim.max_workers and self.wanted >= s.workers:
            return self._change(s, Action.RETIRE, Reason.ABOVE_MAX, f"more than max_workers ({lim.max_workers})")
        if s.workers != self.wanted and not (self.wanted > s.workers >= s.capacity):
            if s.now - self.since > GIVE_UP_WINDOWS * (lim.settle_s + lim.window_s):
                self.wanted = s.workers  # a worker that never came (or never left): go on from here
                self.probe = None
                return self._hold(f"the pool stayed at {s.workers} workers")
            return self._hold(f"waiting for the pool to reach {self.wanted} workers")
        if s.now - self.since < lim.settle_s:
            return self._hold(self.why)
        if self.window is None:
            self.window = _Window(s, s, [s.held_back])
            return self._hold(self.why)
        w = self.window
        w.last = s
        w.sides.append(s.held_back)
        if s.now - w.first.now < lim.window_s:
            return self._hold(self.why)
        self.window = _Window(s, s, [s.held_back])  # the next window starts where this one ended
        return self._decide(s, w)

    # ---- one measured window --------------------------------------------------------------------
    def _decide(self, s: PoolSample, w: _Window) -> Decision:
        lim, n = self.limits, s.workers
        rate, side = w.rate(), w.side()
        probe, self.probe = self.probe, None
        if side is None:
            self.last_rate = None
            self.trainer_windows = 0
            return self._hold("no epoch is being delivered")
        if probe is not None and probe[1] > 0:
            change = rate / probe[1] - 1.0
            # (an add after which the trainer holds the epoch back did its job, whatever the gain)
            if probe[0] is Action.ADD and change <= GAIN and side is not Side.TRAINER:
                self.ceiling = (n, s.now + lim.hold_windows * (lim.settle_s + lim.window_s))
                text = f"worker {n} raised the rate by {change:+.0%} only (needs > {GAIN:.0%})"
                return self._change(s, Action.RETIRE, Reason.NO_GAIN, text)
            if probe[0] is Action.RETIRE and -change > LOSS and side is Side.WORKERS:
                self.floor = (n, s.now + lim.hold_windows * (lim.settle_s + lim.window_s))
                text = f"retiring worker {n + 1} cost {-change:.0%} of the rate (allowed {LOSS:.0%})"
                return self._change(s, Action.ADD, Reason.RATE_LOST, text)
        self.last_rate = rate
        self.wanted = n  # (unless it wants more than there is room for, below)
        ceiling = self._bound(self.ceiling, s.now)
        floor = self._bound(self.floor, s.now)
        self.trainer_windows = self.trainer_windows + 1 if side is Side.TRAINER else 0
        if side is Side.WORKERS:
            top = min(lim.max_workers, ceiling - 1 if ceiling is not None else lim.max_workers)
            if n >= top:
                why = "max_workers" if n >= lim.max_workers else "a worker more gained nothing lately"
                return self._hold(f"the workers hold the epoch back; {n} workers ({why})")
            text = f"the workers hold the epoch back ({rate:.1f}/s with {n})"
            if n >= s.capacity:
                self.wanted = n + 1
                return self._hold(f"{text}: no room for another worker here; wants {n + 1}")
            return self._change(s, Action.ADD, Reason.WORKERS_HOLD_BACK, text)
        busy = w.busy()
        bottom = max(lim.min_workers, floor + 1 if floor is not None else lim.min_workers)
        if side is Side.TRAINER and n > bottom and busy <= SPARE * (n - 1):
            if self.trainer_windows >= RETIRE_WINDOWS:
                text = f"the trainer holds the epoch back ({rate:.1f}/s, {busy:.1f} of {n} workers busy)"
                return self._change(s, Action.RETIRE, Reason.TRAINER_HOLDS_BACK, text)
            return self._hold(f"the trainer holds the epoch back; {busy:.1f} of {n} workers busy")
        return self._hold(f"held back by the {side.value}; {n} workers, {busy:.1f} busy, {rate:.1f}/s")

    @staticmethod
    def _bound(bound: Optional[Tuple[int, float]], now: float) -> Optional[int]:
        return bound[0] if bound is not None and now < bound[1] else None

    def _change(self, s: PoolSample, action: Action, reason: Reason, text: str) -> Decision:
        self.wanted = s.workers + (1 if action is Action.ADD else -1)
        self.why = text
        self.since = s.now
        self.window = None
        self.trainer_windows = 0
        undo = reason in (Reason.NO_GAIN, Reason.RATE_LOST, Reason.BELOW_MIN, Reason.ABOVE_MAX)
        self.probe = None if undo or self.last_rate is None else (action, self.last_rate)
        return Decision(action, reason, text, self.wanted)

    def _hold(self, text: str) -> Decision:
        self.why = text
        return Decision(Action.HOLD, None, text, self.wanted)

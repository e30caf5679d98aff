"""The pool's size, in the server's loop: samples for the policy (scheduler/elastic.py), its
decisions performed, and the worker hosts that size themselves (`ppserver worker --procs auto`).

An add starts a local worker while the local pool has room (`max_workers`), else asks a
self-sizing host for one more process (its supervisor asks about once a second how many it
should run: HostRequest). A retire picks the newest worker the server may retire (a local one,
or one of a self-sizing host) and hands the scheduler a RetireWorker: the worker gets no new
work and is told to exit once it holds none, so nothing is redone. Every change is logged with
its reason, counted, and shown by `ppserver status` and the metrics; `wanted` is what an
outside scaler acts on (more hosts when it exceeds what the pool can hold).

With a fixed pool (num_workers a number) no policy runs: self-sizing hosts run all their cores
and `wanted` is the workers there are.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from ppclient import protocol
from ppserver.observe.stages import StageClock
from ppserver.observe.status import PoolChange, PoolHost, PoolStatus
from ppserver.scheduler import Scheduler, WorkerState
from ppserver.scheduler import events as ev
from ppserver.scheduler.elastic import Action, Decision, Elastic, Limits, PoolSample
from ppserver.scheduler.status import holdup
from ppserver.worker.pool import ProcessPool

log = logging.getLogger("ppserver.pool")

HISTORY = 10  # changes `ppserver status` shows
HOST_TIMEOUT_S = 10.0  # a self-sizing host not heard from this long is forgotten


@dataclass
class Host:
    """A self-sizing worker host (one `ppserver worker --procs auto`)."""

    supervisor: str
    host: str
    max_procs: int
    wanted: int
    pids: List[int] = field(default_factory=list)
    heard: float = 0.0

    def runs(self, w: WorkerState) -> bool:
        return w.host == self.host and w.pid in self.pids


@dataclass(frozen=True)
class Change:
    at: float
    action: str
    reason: str
    text: str
    before: int
    after: int


class PoolSize:
    """`limits` None: a fixed pool (no policy). `local_max`: the most local workers."""

    def __init__(
        self,
        sched: Scheduler,
        stages: StageClock,
        *,
        limits: Optional[Limits],
        local_max: int,
        pool: Callable[[], Optional[ProcessPool]],
        handle: Callable[[ev.Event], None],
    ):
        self.sched = sched
        self.stages = stages
        self.limits = limits
        self.local_max = local_max
        self.pool = pool
        self.handle = handle
        self.policy = Elastic(limits) if limits is not None else None
        step = limits.settle_s / 4 if limits is not None else 1.0
        self.step = min(max(step, 0.05), 1.0)
        self.sampled = float("-inf")
        self.hosts: Dict[str, Host] = {}
        self.changes: Deque[Change] = deque(maxlen=HISTORY)
        self.counts: Counter = Counter()  # (direction, reason) -> changes

    # ---- the loop's hooks -----------------------------------------------------------------------
    def tick(self, now: float) -> None:
        for key, h in list(self.hosts.items()):
            if now - h.heard > HOST_TIMEOUT_S:
                log.info("self-sizing host %s (%s) not heard for %.0f s: forgotten", h.host, key, now - h.heard)
                del self.hosts[key]
        if self.policy is None or now - self.sampled < self.step:
            return
        self.sampled = now
        decision = self.policy.sample(self._sample(now))
        if decision.action is not Action.HOLD:
            self._perform(now, decision)
        elif self.policy.wanted > self.serving() + self._pending() and self._add():
            log.info("pool: started a worker towards the %d wanted", self.policy.wanted)

    def host_request(self, msg: protocol.HostRequest) -> protocol.Message:
        """A self-sizing host asks how many processes to run (control socket)."""
        now = time.monotonic()
        h = self.hosts.get(msg.supervisor)
        if h is None:
            first = 1 if self.policy is not None else msg.max_procs
            h = self.hosts[msg.supervisor] = Host(msg.supervisor, msg.host, msg.max_procs, min(first, msg.max_procs))
            log.info("self-sizing host %s joined: up to %d processes, %d wanted now", msg.host, msg.max_procs, h.wanted)
        h.pids, h.heard, h.max_procs = list(msg.pids), now, msg.max_procs
        h.wanted = min(h.wanted, h.max_procs)
        return protocol.HostReply(procs=h.wanted)

    # ---- samples --------------------------------------------------------------------------------
    def serving(self) -> int:
        return sum(1 for w in self.sched.state.workers.values() if not w.retiring)

    def _local_room(self) -> int:
        pool = self.pool()
        return max(self.local_max - pool.size, 0) if pool is not None else 0

    def _pending(self) -> int:
        """Workers asked for that have not registered yet (local ones starting, hosts' to come)."""
        workers = [w for w in self.sched.state.workers.values() if not w.retiring]
        pool = self.pool()
        pending = 0
        if pool is not None:
            local = sum(1 for w in self.sched.state.workers.values() if w.local_index is not None)
            pending += max(pool.size - local, 0)
        for h in self.hosts.values():
            pending += max(h.wanted - sum(1 for w in workers if h.runs(w)), 0)
        return pending

    def capacity(self) -> int:
        hosts = sum(max(h.max_procs - h.wanted, 0) for h in self.hosts.values())
        return self.serving() + self._pending() + self._local_room() + hosts

    def _sample(self, now: float) -> PoolSample:
        """Who holds the epoch back now: the scheduler's word for what the newest live run waits
        for (the trainer's credit, the workers, the dataset), sampled several times a window."""
        stages = self.stages
        live = [r for r in self.sched.state.runs.values() if r.dispatch is not None and r.live]
        run = max(live, key=lambda r: r.run) if live else None
        side = holdup(self.sched.state, run).side if run is not None else None
        serving, starting = self.serving(), self._pending()
        # The rate: results the workers sent (to the server or, direct, to their consumers), which
        # is what the trainer took where it holds the epoch back; delivery itself is only heard
        # of with a direct consumer's credit, in bursts.
        busy = stages.seconds["mapper"]
        return PoolSample(now, stages.results, side, serving, busy, self.capacity(), starting)

    # ---- decisions ------------------------------------------------------------------------------
    def _perform(self, now: float, d: Decision) -> None:
        before = self.serving()
        done = self._add() if d.action is Action.ADD else self._retire(now)
        if not done:
            log.warning("pool: cannot %s a worker (%s)", d.action.value, d.text)
            return
        reason = d.reason.value if d.reason is not None else ""
        after = before + (1 if d.action is Action.ADD else -1)
        direction = "up" if d.action is Action.ADD else "down"
        self.counts[(direction, reason)] += 1
        self.changes.append(Change(now, d.action.value, reason, d.text, before, after))
        log.info("pool: %s a worker (%d -> %d): %s", d.action.value, before, after, d.text)

    def _add(self) -> bool:
        pool = self.pool()
        if pool is not None and pool.size < self.local_max:
            pool.add()
            return True
        room = [h for h in self.hosts.values() if h.wanted < h.max_procs]
        if not room:
            return False
        h = max(room, key=lambda h: h.max_procs - h.wanted)
        h.wanted += 1
        return True

    def _retire(self, now: float) -> bool:
        """A worker the server may retire (a local one, or one of a self-sizing host): the one that
        holds the least (a stream partition keeps its worker to the epoch's end), the newest of those."""
        owners: Dict[bytes, Optional[Host]] = {}
        for w in self.sched.state.workers.values():
            if w.retiring:
                continue
            if w.local_index is not None:
                owners[w.wid] = None
            else:
                h = next((h for h in self.hosts.values() if h.runs(w)), None)
                if h is not None:
                    owners[w.wid] = h
        if not owners:
            return False
        workers = self.sched.state.workers
        wid = min(
            owners, key=lambda wid: (len(workers[wid].tasks) + len(workers[wid].partitions), -workers[wid].joined)
        )
        h = owners[wid]
        if h is not None:
            h.wanted = max(h.wanted - 1, 0)
        self.handle(ev.RetireWorker(now, wid))
        return True

    # ---- what it tells --------------------------------------------------------------------------
    def wanted(self) -> int:
        return self.policy.wanted if self.policy is not None else self.serving()

    def status(self, now: float) -> PoolStatus:
        lim = self.limits
        return PoolStatus(
            auto=lim is not None,
            current=self.serving(),
            wanted=self.wanted(),
            min=lim.min_workers if lim is not None else None,
            max_local=self.local_max if lim is not None else None,
            capacity=self.capacity(),
            why=self.policy.why if self.policy is not None else "a fixed pool",
            changes=tuple(
                PoolChange(round(now - c.at, 1), c.action, c.reason, c.text, c.before, c.after)
                for c in reversed(self.changes)
            ),
            changes_total=tuple((d, r, n) for (d, r), n in sorted(self.counts.items())),
            hosts=tuple(
                PoolHost(h.host, len(h.pids), h.wanted, h.max_procs)
                for h in sorted(self.hosts.values(), key=lambda h: h.host)
            ),
        )


def local_limits(cfg: Any, cores: Optional[int]) -> Tuple[Limits, int]:
    """The policy's limits and the most local workers, for num_workers = 'auto': max_workers, else
    the host's cores less one for the trainer (at least 1, and at least min_workers)."""
    local_max = cfg.max_workers if cfg.max_workers is not None else max((cores or 1) - 1, 1, cfg.min_workers)
    limits = Limits(
        min_workers=cfg.min_workers,
        max_workers=1 << 20,  # the capacity bounds it (local room plus the self-sizing hosts')
        settle_s=cfg.elastic_settle,
        window_s=cfg.elastic_window,
    )
    return limits, local_max

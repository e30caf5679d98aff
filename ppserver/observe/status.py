"""The server's status as one typed value: the scheduler's part (scheduler/status.py), the
server's own counters, its pool and its progress (progress.py). Everything on the server reads
it by attribute; `ServerStatus.to_wire` is the one place it becomes the `status_reply` dict
(docs/protocol.md) that clients and `ppserver status --json` see."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ppserver.observe.progress import Progress, RunProgress
from ppserver.scheduler.status import JobStatus, RankStatus, RunStatus, SchedulerStatus, WorkerStatus


@dataclass(frozen=True)
class PoolChange:
    """A worker the server added or retired to size its pool."""

    ago_s: float
    action: str
    reason: str
    text: str
    before: int
    after: int


@dataclass(frozen=True)
class PoolHost:
    """A host that runs workers for the pool (self-sizing hosts)."""

    host: str
    procs: int
    wanted: int
    max_procs: int


@dataclass(frozen=True)
class PoolStatus:
    """The pool: its size, what it wants and why (num_workers "auto"), its last changes."""

    auto: bool
    current: int
    wanted: int
    min: Optional[int]  # auto only
    max_local: Optional[int]  # auto only
    capacity: int
    why: str
    changes: Tuple[PoolChange, ...]  # newest first
    changes_total: Tuple[Tuple[str, str, int], ...]  # (direction, reason, changes)
    hosts: Tuple[PoolHost, ...]


@dataclass(frozen=True)
class ServerStatus:
    scheduler: SchedulerStatus
    address: str
    worker_address: str
    version: str
    uptime_s: float
    local_workers: int
    local_worker_respawns: int
    malformed_messages: int
    refused_handshakes: int
    dataset: str  # what the reader does in the dataset, or "idle"
    pool: PoolStatus
    progress: Progress

    def to_wire(self) -> Dict[str, Any]:
        """The `status` field of a `status_reply`."""
        s = self.scheduler
        p = self.progress
        return {
            "workers_alive": len(s.workers),
            "workers": [_worker(w) for w in s.workers],
            "seqs_delivered_total": s.seqs_delivered_total,
            "seqs_skipped_total": s.seqs_skipped_total,
            "malformed_results": s.malformed_results,
            "lost_direct_results": s.lost_direct_results,
            "lost_inputs": s.lost_inputs,
            "dropped_by_workers": s.dropped_by_workers,
            "departures": {d.value: n for d, n in s.departures.items()},
            "handed_back": s.handed_back,
            "job": None if s.job is None else _job(s.job),
            "ranks": [_rank(r) for r in s.ranks],
            **_newest(s.newest),
            "address": self.address,
            "worker_address": self.worker_address,
            "version": self.version,
            "uptime_s": self.uptime_s,
            "local_workers": self.local_workers,
            "local_worker_respawns": self.local_worker_respawns,
            "malformed_messages": self.malformed_messages,
            "refused_handshakes": self.refused_handshakes,
            "dataset": self.dataset,
            "pool": _pool(self.pool),
            "rate_seqs_per_sec": p.rate_seqs_per_sec,
            "rate_window_s": p.rate_window_s,
            "eta_s": p.eta_s,
            "held_back_by": p.held_back_by,
            "advice": p.advice,
            "stage_ms": dict(p.stage_ms),
            "progress": [_run_progress(r) for r in p.progress],
        }


def _worker(w: WorkerStatus) -> Dict[str, Any]:
    return {
        "id": w.id,
        "host": w.host,
        "pid": w.pid,
        "local": w.local,
        "seqs_done": w.seqs_done,
        "in_flight": w.in_flight,
        "partitions": list(w.partitions),
        "last_heartbeat_s": w.last_heartbeat_s,
        "retiring": w.retiring,
    }


def _job(j: JobStatus) -> Dict[str, Any]:
    return {
        "name": j.name,
        "world_size": j.world_size,
        "drop_last": j.drop_last,
        "subshards": j.subshards,
        "batching": None if j.batching is None else j.batching.to_dict(),
        "sharding": j.sharding,
        "clients": j.clients,
        "runs": list(j.runs),
        "epochs": list(j.epochs),
    }


def _rank(r: RankStatus) -> Dict[str, Any]:
    return {
        "rank": r.rank,
        "subshard": r.subshard,
        "epoch": r.epoch,
        "run": r.run,
        "solo": r.solo,
        "position": r.position,
        "shard_size": r.shard_size,
        "seqs_per_sec": r.seqs_per_sec,
        "done": r.done,
        "last_heard_s": r.last_heard_s,
        "credit": r.credit,
    }


def _newest(r: Optional[RunStatus]) -> Dict[str, Any]:
    """The newest run's fields, at the top level; before any run, an idle server's."""
    if r is None:
        return {
            "epoch": None,
            "run": None,
            "state": "idle",
            "seqs_delivered": 0,
            "seqs_skipped": 0,
            "num_seqs": None,
            "seqs_per_sec": 0.0,
            "mb_delivered": 0.0,
            "error": None,
            "waiting_for": None,
            "queues": {},
        }
    return {
        "epoch": r.epoch,
        "run": r.run,
        "state": r.state.value,
        "num_seqs": r.num_seqs,
        "seqs_delivered": r.seqs_delivered,
        "seqs_skipped": r.seqs_skipped,
        "seqs_per_sec": r.seqs_per_sec,
        "mb_delivered": r.mb_delivered,
        "error": r.error,
        "waiting_for": r.waiting_for,
        "queues": dict(r.queues),
    }


def _pool(p: PoolStatus) -> Dict[str, Any]:
    return {
        "auto": p.auto,
        "current": p.current,
        "wanted": p.wanted,
        "min": p.min,
        "max_local": p.max_local,
        "capacity": p.capacity,
        "why": p.why,
        "changes": [
            {"ago_s": c.ago_s, "action": c.action, "reason": c.reason, "text": c.text, "from": c.before, "to": c.after}
            for c in p.changes
        ],
        "changes_total": [list(t) for t in p.changes_total],
        "hosts": [{"host": h.host, "procs": h.procs, "wanted": h.wanted, "max_procs": h.max_procs} for h in p.hosts],
    }


def _run_progress(r: RunProgress) -> Dict[str, Any]:
    return {
        "epoch": r.epoch,
        "run": r.run,
        "seqs_done": r.seqs_done,
        "seqs_total": r.seqs_total,
        "seqs_per_sec": r.seqs_per_sec,
        "eta_s": r.eta_s,
    }

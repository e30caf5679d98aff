"""The server's status as one typed value: the scheduler's part (scheduler/status.py), the
server's own counters, its pool and its progress (progress.py). Everything on the server reads
it by attribute; `ServerStatus.to_wire` is the one place it becomes the `status_reply` dict
(docs/protocol.md) that clients and `ppserver status --json` see."""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Dict, Optional, Tuple

from ppserver.observe.progress import Progress
from ppserver.scheduler.status import JobStatus, RunStatus, SchedulerStatus


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
    dataset: Optional[str]  # what the reader does in the dataset (None: nothing, "idle" on the wire)
    pool: PoolStatus
    progress: Progress

    def to_wire(self) -> Dict[str, Any]:
        """The `status` field of a `status_reply`."""
        s = self.scheduler
        p = self.progress
        return {
            "workers_alive": len(s.workers),
            "workers": _plain(s.workers),
            "seqs_delivered_total": s.seqs_delivered_total,
            "seqs_skipped_total": s.seqs_skipped_total,
            "malformed_results": s.malformed_results,
            "lost_direct_results": s.lost_direct_results,
            "lost_inputs": s.lost_inputs,
            "dropped_by_workers": s.dropped_by_workers,
            "departures": {d.value: n for d, n in s.departures.items()},
            "handed_back": s.handed_back,
            "internal_errors": s.internal_errors,
            "job": None if s.job is None else _job(s.job),
            "ranks": _plain(s.ranks),
            **_newest(s.newest),
            "address": self.address,
            "worker_address": self.worker_address,
            "version": self.version,
            "uptime_s": self.uptime_s,
            "local_workers": self.local_workers,
            "local_worker_respawns": self.local_worker_respawns,
            "malformed_messages": self.malformed_messages,
            "refused_handshakes": self.refused_handshakes,
            "dataset": self.dataset if self.dataset is not None else "idle",
            "pool": _pool(self.pool),
            "rate_seqs_per_sec": p.rate_seqs_per_sec,
            "rate_window_s": p.rate_window_s,
            "eta_s": p.eta_s,
            "held_back_by": None if p.held_back_by is None else p.held_back_by.value,
            "advice": p.advice,
            "stage_ms": dict(p.stage_ms),
            "progress": _plain(p.progress),
        }


def _plain(value: Any) -> Any:
    """A status value as msgpack takes it: a dataclass as a dict of its fields in their order,
    tuples as lists, enums as their values (the field names are the wire's keys)."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    return value


def _job(j: JobStatus) -> Dict[str, Any]:
    return {**_plain(j), "batching": None if j.batching is None else j.batching.to_dict()}


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
    wire = _plain(r)
    del wire["client_credit"]  # (it goes among the queues)
    wire["waiting_for"] = r.waiting_for.words if r.waiting_for is not None else None
    wire["queues"] = queue_counts(r)
    return wire


def queue_counts(r: RunStatus) -> Dict[str, int]:
    """A run's `queues` as the wire and the metrics' labels name them: its dispatch's (while
    live), then its clients' credit."""
    counts: Dict[str, int] = _plain(r.queues) if r.queues is not None else {}
    counts["client_credit"] = r.client_credit
    return counts


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
        "changes_total": _plain(p.changes_total),
        "hosts": _plain(p.hosts),
    }

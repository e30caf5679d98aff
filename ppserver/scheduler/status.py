"""What the scheduler tells about itself: what a run waits for (in words), the keepalives that
say so to its clients, and the status dict (`ppserver status`)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ppclient.protocol import Keepalive
from ppserver.scheduler.instructions import Instruction, ToClient
from ppserver.scheduler.jobs import Lane, Run
from ppserver.scheduler.state import SchedulerState


def holdup(s: SchedulerState, run: Run, lane: Optional[Lane] = None) -> Tuple[str, bool]:
    """What the run (or a rank of it) waits for, in words (keepalives and status), and whether
    that is other readers whose clients live (their batch sizes, or room for their seqs)."""
    if run.dispatch is None:
        busy = f" ({s.reader_busy})" if s.reader_busy else ""
        return f"the dataset to set up the epoch{busy}", False
    job = run.job
    if not s.workers:
        return "a worker (none is connected)", False
    if any(ln.credit <= 0 and ln.live for ln in ([lane] if lane is not None else run.lanes.values())):
        return "the trainer (no credit)", False
    held = run.lanes.get(run.held_by) if run.held_by is not None else None
    if held is not None and held is not lane and held.consumer in job.clients:
        return f"{job.who(held.index)} of job {job.name!r} to take its seqs (the next one waits for credit)", True
    missing = run.awaited(8)
    if missing:
        return f"rank(s) {', '.join(map(str, missing))} of job {run.job.name!r} to connect", False
    q = run.dispatch.queues()
    if q["in_flight"]:
        return f"the workers ({q['in_flight']} in flight)", False
    if s.reader_busy:
        return f"the dataset ({s.reader_busy})", False
    return "the dataset", False


def keepalives(s: SchedulerState, out: List[Instruction]) -> None:
    """A keepalive to the client of every lane that is not settled, saying what it waits for."""
    for run in s.runs.values():
        for lane in run.lanes.values():
            if lane.consumer is not None and lane.connected and not lane.settled:
                waiting_for, on_readers = holdup(s, run, lane)
                msg = Keepalive(
                    run=run.run,
                    interval=s.settings.heartbeat_interval,
                    workers=len(s.workers),
                    waiting_for=waiting_for,
                    waits_on_readers=on_readers,
                    mapped=run.mapped,
                )
                out.append(ToClient(lane.consumer, msg))


def status(s: SchedulerState, now: float) -> Dict[str, Any]:
    st: Dict[str, Any] = {
        "workers_alive": len(s.workers),
        "workers": [w.describe(now) for w in s.workers.values()],
        "seqs_delivered_total": s.total_delivered,
        "seqs_skipped_total": s.skipped_total,
        "malformed_results": s.malformed_results,
        "lost_direct_results": s.lost_direct,
        "lost_inputs": s.lost_inputs,
        "dropped_by_workers": s.dropped_by_workers,
        "departures": {d.value: n for d, n in s.departures.items()},
        "handed_back": s.handed_back,
        "job": None,
        "ranks": [],
    }
    job = s.job
    if job is not None:
        st["job"] = {**job.describe(), "runs": sorted(job.runs), "epochs": sorted({r.epoch for r in job.runs.values()})}
        for run in sorted(job.runs.values(), key=lambda r: r.run):
            for _, lane in sorted(run.lanes.items()):
                if lane.consumer is not None and not lane.gone:
                    st["ranks"].append(_rank(s, run, lane, now))
    last = s.last_run
    if last is None:
        st.update(
            {
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
        )
        return st
    began = last.started if last.started is not None else last.requested
    end = now if last.ended is None else last.ended
    delivered = sum(lane.delivered for lane in last.lanes.values())
    st.update(
        {
            "epoch": last.epoch,
            "run": last.run,
            "state": last.state.value,
            "num_seqs": last.total,
            "seqs_delivered": delivered,
            "seqs_skipped": last.skipped,
            "seqs_per_sec": round(delivered / max(end - began, 1e-9), 2),
            "mb_delivered": round(sum(lane.delivered_bytes for lane in last.lanes.values()) / 1e6, 3),
            "error": last.error,
            "waiting_for": holdup(s, last)[0] if last.live else None,
            "queues": {
                **(last.dispatch.queues() if last.dispatch is not None and last.live else {}),
                "client_credit": sum(max(lane.credit, 0) for lane in last.lanes.values() if lane.live),
            },
        }
    )
    return st


def _rank(s: SchedulerState, run: Run, lane: Lane, now: float) -> Dict[str, Any]:
    """A reader of the job, for status."""
    job = run.job
    took = max(now - lane.attached_at, 1e-9)
    client = job.clients.get(lane.consumer) if lane.consumer is not None else None
    rank, subshard = job.reader_of(lane.index)
    return {
        "rank": rank,
        "subshard": subshard,
        "epoch": run.epoch,
        "run": run.run,
        "solo": run.solo is not None,
        "position": lane.start + lane.delivered,
        "shard_size": run.shard_size(lane.index),
        "seqs_per_sec": round(lane.delivered / took, 2),
        "done": lane.done,
        "last_heard_s": round(now - client.alive_at, 1) if client is not None else None,
        "credit": max(lane.credit, 0),
    }

"""`ppserver status`: a running server's state, or (`--story`) the moves its scheduler kept about
some seqs, batches, partitions, runs or workers, as text or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List

from ppserver.cli.output import EXIT_CONFIG


def run(args: argparse.Namespace) -> int:
    from ppclient import Client, Error, UsageError

    if args.story:
        from ppserver.scheduler.story import parse_key

        try:
            for key in args.story:
                parse_key(key)
        except ValueError as exc:
            print(f"ppserver status: error: --story: {exc}", file=sys.stderr)
            return EXIT_CONFIG
    try:
        with Client(args.address, timeout=args.timeout, keys=args.keys) as c:
            st = c.story(*args.story) if args.story else c.status()
    except UsageError as exc:
        print(f"ppserver status: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except Error as exc:
        print(f"ppserver status: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True))
    else:
        print(format_story(st) if args.story else format_status(st))
    return 0


def format_story(story: Dict[str, Any]) -> str:
    """The moves as a table, oldest first; `ago` counts back from the server's clock."""
    entries = story["entries"]
    if not entries:
        return "no moves kept about these keys"
    rows = [("ago s", "what", "run", "from", "to", "worker", "stimulus", "note")]
    for e in entries:
        what = f"{e['subject']} {e['key']}"
        run = "" if e["run"] is None else str(e["run"])
        rows.append(
            (f"{story['now'] - e['time']:.3f}", what, run, e["from"], e["to"], e["worker"], e["stimulus"], e["note"])
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    if story["total"] > len(entries):
        lines.append(f"(the last {len(entries)} of {story['total']} moves)")
    return "\n".join(line.rstrip() for line in lines)


def format_status(st: Dict[str, Any]) -> str:
    q = st.get("queues") or {}
    lines = [
        f"server      {st.get('address')}  (workers connect to {st.get('worker_address')}), up {st.get('uptime_s')} s",
        f"epoch       {st.get('epoch')}  state {st.get('state')}  "
        f"delivered {st.get('seqs_delivered')}/{st.get('num_seqs') if st.get('num_seqs') is not None else '?'}"
        f"  {st.get('seqs_per_sec')} seqs/s"
        f"{_skipped(st)}",
        *_progress_lines(st),
        f"queues      waiting {q.get('waiting_for_worker', 0)}  in flight {q.get('in_flight', 0)}  "
        f"reorder {q.get('reorder_buffer', 0)}  client credit {q.get('client_credit', 0)}",
        f"workers     {st.get('workers_alive')} alive",
        *_pool_lines(st.get("pool")),
    ]
    if st.get("waiting_for"):
        lines.append(f"waiting for {st['waiting_for']}")
    if st.get("error"):
        lines.append(f"error       {st['error']}")
    job = st.get("job")
    if job:
        epochs = ", ".join(map(str, job.get("epochs", []))) or "none"
        lines.append(
            f"job         {job['name']!r}  world_size {job['world_size']}  drop_last {job['drop_last']}  "
            f"{job['clients']} live clients  epochs {epochs}"
        )
        for r in st.get("ranks", []):
            size = "?" if r["shard_size"] is None else r["shard_size"]
            heard = "" if r["last_heard_s"] is None else f"  heard {r['last_heard_s']:.1f} s ago"
            lines.append(
                f"  rank {r['rank']:<3} epoch {r['epoch']} (run {r['run']}{', solo' if r['solo'] else ''})  "
                f"position {r['position']}/{size}  {r['seqs_per_sec']} seqs/s"
                f"{'  done' if r['done'] else ''}{heard}"
            )
    if st.get("workers"):
        lines.append(f"  {'host':<20} {'pid':>7} {'done':>8} {'in flight':>9} {'last hb':>8}")
        for w in st["workers"]:
            lines.append(
                f"  {w['host'][:20]:<20} {w['pid']:>7} {w['seqs_done']:>8} {w['in_flight']:>9} "
                f"{w['last_heartbeat_s']:>7.1f}s"
            )
    return "\n".join(lines)


def _skipped(st: Dict[str, Any]) -> str:
    """The seqs map_seq skipped (returned None), if it skipped any."""
    run, total = st.get("seqs_skipped") or 0, st.get("seqs_skipped_total") or 0
    return f"  skipped {run} (all epochs: {total})" if total else ""


def _pool_lines(pool: Any) -> List[str]:
    """The pool: its size, what it wants and why, its last changes (num_workers = "auto")."""
    if not pool:
        return []
    if not pool["auto"]:
        return [f"pool        fixed: {pool['current']} workers"]
    lines = [
        f"pool        auto: {pool['current']} workers, wants {pool['wanted']} (min {pool['min']}, "
        f"up to {pool['max_local']} here, room for {pool['capacity']})",
        f"  why       {pool['why']}",
    ]
    for h in pool.get("hosts", []):
        lines.append(f"  host      {h['host']}: {h['procs']} processes, wants {h['wanted']} of {h['max_procs']}")
    for c in pool.get("changes", [])[:5]:
        lines.append(f"  {c['ago_s']:>6.1f} s ago  {c['action']} {c['from']} -> {c['to']}: {c['text']}")
    return lines


def _progress_lines(st: Dict[str, Any]) -> List[str]:
    """Rolling rate, ETA and holdup, and the mean time per seq in each stage (see README)."""
    from ppserver.observe.progress import format_eta

    if "rate_seqs_per_sec" not in st:
        return []  # a server without stage timings
    held = f"  held back by the {st['held_back_by']}" if st.get("held_back_by") else ""
    eta = f"  ETA {format_eta(st['eta_s'])}" if st.get("eta_s") is not None else ""
    lines = [f"progress    {st['rate_seqs_per_sec']} seqs/s (last {st.get('rate_window_s', 0):g} s){eta}{held}"]
    stages = [f"{name} {ms:.2f}" for name, ms in (st.get("stage_ms") or {}).items() if ms is not None]
    if stages:
        lines.append(f"stages      ms per seq: {'  '.join(stages)}")
    if st.get("advice"):
        lines.append(f"advice      {st['advice']}")
    return lines

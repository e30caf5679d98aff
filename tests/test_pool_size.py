"""The pool sizes itself (num_workers = "auto"): real servers, workers and a trainer that takes
seqs at a fixed rate, with a mapper of fixed cost (it sleeps, so that the pool may need more
workers than the host has cores, or it burns CPU). The policy's intervals are sub-second here.
Whatever the pool does, the epoch is the reference epoch bit for bit."""

from __future__ import annotations

import threading
import time
import urllib.request
from typing import Any, Dict, Iterable, List, Tuple

import pytest
from conftest import (
    SLOW_MAPPER,
    STREAM_MAPPER,
    assert_same_batches,
    assert_same_epoch,
    free_port,
    numpy_config,
    reference,
    reference_batches,
    run_cli,
    run_server,
)

pytestmark = pytest.mark.processes

AUTO = """
num_workers = "auto"
max_workers = 6
elastic_settle = 0.5
elastic_window = 1.5
heartbeat_interval = 0.2
heartbeat_timeout = 3.0
buf_size = 2
progress_interval = 0
"""
COST = 0.05  # seconds per seq the sleeping mapper takes
FAST, SLOW = 50.0, 8.0  # seqs/s the trainer takes: 2.5 workers' worth, then 0.4


class Watch(threading.Thread):
    """Polls the server's status: the pool's size over time."""

    def __init__(self, srv: Any, every: float = 0.25):
        super().__init__(daemon=True)
        self.srv, self.every = srv, every
        self.seen: List[Tuple[float, int]] = []
        self.last: Dict[str, Any] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        with self.srv.client(timeout=10) as c:
            while not self.stop.is_set():
                self.last = c.status()["pool"]
                self.seen.append((time.monotonic(), self.last["current"]))
                self.stop.wait(self.every)

    def __enter__(self) -> Watch:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.join(timeout=15)

    def size_at(self, t: float) -> int:
        return [n for at, n in self.seen if at <= t][-1]

    def sizes_between(self, a: float, b: float) -> List[int]:
        return [n for at, n in self.seen if a <= at <= b]


def paced(it: Iterable[dict], phases: List[Tuple[float, int]], marks: List[float]) -> List[dict]:
    """Take the epoch at most at a fixed rate (a trainer whose step takes 1/rate s, which never
    catches up): phases of (seqs/s, count); the last one takes what is left. `marks` gets the
    time each phase ended."""
    got: List[dict] = []
    rate, count = phases[0]
    phase, taken, step_end = 0, 0, time.monotonic()
    for item in it:
        got.append(dict(item))
        taken += 1
        if phase + 1 < len(phases) and taken >= count:
            marks.append(time.monotonic())
            phase += 1
            rate, count = phases[phase]
            taken = 0
        step_end = max(step_end, time.monotonic()) + 1 / rate
        time.sleep(max(step_end - time.monotonic(), 0))
    marks.append(time.monotonic())
    return got


def changes(pool: Dict[str, Any]) -> Dict[Tuple[str, str], int]:
    return {(d, r): n for d, r, n in pool["changes_total"]}


def test_the_pool_grows_to_what_the_trainer_needs_stays_and_shrinks(tmp_path):
    """50 seqs/s of a 50 ms mapper: 2.5 workers' worth. From 1 the pool grows to 3 (one more at
    most), stays, and once the trainer takes 8 seqs/s it shrinks; the epoch is the reference."""
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=COST), n=590, extra=AUTO)
    log = str(tmp_path / "server.log")
    port = free_port()
    with run_server(cfg, log_path=log, extra=["--metrics", f"127.0.0.1:{port}"]) as srv, Watch(srv) as watch:
        marks: List[float] = []
        with srv.client(timeout=30) as c:
            got = paced(c.epoch(1), [(FAST, 500), (SLOW, 90)], marks)
        pool = watch.last
        shown = run_cli("status", srv.address).stdout
        time.sleep(1.2)  # the metrics are published about once a second
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
    assert_same_epoch(got, reference(cfg, 1))
    grown, end = marks
    need = 3
    # within one worker of what the rate needs, and there for the last part of the fast phase
    assert need <= watch.size_at(grown) <= need + 1, watch.seen
    steady = watch.sizes_between(grown - 4.0, grown)
    assert steady and max(steady) - min(steady) <= 1, watch.seen  # no oscillation
    ups = sum(n for (d, _), n in changes(pool).items() if d == "up")
    assert ups <= need + 1, pool  # 1 -> 3, at most one probe more
    # the slower trainer: the pool shrank, each retire for the trainer holding the epoch back
    assert watch.size_at(end) < watch.size_at(grown), watch.seen
    assert changes(pool).get(("down", "trainer_holds_back"), 0) >= 1, pool
    text = open(log).read()
    assert "pool: add a worker (1 -> 2): the workers hold the epoch back" in text
    assert "pool: retire a worker" in text and "retired by the server" in text
    # ppserver status and the metrics say the same
    assert f"pool        auto: {pool['current']} workers" in shown, shown
    last = pool["changes"][0]
    assert f"{last['action']} {last['from']} -> {last['to']}: {last['text']}" in shown, shown
    assert f"ppserver_workers_wanted {float(pool['wanted'])}" in metrics
    ups = 'ppserver_pool_changes_total{direction="up",reason="workers_hold_back"}'
    assert f"{ups} {float(changes(pool)[('up', 'workers_hold_back')])}" in metrics, metrics


@pytest.mark.parametrize("mode", ["map_seq_stream", "batches"])
def test_the_epoch_is_the_reference_while_the_pool_grows_and_shrinks(tmp_path, mode):
    """One epoch taken fast, then slowly: the pool grows and shrinks meanwhile (with
    map_seq_stream the partitions are all taken when the epoch starts, so an added worker gains
    nothing in it and is retired again). The epoch is the reference, seqs or batches."""
    if mode == "map_seq_stream":
        body, extra = STREAM_MAPPER.format(delay=COST), AUTO + "stream_partitions = 4\n"
    else:
        body, extra = SLOW_MAPPER.format(delay=COST), AUTO
    cfg = numpy_config(tmp_path, body, n=300, extra=extra)
    batching = {"max_seqs": 3}
    per = 3 if mode == "batches" else 1  # seqs per item the trainer takes
    with run_server(cfg) as srv, Watch(srv) as watch:
        with srv.client(timeout=30, batching=batching if mode == "batches" else None) as c:
            got = paced(c.epoch(1), [(FAST / per, 200 // per), (SLOW / per, 10**6)], [])
        pool = watch.last
    seen = [n for _, n in watch.seen]
    assert max(seen) >= 2 and min(seen[seen.index(max(seen)) :]) < max(seen), watch.seen  # it grew, then shrank
    assert changes(pool), pool
    if mode == "batches":
        assert_same_batches(got, reference_batches(cfg, 1, batching))
    else:
        assert_same_epoch(got, reference(cfg, 1))


CPU_MAPPER = """
import time
def map_seq(seq, *, rng, **kwargs):
    end = time.thread_time() + 0.02
    while time.thread_time() < end:
        pass
    seq["data"] = seq["data"] * rng.uniform(0.5, 1.5)
    return seq
"""


def test_a_cpu_bound_mapper_stops_the_pool_where_a_worker_more_gains_nothing(tmp_path):
    """20 ms of CPU per seq on this host's cores, a trainer that takes all it gets: the pool stops
    growing once another worker no longer raises the rate (it undoes that add), far below
    max_workers."""
    import os

    cores = os.cpu_count() or 1
    cfg = numpy_config(tmp_path, CPU_MAPPER, n=20000, extra=AUTO.replace("max_workers = 6", "max_workers = 8"))
    with run_server(cfg) as srv, Watch(srv) as watch:
        deadline = time.monotonic() + 40
        with srv.client(timeout=30) as c:
            for _ in c.epoch(1):
                if changes(watch.last).get(("down", "no_gain")) or time.monotonic() > deadline:
                    break
        time.sleep(0.5)
        pool = watch.last
    assert changes(pool).get(("down", "no_gain"), 0) >= 1, pool
    assert max(n for _, n in watch.seen) <= cores + 2, watch.seen
    assert "raised the rate by" in pool["changes"][0]["text"] or any(
        "raised the rate by" in ch["text"] for ch in pool["changes"]
    ), pool

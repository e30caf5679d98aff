"""Stage timings, rolling rates, ETAs and holdups as pure code: events and instructions in, with
the time passed in, as the server's loop feeds them; no processes, no sockets."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

import numpy as np
import pytest

from ppclient import protocol
from ppserver.errors import ConfigError
from ppserver.observe.metrics import families, parse_address
from ppserver.observe.progress import (
    Progress,
    RunProgress,
    Sample,
    Window,
    advice,
    format_eta,
    held_back_by,
    progress_line,
    run_progress,
    status_fields,
)
from ppserver.observe.stages import STAGES, StageClock
from ppserver.observe.status import PoolStatus, ServerStatus, queue_counts
from ppserver.scheduler import Departure, RunState, Scheduler, Settings, ToClient, ToWorker
from ppserver.scheduler import events as ev
from ppserver.scheduler.dispatch import StreamQueues
from ppserver.scheduler.status import Holdup, RankStatus, RunStatus, SchedulerStatus, Side
from ppserver.server.reader import DATASET_CALLS
from ppserver.worker.clock import MapperClock, heartbeat_stats

pytestmark = pytest.mark.unit

CONSUMER = b"client-1"


class FakeReader:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(DATASET_CALLS, 0.0)
        self.calls = dict.fromkeys(DATASET_CALLS, 0)


class Loop:
    """What the server's loop does with the stage clock: the hook before each event, then the
    scheduler, then a hook per instruction performed, all at the event's time."""

    def __init__(self, **settings_kw: Any):
        self.sched = Scheduler(Settings(**{"buf_size": 2, **settings_kw}))
        self.reader = FakeReader()
        self.clock = StageClock(self.sched, self.reader, stream=False)
        self.out: List[Any] = []

    def __call__(self, event: ev.Event) -> List[Any]:
        self.clock.on_event(event)
        out = self.sched.handle(event)
        for instr in out:
            if isinstance(instr, ToWorker):
                self.clock.to_worker(instr, self.sched.state.now)
            elif isinstance(instr, ToClient):
                self.clock.to_client(instr, self.sched.state.now)
        self.out += out
        return out


def item(pos: int) -> protocol.Item:
    return protocol.seq_to_item({"data": np.zeros((4,), "float32"), "seq_tag": f"s{pos}"}, pos)


def tasks(out: List[Any]) -> List[int]:
    return [it.pos for i in out if isinstance(i, ToWorker) and isinstance(i.msg, protocol.Tasks) for it in i.items]


def started(loop: Loop, num_seqs: int, credit: int) -> int:
    out = loop(ev.WorkerJoined(0.0, b"w1", "hostA", 11))
    out = loop(ev.EpochRequested(0.0, b"req", CONSUMER, 1, job="asr"))
    run = next(i.msg.run for i in out if isinstance(getattr(i, "msg", None), protocol.EpochAccepted))
    loop(ev.RunChecked(0.0, run))
    loop(ev.CreditGranted(0.0, CONSUMER, run, credit))
    loop(ev.RunStarted(0.0, run, 1, num_seqs))
    return run


def sent_to_client(out: List[Any]) -> List[int]:
    return [it.pos for i in out if isinstance(i, ToClient) and isinstance(i.msg, protocol.Seqs) for it in i.items]


def test_stage_times_follow_each_seq_through_the_server():
    loop = Loop()  # one worker with room for 2 tasks
    run = started(loop, 3, credit=1)
    assert tasks(loop(ev.InputsRead(1.0, run, [item(0), item(1), item(2)]))) == [0, 1]
    # results out of order: seq 1 waits for seq 0 (reorder); seq 2 waited for a free slot
    assert tasks(loop(ev.ResultsReceived(3.0, b"w1", run, [item(1)]))) == [2]
    assert sent_to_client(loop(ev.ResultsReceived(4.0, b"w1", run, [item(0)]))) == [0]
    loop(ev.ResultsReceived(5.0, b"w1", run, [item(2)]))
    loop.clock.heartbeat(b"w1", {"map_s": 0.5, "mapped": 3})
    assert sent_to_client(loop(ev.CreditGranted(6.0, CONSUMER, run, 3))) == [1, 2]  # the trainer was slow
    seconds, seqs = loop.clock.totals()
    assert seconds["wait_worker"] == pytest.approx(2.0)  # seq 2: read at 1, sent at 3
    assert seconds["reorder"] == pytest.approx(1.0)  # seq 1 arrived at 3, seq 0 at 4
    assert seconds["wait_trainer"] == pytest.approx(3.0)  # ready at 4 and 5, credit at 6
    assert seconds["mapper"] == pytest.approx(0.5) and seqs["mapper"] == 3
    # task sent until result: 3 + 2 + 2 s, less 0.5 s inside the mapper
    assert seconds["transfer"] == pytest.approx(6.5) and seqs["transfer"] == 3
    assert all(seqs[s] == 3 for s in STAGES if s != "read")
    assert loop.clock.delivered == {("asr", "0"): [3, 48]}
    assert loop.clock.hosts["hostA"][:2] == [3, pytest.approx(7.0)]
    assert loop.clock.run_delivered == {run: 3} and loop.clock.total_delivered == 3


def test_heartbeat_stats_add_only_what_is_new_and_junk_is_ignored():
    loop = Loop()
    loop(ev.WorkerJoined(0.0, b"w1", "hostA", 11))
    clock = loop.clock
    for stats in ({"map_s": 1.0, "mapped": 10}, {"map_s": 1.5, "mapped": 12}, {"map_s": 1.5, "mapped": 12}):
        clock.heartbeat(b"w1", stats)
    assert clock.seconds["mapper"] == pytest.approx(1.5) and clock.seqs["mapper"] == 12
    for junk in (None, {}, {"map_s": "x", "mapped": 1}, {"map_s": float("nan"), "mapped": 1}, {"map_s": 1.0}):
        clock.heartbeat(b"w1", junk)
    clock.heartbeat(b"stranger", {"map_s": 100.0, "mapped": 100})
    assert clock.seconds["mapper"] == pytest.approx(1.5) and clock.seqs["mapper"] == 12
    # the same identity's process counted again from zero (another process with that pid)
    clock.heartbeat(b"w1", {"map_s": 0.25, "mapped": 1})
    assert clock.seconds["mapper"] == pytest.approx(1.75) and clock.seqs["mapper"] == 13
    assert clock.hosts["hostA"][2:] == [pytest.approx(1.75), 13]


def test_mapper_clock_leaves_out_the_time_a_stream_waits_for_inputs():
    clock = MapperClock()
    clock.start()
    clock.paused += 100.0  # waited for inputs inside the generator
    clock.stop()
    assert clock.seconds < 1.0 and clock.seqs == 1
    assert heartbeat_stats(clock, MapperClock()) == {"map_s": round(clock.seconds, 6), "mapped": 1}


def sample(t: float, delivered: int, **seconds: float) -> Sample:
    secs = {s: seconds.get(s, 0.0) for s in STAGES}
    return Sample(t, delivered, {7: delivered}, secs, {s: delivered for s in STAGES})


def window(*samples: Sample) -> Window:
    w = Window(span=20.0)
    for s in samples:
        w.add(s)
    return w


def test_window_rate_stage_means_and_span():
    w = window(*(sample(t, 10 * t, wait_worker=0.1 * t) for t in range(0, 41)))
    assert w.span() == 20.0  # older samples are dropped
    assert w.rate() == pytest.approx(10.0) and w.run_rate(7) == pytest.approx(10.0)
    assert w.stage_ms()["wait_worker"] == pytest.approx(10.0)  # 0.1 s per 10 seqs
    assert w.stage_ms()["read"] == 0.0
    assert w.run_rate(8) is None
    assert Window().rate() is None and Window().stage_ms() == {}


@pytest.mark.parametrize(
    "stage, side",
    [
        ("wait_trainer", Side.TRAINER),
        ("wait_worker", Side.WORKERS),
        ("reorder", Side.WORKERS),
        ("read", Side.DATASET),
    ],
)
def test_the_stage_where_seqs_wait_names_the_side(stage, side):
    w = window(*(sample(t, 10 * t, **{stage: 0.9 * t}) for t in range(10)))
    assert w.flowing()
    assert held_back_by(w, Holdup("the trainer (no credit)", Side.TRAINER, False)) is side


def test_a_stall_or_no_saturated_side_falls_back_to_the_side_of_the_schedulers_holdup():
    stalled = window(*(sample(t, 50 if t > 2 else 10 * t, wait_trainer=0.9 * t) for t in range(10)))
    assert not stalled.flowing()
    assert held_back_by(stalled, Holdup("the dataset (in get_seq(5) for 12.0 s)", Side.DATASET, False)) is Side.DATASET
    idle = window(*(sample(t, 10 * t) for t in range(10)))
    assert held_back_by(idle, Holdup("a worker (none is connected)", Side.WORKERS, False)) is Side.WORKERS
    assert held_back_by(idle, None) is None  # no live run


def test_the_holdup_names_its_side_with_its_words():
    """What the newest run waits for, from the scheduler driven by events: the words keepalives
    carry and the side status and the elastic pool read."""
    loop = Loop()
    run = started(loop, 2, credit=1)
    assert loop.sched.status(0.5).newest.waiting_for == Holdup("the dataset", Side.DATASET, False)
    loop(ev.InputsRead(1.0, run, [item(0), item(1)]))
    assert loop.sched.status(1.5).newest.waiting_for == Holdup("the workers (2 in flight)", Side.WORKERS, False)
    loop(ev.ResultsReceived(2.0, b"w1", run, [item(0)]))
    assert loop.sched.status(2.5).newest.waiting_for == Holdup("the trainer (no credit)", Side.TRAINER, False)
    loop(ev.WorkerLeft(3.0, b"w1"))
    assert loop.sched.status(3.5).newest.waiting_for == Holdup("a worker (none is connected)", Side.WORKERS, False)


def rank(position: int, shard_size: Optional[int], done: bool = False) -> RankStatus:
    return RankStatus(0, 0, 3, 7, False, position, shard_size, 0.0, done, 1.0, 0)


def sched_status(
    *ranks: RankStatus, why: Holdup = Holdup("the workers", Side.WORKERS, False), idle: bool = False
) -> SchedulerStatus:
    """A scheduler's status whose newest run is 7 (none if `idle`), with `ranks`."""
    newest = RunStatus(3, 7, RunState.RUNNING, None, 0, 0, 0.0, 0.0, None, why, None, 0)
    return SchedulerStatus((), 0, 0, 0, 0, 0, 0, {}, 0, 0, None, ranks, None if idle else newest)


def test_eta_comes_from_what_the_ranks_have_left_and_the_rolling_rate():
    w = window(*(sample(t, 10 * t) for t in range(5)))
    st = sched_status(rank(30, 100), rank(10, 100))
    (run,) = run_progress(st.ranks, w, {7: 3})
    assert run == RunProgress(epoch=3, run=7, seqs_done=40, seqs_total=200, seqs_per_sec=10.0, eta_s=16.0)
    assert progress_line(run, Side.WORKERS) == (
        "epoch 3 (run 7): 40/200 seqs, 10.0 seqs/s, ETA 16 s, held back by the workers"
    )
    unknown = run_progress([rank(30, None)], w, {7: 3})[0]
    assert unknown.seqs_total is None and unknown.eta_s is None
    assert "30/? seqs" in progress_line(unknown, None) and "ETA ?" in progress_line(unknown, None)
    done = run_progress([rank(100, 100, done=True)], Window(), {7: 3})[0]
    assert done.eta_s == 0.0 and done.seqs_per_sec is None
    fields = status_fields(st, w, {7: 3})
    assert fields.eta_s == 16.0 and fields.rate_seqs_per_sec == 10.0 and fields.held_back_by is Side.WORKERS
    assert fields.rate_window_s == 4.0 and fields.progress == (run,)
    assert status_fields(sched_status(idle=True), Window(), {}).held_back_by is None


def test_advice_only_for_a_reader_that_holds_the_epoch_back():
    text = advice(Side.DATASET, {"read": 3.25, "mapper": 0.1})
    assert text is not None and text.startswith("the reader holds the epoch back") and "3.2 ms per seq" in text
    assert "map_seq" in text and "\n" not in text
    assert advice(Side.DATASET, {}) is not None and advice(Side.WORKERS, {"read": 3.0}) is None
    assert advice(None, {}) is None
    st = sched_status(why=Holdup("the dataset (in get_seq(5) for 1.0 s)", Side.DATASET, False))
    w = window(*(sample(t, 10 * t, read=0.9 * t) for t in range(10)))
    assert status_fields(st, w, {7: 1}).advice == advice(Side.DATASET, w.stage_ms())


@pytest.mark.parametrize("seconds, text", [(None, "?"), (4.4, "4 s"), (125, "2 min 05 s"), (7260, "2 h 01 min")])
def test_format_eta(seconds: Optional[float], text: str):
    assert format_eta(seconds) == text


@pytest.mark.parametrize(
    "text, want",
    [
        ("127.0.0.1:9100", ("127.0.0.1", 9100)),
        (":9100", ("0.0.0.0", 9100)),
        ("[::1]:9100", ("::1", 9100)),
        ("metrics-host.local:80", ("metrics-host.local", 80)),
    ],
)
def test_metrics_address(text, want):
    assert parse_address(text) == want


@pytest.mark.parametrize("text", ["9100", "127.0.0.1", "127.0.0.1:", ":0", ":65536", "tcp://h:1", "[zz]:1", "a b:1"])
def test_bad_metrics_address_names_the_option(text):
    with pytest.raises(ConfigError, match="'--metrics'") as info:
        parse_address(text)
    assert "\n" not in str(info.value)


def test_metric_families_name_every_stage_host_and_counter():
    loop = Loop()
    run = started(loop, 1, credit=5)
    loop(ev.InputsRead(1.0, run, [item(0)]))
    loop(ev.ResultsReceived(2.0, b"w1", run, [item(0)]))
    sched = loop.sched.status(2.0)  # one worker on hostA
    sched = dataclasses.replace(
        sched,
        workers=sched.workers * 2,
        handed_back=3,
        internal_errors=2,
        departures={Departure.LOST: 1},
        malformed_results=2,
        seqs_skipped_total=7,
    )
    changes = (("down", "trainer_holds_back", 1), ("up", "workers_hold_back", 2))
    pool = PoolStatus(True, 2, 3, 1, 4, 4, "the trainer", (), changes, ())
    progress = Progress(1.5, 2.0, 3.0, Side.TRAINER, None, {}, ())
    st = ServerStatus(sched, "tcp://a", "tcp://b", "v", 1.0, 1, 6, 4, 5, None, pool, progress)
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families(loop.clock, st) for s in f.samples}
    assert got[("ppserver_workers_wanted", ())] == 3
    assert got[("ppserver_pool_changes_total", (("direction", "up"), ("reason", "workers_hold_back")))] == 2
    assert got[("ppserver_pool_changes_total", (("direction", "down"), ("reason", "trainer_holds_back")))] == 1
    assert got[("ppserver_seqs_delivered_total", (("job", "asr"), ("rank", "0")))] == 1
    assert got[("ppserver_bytes_delivered_total", (("job", "asr"), ("rank", "0")))] == 16
    assert {labels[0][1] for name, labels in got if name == "ppserver_stage_seconds_total"} == set(STAGES)
    assert got[("ppserver_worker_results_total", (("host", "hostA"),))] == 1
    assert got[("ppserver_workers", (("host", "hostA"),))] == 2
    assert got[("ppserver_reassigned_total", ())] == 3
    assert got[("ppserver_internal_errors_total", ())] == 2
    assert got[("ppserver_worker_departures_total", (("reason", "lost"),))] == 1
    assert got[("ppserver_malformed_messages_total", ())] == 4
    assert got[("ppserver_refused_handshakes_total", ())] == 5
    assert got[("ppserver_seqs_skipped_total", ())] == 7
    assert got[("ppserver_held_back", (("side", "trainer"),))] == 1
    assert got[("ppserver_held_back", (("side", "dataset"),))] == 0
    assert got[("ppserver_eta_seconds", ())] == 3.0
    assert got[("ppserver_epoch", ())] == 1 and got[("ppserver_malformed_results_total", ())] == 2
    assert got[("ppserver_local_worker_respawns_total", ())] == 6
    queues = {labels: v for (name, labels), v in got.items() if name == "ppserver_queue_seqs"}
    assert queues == {(("queue", "client_credit"),): 0}  # the run is done: no queues, no live lane


WIRE_KEYS = (
    "workers_alive workers seqs_delivered_total seqs_skipped_total malformed_results lost_direct_results "
    "lost_inputs dropped_by_workers departures handed_back internal_errors job ranks epoch run state num_seqs "
    "seqs_delivered "
    "seqs_skipped seqs_per_sec mb_delivered error waiting_for queues address worker_address version uptime_s "
    "local_workers local_worker_respawns malformed_messages refused_handshakes dataset pool rate_seqs_per_sec "
    "rate_window_s eta_s held_back_by advice stage_ms progress"
).split()


def test_the_status_reply_names_each_field_as_docs_and_clients_know_it():
    """ServerStatus.to_wire is the one place the typed status becomes the `status_reply` dict."""
    loop = Loop()
    pool = PoolStatus(False, 1, 1, None, None, 0, "a fixed pool", (), (("up", "workers_hold_back", 1),), ())
    idle = ServerStatus(
        loop.sched.status(0.0),
        "a",
        "b",
        "v",
        0.0,
        0,
        0,
        0,
        0,
        None,
        pool,
        Progress(0.0, 0.0, None, None, None, {}, ()),
    ).to_wire()
    assert sorted(idle) == sorted(WIRE_KEYS)
    assert (idle["state"], idle["epoch"], idle["num_seqs"], idle["queues"], idle["job"], idle["dataset"]) == (
        "idle",
        None,
        None,
        {},
        None,
        "idle",  # the reader is in no dataset call
    )
    assert idle["pool"]["changes_total"] == [["up", "workers_hold_back", 1]]
    run = started(loop, 2, credit=1)
    loop(ev.InputsRead(1.0, run, [item(0), item(1)]))
    loop(ev.ResultsReceived(2.0, b"w1", run, [item(0)]))
    sched = loop.sched.status(3.0)
    w = window(*(sample(t, 10 * t) for t in range(3)))
    wire = ServerStatus(
        sched, "a", "b", "v", 3.0, 1, 0, 0, 0, "get_seq(1) for 2.5 s", pool, status_fields(sched, w, {run: 1})
    ).to_wire()
    assert list(wire) == WIRE_KEYS  # the order the server has always sent
    assert (wire["state"], wire["run"], wire["num_seqs"], wire["seqs_delivered"]) == ("running", run, 2, 1)
    assert wire["workers_alive"] == 1 and wire["workers"][0]["id"] == "w1" and wire["workers"][0]["partitions"] == []
    assert wire["job"]["name"] == "asr" and wire["job"]["runs"] == [run] and wire["job"]["batching"] is None
    assert wire["ranks"] == [
        {
            "rank": 0,
            "subshard": 0,
            "epoch": 1,
            "run": run,
            "solo": False,
            "position": 1,
            "shard_size": 2,
            "seqs_per_sec": wire["ranks"][0]["seqs_per_sec"],
            "done": False,
            "last_heard_s": 3.0,
            "credit": 0,
        }
    ]
    assert wire["waiting_for"] == "the trainer (no credit)" and wire["dataset"] == "get_seq(1) for 2.5 s"
    assert list(wire["queues"].items()) == [
        ("fed", 2),
        ("waiting_for_worker", 0),
        ("in_flight", 1),
        ("reorder_buffer", 0),
        ("kept_for_consumers", 1),
        ("suspects", 0),
        ("client_credit", 0),
    ]
    assert wire["progress"] == [
        {"epoch": 1, "run": run, "seqs_done": 1, "seqs_total": 2, "seqs_per_sec": None, "eta_s": None}
    ]


def test_stage_times_stay_positive_when_direct_lanes_report_out_of_epoch_order():
    """Two ranks with direct results: rank 1 says it took its seqs before rank 0 does, whose seqs
    are dated back over the interval since its last credit, to before rank 1's last arrival. No
    stage's seconds go down, and each seq's time after arriving is counted once (reorder + wait_trainer)."""
    loop = Loop(buf_size=4)
    loop(ev.WorkerJoined(0.0, b"w1", "hostA", 11))
    runs = []
    for rank in (0, 1):
        out = loop(
            ev.EpochRequested(
                0.0, b"req%d" % rank, b"c%d" % rank, 1, job="asr", rank=rank, world_size=2, direct="ipc://@c"
            )
        )
        runs.append(next(i.msg.run for i in out if isinstance(getattr(i, "msg", None), protocol.EpochAccepted)))
    run = runs[0]
    assert runs == [run, run]
    loop(ev.RunChecked(0.0, run))
    loop(ev.RunStarted(0.0, run, 1, 4))
    for rank in (0, 1):
        loop(ev.CreditGranted(2.0, b"c%d" % rank, run, 10))
    assert tasks(loop(ev.InputsRead(1.0, run, [item(p) for p in range(4)]))) == [0, 1, 2, 3]
    loop(ev.CompletedReceived(3.0, b"w1", run, [0, 1], [16, 16]))
    loop(ev.CompletedReceived(9.0, b"w1", run, [2, 3], [16, 16]))
    loop(ev.CreditGranted(9.5, b"c1", run, 10, consumed=2))  # took 1 and 3 (dated 5.75 and 9.5)
    before, _ = loop.clock.totals()
    loop(ev.CreditGranted(10.0, b"c0", run, 10, consumed=2))  # took 0 and 2 (dated 6 and 10)
    seconds, seqs = loop.clock.totals()
    assert seqs["wait_trainer"] == seqs["reorder"] == 4
    # they are Prometheus counters: a seq never takes time off a stage
    assert all(seconds[stage] >= before[stage] for stage in STAGES), (before, seconds)
    assert seconds["wait_trainer"] + seconds["reorder"] == pytest.approx(3 + 2.75 + 1 + 0.5)


def test_a_stream_runs_queues_are_named_on_the_wire_by_their_fields_then_the_credit():
    queues = StreamQueues(fed=5, waiting_for_worker=1, in_flight=2, reorder_buffer=3, partitions_done=1)
    run = RunStatus(3, 7, RunState.RUNNING, None, 0, 0, 0.0, 0.0, None, "the workers", queues, 4)
    wire = [
        ("fed", 5),
        ("waiting_for_worker", 1),
        ("in_flight", 2),
        ("reorder_buffer", 3),
        ("partitions_done", 1),
        ("client_credit", 4),
    ]
    assert list(queue_counts(run).items()) == wire
    ended = dataclasses.replace(run, state=RunState.DONE, waiting_for=None, queues=None, client_credit=0)
    assert queue_counts(ended) == {"client_credit": 0}  # an ended run's dispatch is gone

"""Batches as the unit of work: the server cuts each epoch, workers map and pad, one message each.

The cut and the padding alone (pure), the scheduler moving batches (events in, instructions
out), and real services whose batches are compared bit for bit with the reference epoch,
cut and padded in this process: for any number of workers and ranks, both data paths, a
killed worker, a resumed iterator and map_seq_stream.
"""

from __future__ import annotations

import os
import random
import re
import signal
from typing import Any, Dict, List

import numpy as np
import pytest
from conftest import (
    DATA_PATHS,
    SCALE_MAPPER,
    SLOW_MAPPER,
    STREAM_MAPPER,
    assert_data_path,
    assert_same_batches,
    collect,
    collect_with,
    in_threads,
    is_shared,
    numpy_config,
    read,
    reference,
    reference_batches,
    run_cli,
    run_server,
    shard,
    wait_for,
)

import ppclient
from ppclient import collate, protocol
from ppclient.batching import Batching
from ppclient.protocol import Batch
from ppserver.scheduler import Reply, Scheduler, Settings, ToClient, ToWorker
from ppserver.scheduler import events as ev
from ppserver.scheduler.cut import Cutter, cut, cut_epoch

MAPPER = SCALE_MAPPER
BATCHING = {"max_seqs": 6, "max_frames": 160, "bucket_window": 16, "pad": {"classes": -1}}


# ---- the cut and the padding, alone ------------------------------------------------------------
def _runner_tasks(messages) -> List[List[int]]:
    """The tasks a worker's map_seq runner queues for messages of (items, lost) of one run: a
    batch's seq positions, or a seq's own."""
    from types import SimpleNamespace

    from ppserver.worker.map_seq import MapSeqRunner
    from ppserver.worker.outputs import Means

    runner = MapSeqRunner(Means(SimpleNamespace(buf_size=4), lambda *a: None, dict, lambda: None))  # type: ignore[arg-type]
    for items, lost in messages:
        runner.add(1, items, lost=lost)
    return [[i.pos for i in task.items] if hasattr(task, "items") else [task.pos] for _, task, _ in runner.tasks]


def _seq(pos: int, batch: int, size: int) -> protocol.Item:
    return protocol.Item(pos, {}, [], [], batch=batch, size=size)


@pytest.mark.unit
def test_an_oversized_batch_laid_out_in_shared_memory_names_its_largest_array():
    from ppserver.mappers.apply import MappingError
    from ppserver.worker.outputs import check_size

    arrays = [["data", "<f4", [16, 1000, 10]], ["data:lengths", "<i8", [16]]]
    item = protocol.Item(
        3, {}, arrays, [], nbytes=16 * 1000 * 10 * 4 + 16 * 8, block=[0, 640128, 1, [0, 640000]], size=16
    )
    with pytest.raises(MappingError, match=r"output is 640128 bytes \(array 'data' the largest\), more than"):
        check_size(item, 1000)


@pytest.mark.unit
def test_a_batch_split_over_messages_with_a_lost_seq_runs_only_when_redone_whole():
    """Batch 0 of seqs 10-13 comes in two messages; seq 11 of the first did not check. The worker
    drops the rest of that send (seq 12 and 13 in the second message) and runs the batch once, as
    the server's redo brings it, not with leftovers of the first send."""
    lost = [protocol.BadItem(0, "did not check", 4)]
    first = ([_seq(10, 0, 4)], lost)
    second = ([_seq(12, 0, 4), _seq(13, 0, 4), _seq(20, 1, 1)], [])
    redo = ([_seq(p, 0, 4) for p in (10, 11, 12, 13)], [])
    assert _runner_tasks([first, second, redo]) == [[20], [10, 11, 12, 13]]
    # the lost seq in the second message: the first message's seqs wait no more, nothing is left over
    assert _runner_tasks([([_seq(10, 0, 4), _seq(11, 0, 4)], []), ([_seq(13, 0, 4)], lost), redo]) == [[10, 11, 12, 13]]
    # a batch whose only seqs in a message are lost: its later ones are dropped too
    pair = [_seq(10, 0, 2), _seq(11, 0, 2)]
    assert _runner_tasks([([], [protocol.BadItem(0, "unreadable", 2)]), (pair[1:], []), (pair, [])]) == [[10, 11]]


@pytest.mark.unit
def test_the_cut_is_greedy_within_both_caps_and_a_long_seq_is_a_batch_of_its_own():
    b = Batching(max_seqs=3, max_frames=10)
    lengths = [2, 3, 1, 1, 30, 4, 4, 1]
    assert cut(list(enumerate(lengths)), b) == [[0, 1, 2], [3], [4], [5, 6], [7]]
    # (the 4th seq would make 4 seqs; 30 alone exceeds 10; 4, 4 and 1 would be 3 x 4 = 12 frames)
    assert cut_epoch(lengths, Batching(max_seqs=2)) == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.unit
def test_buckets_sort_each_window_by_length_and_the_reading_cutter_agrees_with_the_whole_epochs():
    rnd = random.Random(5)
    for _ in range(300):
        n = rnd.randint(0, 60)
        lengths = [rnd.randint(0, 40) for _ in range(n)]
        b = Batching(
            max_seqs=rnd.choice([None, 1, 3, 7]), max_frames=rnd.choice([None, 20, 50]), bucket_window=rnd.randint(1, 9)
        )
        if b.max_seqs is None and b.max_frames is None:
            continue
        batches = cut_epoch(lengths, b)
        cutter, streamed = Cutter(b), []
        for pos, n_ in enumerate(lengths):
            got = cutter.add(pos, n_)
            assert all(p <= pos for batch in got for p in batch)  # only seqs already read
            streamed += got
        assert streamed + cutter.finish() == batches
        w = b.bucket_window
        # the batches, one after the other, are the epoch's windows each sorted stably by length
        windows = [sorted(range(s, min(s + w, n)), key=lambda p: lengths[p]) for s in range(0, n, w)]
        assert [p for batch in batches for p in batch] == [p for window in windows for p in window]
        for batch, after in zip(batches, batches[1:] + [None]):
            longest = max(lengths[p] for p in batch)
            assert b.max_seqs is None or len(batch) <= b.max_seqs
            assert b.max_frames is None or len(batch) * longest <= b.max_frames or len(batch) == 1
            if after is not None:  # full: its next seq would break a cap (only the last may be short)
                grown = (len(batch) + 1) * max(longest, lengths[after[0]])
                assert len(batch) == b.max_seqs or (b.max_frames is not None and grown > b.max_frames), batch


@pytest.mark.unit
def test_a_small_bucket_window_does_not_cap_the_batch_size():
    """Windows of 2 and batches of 8: the cut runs on across windows, so every batch but the
    epoch's last has 8 seqs (each window cut on its own gave batches of 2)."""
    lengths = [(7 * i) % 11 + 1 for i in range(30)]
    batches = cut_epoch(lengths, Batching(max_seqs=8, bucket_window=2))
    assert [len(batch) for batch in batches] == [8, 8, 8, 6]
    assert batches[0] == [0, 1, 2, 3, 5, 4, 7, 6]  # each window of 2 sorted by length (7, 3 and 10, 6 swap)
    # by frames too: 18 seqs of at most 11 frames fill 198 of 200, whatever the windows of 7
    assert [len(b) for b in cut_epoch(lengths, Batching(max_seqs=30, max_frames=200, bucket_window=7))] == [18, 12]


@pytest.mark.unit
def test_padding_gives_one_array_per_key_with_lengths_and_names_a_seq_that_does_not_fit():
    seqs = [
        {"data": np.ones((2, 3), "f4"), "classes": np.array([1, 2], "i4"), "n": np.array(7), "seq_tag": "a",
         "seq_idx": 4, "complete_frac": 0.5},
        {"data": np.full((4, 3), 2, "f4"), "classes": np.array([3], "i4"), "n": np.array(8), "seq_tag": "b",
         "seq_idx": 5, "complete_frac": 0.75},
    ]  # fmt: skip
    batch = collate.pad(seqs, {"classes": -1})
    assert batch["data"].shape == (2, 4, 3) and batch["data:lengths"].tolist() == [2, 4]
    assert batch["data"][0, 2:].sum() == 0 and batch["data"][1].min() == 2
    assert batch["classes"].tolist() == [[1, 2], [3, -1]]  # padded with the key's value
    assert batch["n"].tolist() == [7, 8] and "n:lengths" not in batch  # scalars are stacked
    assert batch["seq_tag"] == ["a", "b"] and batch["seq_idx"].tolist() == [4, 5]
    assert batch["complete_frac"].dtype == np.float64
    seqs[1]["data"] = np.ones((4, 5), "f4")
    with pytest.raises(
        collate.BatchError, match=r"'data' of seq 'b' has shape \(4, 5\), seq 'a', the batch's first, has \(2, 3\)"
    ) as info:
        collate.pad(seqs)
    assert info.value.seq_tag == "b"


@pytest.mark.unit
@pytest.mark.parametrize(
    "value, message",
    [
        ({}, "needs max_seqs, max_frames or max_duration"),
        ({"max_seqs": 0}, r"\['max_seqs'\] must be an int >= 1"),
        ({"max_frames": True}, r"\['max_frames'\] must be an int >= 1"),
        ({"max_seqs": 4, "bucket": 3}, "unknown key 'bucket'"),
        ({"max_seqs": 4, "bucket_window": 0}, r"\['bucket_window'\] must be an int from 1"),
        ({"max_seqs": 4, "pad": {"data": "x"}}, r"\['pad'\] must map keys to numbers"),
        ({"max_seqs": 4, "length_key": 3}, r"\['length_key'\] must be a data key"),
        ({"max_seqs": 4, "pad": {"classes": 2**63}}, r"\['pad'\]\['classes'\] must be an int64"),
        ({"max_seqs": 4, "pad": {"classes": -(2**63) - 1}}, r"\['pad'\]\['classes'\] must be an int64"),
    ],
)
def test_bad_batching_settings_are_one_line_naming_the_key(value, message):
    with pytest.raises(ppclient.UsageError, match=message) as info:
        Batching.from_dict(value)
    assert "\n" not in str(info.value)


@pytest.mark.unit
def test_a_pad_int_beyond_int64_is_a_usage_error_of_the_client_before_anything_is_sent():
    with pytest.raises(ppclient.UsageError, match=r"batching\['pad'\]\['data'\] must be an int64") as info:
        ppclient.Client("tcp://127.0.0.1:1", batching={"max_seqs": 2, "pad": {"data": 2**64}})
    assert "\n" not in str(info.value)


@pytest.mark.unit
def test_the_keys_a_batching_names_must_be_the_datas_and_a_lengths_key_cannot_be_padded():
    keys = ("data", "classes")
    outputs = {"data": {"shape": [None, 2], "dtype": "float32"}, "classes": {"shape": [None], "dtype": "uint8"}}
    Batching.from_dict({"max_seqs": 2, "length_key": "data", "pad": {"classes": 255}}).check_keys(
        keys, "input", outputs
    )
    for value, message in [
        ({"length_key": "dat"}, r"\['length_key'\] 'dat' is not an input key of this server \('data', 'classes'\)"),
        ({"pad": {"clases": -1}}, r"\['pad'\] key 'clases' is not an output key of this server"),
        ({"pad": {"classes": -1}}, r"\['pad'\]\['classes'\] -1 does not fit the key's dtype uint8"),
        ({"pad": {"classes": 0.5}}, r"\['pad'\]\['classes'\] 0.5 does not fit the key's dtype uint8"),
    ]:
        with pytest.raises(ppclient.UsageError, match=message):
            Batching.from_dict({"max_seqs": 2, **value}).check_keys(keys, "input", outputs)
    with pytest.raises(ppclient.UsageError, match="data key 'data:lengths' ends in ':lengths'"):
        Batching(max_seqs=2).check_keys(keys, "input", {**outputs, "data:lengths": {"dtype": "int64"}})
    seqs = [{"data": np.ones((n, 2), "f4"), "classes": np.arange(n, dtype="u1"), "seq_tag": f"s{n}"} for n in (2, 3)]
    with pytest.raises(collate.BatchError, match="pad value -1 of 'classes' does not fit its dtype uint8"):
        collate.pad(seqs, {"classes": -1})
    seqs[1]["data:lengths"] = np.array([7])  # would overwrite the lengths of data, or be lost
    with pytest.raises(collate.BatchError, match="seq 's3' has array 'data:lengths'") as info:
        collate.pad(seqs)
    assert info.value.seq_tag == "s3"


# ---- the scheduler moving batches --------------------------------------------------------------
def batch_input(pos: int, seqs: List[int]) -> Batch:
    items = []
    for p in seqs:
        item = protocol.seq_to_item({"data": np.full((2,), p, "f4"), "seq_tag": f"s{p}", "seq_idx": p}, p)
        item.batch, item.size = pos, len(seqs)
        items.append(item)
    return Batch(pos, items)


@pytest.mark.unit
def test_a_batch_counts_its_seqs_array_bytes_when_made():
    """The byte cap on a worker's tasks reads it (scheduler/seqs.py); there is no batch not counted."""
    assert batch_input(0, [1, 2, 3]).nbytes == 3 * 2 * 4  # three seqs of two float32
    assert Batch(1, []).nbytes == 0


def padded(pos: int, n: int) -> protocol.Item:
    seqs = [{"data": np.full((2,), pos, "f4"), "seq_tag": f"b{pos}.{k}", "seq_idx": k} for k in range(n)]
    batch = collate.pad(seqs)
    meta = {"seq_tag": batch.pop("seq_tag"), "seq_idx": batch.pop("seq_idx").tolist()}
    arrays = [[k, v.dtype.str, list(v.shape)] for k, v in batch.items()]
    return protocol.Item(pos, meta, arrays, list(batch.values()), sum(v.nbytes for v in batch.values()), size=n)


class BatchSim:
    """A scheduler serving one job that batches; the shorthands of tests/test_scheduler.py (strict,
    its invariants checked after every event)."""

    def __init__(self, world: int = 1, stream: bool = False, buf_size: int = 2):
        settings = Settings(buf_size=buf_size, stream=stream, partitions=1, direct=False)
        self.s = Scheduler(settings, strict=True)
        self.now = 0.0
        self.b = Batching(max_seqs=2)
        self.world = world
        self.out: List[Any] = []

    def __call__(self, event_type, *args, **kw) -> List[Any]:
        out = self.s.handle(event_type(self.now, *args, **kw))
        self.s.validate()
        self.out += out
        return out

    def start(self, num_batches: Any) -> int:
        for rank in range(self.world):
            out = self(
                ev.EpochRequested, b"req", b"r%d" % rank, 1, job="j", rank=rank, world_size=self.world, batching=self.b
            )
            (reply,) = [i.msg for i in out if isinstance(i, Reply)]
            run = reply.run
        self(ev.RunChecked, run)
        for rank in range(self.world):
            self(ev.CreditGranted, b"r%d" % rank, run, 100)
        self(ev.RunStarted, run, 1, num_batches)
        return run


def to_workers(out: List[Any], kind=protocol.Tasks) -> List[ToWorker]:
    return [i for i in out if isinstance(i, ToWorker) and isinstance(i.msg, kind)]


def to_clients(out: List[Any], kind=protocol.Seqs) -> List[ToClient]:
    return [i for i in out if isinstance(i, ToClient) and isinstance(i.msg, kind)]


@pytest.mark.unit
def test_a_batch_travels_as_its_seqs_naming_it_and_batch_j_goes_to_rank_j_mod_world():
    sim = BatchSim(world=2)
    run = sim.start(5)
    prepares = [i for i in sim.out if type(i).__name__ == "Prepare"]
    assert prepares[0].batching == sim.b  # the reader cuts: positions are batches
    sim(ev.WorkerJoined, b"w", "host", 1)
    asked = [p for i in sim.out if type(i).__name__ == "Read" for p in i.positions]
    assert asked == [0, 1, 2, 3]  # the last batch (4) goes to no one (drop_last with 2 ranks): never read
    out = sim(ev.InputsRead, run, [batch_input(j, [2 * j, 2 * j + 1]) for j in asked])
    tasks = to_workers(out)
    assert [(it.pos, it.batch, it.size) for t in tasks for it in t.items] == [
        (0, 0, 2),
        (1, 0, 2),
        (2, 1, 2),
        (3, 1, 2),
    ]
    opened = to_workers(sim.out, protocol.RunOpen)
    assert opened and opened[0].msg.pad == {}
    out = sim(ev.ResultsReceived, b"w", run, [padded(0, 2), padded(1, 2)], [])
    got = {c.consumer: [it.pos for it in c.items] for c in to_clients(out)}
    assert got == {b"r0": [0], b"r1": [1]}
    for j in (2, 3):
        sim(ev.ResultsReceived, b"w", run, [padded(j, 2)], [])
    ends = to_clients(sim.out, protocol.End)
    assert sorted((e.consumer, e.msg.count) for e in ends) == [(b"r0", 2), (b"r1", 2)]  # equal steps
    started = to_clients(sim.out, protocol.Started)
    assert {s.msg.num_seqs for s in started} == {2} and started[0].msg.batching == sim.b.to_dict()


@pytest.mark.unit
def test_a_suspect_batch_is_probed_and_its_last_crash_names_the_seq_being_mapped():
    sim = BatchSim(buf_size=1)
    run = sim.start(1)
    sim(ev.InputsRead, run, [batch_input(0, [0, 1])])
    for k in range(3):  # max_seq_retries workers take the batch and die (no heartbeat for 5 s)
        wid = b"w%d" % k
        out = sim(ev.WorkerJoined, wid, "host", 10 + k)
        (task,) = to_workers(out)
        assert task.msg.probe == (k > 0)  # a suspect after the first crash: the worker says what it maps
        if k == 2:
            sim(ev.MappingReported, wid, run, 0, "s0")
            sim(ev.MappingReported, wid, run, 0, "s1")
        sim.now += 6.0
        sim(ev.Tick)
    (failed,) = [i.msg for i in to_clients(sim.out, protocol.RunFailed)]
    assert failed.seq_tag == "s1" and "seq 's1' (of batch 0) was being mapped" in failed.message


@pytest.mark.unit
def test_stream_outputs_are_cut_into_batches_the_client_pads():
    sim = BatchSim(stream=True)
    run = sim.start(None)
    sim(ev.WorkerJoined, b"w", "host", 1)
    (opened,) = to_workers(sim.out, protocol.StreamOpen)
    outputs = [
        protocol.seq_to_item({"data": np.zeros((n,), "f4"), "seq_tag": f"o{k}"}, k) for k, n in enumerate([3, 1, 2])
    ]
    sim(ev.StreamOutputsReceived, b"w", run, 0, opened.msg.incarnation, outputs, [])
    sim(ev.StreamFinished, b"w", run, 0, opened.msg.incarnation)
    seqs = to_clients(sim.out)
    assert [(it.pos, it.batch, it.size) for c in seqs for it in c.items] == [(0, 0, 2), (1, 0, 2), (2, 1, 1)]
    (end,) = to_clients(sim.out, protocol.End)
    assert end.msg.count == 2  # batches


@pytest.mark.unit
def test_stream_batches_of_sorted_windows_carry_a_complete_frac_that_never_goes_back():
    """Windows of 4 outputs sorted by length put later outputs first; each batch's seqs carry the
    batch's complete_frac, the furthest output's in it or before it: monotonic in delivery order."""
    sim = BatchSim(stream=True)
    sim.b = Batching(max_seqs=2, bucket_window=4)
    run = sim.start(None)
    sim(ev.WorkerJoined, b"w", "host", 1)
    (opened,) = to_workers(sim.out, protocol.StreamOpen)
    lengths = [5, 1, 4, 2, 3, 6]
    outputs = [
        protocol.seq_to_item({"data": np.zeros((n,), "f4"), "seq_tag": f"o{k}", "complete_frac": (k + 1) / 6}, k)
        for k, n in enumerate(lengths)
    ]
    sim(ev.StreamOutputsReceived, b"w", run, 0, opened.msg.incarnation, outputs, [])
    sim(ev.StreamFinished, b"w", run, 0, opened.msg.incarnation)
    seqs = [it for c in to_clients(sim.out) for it in c.items]
    assert [(it.meta["seq_tag"], it.batch) for it in seqs] == [
        ("o1", 0),
        ("o3", 0),
        ("o2", 1),
        ("o0", 1),
        ("o4", 2),
        ("o5", 2),
    ]
    assert [it.meta["complete_frac"] for it in seqs] == [4 / 6, 4 / 6, 4 / 6, 4 / 6, 1.0, 1.0]


@pytest.mark.unit
def test_a_stream_batch_whose_outputs_cannot_be_padded_fails_the_run_for_every_rank_naming_the_seqs():
    sim = BatchSim(world=2, stream=True)
    run = sim.start(None)
    sim(ev.WorkerJoined, b"w", "host", 1)
    (opened,) = to_workers(sim.out, protocol.StreamOpen)
    outputs = [
        protocol.seq_to_item({"data": np.zeros((2, d), "f4"), "seq_tag": f"o{k}"}, k)
        for k, d in enumerate([3, 3, 3, 4])
    ]
    sim(ev.StreamOutputsReceived, b"w", run, 0, opened.msg.incarnation, outputs, [])
    failed = to_clients(sim.out, protocol.RunFailed)
    assert sorted(f.consumer for f in failed) == [b"r0", b"r1"]  # as a map_seq batch that fails: every rank
    msg = failed[0].msg
    assert msg.failure == protocol.FailureKind.MAPPER.value and msg.seq_tag == "o3"
    assert "batch 1: batch: 'data' of seq 'o3' has shape (2, 4), seq 'o2', the batch's first, has (2, 3)" in msg.message
    assert run not in sim.s.state.runs


# ---- real services ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return numpy_config(
        tmp_path_factory.mktemp("batches"), MAPPER, n=61, ordering="laplace:.20", extra="buf_size = 3\n"
    )


def pull(address: str, world: int, epoch: int, *, warm: bool = False, **kw) -> Dict[int, List[dict]]:
    """Every rank's batches of `epoch`, each rank a client in a thread of its own; `warm`: each
    reads the epoch before first (by then every worker reaches its result socket)."""
    got: Dict[int, List[dict]] = {}

    def rank_main(rank: int) -> None:
        with ppclient.Client(address, rank=rank, world_size=world, job=f"b{world}", timeout=30, **kw) as c:
            if warm:
                collect(c.epoch(epoch - 1))
            got[rank] = collect(c.epoch(epoch))

    in_threads(rank_main, range(world))
    return got


@pytest.mark.processes
@pytest.mark.parametrize(
    "workers, world, path", [(1, 1, "direct"), (3, 1, "via-server"), (3, 3, "direct"), (1, 3, "via-server")]
)
def test_batches_are_the_reference_epoch_cut_and_padded_for_any_workers_ranks_and_path(tmp_path, workers, world, path):
    cfg = numpy_config(tmp_path, MAPPER, n=61, ordering="laplace:.20", extra="buf_size = 3\n" + DATA_PATHS[path])
    want = reference_batches(cfg, 2, BATCHING)
    log = str(tmp_path / "server.log")
    with run_server(cfg, workers=workers, log_path=log) as srv:
        got = pull(srv.address, world, 2, warm=True, batching=BATCHING)
    for rank in range(world):
        assert_same_batches(got[rank], shard(want, rank, world))
    if world > 1:
        assert len({len(got[rank]) for rank in range(world)}) == 1  # equal steps
    assert_data_path(read(log), path)
    assert "batches of max_seqs 6, max_frames 160, bucket_window 16" in read(log)


@pytest.mark.processes
def test_padded_batches_come_straight_through_shared_memory_and_len_is_known_up_front(corpus, tmp_path):
    want = reference_batches(corpus, 1, BATCHING)
    log = str(tmp_path / "server.log")
    with run_server(corpus, workers=2, log_path=log) as srv, srv.client(batching=BATCHING) as c:
        # epochs before the one compared, until both workers have the client's route and send through
        # shared memory (one that had none yet sent its results of an epoch through the server)
        wait_for(
            lambda: collect(c.epoch(2)) and read(log).count("(shared memory)") == 2,
            30,
            "both workers to send through shared memory",
        )
        it = c.epoch(1)
        assert len(it) == len(want)  # NumpyDataset knows every length: the server cut the epoch up front
        got = collect(it)
        shared = sum(is_shared(b["data"]) for b in got)
        assert_same_batches(got, want)
        assert shared == len(got), shared  # padded straight into the workers' segments
        assert it.state_dict()["batching"] == Batching.from_dict(BATCHING).to_dict()


LENGTH_FN = """
def batch_length(seq):
    return 2 * seq["data"].shape[0]  # e.g. a speed perturbation by 2 in the mapper
batching = {"max_frames": 200, "max_seqs": 5}
"""


@pytest.mark.processes
def test_a_config_batch_length_cuts_as_the_reader_reads_and_the_config_batching_is_the_default(tmp_path):
    cfg = numpy_config(tmp_path, MAPPER, n=33, extra=LENGTH_FN)
    want = reference_batches(cfg, 3, {"max_frames": 200, "max_seqs": 5})
    with run_server(cfg, workers=2) as srv:
        with srv.client() as c:
            assert c.info()["batching"]["max_frames"] == 200
            it = c.epoch(3)
            with pytest.raises(TypeError, match="number of batches of this epoch is not known in advance"):
                len(it)
            assert_same_batches(collect(it), want)
        with srv.client(batching=False, job="seqs") as c:  # one seq at a time, asked for
            got = collect(c.epoch(3))
    assert [s["seq_tag"] for s in got] == [s["seq_tag"] for s in reference(cfg, 3)]


@pytest.mark.processes
def test_a_resumed_iterator_and_a_killed_worker_give_the_same_batches(tmp_path):
    # 10 ms a seq: the epoch is still being mapped when the worker is killed
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.01), n=61, ordering="laplace:.20", extra="buf_size = 3\n")
    want = reference_batches(cfg, 4, BATCHING)
    with run_server(cfg, workers=2) as srv:
        with srv.client(batching=BATCHING, job="resume") as c:
            it = c.epoch(4)
            first = [next(it) for _ in range(3)]
            state = it.state_dict()
        assert state["position"] == 3  # batches
        with srv.client(job="resume") as c:  # the state carries its batching
            rest = collect_with(c.epoch(state=state), {2: lambda: os.kill(srv.worker_pids()[0], signal.SIGKILL)})
            st = c.status()
        assert_same_batches(first + rest, want)
        # killed mid-epoch, with the seqs of a batch it had yet to send back
        assert st["departures"].get("exited") == 1 and st["handed_back"] >= 1, st
        wait_for(lambda: len(srv.worker_pids()) == 2, 30, "the killed worker to be replaced")
        with srv.client(batching=False, job="resume") as c:
            with pytest.raises(
                ppclient.UsageError, match="the state was taken of an epoch read in batches of max_seqs 6"
            ):
                c.epoch(state=state)


STREAM = STREAM_MAPPER.format(delay=0) + "stream_partitions = 2\n"


@pytest.mark.processes
def test_map_seq_stream_batches_cut_the_merged_outputs_by_their_lengths(tmp_path):
    cfg = numpy_config(tmp_path, STREAM, n=50)
    batching = {"max_frames": 300, "bucket_window": 8, "pad": {"classes": -1}}
    want = reference_batches(cfg, 1, batching)
    with run_server(cfg, workers=2) as srv:
        got = pull(srv.address, 2, 1, batching=batching)
    for rank in range(2):
        assert_same_batches(got[rank], shard(want, rank, 2))


FAILING = """
import os
def map_seq(seq, **kwargs):
    if seq["seq_tag"] == "seq-7":
        if os.environ.get("PPTEST_CRASH"):
            os._exit(3)  # kills its worker
        raise ValueError("cannot map this one")
    return seq
max_seq_retries = 2
"""


@pytest.mark.processes
@pytest.mark.parametrize("crash", [False, True])
def test_a_seq_that_fails_fails_its_batch_naming_the_seq(tmp_path, crash):
    cfg = numpy_config(tmp_path, FAILING, n=20)
    env = {"PPTEST_CRASH": "1"} if crash else None
    with run_server(cfg, workers=2, env=env) as srv, srv.client(batching={"max_seqs": 4}) as c:
        with pytest.raises(ppclient.MapperError) as info:
            collect(c.epoch(1))
    assert info.value.seq_tag == "seq-7"
    if crash:
        assert "seq 'seq-7' (of batch 1) was being mapped when the last of 2 workers" in str(info.value)
    else:
        assert "batch 1: ValueError: cannot map this one" in str(info.value)


@pytest.mark.processes
def test_a_rank_asking_for_other_batching_than_its_job_is_refused_in_one_line(corpus):
    with run_server(corpus, workers=1) as srv:
        with srv.client(rank=0, world_size=2, job="x", batching={"max_seqs": 4}) as c0:
            c0.epoch(1)
            with srv.client(rank=1, world_size=2, job="x", batching={"max_seqs": 5}) as c1:
                with pytest.raises(
                    ppclient.Error, match="batches of max_seqs 5, where the job has batches of max_seqs 4"
                ):
                    c1.epoch(1)
        with srv.client(job="y", batching={"max_seqs": 2, "length_key": "text"}) as c:
            with pytest.raises(
                ppclient.Error, match=r"batching\['length_key'\] 'text' is not an input key of this server"
            ):
                c.epoch(1)
        with srv.client(job="y", batching={"max_seqs": 2, "pad": {"clases": -1}}) as c:
            with pytest.raises(ppclient.Error, match=r"batching\['pad'\] key 'clases' is not an output key"):
                c.epoch(1)


@pytest.mark.processes
def test_a_batched_epoch_reads_on_through_a_server_restart(tmp_path):
    """kill -9 of the server after 3 batches and a new one on its address 3 s later: the client asks
    it for its epoch from batch 3, and gets the batches it would have got."""
    from conftest import SLOW_MAPPER, restartable

    cfg = numpy_config(
        tmp_path,
        SLOW_MAPPER.format(delay=0.03),
        n=61,
        ordering="laplace:.20",
        extra="heartbeat_interval = 0.2\nheartbeat_timeout = 1.0\nbuf_size = 2\n",
    )
    want = reference_batches(cfg, 1, BATCHING)
    with restartable(cfg, tmp_path) as service, ppclient.Client(service.address, timeout=30, batching=BATCHING) as c:
        it = c.epoch(1)
        got = collect_with(it, {3: service.restart_after})
        service.join()
        assert it.reconnects == 1  # the kill landed mid-epoch
        starts = re.findall(r"reads epoch 1 \(run \d+\) from (?:seq|batch) (\d+)", read(service.log(2)))
        assert len(starts) == 1 and int(starts[0]) >= 3, starts  # asked again from where it was
    assert_same_batches(got, want)


SMALL_WINDOWS = {"max_seqs": 8, "bucket_window": 2}
INPUT_LENGTH = """
def batch_length(seq):
    return seq["data"].shape[0]
"""
OUTPUTS = """
map_outputs = {"data": {"shape": (None, None), "dtype": "float32"}, "classes": {"shape": (None,), "dtype": "int32"}}
"""
LENGTHS_KEY = """
for _s in SEQS:
    _s["data:lengths"] = np.zeros(2, "int64")
batching = {"max_seqs": 4}
"""


@pytest.mark.processes
@pytest.mark.parametrize("cut_at", ["up front", "as read"])
def test_small_bucket_windows_give_full_batches_whose_complete_frac_never_goes_back(tmp_path, cut_at):
    """Windows of 2 and batches of 8: every batch but the last has 8 seqs, and a batch's
    complete_frac (the same for its seqs) never decreases, whether the cut is made up front (the
    dataset knows the lengths) or as the reader reads (a config batch_length)."""
    extra = "buf_size = 2\n" + (INPUT_LENGTH if cut_at == "as read" else "")
    cfg = numpy_config(tmp_path, MAPPER, n=61, ordering="laplace:.20", extra=extra)
    want = reference_batches(cfg, 1, SMALL_WINDOWS)
    with run_server(cfg, workers=2) as srv, srv.client(batching=SMALL_WINDOWS) as c:
        got = collect(c.epoch(1))
    assert_same_batches(got, want)
    assert [len(b["seq_tag"]) for b in got] == [8] * 7 + [5]
    fracs = [b["complete_frac"] for b in got]
    assert all(len(set(f.tolist())) == 1 for f in fracs)  # one value per batch
    per_batch = [float(f[0]) for f in fracs]
    assert per_batch == sorted(per_batch) and per_batch[-1] == 1.0, per_batch
    positions = [int(i) for b in got for i in b["seq_idx"]]
    assert positions != sorted(positions)  # the windows do reorder: the seqs' own values would go back


HELD_INPUTS = """
import gc
from ppclient.protocol import Item
def batch_length(seq):  # the reader calls it as it cuts: how many inputs does the server hold then?
    with open({path!r}, "a") as f:
        f.write(f"{{sum(type(o) is Item for o in gc.get_objects())}}\\n")
    return seq["data"].shape[0]
"""


@pytest.mark.processes
def test_a_bucket_window_as_large_as_the_epoch_holds_lengths_not_inputs_in_the_server(tmp_path):
    """Cut as read with a window of the whole epoch: the first batch is known only once every seq
    is read, yet the server holds none of the inputs read for the cut; it reads each again when
    its batch is due."""
    held = tmp_path / "held.txt"
    batching = {"max_seqs": 8, "bucket_window": 64}
    cfg = numpy_config(tmp_path, MAPPER, n=61, extra=HELD_INPUTS.format(path=str(held)))
    with run_server(cfg, workers=2) as srv, srv.client(batching=batching) as c:
        got = collect(c.epoch(1))
    counts = [int(line) for line in held.read_text().split()]
    assert len(counts) == 61 and max(counts) <= 1, counts  # (the seq being measured, at most)
    assert_same_batches(got, reference_batches(cfg, 1, batching))
    assert [len(b["seq_tag"]) for b in got] == [8] * 7 + [5]


SLOW_BATCH = SLOW_MAPPER.format(delay=0.3) + "heartbeat_interval = 0.2\nbuf_size = 1\n"
STUCK_SEQ = """
import time
def map_seq(seq, **kwargs):
    if seq["seq_tag"] == "seq-3":
        time.sleep(30)
    return seq
heartbeat_interval = 0.2
buf_size = 1
"""


@pytest.mark.processes
def test_a_batch_slower_than_the_timeout_is_progress_and_a_stuck_mapper_is_not(tmp_path):
    """Batches of 8 at 0.3 s a seq take 2.4 s, beyond the client's timeout of 1.5 s: the workers'
    heartbeats say how far they are, so the epoch completes. A mapper stuck on one seq shows no
    progress and the epoch fails naming the workers once the timeout passes."""
    cfg = numpy_config(tmp_path, SLOW_BATCH, n=16)
    want = reference_batches(cfg, 1, {"max_seqs": 8})
    with run_server(cfg, workers=2) as srv, srv.client(timeout=1.5, batching={"max_seqs": 8}) as c:
        assert_same_batches(collect(c.epoch(1)), want)
    stuck = numpy_config(tmp_path, STUCK_SEQ, n=16, name="stuck.py")
    with run_server(stuck, workers=2) as srv, srv.client(timeout=1.5, batching={"max_seqs": 8}) as c:
        with pytest.raises(ppclient.Error, match=r"made no progress for 1.5 s .*waiting for the workers"):
            collect(c.epoch(1))


@pytest.mark.processes
@pytest.mark.parametrize(
    "mapper, extra, message",
    [
        (MAPPER, 'batching = {"max_seqs": 4, "length_key": "dat"}', r"\['length_key'\] 'dat' is not an input key"),
        (
            STREAM,
            OUTPUTS + 'batching = {"max_frames": 300, "length_key": "clases"}',
            r"\['length_key'\] 'clases' is not an output key",
        ),
        (MAPPER, 'batching = {"max_seqs": 4, "pad": {"clases": -1}}', r"\['pad'\] key 'clases' is not an output key"),
        (MAPPER, 'batching = {"max_seqs": 4, "pad": {"classes": 2**63}}', r"\['pad'\]\['classes'\] must be an int64"),
        (MAPPER, 'batching = {"max_seqs": 4, "pad": {"classes": 1.5}}', r"1.5 does not fit the key's dtype int32"),
        (MAPPER, LENGTHS_KEY, "data key 'data:lengths' ends in ':lengths'"),
    ],
)
def test_a_config_batching_that_names_keys_the_data_has_not_is_one_line_and_exit_2(tmp_path, mapper, extra, message):
    cfg = numpy_config(tmp_path, mapper, n=8, extra=extra)
    res = run_cli("serve", cfg, "--bind", "tcp://127.0.0.1:0", "--workers", "0", timeout=60)
    lines = [line for line in res.stderr.splitlines() if "error" in line]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert "config key 'batching'" in lines[0] and re.search(message, lines[0]), lines[0]
    assert "ready" not in res.stdout


UNPADDABLE = """
import numpy as np
def {kind}(seq, **kwargs):
    if seq["seq_tag"] == "seq-3":
        {change}
    return seq
def map_seq_stream(seqs, **kwargs):
    for seq in seqs:
        yield _change(seq)
"""


def unpaddable(kind: str, change: str) -> str:
    """A mapper (map_seq, or map_seq_stream through the same function) whose output of seq-3 does not
    pad with the others'."""
    body = UNPADDABLE.format(kind="map_seq" if kind == "map_seq" else "_change", change=change)
    if kind == "map_seq":
        body = body[: body.index("def map_seq_stream")]
    return body


@pytest.mark.processes
@pytest.mark.parametrize(
    "kind, change, message",
    [
        ("stream", 'seq["data"] = seq["data"][:, :4]', r"'data' of seq 'seq-3' has shape \(\d+, 4\), seq 'seq-0'"),
        ("stream", 'seq["extra"] = np.zeros(2)', r"seq 'seq-3' has array 'extra', seq 'seq-0', the batch's first"),
        ("stream", 'seq["data:lengths"] = np.zeros(2)', r"seq 'seq-3' has array 'data:lengths'"),
        ("map_seq", 'seq["data:lengths"] = np.zeros(2)', r"seq 'seq-3' has array 'data:lengths'"),
    ],
)
def test_outputs_that_cannot_be_padded_fail_the_epoch_naming_the_seqs_on_every_next(tmp_path, kind, change, message):
    cfg = numpy_config(tmp_path, unpaddable(kind, change), n=12, extra=OUTPUTS)
    with run_server(cfg, workers=1) as srv, srv.client(batching={"max_seqs": 4}, timeout=10) as c:
        it = c.epoch(1)
        with pytest.raises(ppclient.MapperError, match=message) as first:
            collect(it)
        assert first.value.seq_tag == "seq-3" and "\n" not in str(first.value)
        with pytest.raises(ppclient.MapperError) as again:  # the same error, not a wait for the lost batch
            next(it)
        assert str(again.value) == str(first.value)


@pytest.mark.processes
def test_the_default_window_is_8_batches_with_the_configs_batching_and_32_seqs_without(tmp_path):
    cfg = numpy_config(tmp_path, MAPPER, n=61, extra='batching = {"max_seqs": 2}\n')

    def sent_ahead(c: ppclient.Client) -> int:
        """What the server sent ahead of a trainer that takes nothing: its whole credit."""
        ranks: List[Dict[str, Any]] = []

        def settled() -> bool:
            ranks[:] = c.status()["ranks"]
            return len(ranks) == 1 and ranks[0]["credit"] == 0

        wait_for(settled, 30, "the server to send what the client's credit allows")
        return ranks[0]["position"]

    with run_server(cfg, workers=1) as srv:
        with srv.client(direct=False, job="config") as c:
            it = c.epoch(1)
            assert sent_ahead(c) == 8  # batches
            assert len(collect(it)) == 31
        with srv.client(direct=False, job="seqs", batching=False) as c:
            it = c.epoch(1)
            assert sent_ahead(c) == 32  # seqs

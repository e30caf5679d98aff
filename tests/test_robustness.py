"""No hang, loop or lost epoch on bad input: stuck and slow datasets, oversized and malformed
results, refused requests, bad addresses and keys, dead servers, superseded epochs.

Every test runs real `ppserver serve` processes (and fake peers speaking the protocol over
real sockets) on loopback.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pytest
import zmq
from conftest import (
    DATA_PATHS,
    REPO,
    SLOW_MAPPER,
    assert_data_path,
    assert_same_epoch,
    children_of,
    collect,
    error_line,
    numpy_config,
    read,
    reference,
    run_cli,
    run_server,
    sitecustomize_env,
    wait_for,
    wait_gone,
    write_config,
)

import ppclient
from ppclient import protocol
from ppclient.protocol import Channel, Peer
from ppserver.scheduler.events import Carried, MessageDropped
from ppserver.server.from_workers import EVENTS, carried

# A corpus whose reads can be made slow or stuck, from a module next to the config.
DATA_MODULE = """
import time
import numpy as np
from ppserver.datasets.base import Dataset

class Corpus(Dataset):
    def __init__(self, n=30, stuck_at=None, len_delay=0.0, **kwargs):
        super().__init__(**kwargs)
        self.n, self.stuck_at, self.len_delay = n, stuck_at, len_delay
    def _num_corpus_seqs(self):
        return self.n
    def _load(self, i):
        if i == self.stuck_at:
            time.sleep(3600)
        return {"data": np.full((3 + i % 5, 4), i, dtype="float32")}
    def _tag(self, i):
        return f"s{i}"
    def _seq_len(self, i):
        time.sleep(self.len_delay)
        return 3 + i % 5
    def _compute_data_keys(self):
        return {"data": {"shape": [None, 4], "dtype": "float32"}}
"""


def corpus_config(tmp_path, dataset_kwargs: str, extra: str = "") -> str:
    write_config(tmp_path, DATA_MODULE, name="corpus.py")
    return write_config(
        tmp_path,
        textwrap.dedent(f"""
    import os, sys
    sys.path.insert(0, os.path.dirname(__file__))
    dataset = {{"class": "corpus:Corpus", {dataset_kwargs}}}
    def map_seq(seq, **kwargs):
        return seq
    """)
        + extra,
    )


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


# ---- 1. a dataset read that never returns ----------------------------------------------------
@pytest.mark.processes
def test_stuck_dataset_is_an_error_and_the_server_stays_responsive(tmp_path):
    cfg = corpus_config(tmp_path, '"stuck_at": 5')
    with run_server(cfg, workers=1) as srv:
        kids = children_of(srv.proc.pid)
        with srv.client(timeout=3) as a:
            it = a.epoch(1)
            got = [next(it) for _ in range(5)]
            assert [s["seq_tag"] for s in got] == [f"s{i}" for i in range(5)]
            with pytest.raises(ppclient.Error, match="no progress") as info:
                next(it)
            assert not isinstance(info.value, ppclient.ServerUnavailable)
            assert "get_seq(5)" in str(info.value)
            # the server answers while its dataset is stuck
            start = time.monotonic()
            st = a.status()
            assert time.monotonic() - start < 2
            assert "get_seq(5)" in st["dataset"] and st["workers_alive"] == 1
            # a new epoch cannot start (the dataset never returns), which is an error, not a hang
            with srv.client(timeout=3) as b:
                start = time.monotonic()
                with pytest.raises(ppclient.Error, match="did not start") as info:
                    b.epoch(2)
                assert time.monotonic() - start < 6
                assert not isinstance(info.value, ppclient.ServerUnavailable)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=5) == 0
        assert time.monotonic() - start < 5
        assert wait_gone(kids, 2.0) == []


# ---- 2. slow epoch set-up ----------------------------------------------------------------------
@pytest.mark.processes
def test_slow_epoch_setup_keeps_workers_alive(tmp_path):
    # 30 lengths x 0.1 s: 3 s inside init_seq_order, 5 heartbeat timeouts
    cfg = corpus_config(
        tmp_path, '"len_delay": 0.1, "seq_ordering": "sorted"', "heartbeat_interval = 0.2\nheartbeat_timeout = 0.6\n"
    )
    slog = str(tmp_path / "server.log")
    with run_server(cfg, workers=2, log_path=slog) as srv, srv.client(timeout=20) as c:
        began = time.monotonic()
        it = c.epoch(1)
        first = next(it)
        setup_s = time.monotonic() - began
        got = [dict(first)] + collect(it)
        st = c.status()
    assert setup_s > 4 * 0.6, setup_s  # the set-up did outlast several heartbeat timeouts
    assert_same_epoch(got, reference(cfg, 1))
    assert st["departures"] == {} and st["workers_alive"] == 2
    assert len(re.findall(r"worker \S+ joined", read(slog))) == 2 and " lost" not in read(slog)


# ---- 3. a result larger than max_message_bytes -------------------------------------------------
@pytest.mark.processes
def test_oversized_result_is_a_mapper_error_not_a_reconnect_loop(tmp_path):
    body = """
    import numpy as np
    def map_seq(seq, *, epoch, **kwargs):
        if epoch == 1 and seq["seq_tag"] == "seq-3":
            seq["data"] = np.zeros((40000,), "float32")[None].repeat(2, 0).reshape(-1, 8)
        return seq
    max_message_bytes = 65536
    """
    cfg = numpy_config(tmp_path, body, n=12)
    slog = str(tmp_path / "server.log")
    with run_server(cfg, workers=1, log_path=slog) as srv, srv.client(timeout=20) as c:
        with pytest.raises(ppclient.MapperError, match="max_message_bytes") as info:
            collect(c.epoch(1))
        assert info.value.seq_tag == "seq-3"
        assert_same_epoch(collect(c.epoch(2)), reference(cfg, 2))
        assert c.status()["departures"] == {}
    assert len(re.findall(r"worker \S+ joined", read(slog))) == 1


# ---- 3b. a result whose header is larger than a message header may be --------------------------
HUGE_TAG = {
    "map_seq": """
    def map_seq(seq, **kwargs):
        if seq["seq_tag"] == "seq-2":
            seq["seq_tag"] = "x" * 2_000_000
        return seq
    """,
    "map_seq_stream": """
    def map_seq_stream(seqs, **kwargs):
        for seq in seqs:
            if seq["seq_tag"] == "seq-2":
                seq["seq_tag"] = "x" * 2_000_000
            yield seq
    """,
}


@pytest.mark.processes
@pytest.mark.parametrize("mode", sorted(HUGE_TAG))
def test_result_with_a_huge_header_is_a_mapper_error_naming_the_seq(tmp_path, mode):
    cfg = numpy_config(tmp_path, HUGE_TAG[mode], n=6)
    with run_server(cfg, workers=1) as srv, srv.client(timeout=20) as c:
        with pytest.raises(ppclient.MapperError, match=r"output header .* is \d+ bytes, more than 262144") as info:
            collect(c.epoch(1))
        assert info.value.seq_tag == "seq-2"
        st = c.status()
        assert st["malformed_messages"] == 0 and st["departures"] == {}


@pytest.mark.processes
def test_results_with_large_headers_travel_in_several_messages(tmp_path):
    # 200 KB tags: a worker's batch of them, or the server's delivery of several, would exceed
    # the 1 MiB header cap if they were not split
    body = """
    def map_seq(seq, **kwargs):
        seq["seq_tag"] = seq["seq_tag"] + ":" + "x" * 200_000
        return seq
    buf_size = 16
    direct_results = False
    """
    cfg = numpy_config(tmp_path, body, n=40)
    with run_server(cfg, workers=1) as srv, srv.client(timeout=20, window=16) as c:
        it = c.epoch(1)
        got = [next(it) for _ in range(15)]  # credit is 24 now (16, topped up by 8)
        wait_for(lambda: c.status()["workers"][0]["seqs_done"] == 40, 20, "the worker to map every seq")
        got += collect(it)  # the next top-up releases 8 results of the 16 held at once
        assert c.status()["malformed_messages"] == 0
    assert_same_epoch(got, reference(cfg, 1))


# ---- 3c. an input whose header is larger than a message header may be ----------------------------
HUGE_INPUT = """
import numpy as np
_r = np.random.RandomState(5)
TAGS = [f"seq-{i}" for i in range(8)]
TAGS[3] = "x" * 2_000_000
SEQS = [{"data": _r.randn(4 + i, 3).astype("float32")} for i in range(8)]
dataset = {"class": "NumpyDataset", "seqs": SEQS, "tags": TAGS}
"""
IDENTITY = {
    "map_seq": """
    def map_seq(seq, **kwargs):
        return seq
    """,
    "map_seq_stream": """
    def map_seq_stream(seqs, **kwargs):
        yield from seqs
    stream_partitions = 2
    """,
}
# Loaded by the server (PYTHONPATH): its reader no longer refuses an input whose header is too large,
# so the worker gets it, cannot decode the message, and must say so.
NO_INPUT_CHECK = """
import ppserver.server.reader
ppserver.server.reader.oversized_header = lambda item: None
"""


def huge_input_config(tmp_path, mode: str) -> str:
    return write_config(tmp_path, HUGE_INPUT + textwrap.dedent(IDENTITY[mode]) + "max_seq_retries = 3\n")


def assert_server_goes_on(c, cfg: str, mode: str, error: str) -> None:
    """An epoch of the other seqs is exact (map_seq_stream takes no seq_list: its next epoch fails
    the same way, at once)."""
    if mode == "map_seq_stream":
        with pytest.raises(ppclient.DatasetError, match=error):
            collect(c.epoch(2))
        return
    others = [f"seq-{i}" for i in (0, 1, 2, 4, 5)]
    assert_same_epoch(collect(c.epoch(2, seq_list=others)), reference(cfg, 2, seq_list=others))


HUGE = r"'x+\.\.\. \(2000000 characters\)'"  # the tag, shortened


@pytest.mark.processes
@pytest.mark.parametrize("mode", sorted(IDENTITY))
def test_input_with_a_huge_header_fails_at_once_as_a_dataset_error_naming_the_seq(tmp_path, mode):
    """A 2 MB seq_tag: the server does not send the seq, and the epoch fails at once (not after the
    client's timeout), the tag shortened in the message."""
    cfg = huge_input_config(tmp_path, mode)
    error = (
        rf"seq {HUGE} \(position 3\) cannot be sent to a worker: its header \(seq_tag, meta entries and "
        r"array specs\) is \d+ bytes, more than 262144"
    )
    with run_server(cfg, workers=1) as srv, srv.client(timeout=20) as c:
        began = time.monotonic()
        with pytest.raises(ppclient.DatasetError, match=error):
            collect(c.epoch(1))
        assert time.monotonic() - began < 10
        st = c.status()
        assert st["dropped_by_workers"] == 0 and st["malformed_messages"] == 0 and st["departures"] == {}
        assert_server_goes_on(c, cfg, mode, error)


@pytest.mark.processes
@pytest.mark.parametrize("mode", sorted(IDENTITY))
def test_a_message_a_worker_cannot_take_is_reported_and_its_seq_fails(tmp_path, mode):
    """The same seq from a server that does not refuse it: each worker that gets it drops the
    message (its header is over 1 MiB) and says so; the server gives the seq (or the stream
    partition) to the next one, and after max_seq_retries fails the epoch naming it, in seconds."""
    cfg = huge_input_config(tmp_path, mode)
    env = sitecustomize_env(tmp_path, NO_INPUT_CHECK)
    slog = str(tmp_path / "server.log")
    why = r"\(header of \d+ bytes exceeds 1048576\)"
    error = {
        "map_seq": rf"seq {HUGE} \(position 3\): 3 workers could not take its input {why}",
        "map_seq_stream": rf"stream partition 1 \(last input '.+'\) could not be taken by 3 workers {why}",
    }[mode]
    with run_server(cfg, workers=2, env=env, log_path=slog) as srv, srv.client(timeout=20) as c:
        began = time.monotonic()
        with pytest.raises(ppclient.DatasetError, match=error):
            collect(c.epoch(1))
        assert time.monotonic() - began < 10
        st = c.status()
        assert st["dropped_by_workers"] == 3 and st["departures"] == {}
        assert_server_goes_on(c, cfg, mode, error)
    kind = {"map_seq": "tasks", "map_seq_stream": "stream_inputs"}[mode]
    assert read(slog).count(f"dropped a {kind!r} message of run") >= 3


# ---- 4. a refused epoch request leaves the running epoch alone ---------------------------------------
@pytest.mark.processes
def test_refused_epoch_request_does_not_stall_the_running_epoch(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.01), n=60)
    with run_server(cfg, workers=2) as srv, srv.client(timeout=20) as a, srv.client(timeout=20) as b:
        it = a.epoch(1)
        got = [next(it) for _ in range(5)]
        with pytest.raises(ppclient.Error, match="unknown seq tag 'nope'"):
            b.epoch(2, seq_list=["seq-1", "nope"])
        with pytest.raises(ppclient.Error, match="out of range"):
            b.epoch(2, seq_order=[999])
        got += [next(it) for _ in range(5)]
        with pytest.raises(ppclient.Error, match="unknown seq tag"):
            a.epoch(3, seq_list=["nope"])  # the same client: its running epoch goes on too
        got += collect(it)
    assert_same_epoch(got, reference(cfg, 1))


# ---- 5. bad addresses and key directories: one line, exit 2, never a hang --------------------------
@pytest.mark.processes
@pytest.mark.parametrize(
    "argv",
    [
        ["status", "127.0.0.1:5555"],
        ["status", "garbage"],
        ["status", "tcp://127.0.0.1:5555", "--keys", "/nonexistent-keys"],
        ["worker", "CONFIG", "--connect", "127.0.0.1:5555"],
        ["worker", "CONFIG", "--connect", "tcp://127.0.0.1:5555", "--keys", "/nonexistent-keys"],
        ["serve", "CONFIG", "--keys", "/nonexistent-keys"],
    ],
)
def test_bad_address_or_keys_is_one_line_and_exit_2(tmp_path, argv):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=3)
    argv = [cfg if a == "CONFIG" else a for a in argv]
    line = error_line(run_cli(*argv, timeout=30), info=True)
    assert ("nonexistent-keys" in line) == ("--keys" in argv)


@pytest.mark.processes
def test_worker_process_with_a_bad_address_exits_2(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=3)
    res = run_cli(cfg, "--connect", "garbage", module="ppserver.worker", timeout=30)
    assert res.returncode == 2 and "'--connect'" in res.stderr


@pytest.mark.unit
def test_client_refuses_bad_address_and_keys_at_once():
    for address in ("127.0.0.1:5555", "garbage", "tcp://host", "tcp://h:99999", None):
        with pytest.raises(ppclient.UsageError):
            ppclient.Client(address)  # type: ignore[arg-type]
    with pytest.raises(ppclient.UsageError, match="nonexistent-keys"):
        ppclient.Client("tcp://127.0.0.1:5555", keys="/nonexistent-keys")
    with pytest.raises(ppclient.UsageError, match="window"):
        ppclient.Client("tcp://127.0.0.1:5555", window=0)


# ---- 6. malformed results from a registered worker ---------------------------------------------
class FakeWorker:
    """A registered worker that answers every task with a malformed result (or with a message
    that does not decode at all, whose header is over the cap)."""

    BREAKS = ("meta not a map", "bytes do not fit", "non-str key")

    def __init__(self, endpoint: str, fingerprint: str, breaks=BREAKS):
        self.breaks = breaks
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.identity = b"fake:" + os.urandom(4).hex().encode()
        self.sock.connect(endpoint)
        self.sock.send_multipart(protocol.encode(protocol.Hello(fingerprint=fingerprint, host="fake", pid=1)))
        self.answered = 0

    def serve(self, seconds: float, stop=None) -> None:
        end = time.monotonic() + seconds
        beat = 0.0
        while time.monotonic() < end and not (stop is not None and stop.is_set()):
            if time.monotonic() - beat > 0.5:  # alive all along: nothing of it is redone for silence
                self.sock.send_multipart(protocol.encode(protocol.Heartbeat()))
                beat = time.monotonic()
            if not self.sock.poll(50):
                continue
            decoded = protocol.decode(self.sock.recv_multipart(), Peer.WORKER, (Channel.WORKER,))
            if isinstance(decoded.msg, protocol.Tasks):
                for item in decoded.items:
                    self._answer(decoded.msg.run, item)
            self.sock.send_multipart(protocol.encode(protocol.Heartbeat()))

    def _answer(self, run: int, item: protocol.Item) -> None:
        header = item.header()
        frames = list(item.frames)
        how = self.breaks[self.answered % len(self.breaks)]
        if how == "undecodable":
            header["meta"] = {"seq_tag": "x" * (1 << 20)}
        elif how == "meta not a map":
            header["meta"] = ["seq_tag", "x"]
        elif how == "bytes do not fit":
            frames = [bytes(7) for _ in frames]
        else:
            header["arrays"] = [[1, *spec[1:]] for spec in header["arrays"]]
        self.answered += 1
        msg = protocol.encode_batch(protocol.Results(run=run), [header], frames)
        self.sock.send_multipart(msg)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _fingerprint(cfg: str) -> str:
    from ppserver.config.settings import load_config

    return load_config(cfg).worker_fingerprint


@contextmanager
def fake_worker(srv, c, cfg: str, workers: int, breaks=FakeWorker.BREAKS) -> Iterator[FakeWorker]:
    """A FakeWorker answering the server's tasks from a thread until the block ends; `workers`:
    how many workers the server then has."""
    fake = FakeWorker(c.status()["worker_address"], _fingerprint(cfg), breaks=breaks)
    stop = threading.Event()
    thread = threading.Thread(target=fake.serve, args=(20.0, stop), daemon=True)
    thread.start()
    try:
        srv.wait_workers(workers)
        yield fake
    finally:
        stop.set()
        thread.join(timeout=15)
        fake.close()


@pytest.mark.processes
@pytest.mark.parametrize("path", ["direct", "via-server"])
def test_malformed_results_are_dropped_counted_and_redone_elsewhere(tmp_path, path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.005), n=60, extra="buf_size = 2\n" + DATA_PATHS[path])
    slog = str(tmp_path / "server.log")
    with run_server(cfg, workers=1, log_path=slog) as srv, srv.client(timeout=20) as c:
        with fake_worker(srv, c, cfg, 2) as fake:
            got = collect(c.epoch(1))
            st = c.status()
    assert_same_epoch(got, reference(cfg, 1))
    assert fake.answered >= 3
    assert st["malformed_results"] >= fake.answered - 1
    assert_data_path(read(slog), path)


@pytest.mark.processes
def test_seq_with_only_malformed_results_fails_naming_it(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=10, extra="max_seq_retries = 3\n")
    with run_server(cfg, workers=0, wait_workers=False) as srv, srv.client(timeout=20) as c:
        with fake_worker(srv, c, cfg, 1):
            with pytest.raises(ppclient.MapperError, match="3 malformed results") as info:
                collect(c.epoch(1))
            assert info.value.seq_tag == "seq-0"


@pytest.mark.processes
def test_undecodable_results_are_redone_elsewhere(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.005), n=40, extra="buf_size = 2\n")
    with run_server(cfg, workers=1) as srv, srv.client(timeout=20) as c:
        with fake_worker(srv, c, cfg, 2, breaks=("undecodable",)) as fake:
            got = collect(c.epoch(1))
            st = c.status()
    assert_same_epoch(got, reference(cfg, 1))
    assert fake.answered >= 1
    assert st["malformed_results"] >= 1 and st["malformed_messages"] >= 1
    assert st["departures"] == {}  # redone because they were charged, not because a worker was lost


@pytest.mark.processes
def test_seq_with_only_undecodable_results_fails_naming_it(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=10, extra="max_seq_retries = 3\n")
    with run_server(cfg, workers=0, wait_workers=False) as srv, srv.client(timeout=20) as c:
        with fake_worker(srv, c, cfg, 1, breaks=("undecodable",)):
            with pytest.raises(ppclient.MapperError, match=r"3 malformed results \(header of \d+ bytes") as info:
                collect(c.epoch(1))
            assert info.value.seq_tag == "seq-0"


# ---- 6b. messages a worker cannot take -----------------------------------------------------------
class FakeServer:
    """A worker ROUTER that welcomes one real worker process, answers its heartbeats, and sends it
    whatever a test likes; every wait has a deadline."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.worker = b""

    def next(self, kind: type, timeout: float = 20.0) -> protocol.Message:
        """The worker's next message of `kind` (heartbeats are answered, other messages skipped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            ident, *frames = self.sock.recv_multipart()
            msg = protocol.decode(frames, Peer.SERVER, (Channel.WORKER,)).msg
            if isinstance(msg, protocol.Heartbeat):
                self.sock.send_multipart([ident, *protocol.encode(protocol.Heartbeat())])
            elif isinstance(msg, kind):
                self.worker = self.worker or ident
                return msg
        raise AssertionError(f"no {kind.__name__} from the worker within {timeout} s")

    def send(self, frames) -> None:
        self.sock.send_multipart([self.worker, *frames])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.mark.processes
def test_a_worker_reports_every_message_it_drops(tmp_path):
    """A real worker that gets a task message of a run it has not opened, one with a bad item, one
    whose header is over 1 MiB, or stream inputs of a run not open tells the server what each
    carried, so nothing waits for it."""
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=4)
    server = FakeServer()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ppserver.worker",
            cfg,
            "--connect",
            server.endpoint,
            "--worker-endpoint",
            server.endpoint,
        ],
        cwd=REPO,
        stderr=subprocess.DEVNULL,
    )
    try:
        server.next(protocol.Hello)
        server.send(protocol.encode(protocol.Welcome()))
        seq = {"data": np.zeros((2, 8), "float32"), "seq_tag": "s"}
        good = protocol.seq_to_item(seq, 3)
        server.send(protocol.encode(protocol.Tasks(run=5), [good]))
        assert server.next(protocol.Dropped) == protocol.Dropped(
            what="tasks", run=5, pos=[3], reason="run 5 is not open here"
        )
        server.send(protocol.encode(protocol.RunOpen(run=5, epoch=1)))
        header = {**good.header(), "i": 4}
        header["meta"] = ["seq_tag", "s"]  # not a map
        server.send(protocol.encode_batch(protocol.Tasks(run=5), [header], list(good.frames)))
        dropped = server.next(protocol.Dropped)
        assert (dropped.what, dropped.run, dropped.pos) == ("tasks", 5, [4]) and "meta is not a map" in dropped.reason
        huge = protocol.seq_to_item({**seq, "seq_tag": "x" * 2_000_000}, 6)
        server.send(protocol.encode(protocol.Tasks(run=5), [huge]))
        dropped = server.next(protocol.Dropped)
        assert (dropped.what, dropped.run, dropped.pos) == ("tasks", 5, [6])
        assert re.fullmatch(r"header of \d+ bytes exceeds 1048576", dropped.reason)
        server.send(protocol.encode(protocol.StreamInputs(run=6, partition=1), [good]))
        assert server.next(protocol.Dropped) == protocol.Dropped(
            what="stream_inputs", run=6, partition=1, pos=[3], reason="run 6 is not open here"
        )
        proc.terminate()
        server.next(protocol.Bye)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        server.close()


@pytest.mark.unit
def test_the_server_tells_what_a_dropped_message_carried_by_its_kind():
    """Which work a dropped message's report makes the scheduler redo, told once as the event is
    built: tasks, a stream partition's, none, or (unreadable) whatever the worker holds."""
    assert carried(protocol.Tasks.kind) is Carried.TASKS
    for kind in (protocol.StreamOpen, protocol.StreamInputs, protocol.StreamEnd, protocol.StreamClose):
        assert carried(kind.kind) is Carried.STREAM
    assert carried(protocol.StreamCredit.kind) is Carried.STREAM  # (a lost credit stalls the stream too)
    for kind in (
        protocol.ConsumerRoute,
        protocol.ConsumerGone,
        protocol.RunOpen,
        protocol.RunClose,
        protocol.Heartbeat,
    ):
        assert carried(kind.kind) is Carried.NOTHING
    assert carried("stream_ack") is Carried.NOTHING  # a worker's own message: never sent to it
    assert carried(None) is Carried.UNKNOWN
    # as the event is built from the report: a kind the worker could not read ("") is None
    unreadable = EVENTS[protocol.Dropped](1.0, b"w", protocol.Dropped(reason="junk"), None)
    assert isinstance(unreadable, MessageDropped)
    assert (unreadable.what, unreadable.carried, unreadable.run) == (None, Carried.UNKNOWN, None)
    tasks = EVENTS[protocol.Dropped](1.0, b"w", protocol.Dropped(what="tasks", run=3, pos=[1]), None)
    assert isinstance(tasks, MessageDropped)
    assert (tasks.what, tasks.carried, tasks.run, tasks.positions) == ("tasks", Carried.TASKS, 3, [1])


# ---- 7. junk on the control socket -----------------------------------------------------------------
@pytest.mark.processes
def test_control_junk_of_many_frames_does_not_grow_the_server(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=8)
    with run_server(cfg, workers=1) as srv, srv.client(timeout=20) as c:
        c.status()
        before = rss_kib(srv.proc.pid)
        ctx = zmq.Context()
        junk = [ctx.socket(zmq.DEALER) for _ in range(2)]
        monitor = junk[0].get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            for s in junk:
                s.linger = 0
                s.connect(srv.address)
            # 16 frames of 2 MiB, each above the cap (max_request_bytes, 1 MiB): the server drops
            # the connection at the first one, before it holds the message
            junk[0].send_multipart([b""] + [os.urandom(2 << 20)] * 16, copy=False)
            assert monitor.poll(10_000), "the server kept the connection"
            # 24 frames of 1 MiB: ZeroMQ assembles the whole message, then the server drops it,
            # counts it and gives its memory back
            junk[1].send_multipart([b""] + [os.urandom(1 << 20)] * 24, copy=False)
            wait_for(lambda: c.status()["malformed_messages"] >= 1, 20, "the many-frame message to be dropped")
        finally:
            monitor.close(linger=0)
            for s in junk:
                s.close(linger=0)
            ctx.term()
        grown_mb = (rss_kib(srv.proc.pid) - before) / 1024
        assert grown_mb < 12, grown_mb
        # a request above the cap would be dropped unanswered: the client refuses to send it
        with pytest.raises(ppclient.UsageError, match=r"'epoch' request is \d+ bytes.*seq_list has 60000 entries"):
            c.epoch(1, seq_list=[f"a-rather-long-seq-tag-{i}" for i in range(60000)])
        assert_same_epoch(collect(c.epoch(1)), reference(cfg, 1))
        assert c.status()["malformed_messages"] == 1


# ---- 8. a server killed while the client waits on a slow seq ---------------------------------------
@pytest.mark.processes
def test_server_killed_during_a_slow_seq_is_unavailable_not_stuck(tmp_path):
    body = """
    import time
    def map_seq(seq, **kwargs):
        if seq["seq_tag"] == "seq-3":
            time.sleep(60)
        return seq
    """
    cfg = numpy_config(tmp_path, body, n=10)
    with run_server(cfg, workers=1) as srv, srv.client(timeout=4) as c:
        it = c.epoch(1)
        assert [next(it)["seq_tag"] for _ in range(3)] == ["seq-0", "seq-1", "seq-2"]
        time.sleep(1.5)  # keepalives arrive while seq-3 is mapped
        stuck = children_of(srv.proc.pid)
        srv.proc.kill()
        srv.proc.wait()
        start = time.monotonic()
        with pytest.raises(ppclient.ServerUnavailable):
            next(it)
        assert time.monotonic() - start < 6
        for pid in stuck:  # its worker sits in the mapper for a minute yet: not what this test is about
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# ---- 9. superseded by another client's request --------------------------------------------------------
@pytest.mark.processes
def test_superseded_epoch_raises_at_once(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.02), n=200)
    with run_server(cfg, workers=2) as srv, srv.client(timeout=30) as a, srv.client(timeout=30) as b:
        old = a.epoch(1)
        next(old)
        new = b.epoch(2)
        start = time.monotonic()
        with pytest.raises(ppclient.Superseded, match="another client"):
            collect(old)
        assert time.monotonic() - start < 2
        assert isinstance(ppclient.Superseded("x"), ppclient.Error)
        assert_same_epoch(collect(new), reference(cfg, 2))


# ---- 10. a MapperError stays raised ----------------------------------------------------------------------
@pytest.mark.processes
def test_mapper_error_is_raised_on_every_later_next(tmp_path):
    body = """
    def map_seq(seq, **kwargs):
        if seq["seq_tag"] == "seq-3":
            raise ValueError("no good")
        return seq
    """
    cfg = numpy_config(tmp_path, body, n=10)
    with run_server(cfg, workers=1) as srv, srv.client(timeout=20) as c:
        it = c.epoch(1)
        got = []
        with pytest.raises(ppclient.MapperError) as first:
            for seq in it:
                got.append(seq)
        assert [s["seq_tag"] for s in got] == ["seq-0", "seq-1", "seq-2"]
        for _ in range(3):  # a loop that catches the error and pulls on never ends the epoch quietly
            with pytest.raises(ppclient.MapperError) as again:
                next(it)
            assert again.value is first.value


@pytest.mark.processes
def test_dataset_that_fails_to_describe_its_data_is_one_line_and_exit_2(tmp_path):
    write_config(
        tmp_path,
        DATA_MODULE
        + """
class Broken(Corpus):
    def _compute_data_keys(self):
        raise RuntimeError("index file is corrupt")
""",
        name="corpus.py",
    )
    cfg = write_config(
        tmp_path,
        """
    import os, sys
    sys.path.insert(0, os.path.dirname(__file__))
    dataset = {"class": "corpus:Broken"}
    def map_seq(seq, **kwargs):
        return seq
    """,
    )
    line = error_line(run_cli("serve", cfg, "--bind", "tcp://127.0.0.1:0"))
    assert "'dataset'" in line and "index file is corrupt" in line

"""The data path through real processes: results straight from workers to the client, arrays
through shared memory on one host, and what happens to both when processes die."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from contextlib import contextmanager
from typing import Iterator

import pytest
from conftest import (
    REPO,
    SLOW_MAPPER,
    assert_data_path,
    assert_same_epoch,
    children_of,
    collect,
    collect_with,
    free_port,
    is_shared,
    mapped_segments,
    numpy_config,
    open_segments,
    read,
    reference,
    run_server,
    run_worker_host,
    sitecustomize_env,
    wait_child,
    wait_for,
    wait_gone,
)

import ppclient

pytestmark = pytest.mark.processes


def shm_files() -> set:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize(
    "extra", ["", "shm_mb = 0\n", "direct_results = False\n", "direct_results = False\nshm_mb = 0\n"]
)
def test_every_data_path_gives_the_reference_epoch(tmp_path, extra):
    """Direct with shared memory (the default), direct over sockets, through the server with
    shared inputs, through the server over sockets: the same bytes."""
    log_path = str(tmp_path / "server.log")
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=120, extra="buf_size = 4\n" + extra)
    with run_server(cfg, workers=2, log_path=log_path) as srv, srv.client() as c:
        got = {e: collect(c.epoch(e)) for e in (1, 2)}
        status = c.status()
    for e in (1, 2):
        assert_same_epoch(got[e], reference(cfg, e))
    log = read(log_path)
    direct = "direct_results = False" not in extra
    shm = "shm_mb = 0" not in extra
    assert ("sending results directly" in log) == direct
    assert ("(shared memory)" in log) == (direct and shm)
    assert status["lost_direct_results"] == 0


def test_shared_memory_arrays_are_writable_views_that_stay_valid(tmp_path):
    """Arrays from shared memory can be written to and outlive the epoch and the client."""
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=60, extra="buf_size = 4\n")
    log = str(tmp_path / "server.log")
    with run_server(cfg, workers=2, log_path=log) as srv:
        with srv.client() as c:
            # epochs before, until both workers send through shared memory (what a worker sends
            # before the client has welcomed it comes over the socket)
            wait_for(
                lambda: collect(c.epoch(2)) and read(log).count("(shared memory)") == 2,
                30,
                "both workers to send through shared memory",
            )
            kept = collect(c.epoch(1))
        want = reference(cfg, 1)
        shared = [seq for seq in kept if is_shared(seq["data"])]
        assert len(shared) == len(kept), len(shared)
        for seq in kept:
            seq["data"] += 0  # writable, in place
        assert_same_epoch(kept, want)


@contextmanager
def client_holding(address: str, n: int, epoch: int, window: int = 32, warm: int = 0) -> Iterator[subprocess.Popen]:
    """A client in another process holding the first n seqs of `epoch`; killed with -9 at the end.
    `proc.shared` tells how many of them are in shared memory. `warm`: first read other epochs
    whole until seqs came in the segments of that many workers (each has welcomed the client: what
    they send from then on comes through shared memory while it has room), dropping them; whole, so
    that no seq of a warm-up epoch is left in flight holding a block when the held epoch starts."""
    code = textwrap.dedent(
        f"""
        import mmap, sys, time
        import numpy as np
        from ppclient import Client
        def segment(a):
            while isinstance(a, np.ndarray) and a.base is not None:
                a = a.base
            a = a.obj if isinstance(a, memoryview) else a
            return a if isinstance(a, mmap.mmap) else None
        def shared(a):
            return segment(a) is not None
        c = Client({address!r}, timeout=30, window={window})
        seen, deadline = set(), time.monotonic() + 30
        rounds = 0
        while len(seen) < {warm} and time.monotonic() < deadline:
            rounds += 1
            for s in c.epoch({epoch} + 1000 * rounds):
                if shared(s["data"]):
                    seen.add(id(segment(s["data"])))
                del s
        held = [s for _, s in zip(range({n}), c.epoch({epoch}))]
        print("holding", len(held), sum(shared(s["data"]) for s in held), flush=True)
        sys.stdin.readline()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert proc.stdout is not None
        words = proc.stdout.readline().split()  # (the client's own timeout bounds the wait)
        assert words[:2] == ["holding", str(n)], words
        proc.shared = int(words[2])  # type: ignore[attr-defined]
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()


def segments_of(pids) -> set:
    """The segments these processes map (a local worker's: its own, and the server's for its inputs)."""
    return set().union(*(mapped_segments(pid) for pid in pids))


def test_killed_workers_and_client_leave_no_segment_behind(tmp_path):
    """kill -9 of a worker in each of two epochs: its seqs are redone, the epochs are exact, the
    server keeps a segment only for live workers, and the client gives a dead worker's segment
    back (the arrays it still holds stay intact) and every one once closed. A client killed while
    it holds seqs in shared memory leaves nothing either: the workers free its blocks once it is
    gone. Nothing ever appears in /dev/shm."""
    before = shm_files()
    log_path = str(tmp_path / "server.log")
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.005), n=200, extra="buf_size = 4\n")
    with run_server(cfg, workers=2, log_path=log_path) as srv:
        with srv.client() as c:
            for epoch in (1, 3):
                pids = srv.worker_pids()
                got = collect_with(c.epoch(epoch), {40: lambda victim=pids[0]: os.kill(victim, signal.SIGKILL)})
                st = c.status()  # killed mid-epoch (seq 40 of 200): counted gone, with seqs it held made again
                assert st["departures"].get("exited") == (1 if epoch == 1 else 2) and st["handed_back"] >= 1, st
                wait_for(
                    lambda gone=pids[0]: gone not in srv.worker_pids() and len(srv.worker_pids()) == 2, 30, "a respawn"
                )
                # workers that read the server's memory need no input segment; others one each
                held = 0 if "reads its inputs in the server's memory" in read(log_path) else 2
                wait_for(
                    lambda held=held: len(open_segments(srv.proc.pid)) == held,
                    10,
                    "the server to keep live workers' segments",
                )
                c.epoch(2)  # the client gives back the segments of workers that are gone...
                assert_same_epoch(got, reference(cfg, epoch))  # ...while the arrays in them stay intact
                del got
                assert mapped_segments() <= segments_of(srv.worker_pids())  # only live workers' stay mapped
        assert mapped_segments() == set()  # closed: nothing mapped any more
        # a client in another process, killed while it holds seqs in shared memory
        with client_holding(srv.address, 50, epoch=2) as proc:
            assert proc.shared > 0  # type: ignore[attr-defined]  # it holds seqs in the workers' segments...
            assert mapped_segments(proc.pid)  # ...which it maps
        # the job is free again once the client is declared gone; a new client reads epoch 2 whole
        with srv.client(timeout=60) as c2:
            again = collect(c2.epoch(2))
        assert_same_epoch(again, reference(cfg, 2))
        wait_for(lambda: "shared-memory blocks of consumer" in read(log_path), 10, "the dead client's blocks freed")
        kids = srv.worker_pids()
    assert wait_gone(kids, 5.0) == []
    assert shm_files() - before == set()
    assert "(shared memory)" in read(log_path)


BIG = """
import numpy as np
_r = np.random.RandomState(3)
SEQS = [{"data": _r.randn(256, 64).astype("float32")} for _ in range(120)]  # 64 KB each, 7.7 MB
dataset = {"class": "NumpyDataset", "seqs": SEQS}
def map_seq(seq, *, epoch, seq_idx, rng, **kwargs):
    seq["data"] = seq["data"] * rng.uniform(0.5, 1.5)
    return seq
buf_size = 4
shm_mb = 1
"""


def test_a_client_holding_every_seq_makes_results_fall_back_to_sockets(tmp_path):
    """A consumer that keeps all arrays fills the workers' 1 MB segments: results then travel
    in the messages instead, nothing blocks, and the arrays already held stay intact."""
    cfg = str(tmp_path / "config.py")
    with open(cfg, "w") as f:
        f.write(BIG)
    with run_server(cfg, workers=2) as srv, srv.client() as c:
        held = collect(c.epoch(1))
    assert_same_epoch(held, reference(cfg, 1))
    assert sum(s["data"].nbytes for s in held) > 3 * (2 << 20)  # several times what both segments hold
    shared = sum(is_shared(s["data"]) for s in held)
    assert 0 < shared <= 2 * (1 << 20) // held[0]["data"].nbytes, shared  # the segments filled, the rest fell back


def test_a_client_binds_its_result_socket_where_it_is_told(tmp_path):
    """direct="tcp://HOST:PORT" (a port a firewall lets through): workers send there; a bad
    value is a UsageError before anything is sent."""
    log_path = str(tmp_path / "server.log")
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=40, extra="buf_size = 4\n")
    port = free_port()
    with run_server(cfg, workers=2, log_path=log_path) as srv:
        with pytest.raises(ppclient.UsageError, match="direct"):
            ppclient.Client(srv.address, direct="127.0.0.1:6000")
        with srv.client(direct=f"tcp://127.0.0.1:{port}") as c:
            got = collect(c.epoch(1))
            # A quick epoch may all go through the server before a worker's hello is answered; the
            # route stays while the client lives, so a worker reaches the socket all the same.
            reached = f"at tcp://127.0.0.1:{port}"
            wait_for(lambda: reached in read(log_path), 10, "a worker to reach the client's socket")
    assert_same_epoch(got, reference(cfg, 1))


def test_direct_results_lost_at_the_end_of_an_epoch_are_made_again(tmp_path):
    """The last direct seqs never reach the client (their messages are dropped on arrival, as
    a cut link would drop them), although the server heard they were done: the client reports
    them missing, the server still holds their inputs and sends them itself."""
    n = 30
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=n, extra="buf_size = 2\n")
    with run_server(cfg, workers=2) as srv, srv.client(timeout=60) as c:
        first = collect(c.epoch(0))  # both workers reach the client directly from now on
        receive = c._inbox._recv
        dropped = []

        def lossy(sock, from_server):
            decoded = receive(sock, from_server)
            if decoded is not None and isinstance(decoded.msg, ppclient.protocol.DirectSeqs):
                if any(item.pos >= n - 3 for item in decoded.items) and len(dropped) < 2:
                    dropped.append([item.pos for item in decoded.items])
                    return None
            return decoded

        c._inbox._recv = lossy
        got = collect(c.epoch(1))
        status = c.status()
        c._inbox._recv = receive
        again = collect(c.epoch(2))
    assert dropped, "no direct message of the last seqs was seen"
    assert_same_epoch(first, reference(cfg, 0))
    assert_same_epoch(got, reference(cfg, 1))
    assert_same_epoch(again, reference(cfg, 2))
    assert status["lost_direct_results"] >= 1


def test_arrays_stay_valid_after_their_client_is_closed(tmp_path):
    """A closed client's arrays in shared memory are still its own: the workers do not hand
    their blocks to the next client while this process lives."""
    cfg = str(tmp_path / "config.py")
    with open(cfg, "w") as f:
        f.write(BIG)
    with run_server(cfg, workers=2) as srv:
        with srv.client() as c:
            held = collect(c.epoch(1))
        with srv.client() as c2:
            later = collect(c2.epoch(2))
    assert any(is_shared(s["data"]) for s in held)  # arrays in the workers' segments, kept past the close
    assert_same_epoch(held, reference(cfg, 1))
    assert_same_epoch(later, reference(cfg, 2))


# Loaded by every Python process started with its directory on PYTHONPATH: breaks shared memory
# the way PPTEST_BREAK_SHM says (memfds refused by the kernel, or no memory for a segment).
SITECUSTOMIZE = """
import errno, os

def _no_memfd(*args, **kwargs):
    raise OSError(errno.EMFILE, "memfd_create refused for this test")

def _no_memory(fd, offset, length):
    raise OSError(errno.ENOSPC, "no memory for a segment in this test")

if os.environ.get("PPTEST_BREAK_SHM") == "memfd":
    os.memfd_create = _no_memfd
elif os.environ.get("PPTEST_BREAK_SHM") == "fallocate":
    os.posix_fallocate = _no_memory
"""


@pytest.mark.parametrize("broken", ["memfd", "fallocate", "client"])
def test_without_shared_memory_results_take_sockets_and_the_log_says_why(tmp_path, monkeypatch, caplog, broken):
    """memfds refused in the server and its workers, no memory for their segments, or a client that
    cannot map a worker's segment: the epoch is exact over sockets, nothing crashes or respawns,
    and the log says why in one line per process."""
    env = {"PPTEST_BREAK_SHM": broken, **sitecustomize_env(tmp_path, SITECUSTOMIZE)}
    if broken == "client":

        def refuse(descriptor):
            raise ppclient.shm.ShmUnavailable("cannot map in this test")

        monkeypatch.setattr(ppclient.shm.mapping, "_map", refuse)
    log_path = str(tmp_path / "server.log")
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=60, extra="buf_size = 4\n")
    with run_server(cfg, workers=2, log_path=log_path, env=env) as srv, srv.client() as c:
        with caplog.at_level("WARNING", logger="ppclient"):
            got = collect(c.epoch(1))
        assert mapped_segments() == set()
    assert_same_epoch(got, reference(cfg, 1))
    log = read(log_path)
    assert "sending results directly" in log and "(shared memory)" not in log
    assert "respawning" not in log and "Traceback" not in log
    if broken == "memfd":
        assert "inputs of local workers go over sockets: shared memory does not work here: memfd_create" in log
        assert log.count("inputs and results go over sockets: shared memory does not work here: memfd_create") == 2
    elif broken == "fallocate":
        assert log.count("results go over sockets: no shared-memory segment of 64 MiB for them") == 2, log
        assert "no memory for a segment in this test" in log
        assert log.count("no shared memory for worker") == 2  # the server's segments for their inputs
    else:
        assert "cannot map its shared memory: cannot map in this test" in caplog.text


def test_a_killed_server_leaves_nothing_mapped_and_a_client_killed_meanwhile_blocks_no_segment(tmp_path):
    """kill -9 of the server: its local worker exits, a worker host on the same machine drops the
    server's input segment once it noticed, and the client maps nothing once closed. A client that
    held results in the worker's 1 MiB segment dies while no server runs (nobody tells the worker it
    left): back at work with the next server, the worker frees its blocks (its process is gone), and
    results come through shared memory again."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    cfg = str(tmp_path / "config.py")
    with open(cfg, "w") as f:
        f.write(BIG + "heartbeat_interval = 0.2\nheartbeat_timeout = 1.0\n")
    wlog = str(tmp_path / "worker.log")
    with run_worker_host(cfg, address, procs=1, log_path=wlog) as host:
        worker = wait_for(lambda: (children_of(host.pid) or [None])[0], 30, "the worker process")
        with run_server(cfg, workers=1, bind=address, log_path=str(tmp_path / "server1.log")) as srv:
            srv.wait_workers(2)
            local = [pid for pid in srv.worker_pids() if pid != worker]
            with srv.client() as c:
                got = collect(c.epoch(1))
            assert_same_epoch(got, reference(cfg, 1))
            assert any(is_shared(seq["data"]) for seq in got)
            del got
            wait_for(lambda: len(mapped_segments(worker)) == 2, 10, "the worker to map the server's input segment")
            # a window of 12: the seqs it holds are all it is sent, and they fit the empty segment
            # (both workers have welcomed the client before: none of them goes through the server)
            with client_holding(address, 12, epoch=2, window=12, warm=2) as holder:
                assert holder.shared == 12  # type: ignore[attr-defined]
                srv.proc.kill()
                srv.proc.wait(timeout=10)
                assert wait_gone(local, 10.0) == []  # local workers follow their server
                wait_for(lambda: "lost the server" in read(wlog), 10, "the worker to notice")
                wait_for(lambda: len(mapped_segments(worker)) == 1, 10, "the worker to map only its own segment")
        with run_server(cfg, workers=0, bind=address, log_path=str(tmp_path / "server2.log")) as srv:
            srv.wait_workers(1)
            wait_for(lambda: "shared-memory blocks of consumer" in read(wlog), 10, "the dead client's blocks freed")
            want = reference(cfg, 3)
            shared = []
            with srv.client(window=8) as c:  # at most 8 seqs in flight: they fit in the segment
                for i, seq in enumerate(c.epoch(3)):
                    shared.append(is_shared(seq["data"]))
                    assert_same_epoch([dict(seq)], want[i : i + 1])
            assert len(shared) == len(want)
            del seq
            # most results came through shared memory (the dead client's blocks, left in the 1 MiB
            # segment, would have sent all but a few over the socket; a seq sent while the segment
            # is full of ones this client still holds may take the socket)
            assert sum(shared) >= len(shared) // 2, shared
            assert mapped_segments() == set()
    assert "(shared memory)" in read(wlog)


def test_a_worker_frees_a_consumers_blocks_only_once_its_process_has_exited():
    """A consumer's blocks outlive its route being replaced, its leaving while the new route is not
    welcomed yet and the server being lost: its arrays may still be in use. They are freed once its
    process has exited; a process that merely has the same pid is not taken for it."""
    import zmq

    from ppserver.worker.routes import Routes

    consumer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    ctx = zmq.Context()
    routes = Routes(ctx, None)
    routes.identity = b"worker-1"
    routes.segment = ppclient.shm.Segment(1 << 16)
    try:
        assert routes.segment.alloc(1000, b"c1") is not None and routes.segment.alloc(1000, b"c2") is not None
        routes._hold(b"c1", consumer.pid)  # welcomed with shared memory
        routes._hold(b"c2", os.getpid())
        pid, start = routes.holders[b"c2"]
        routes.holders[b"c2"] = (pid, start - 1)  # an earlier process with this pid
        endpoint = f"tcp://127.0.0.1:{free_port()}"  # nobody answers: the new route is never welcomed
        routes.set(ppclient.protocol.ConsumerRoute(consumer=b"c1", endpoint=endpoint))
        routes.drop(b"c1", gone=True)
        routes.clear()
        routes.poll()
        assert routes.segment.used() == routes.segment.capacity - routes.segment.free() > 0
        assert list(routes.departed) == [b"c1"]  # c2's process is gone: its block is free
        assert consumer.stdin is not None
        consumer.stdin.close()
        consumer.wait(timeout=10)
        routes._reap()
        assert routes.segment.used() == 0 and not routes.departed and not routes.holders
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait(timeout=10)
        routes.segment.close()
        ctx.destroy(linger=0)


def test_malformed_direct_results_are_counted_logged_and_made_again(tmp_path, caplog):
    """A peer on the client's result socket sends an undecodable message and a result with a bad
    item while the client waits for its first seq: both are dropped, counted and logged, and the
    epoch is exact."""
    import threading

    import zmq

    flag = tmp_path / "go"
    body = f"""
    import os, time
    def map_seq(seq, **kwargs):
        deadline = time.monotonic() + 30
        while seq["seq_tag"] == "seq-0" and not os.path.exists({str(flag)!r}) and time.monotonic() < deadline:
            time.sleep(0.01)  # the first seq waits until the client has seen the bad messages
        return seq
    """
    cfg = numpy_config(tmp_path, body, n=20, extra="buf_size = 2\n")
    ctx = zmq.Context()
    with run_server(cfg, workers=2) as srv, srv.client() as c:
        try:
            it = c.epoch(1)
            fake = ctx.socket(zmq.DEALER)
            fake.linger = 0
            fake.identity = b"not-a-worker"
            fake.connect(c._results.endpoint)
            fake.send_multipart([b"\xc1 is no msgpack"])
            bad = {"i": 0, "meta": ["seq_tag", "x"], "arrays": []}  # meta is not a map
            fake.send_multipart(ppclient.protocol.encode_batch(ppclient.protocol.DirectSeqs(run=it.run), [bad], []))

            def release() -> None:
                wait_for(lambda: c.malformed_results == 2, 20, "the client to drop both messages")
                flag.touch()

            thread = threading.Thread(target=release, daemon=True)
            thread.start()
            with caplog.at_level("WARNING", logger="ppclient"):
                got = collect(it)
            thread.join(timeout=30)
        finally:
            flag.touch()
            ctx.destroy(linger=0)
    assert_same_epoch(got, reference(cfg, 1))
    assert c.malformed_results == 2
    assert "dropped a malformed direct result: from worker not-a-worker" in caplog.text


def shared_count(address: str, epoch: int) -> tuple:
    """(seqs, seqs through shared memory) of a whole epoch read by a client in another process,
    which drops each seq as it goes; its own timeout bounds the wait."""
    code = textwrap.dedent(
        f"""
        import mmap
        import numpy as np
        from ppclient import Client
        def shared(a):
            while isinstance(a, np.ndarray) and a.base is not None:
                a = a.base
            return isinstance(a.obj if isinstance(a, memoryview) else a, mmap.mmap)
        with Client({address!r}, timeout=30) as c:
            n = k = 0
            for seq in c.epoch({epoch}):
                n, k = n + 1, k + shared(seq["data"])
                del seq
        print(n, k, flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    n, k = out.stdout.split()
    return int(n), int(k)


def test_clients_closed_mid_epoch_give_their_blocks_back(tmp_path):
    """Clients in this process that read a few seqs and close while their results are still
    arriving (unread in their buffer, queued in their socket, on the way) leave no block taken in
    the workers' 2 MiB segments, although this process lives on: a client in another process
    still gets (nearly) all its results through shared memory. A seq this process holds past its
    client's close stays intact while those segments are used again."""
    import time

    cfg = str(tmp_path / "config.py")
    with open(cfg, "w") as f:
        f.write(BIG.replace("shm_mb = 1", "shm_mb = 2"))
    kept = []
    with run_server(cfg, workers=2) as srv:
        for epoch in range(6):
            with srv.client() as c:
                for i, seq in enumerate(c.epoch(epoch)):
                    if is_shared(seq["data"]):
                        kept.append((epoch, i, seq))  # held past the close: its block stays taken
                        break
                time.sleep(0.5)  # the trainer is busy: the rest of its window arrives meanwhile
        n, via_shm = shared_count(srv.address, 7)
    assert n == 120
    assert via_shm >= n * 3 // 4, via_shm
    assert kept
    for epoch, i, seq in kept:
        assert_same_epoch([seq], reference(cfg, epoch)[i : i + 1])


# A client that reads an epoch straight from the workers of an ipc server, then ends without its
# cleanup: os._exit (as a DataLoader worker ends) or kill -9.
READ_AND_VANISH = """
import os, signal, sys
from ppclient import Client

client = Client(sys.argv[1])
tags = [seq["seq_tag"] for seq in client.epoch(1)]
print(client._results.endpoint, " ".join(tags), flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
os._exit(0)
"""


@pytest.mark.parametrize("end", ["exit", "kill"])
def test_a_client_beside_an_ipc_server_leaves_no_socket_file(tmp_path, end):
    """The result socket of a client of an ipc server is an abstract Unix socket: its results come
    straight from the workers, and a client that ends without closing leaves nothing in $TMPDIR."""
    short = tempfile.mkdtemp(prefix="pp", dir="/tmp")  # pytest's folders are too long for Unix sockets
    try:
        client_tmp = os.path.join(short, "tmp")
        os.mkdir(client_tmp)
        log_path = str(tmp_path / "server.log")
        cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=12)
        with run_server(cfg, workers=2, bind=f"ipc://{short}/server", log_path=log_path) as srv:
            env = dict(os.environ, TMPDIR=client_tmp)
            res = subprocess.run(
                [sys.executable, "-c", READ_AND_VANISH, srv.address, end],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )
        assert res.returncode == (0 if end == "exit" else -signal.SIGKILL), res.stderr[-3000:]
        endpoint, *tags = res.stdout.split()
        assert endpoint.startswith("ipc://@ppclient-"), endpoint
        assert tags == [seq["seq_tag"] for seq in reference(cfg, 1)]
        assert_data_path(read(log_path), "direct")
        assert os.listdir(client_tmp) == []
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.mark.skipif(os.getuid() != 0 or not sys.platform.startswith("linux"), reason="needs root on Linux")
def test_the_abstract_result_socket_hears_only_this_user():
    """An abstract socket has no folder whose mode keeps other users out: a hello from a process of
    another user is refused (and gets no welcome), one of this user is welcomed."""
    import zmq

    from ppclient import protocol
    from ppclient.results import DirectResults

    hello = protocol.encode(protocol.DirectHello(worker=b"w"))
    ctx = zmq.Context()
    results = DirectResults(ctx, None, None)
    try:
        assert results.bind("ipc:///nowhere/server") and results.endpoint.startswith("ipc://@")
        assert results.sock is not None
        pid = os.fork()
        if pid == 0:  # another user's process: says hello, and must get no answer
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                child = zmq.Context()
                peer = child.socket(zmq.DEALER)
                peer.linger = 0
                peer.connect(results.endpoint)
                peer.send_multipart(hello)
                code = 1 if peer.poll(1500) else 0
                peer.close()
                child.term()
            finally:
                os._exit(code)
        assert results.sock.poll(10_000)
        assert results.receive(results.sock.recv_multipart(copy=False)) is None
        assert results.refused.count == 1
        assert wait_child(pid, 20) == 0, "the other user's hello was answered"
        peer = ctx.socket(zmq.DEALER)
        peer.linger = 0
        peer.connect(results.endpoint)
        peer.send_multipart(hello)
        assert results.sock.poll(10_000)
        assert results.receive(results.sock.recv_multipart(copy=False)) is None
        assert results.refused.count == 1
        assert peer.poll(5000), "this user's hello got no welcome"
        welcome = protocol.decode(peer.recv_multipart(), protocol.Peer.WORKER, (protocol.Channel.DIRECT,)).msg
        assert isinstance(welcome, protocol.DirectWelcome) and welcome.pid == os.getpid()
        peer.close()
    finally:
        results.close()
        ctx.destroy(linger=0)

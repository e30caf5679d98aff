"""The data path through real processes: results straight from workers to the client, arrays
through shared memory on one host, and what happens to both when processes die."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import (
    REPO,
    assert_same_epoch,
    collect,
    collect_with,
    free_port,
    numpy_config,
    read,
    reference,
    run_server,
    wait_for,
    wait_gone,
)

import ppclient

SLOW = """
import time
def map_seq(seq, *, epoch, seq_idx, rng, **kwargs):
    time.sleep({delay})
    seq["data"] = seq["data"] * rng.uniform(0.5, 1.5)
    return seq
"""


def memfds(pid: int) -> int:
    """Shared-memory segments (memfds) a process holds open, counted once each."""
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            path = f"/proc/{pid}/fd/{fd}"
            try:
                if os.readlink(path).startswith("/memfd:"):
                    found.add(os.stat(path).st_ino)
            except OSError:
                pass
    except OSError:
        return 0
    return len(found)


def shm_files() -> set:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize(
    "extra", ["", "shm_mb = 0\n", "direct_results = False\n", "direct_results = False\nshm_mb = 0\n"]
)
def test_every_data_path_gives_the_reference_epoch(tmp_path, extra):
    """Direct with shared memory (the default), direct over sockets, through the server with
    shared inputs, through the server over sockets: the same bytes."""
    log_path = str(tmp_path / "server.log")
    cfg = numpy_config(tmp_path, SLOW.format(delay=0), n=120, extra="buf_size = 4\n" + extra)
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
    cfg = numpy_config(tmp_path, SLOW.format(delay=0), n=60, extra="buf_size = 4\n")
    with run_server(cfg, workers=2) as srv:
        with srv.client() as c:
            kept = collect(c.epoch(1))
        want = reference(cfg, 1)
        for seq in kept:
            seq["data"] += 0  # writable, in place
        assert_same_epoch(kept, want)


def test_killed_worker_and_client_leave_no_segment_behind(tmp_path):
    """kill -9 of a worker mid-epoch: its seqs are redone, the epoch is exact, the server keeps a
    segment only for live workers; a client killed while it maps workers' segments leaves nothing
    either, and nothing ever appears in /dev/shm."""
    before = shm_files()
    log_path = str(tmp_path / "server.log")
    cfg = numpy_config(tmp_path, SLOW.format(delay=0.005), n=200, extra="buf_size = 4\n")
    with run_server(cfg, workers=2, log_path=log_path) as srv, srv.client() as c:
        pids = srv.worker_pids()
        got = collect_with(c.epoch(1), {40: lambda: os.kill(pids[0], signal.SIGKILL)})
        assert_same_epoch(got, reference(cfg, 1))
        srv.wait_workers(2)
        wait_for(lambda: memfds(srv.proc.pid) == 2, 10.0, "the server to keep segments of its 2 live workers only")
        # a client in another process, killed while it holds seqs in shared memory
        code = textwrap.dedent(
            f"""
            import os, signal, sys
            from ppclient import Client
            c = Client({srv.address!r}, timeout=30)
            held = [s for _, s in zip(range(50), c.epoch(2))]
            print("holding", len(held), flush=True)
            sys.stdin.readline()
            """
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "holding 50"
            assert memfds(proc.pid) >= 1  # it maps the workers' result segments
            proc.kill()
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        # the job is free again once the client is declared gone; a new client reads epoch 2 whole
        with srv.client(timeout=60) as c2:
            again = collect(c2.epoch(2))
        assert_same_epoch(again, reference(cfg, 2))
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


def test_a_client_binds_its_result_socket_where_it_is_told(tmp_path):
    """direct="tcp://HOST:PORT" (a port a firewall lets through): workers send there; a bad
    value is a UsageError before anything is sent."""
    log_path = str(tmp_path / "server.log")
    cfg = numpy_config(tmp_path, SLOW.format(delay=0), n=40, extra="buf_size = 4\n")
    port = free_port()
    with run_server(cfg, workers=2, log_path=log_path) as srv:
        with pytest.raises(ppclient.UsageError, match="direct"):
            ppclient.Client(srv.address, direct="127.0.0.1:6000")
        with srv.client(direct=f"tcp://127.0.0.1:{port}") as c:
            got = collect(c.epoch(1))
    assert_same_epoch(got, reference(cfg, 1))
    assert f"at tcp://127.0.0.1:{port}" in read(log_path)


def test_direct_results_lost_at_the_end_of_an_epoch_are_made_again(tmp_path):
    """The last direct seqs never reach the client (their messages are dropped on arrival, as
    a cut link would drop them), although the server heard they were done: the client reports
    them missing, the server still holds their inputs and sends them itself."""
    n = 30
    cfg = numpy_config(tmp_path, SLOW.format(delay=0), n=n, extra="buf_size = 2\n")
    with run_server(cfg, workers=2) as srv, srv.client(timeout=60) as c:
        first = collect(c.epoch(0))  # both workers reach the client directly from now on
        receive = c._recv
        dropped = []

        def lossy(sock, from_server):
            decoded = receive(sock, from_server)
            if decoded is not None and isinstance(decoded.msg, ppclient.protocol.DirectSeqs):
                if any(item.pos >= n - 3 for item in decoded.items) and len(dropped) < 2:
                    dropped.append([item.pos for item in decoded.items])
                    return None
            return decoded

        c._recv = lossy
        got = collect(c.epoch(1))
        status = c.status()
        c._recv = receive
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
    assert_same_epoch(held, reference(cfg, 1))
    assert_same_epoch(later, reference(cfg, 2))

"""Several trainers on one epoch, exact resume, one job at a time: real servers, workers and clients.

Each rank is a ppclient.Client (in a thread of this process, or in a subprocess that is killed),
and every test checks the delivered seqs bit for bit against the unsharded reference epoch.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List

import pytest
from conftest import (
    DATA_PATHS,
    NOISY_MAPPER,
    REPO,
    SLOW_MAPPER,
    STREAM_MAPPER,
    assert_data_path,
    assert_same_epoch,
    collect,
    in_threads,
    numpy_config,
    read,
    reference,
    run_cli,
    run_server,
    shard,
    wait_for,
)

import ppclient
from ppserver.scheduler import MAX_READERS

pytestmark = pytest.mark.processes

MAPPER = NOISY_MAPPER
STREAM = STREAM_MAPPER.format(delay=0)  # merges pairs, drops every 5th input


def pull_ranks(address: str, world: int, epoch: int, **client_kw) -> Dict[int, List[dict]]:
    """Every rank's shard of `epoch`, each rank a client in its own thread (as DDP ranks pull at once)."""
    got: Dict[int, List[dict]] = {}

    def rank_main(rank: int) -> None:
        with ppclient.Client(address, rank=rank, world_size=world, job="train", timeout=30, **client_kw) as c:
            it = c.epoch(epoch)
            seqs = collect(it)
            assert len(seqs) == len(it) if it.num_seqs is not None else True
            got[rank] = seqs

    in_threads(rank_main, range(world))
    return got


@pytest.mark.parametrize(
    "world, path",
    [
        # the default config ("direct"): a 43-seq epoch may end before a worker's route to a rank is
        # up, so which path each seq took is not asserted there
        pytest.param(1, "direct", id="1-default"),
        pytest.param(2, "direct", id="2-default"),
        pytest.param(3, "direct", id="3-default"),
        pytest.param(4, "direct", id="4-default"),
        pytest.param(3, "via-server", id="3-via-server"),
    ],
)
def test_ranks_share_one_epoch_bit_identical_to_the_reference(tmp_path, world, path):
    cfg = numpy_config(tmp_path, MAPPER, n=43, ordering="laplace:.5", extra="buf_size = 3\n" + DATA_PATHS[path])
    want = reference(cfg, 2)
    slog = str(tmp_path / "server.log")
    with run_server(cfg, workers=2, log_path=slog) as srv:
        got = pull_ranks(srv.address, world, 2)
        with srv.client() as c:
            st = c.status()
    for rank in range(world):
        assert [s["seq_idx"] for s in got[rank]] == [s["seq_idx"] for s in shard(want, rank, world)]
        assert_same_epoch(got[rank], shard(want, rank, world))
    tags = [s["seq_tag"] for r in range(world) for s in got[r]]
    assert len(tags) == len(set(tags)) == 43 // world * world  # disjoint; the remainder dropped
    assert st["job"]["name"] == "train" and st["job"]["world_size"] == world
    if path == "via-server":
        assert_data_path(read(slog), path)


def test_uneven_shards_without_drop_last_deliver_every_seq(tmp_path):
    cfg = numpy_config(tmp_path, MAPPER, n=22)
    want = reference(cfg, 1)
    with run_server(cfg, workers=2) as srv:
        got = pull_ranks(srv.address, 4, 1, drop_last=False)
    assert [len(got[r]) for r in range(4)] == [6, 6, 5, 5]
    for rank in range(4):
        assert_same_epoch(got[rank], shard(want, rank, 4, drop_last=False))


def test_ranks_in_stream_mode_get_the_merged_outputs_by_position(tmp_path):
    cfg = numpy_config(tmp_path, STREAM, n=47, extra="stream_partitions = 3\nbuf_size = 2\n")
    want = reference(cfg, 1)
    with run_server(cfg, workers=2) as srv:
        got = pull_ranks(srv.address, 2, 1)
    for rank in range(2):
        assert_same_epoch(got[rank], shard(want, rank, 2))


def test_a_rank_ahead_by_an_epoch_does_not_disturb_the_others(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.01), n=40, ordering="random", extra="buf_size = 2\n")
    want1, want2 = reference(cfg, 1), reference(cfg, 2)
    with run_server(cfg, workers=2) as srv:
        # rank 1 has a window of 2: its last seqs of epoch 1 are still on the server when rank 0 moves on
        fast = ppclient.Client(srv.address, rank=0, world_size=2, job="train")
        slow = ppclient.Client(srv.address, rank=1, world_size=2, job="train", window=2)
        try:
            it0, it1 = fast.epoch(1), slow.epoch(1)
            got1 = {0: [], 1: []}
            got1[1] += [next(it1) for _ in range(17)]  # rank 1 is nearly done...
            got1[0] += collect(it0)  # ...rank 0 finishes epoch 1
            result: Dict[str, object] = {}

            def next_epoch() -> None:  # and asks for epoch 2 while rank 1 still reads epoch 1
                it = fast.epoch(2)
                result["got"] = collect(it)

            t = threading.Thread(target=next_epoch)
            t.start()

            def ranks() -> Dict[int, dict]:
                return {r["rank"]: r for r in slow.status()["ranks"]}

            wait_for(lambda: ranks().get(0, {}).get("epoch") == 2, 30, "rank 0 to read epoch 2")
            behind = ranks()[1]
            assert behind["epoch"] == 1 and behind["position"] < 20  # not all of its shard was sent yet
            got1[1] += collect(it1)
            got2_1 = collect(slow.epoch(2))
            t.join(timeout=60)
            assert not t.is_alive()
        finally:
            fast.close()
            slow.close()
    for rank in range(2):
        assert_same_epoch(got1[rank], shard(want1, rank, 2))
    assert_same_epoch(result["got"], shard(want2, 0, 2))
    assert_same_epoch(got2_1, shard(want2, 1, 2))


def test_another_job_is_refused_while_the_first_lives_and_accepted_after(tmp_path):
    cfg = numpy_config(tmp_path, MAPPER, n=12)
    with run_server(cfg, workers=1) as srv:
        first = ppclient.Client(srv.address, rank=0, world_size=1, job="train", timeout=5)
        first_it = first.epoch(1)
        next(first_it)
        with ppclient.Client(srv.address, job="eval") as other:
            with pytest.raises(ppclient.Error, match=r"job 'train' is running with 1 live client .*must wait") as err:
                other.epoch(1)
            assert "silent for its client timeout of 5 s" in str(err.value)
            with ppclient.Client(srv.address, job="train", rank=0, world_size=4) as wrong_world:
                with pytest.raises(
                    ppclient.Error, match=r"job 'train' conflicts.*world_size 4, where the job has world_size 1"
                ):
                    wrong_world.epoch(1)
            first.close()  # the first job's last client leaves: the other job may run now
            # (its goodbye travels on its own connection: wait until the server has heard it)
            wait_for(lambda: other.status()["job"]["clients"] == 0, 10, "the first job's client to be gone")
            assert_same_epoch(collect(other.epoch(1)), reference(cfg, 1))
            assert other.status()["job"]["name"] == "eval"


def test_a_silent_job_is_replaced_after_its_client_timeout(tmp_path):
    cfg = numpy_config(tmp_path, MAPPER, n=12)
    with run_server(cfg, workers=1) as srv:
        code = (
            f"import ppclient, os, time\nc = ppclient.Client({srv.address!r}, job='train', timeout=2)\n"
            "it = c.epoch(1); next(it); print('ready', flush=True); time.sleep(60)"
        )
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
        try:
            assert proc.stdout.readline().strip() == "ready"
            with ppclient.Client(srv.address, job="eval") as other:
                with pytest.raises(ppclient.Error, match="job 'train'"):
                    other.epoch(1)  # its keepalive thread keeps the trainer alive while it sleeps
                proc.send_signal(signal.SIGSTOP)  # frozen: no keepalives, no credit
                start = time.monotonic()
                got = wait_for(lambda: _try_epoch(other), 15, "the silent job to be replaced")
                assert time.monotonic() - start >= 1.5
                assert_same_epoch(got, reference(cfg, 1))
        finally:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def _try_epoch(client: ppclient.Client):
    try:
        return collect(client.epoch(1))
    except ppclient.Error as exc:
        if "job 'train'" in str(exc):
            return None
        raise


RANK_SCRIPT = """
import json, os, pickle, sys
import ppclient
address, rank, world, stop_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
out, use_state = sys.argv[5], sys.argv[6] == "1"
state_path = out + ".state"
c = ppclient.Client(address, rank=rank, world_size=world, job="train", timeout=2)
state = json.load(open(state_path)) if use_state and os.path.exists(state_path) else None
print("consumer", c._consumer.hex()[:12], flush=True)
it = c.epoch(1, state=state) if state else c.epoch(1)
n = 0
for seq in it:
    with open(f"{out}-{seq['seq_idx']}.pkl", "wb") as f:
        pickle.dump(dict(seq), f)  # every array and meta entry, as received
    with open(state_path + ".tmp", "w") as f:
        json.dump(it.state_dict(), f)  # a checkpoint after every step
    os.replace(state_path + ".tmp", state_path)
    n += 1
    if n == stop_after:
        os.kill(os.getpid(), 9)
print("done", it.position, flush=True)
"""


def _run_rank(
    address: str, rank: int, world: int, stop_after: int, out: str, use_state: bool
) -> subprocess.CompletedProcess:
    script = os.path.join(os.path.dirname(out), "rank.py")
    with open(script, "w") as f:
        f.write(RANK_SCRIPT)
    return subprocess.run(
        [sys.executable, script, address, str(rank), str(world), str(stop_after), out, "1" if use_state else "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.parametrize("how, path", [("start", "direct"), ("state_dict", "direct"), ("state_dict", "via-server")])
def test_a_killed_rank_resumes_its_shard_while_the_other_runs(tmp_path, how, path):
    """A trainer restarting mid-epoch: rank 1 is killed with -9 after 11 seqs and a new process (or
    client) resumes its shard from its position while rank 0 runs on; in the direct data path the
    new client's results come straight from the workers."""
    cfg = numpy_config(
        tmp_path, SLOW_MAPPER.format(delay=0.01), n=60, ordering="random", extra="buf_size = 2\n" + DATA_PATHS[path]
    )
    want = reference(cfg, 1)
    out = str(tmp_path / "rank1")
    slog = str(tmp_path / "server.log")
    with run_server(cfg, workers=2, log_path=slog) as srv:
        other: Dict[str, object] = {}

        def rank0() -> None:
            with ppclient.Client(srv.address, rank=0, world_size=2, job="train") as c:
                other["got"] = collect(c.epoch(1))

        t = threading.Thread(target=rank0)
        t.start()
        killed = _run_rank(srv.address, 1, 2, 11, out, use_state=True)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        state = json.load(open(out + ".state"))
        assert state["position"] == 11 and state["rank"] == 1 and state["world_size"] == 2
        if how == "start":
            with ppclient.Client(srv.address, rank=1, world_size=2, job="train") as c:
                it = c.epoch(1, start=state["position"])
                assert len(it) == 30 - 11
                rest = collect(it)
                successor = c._consumer.hex()[:12]
            for seq in rest:
                with open(f"{out}-{seq['seq_idx']}.pkl", "wb") as f:
                    pickle.dump(seq, f)
        else:
            done = _run_rank(srv.address, 1, 2, -1, out, use_state=True)
            assert done.returncode == 0 and done.stdout.split()[2:] == ["done", "30"], done.stderr
            successor = done.stdout.split()[1]
        t.join(timeout=60)
        assert not t.is_alive()
    log = read(slog)
    assert_data_path(log, path)
    assert (f"sending results directly to consumer {successor}" in log) == (path == "direct")
    # the successor asked for the rest of the shard: from the killed rank's position, mid-epoch
    assert re.search(r"rank 1 of job 'train' reads epoch 1 \(run \d+\) from seq 11 of its shard", log), log[-3000:]
    assert_same_epoch(other["got"], shard(want, 0, 2))
    mine = shard(want, 1, 2)
    got = []
    for seq in mine:  # what the killed rank got before and after its restart: all keys, all meta
        with open(f"{out}-{seq['seq_idx']}.pkl", "rb") as f:
            got.append(pickle.load(f))
    assert_same_epoch(got, mine)


def test_resume_in_stream_mode_replays_and_skips(tmp_path):
    cfg = numpy_config(tmp_path, STREAM, n=47, extra="stream_partitions = 3\nbuf_size = 2\n")
    want = reference(cfg, 3)
    slog = str(tmp_path / "server.log")
    with run_server(cfg, workers=2, log_path=slog) as srv:
        with srv.client() as c:
            it = c.epoch(3)
            first = [next(it) for _ in range(7)]
            state = it.state_dict()
        with srv.client() as c:  # a new client (a restarted trainer)
            rest = collect(c.epoch(state=state))
    assert state["position"] == 7
    assert_same_epoch(first + rest, want)
    # the server was asked for the epoch from seq 7: it replayed the stream and skipped what was read
    assert re.search(r"reads epoch 3 \(run \d+\) from seq 7 of its shard", read(slog)), read(slog)[-3000:]


def test_a_rank_resumes_in_stream_mode_while_the_other_runs(tmp_path):
    cfg = numpy_config(tmp_path, STREAM, n=120, extra="stream_partitions = 3\nbuf_size = 2\n")
    want = reference(cfg, 1)
    slog = str(tmp_path / "server.log")
    with run_server(cfg, workers=2, log_path=slog) as srv:
        a = ppclient.Client(srv.address, rank=0, world_size=2, job="train", window=4)
        b = ppclient.Client(srv.address, rank=1, world_size=2, job="train", window=4)
        try:
            ita, itb = a.epoch(1), b.epoch(1)
            got0, got1 = [], []
            for _ in range(5):  # in step, as DDP ranks read
                got0.append(next(ita))
                got1.append(next(itb))
            state = itb.state_dict()
            b.close()  # rank 1 crashes after 5 seqs
            got0 += [next(ita) for _ in range(5)]  # rank 0 goes on
            rest: Dict[str, List[dict]] = {}
            resumed = threading.Event()

            def rank1() -> None:
                it = b2.epoch(state=state)
                resumed.set()
                rest["got"] = collect(it)

            with ppclient.Client(srv.address, rank=1, world_size=2, job="train") as b2:  # rank 1 comes back
                t = threading.Thread(target=rank1)
                t.start()
                assert resumed.wait(timeout=30)
                ranks = a.status()["ranks"]
                assert [r["done"] for r in ranks if r["rank"] == 0] == [False]  # while rank 0 still reads
                got0 += collect(ita)
                t.join(timeout=60)
                assert not t.is_alive()
        finally:
            a.close()
    assert state["position"] == 5
    assert_same_epoch(got0, shard(want, 0, 2))
    assert_same_epoch(got1 + rest["got"], shard(want, 1, 2))
    assert re.search(r"rank 1 of job 'train' reads epoch 1 \(run \d+\) from seq 5 of its shard", read(slog))


def test_a_state_without_its_fingerprint_is_refused_by_client_and_server(tmp_path):
    import zmq

    from ppclient import protocol
    from ppclient.protocol import Channel, Peer

    cfg = numpy_config(tmp_path, MAPPER, n=12)
    want = reference(cfg, 1)
    with run_server(cfg, workers=1) as srv, srv.client() as c:
        it = c.epoch(1)
        first = [next(it) for _ in range(4)]
        state = it.state_dict()
        assert state["fingerprint"]
        for bad in ("", None, 0):
            with pytest.raises(
                ppclient.UsageError, match=f"the state has no config fingerprint \\(fingerprint={bad!r}\\)"
            ):
                c.epoch(state=dict(state, fingerprint=bad))
        # a request that bypasses the client's check
        ctx = zmq.Context()
        req = ctx.socket(zmq.REQ)
        req.linger = 0
        try:
            req.connect(srv.address)
            req.send_multipart(
                protocol.encode(protocol.EpochRequest(epoch=1, consumer=b"raw", start=4, fingerprint=""))
            )
            assert req.poll(10_000), "no answer"
            reply = protocol.decode(req.recv_multipart(), Peer.CLIENT, (Channel.CONTROL,)).msg
        finally:
            req.close(linger=0)
            ctx.term()
        assert reply == protocol.ErrorReply(
            error="the resume state has no config fingerprint (EpochIterator.state_dict() always gives one)"
        )
        rest = collect(c.epoch(1, start=4))  # an explicit start resumes no state: nothing to check
    assert_same_epoch(first + rest, want)


def test_conflicting_requests_are_refused_and_disturb_nothing(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.01), n=30, extra="buf_size = 2\n")
    with run_server(cfg, workers=2) as srv:
        a = ppclient.Client(srv.address, rank=0, world_size=2, job="train")
        b = ppclient.Client(srv.address, rank=1, world_size=2, job="train")
        try:
            ita, itb = a.epoch(1), b.epoch(1)
            got = {0: [next(ita) for _ in range(3)], 1: [next(itb) for _ in range(3)]}
            with ppclient.Client(srv.address, rank=1, world_size=2, job="train") as c:
                with pytest.raises(ppclient.Error, match="at most one epoch apart"):
                    c.epoch(5)
                with pytest.raises(ppclient.Error, match="another seq_list"):
                    c.epoch(1, seq_order=[3, 2, 1])
            with ppclient.Client(srv.address, rank=0, world_size=3, job="train") as c:
                with pytest.raises(ppclient.Error, match="world_size 3, where the job has world_size 2"):
                    c.epoch(1)
            with ppclient.Client(srv.address, rank=0, world_size=2, job="train", subshard=(1, 2)) as c:
                with pytest.raises(ppclient.Error, match="DataLoader num_workers 2, where the job has 1 reader"):
                    c.epoch(1)  # a DataLoader worker of a loader with another num_workers than the job's
            foreign = dict(ita.state_dict(), fingerprint="0123456789abcdef")
            with ppclient.Client(srv.address, rank=0, world_size=2, job="train") as c:
                with pytest.raises(ppclient.Error, match="config fingerprint"):
                    c.epoch(state=foreign)
            with ppclient.Client(srv.address, rank=1, world_size=2, job="train") as c:
                with pytest.raises(ppclient.UsageError, match="rank 0"):
                    c.epoch(state=ita.state_dict())  # rank 0's state for a rank-1 client
            with pytest.raises(ppclient.UsageError, match="below world_size"):
                ppclient.Client(srv.address, rank=2, world_size=2)
            st = a.status()
            assert sorted(r["rank"] for r in st["ranks"]) == [0, 1]
            assert {r["epoch"] for r in st["ranks"]} == {1}
            got[0] += collect(ita)
            got[1] += collect(itb)
        finally:
            a.close()
            b.close()
    want = reference(cfg, 1)
    for rank in range(2):
        assert_same_epoch(got[rank], shard(want, rank, 2))


def test_status_shows_the_job_and_its_ranks(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.01), n=30)
    with run_server(cfg, workers=1) as srv:
        with (
            ppclient.Client(srv.address, rank=0, world_size=2, job="train") as a,
            ppclient.Client(srv.address, rank=1, world_size=2, job="train") as b,
        ):
            ita, itb = a.epoch(1), b.epoch(1)
            [next(ita) for _ in range(3)]
            [next(itb) for _ in range(2)]
            res = run_cli("status", srv.address, timeout=30)
    assert res.returncode == 0, res.stderr
    assert re.search(r"^job +'train' +world_size 2 +drop_last True +2 live clients +epochs 1$", res.stdout, re.M)
    # position: the index in the shard up to which seqs were sent (the client buffers its window);
    # the rate: seqs sent to the rank per second since it began
    for rank, least in ((0, 3), (1, 2)):
        m = re.search(rf"^  rank {rank} +epoch 1 \(run \d+\) +position (\d+)/15 +([\d.]+) seqs/s", res.stdout, re.M)
        assert m and int(m.group(1)) >= least and float(m.group(2)) > 0, res.stdout


def rss_mb(pid: int) -> float:
    """A process's resident memory, from /proc."""
    for line in read(f"/proc/{pid}/status").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_a_job_of_too_many_readers_is_refused_at_once_and_one_at_the_bound_costs_its_readers_only(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.01), n=30, extra="buf_size = 2\n")
    want = {epoch: reference(cfg, epoch) for epoch in (1, 2)}
    bound = f"above the {MAX_READERS}"
    with run_server(cfg, workers=1) as srv:
        # no job runs: the request would make the job (it made a lane for every reader of it)
        with ppclient.Client(srv.address, world_size=10**6, job="huge", timeout=20) as huge:
            with pytest.raises(ppclient.Error, match=f"world_size 1000000 is {bound} readers a job may have"):
                huge.epoch(1)
        # a job runs: requests of a too wide one are refused, by another client, while it reads on
        refusals: List[str] = []

        def ask_too_wide() -> None:
            for world, parts in ((10**6, 1), (MAX_READERS // 4, 8)):
                with ppclient.Client(srv.address, world_size=world, subshard=(0, parts), job="train", timeout=20) as c:
                    try:
                        c.epoch(1)
                    except ppclient.Error as exc:
                        refusals.append(str(exc))

        with ppclient.Client(srv.address, job="train", timeout=30) as train:
            it = train.epoch(1)
            got = [next(it) for _ in range(3)]
            asker = threading.Thread(target=ask_too_wide)
            asker.start()
            got += collect(it)
            asker.join(timeout=60)
            assert not asker.is_alive()
        assert_same_epoch(got, want[1])
        assert len(refusals) == 2 and all(bound in r for r in refusals), refusals
        assert f"= {MAX_READERS * 2} readers" in refusals[1]
        # a job at the bound: served to the readers that come, which cost the server what they cost
        before = rss_mb(srv.proc.pid)
        kw = dict(world_size=MAX_READERS, job="wide", drop_last=False, timeout=30)
        with ppclient.Client(srv.address, rank=0, **kw) as a, ppclient.Client(srv.address, rank=1, **kw) as b:
            ita, itb = a.epoch(2), b.epoch(2)
            assert (len(ita), len(itb)) == (1, 1)  # 30 seqs: one for each of the job's first 30 ranks
            assert_same_epoch(collect(ita) + collect(itb), want[2][:2])
            with srv.client() as other:
                assert other.info()["num_seqs"] == 30
                st = other.status()
            assert st["job"]["world_size"] == MAX_READERS and sorted(r["rank"] for r in st["ranks"]) == [0, 1]
            assert "rank(s) 2, 3, 4, 5, 6, 7, 8, 9 of job 'wide' to connect" in st["waiting_for"]
            grew = rss_mb(srv.proc.pid) - before
        assert grew < 32, f"the server grew by {grew:.0f} MB for a job of {MAX_READERS} readers"
        with ppclient.Client(srv.address, job="train", timeout=30) as train:
            wait_for(lambda: train.status()["job"]["clients"] == 0, 10, "the wide job's clients to be gone")
            assert_same_epoch(collect(train.epoch(2)), want[2])

"""A trainer outlives its server: kill -9 of the server's process group mid-epoch, a new server on
the same address about 3 s later (as systemd's Restart=on-failure starts it), and the clients go on
where they were, bit for bit as the uninterrupted epoch.

Every test runs real `ppserver serve` processes (and `ppserver worker` hosts) on loopback, checks
that the kill landed while the epoch was under way (`EpochIterator.reconnects`), and compares what
the clients got with the reference epoch computed in this process.
"""

from __future__ import annotations

import gc
import re
import threading
import time
from typing import Any, Dict, List

import pytest
from conftest import (
    DATA_PATHS,
    SLOW_MAPPER,
    STREAM_MAPPER,
    assert_data_path,
    assert_same_epoch,
    change_fingerprint,
    changing_config,
    children_of,
    collect,
    collect_with,
    in_threads,
    mapped_segments,
    numpy_config,
    read,
    reference,
    restartable,
    run_worker_host,
    shard,
    wait_for,
)
from test_robustness import corpus_config

import ppclient

pytestmark = pytest.mark.processes

HEARTBEATS = "heartbeat_interval = 0.2\nheartbeat_timeout = 1.0\nbuf_size = 2\n"

# A stream mapper that merges pairs of seqs and takes a while per input in the service.
SLOW_STREAM = STREAM_MAPPER.format(delay=0.03)


def slow_config(tmp_path, path: str = "direct", n: int = 60, name: str = "config.py", extra: str = "") -> str:
    return numpy_config(
        tmp_path,
        SLOW_MAPPER.format(delay=0.04),
        n=n,
        ordering="laplace:.10",
        extra=HEARTBEATS + DATA_PATHS[path] + extra,
        name=name,
    )


@pytest.mark.parametrize("path", ["direct", "via-server"])
def test_a_client_reads_on_through_two_server_restarts_in_one_epoch(tmp_path, path):
    """Killed twice in one epoch, the server comes back twice; the client notices each time, asks
    the new one for the epoch from where it was, and the epoch is the reference's. Its mappings
    of the killed workers' segments go once their arrays do."""
    cfg = slow_config(tmp_path, path)
    want = reference(cfg, 1)
    with restartable(cfg, tmp_path) as service, ppclient.Client(service.address, timeout=30) as c:
        it = c.epoch(1)
        got = collect_with(it, {5: service.restart_after, 25: service.restart_after})
        service.join()
        assert it.reconnects == 2
        assert_same_epoch(got, want)
        assert_data_path(read(service.log(3)), path)
        del got
        gc.collect()
        # only the segments of the third server's two workers may stay mapped (the killed ones' are gone)
        assert len(mapped_segments()) <= (2 if path == "direct" else 0)
        again = collect(c.epoch(2))  # and the next epoch is as it should be too
    assert_same_epoch(again, reference(cfg, 2))


def test_ranks_of_a_job_read_on_through_a_restart_in_stream_mode(tmp_path):
    """Two ranks of a job, map_seq_stream: both notice the restart on their own, at their own
    positions, and each gets its shard of the merged reference stream."""
    cfg = numpy_config(tmp_path, SLOW_STREAM, n=70, extra=HEARTBEATS + "stream_partitions = 2\n")
    want = reference(cfg, 1)
    got: Dict[int, List[dict]] = {}
    reconnects: Dict[int, int] = {}
    with restartable(cfg, tmp_path) as service:

        def rank_main(rank: int) -> None:
            with ppclient.Client(service.address, rank=rank, world_size=2, job="train", timeout=30) as c:
                it = c.epoch(1)
                got[rank] = collect_with(it, {4: service.restart_after} if rank == 0 else {})
                reconnects[rank] = it.reconnects

        try:
            in_threads(rank_main, range(2))
        finally:
            service.join()
    assert reconnects == {0: 1, 1: 1}
    for rank in range(2):
        assert_same_epoch(got[rank], shard(want, rank, 2))


def test_a_resumed_iterator_reads_on_through_a_restart(tmp_path):
    """An iterator resumed from a state (of an epoch asked for with a seq_order) reads on from a
    restarted server with that same seq_order."""
    cfg = slow_config(tmp_path, "via-server")
    order = list(range(59, -1, -2)) + list(range(0, 60, 2))
    want = reference(cfg, 3, seq_order=order)
    with restartable(cfg, tmp_path) as service, ppclient.Client(service.address, timeout=30) as c:
        it = c.epoch(3, seq_order=order)
        first = [next(it) for _ in range(7)]
        state = it.state_dict()
        resumed = c.epoch(state=state, seq_order=order)
        rest = collect_with(resumed, {6: service.restart_after})
        service.join()
    assert resumed.reconnects == 1
    assert_same_epoch(first + rest, want)


def test_a_kill_while_the_dataset_sets_the_epoch_up(tmp_path):
    """Killed inside init_seq_order (3 s of it): `epoch()` returns once the restarted server has set
    the epoch up, and the epoch is whole."""
    cfg = corpus_config(tmp_path, '"len_delay": 0.1, "seq_ordering": "sorted"', HEARTBEATS)
    want = reference(cfg, 1)
    with restartable(cfg, tmp_path, workers=1) as service, ppclient.Client(service.address, timeout=30) as c:
        log = service.log(1)
        killer = threading.Timer(1.0, lambda: service.restart_after(2.0))
        killer.start()
        try:
            it = c.epoch(1)
        finally:
            killer.join()
        service.join()
        assert "epoch 1 started" not in read(log)  # the first server died before the epoch was set up
        assert it.reconnects == 1 and len(it) == len(want)
        assert_same_epoch(collect(it), want)


def test_remote_workers_rejoin_a_restarted_server_and_keep_nothing_of_the_old_one(tmp_path):
    """The server has no local workers: the epoch goes on only because the `ppserver worker` host
    registers again with the new server. Neither the host's worker nor the client keeps a mapping
    of what the killed server or the worker's old identity offered."""
    cfg = slow_config(tmp_path)
    want = reference(cfg, 1)
    wlog = str(tmp_path / "worker.log")
    with restartable(cfg, tmp_path, workers=0) as service:
        with run_worker_host(cfg, service.address, procs=1, log_path=wlog) as host:
            worker = wait_for(lambda: (children_of(host.pid) or [None])[0], 30, "the worker process")
            with ppclient.Client(service.address, timeout=30) as c:
                it = c.epoch(1)
                got = collect_with(it, {5: service.restart_after})
                service.join()
                assert it.reconnects == 1
                assert_same_epoch(got, want)
                assert "lost the server; registering again" in read(wlog)
                del got
                gc.collect()
                assert len(mapped_segments()) <= 1  # the worker's segment, once (not again for its old identity)
            # the worker maps its own segment and the new server's input segment, nothing of the old one
            wait_for(lambda: len(mapped_segments(worker)) <= 2, 10, "the worker to map two segments at most")


def refused_after_restart(service: Any, c: ppclient.Client, **restart: Any) -> None:
    """A client mid-epoch whose server comes back (after 1 s) with `restart`'s other config, values or
    code: its epoch is an error naming both fingerprints, not a wrong epoch read on."""
    before = c.info()["fingerprint"]
    it = c.epoch(1)
    next(it)
    service.restart_after(1.0, **restart)
    service.join()
    with ppclient.Client(service.address) as probe:
        after = probe.info()["fingerprint"]
    assert before != after
    with pytest.raises(ppclient.Error, match="restarted with another config") as info:
        collect(it)
    assert before in str(info.value) and after in str(info.value)


def test_a_server_with_another_config_at_the_address_is_an_error_naming_both(tmp_path):
    cfg = slow_config(tmp_path)
    other = slow_config(tmp_path, name="other.py", extra="seed = 5\n")
    with restartable(cfg, tmp_path) as service, ppclient.Client(service.address, timeout=30) as c:
        refused_after_restart(service, c, config=other)


@pytest.mark.parametrize("change", ["seed from the environment", "dataset module"])
def test_a_server_restarted_with_the_same_file_but_other_values_code_or_data_is_an_error(tmp_path, change):
    """The config file is the same; the seed from the environment or a module it uses is not: the
    restarted server is not taken for the same one (its seqs would differ). (The other changes of
    FINGERPRINT_CHANGES change the same served fingerprint: test_client_misuse.py's resume test.)"""
    cfg = changing_config(tmp_path, delay=0.04)
    with restartable(cfg, tmp_path) as service, ppclient.Client(service.address, timeout=30) as c:
        refused_after_restart(service, c, env=change_fingerprint(tmp_path, change))


def test_no_server_back_within_the_timeout_is_server_unavailable_saying_it_tried(tmp_path):
    cfg = slow_config(tmp_path)
    with restartable(cfg, tmp_path) as service, ppclient.Client(service.address, timeout=4) as c:
        it = c.epoch(1)
        next(it)
        service.kill()
        began = time.monotonic()
        with pytest.raises(ppclient.ServerUnavailable) as info:
            collect(it)
        assert time.monotonic() - began < 15  # the timeout, not a hang
        assert re.search(r"tried \d+ times to reach a server there again, none answered", str(info.value))
        with pytest.raises(ppclient.ServerUnavailable, match=r"within 4 s \(asked \d+ times.*: nothing listens on"):
            c.info()


def test_a_request_made_while_the_server_is_down_is_answered_by_the_restarted_one(tmp_path):
    cfg = slow_config(tmp_path, n=10)
    with restartable(cfg, tmp_path) as service, ppclient.Client(service.address, timeout=30) as c:
        service.restart_after(3.0)
        killed = time.monotonic()
        assert c.info()["num_seqs"] == 10  # asked again on a new connection until the new server answers
        # (and answered by the restarted server, up for less time than has passed since the kill)
        assert c.status()["uptime_s"] < time.monotonic() - killed
        got = collect(c.epoch(1))
        service.join()
        assert service.starts == 2
    assert_same_epoch(got, reference(cfg, 1))

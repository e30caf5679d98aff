"""Multi-host faults: a server and two worker hosts in network namespaces, the client in the root one.

Each test runs real `ppserver serve --workers 0` and `ppserver worker --procs N` processes
(see tests/netns.py for the topology), injects a fault from a second thread while the main
thread consumes an epoch, and checks that the delivered epoch equals the fault-free
reference bit for bit: no seq lost, duplicated, reordered or changed.

Each worker host has a hostname of its own (see tests/netns.py), so array bytes cross between
the hosts over sockets, as between real hosts; every test checks that, and which way the results
took. The mapper sleeps only in the worker processes (PP_NETNS_MAP_DELAY is set in their
environment), so the in-process reference runs at full speed. Heartbeats are fast (0.2 s,
declared dead after 1 s) to keep the module short. Needs root and iproute2; skipped otherwise.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from typing import Callable, Dict, List, Optional

import pytest
from conftest import assert_same_epoch, mapped_segments, numpy_config, reference
from netns import Lab, NetnsUnavailable, Proc, ServerHandle, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.netns, pytest.mark.timeout(180)]

MAPPER = """
import os
import time
_DELAY = float(os.environ.get("PP_NETNS_MAP_DELAY", "0"))
def map_seq(seq, *, epoch, seq_idx, rng, **kwargs):
    scale = rng.uniform(0.5, 1.5)
    if _DELAY:
        time.sleep(_DELAY * scale)
    seq["data"] = seq["data"] * scale + rng.randn(*seq["data"].shape).astype("float32")
    return seq
"""

HB_INTERVAL = 0.2
HB_TIMEOUT = 1.0
SETTINGS = f"""
heartbeat_interval = {HB_INTERVAL}
heartbeat_timeout = {HB_TIMEOUT}
buf_size = 2
max_seq_retries = 50
"""
WORKER_ENV = {"PP_NETNS_MAP_DELAY": "0.008"}  # 4-12 ms per seq: ~100 seqs/s per worker process
PORT = 5555  # the server namespace is ours: nothing else listens there
REGISTER_TIMEOUT = 30.0
REJOIN_TIMEOUT = 15.0


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    the_lab = Lab(hosts=2, log_dir=str(tmp_path_factory.mktemp("netns")))
    try:
        the_lab.create()
    except NetnsUnavailable as exc:
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        yield the_lab
    finally:
        the_lab.destroy()


@pytest.fixture
def net(lab, tmp_path, request):
    """The lab with this test's log directory; every process stopped and every link up afterwards."""
    lab.log_dir = str(tmp_path)
    failed_before = request.session.testsfailed
    print(f"logs in {tmp_path}")
    try:
        yield lab
    finally:
        lab.stop_all()
        for host in (1, 2):
            lab.host_link(host, up=True)
        if request.session.testsfailed > failed_before:
            for name in sorted(os.listdir(str(tmp_path))):
                if name.endswith(".log"):
                    with open(os.path.join(str(tmp_path), name), errors="replace") as f:
                        print(f"----- {name} (last 40 lines) -----\n" + "".join(f.readlines()[-40:]))


@pytest.fixture(params=["direct", "via-server"])
def data_path(request):
    """Every fault twice: results straight from workers to the client, and all through the server."""
    return request.param


def make_config(tmp_path, n: int, data_path: str) -> str:
    return numpy_config(tmp_path, MAPPER, n=n, extra=SETTINGS + f"direct_results = {data_path == 'direct'}\n")


def assert_path(data_path: str, *hosts: Proc) -> None:
    """The results took the path the test is about, and array bytes crossed between hosts over the
    sockets: no result went through shared memory, and no worker maps a segment (not the server's
    for its inputs, nor one of its own for results)."""
    logs = [host.log() for host in hosts]
    assert any("sending results directly" in log for log in logs) == (data_path == "direct"), data_path
    assert not any("(shared memory)" in log for log in logs)
    for host in hosts:
        for pid in host.children():
            assert mapped_segments(pid) == set(), (host.name, pid)


def start_host(lab: Lab, host: int, cfg: str, procs: int = 2, port: int = PORT) -> Proc:
    return lab.start_workers(host, cfg, port=port, procs=procs, env=WORKER_ENV)


def host_pids(host: Proc, procs: int, timeout: float = REGISTER_TIMEOUT) -> List[int]:
    """The worker processes of a `ppserver worker` supervisor, once all of them are running."""
    return wait_for(
        lambda: (lambda k: k if len(k) == procs else None)(host.children()),
        timeout,
        f"{procs} worker processes of {host.name}",
    )


def workers_by_pid(srv: ServerHandle) -> Dict[int, dict]:
    return {w["pid"]: w for w in srv.status()["workers"]}


class Progress:
    def __init__(self, total: int):
        self.total = total
        self.n = 0
        self.finished = threading.Event()
        self.fault_done = threading.Event()

    def wait(self, k: int, timeout: float = 30.0) -> None:
        """Wait until k seqs were consumed (the consumer holds the epoch's tail until the fault is done)."""
        deadline = time.monotonic() + timeout
        while self.n < k:
            if self.finished.is_set():
                raise AssertionError(f"the epoch stopped after {self.n} seqs, before seq {k}")
            if time.monotonic() > deadline:
                raise AssertionError(f"only {self.n} of {k} seqs consumed after {timeout:g} s")
            time.sleep(0.01)


def run_epoch(
    srv: ServerHandle,
    epoch: int,
    fault: Optional[Callable[[Progress], None]] = None,
    hold_frac: float = 0.9,
    stats: Optional[dict] = None,
) -> List[dict]:
    """Consume an epoch while `fault(progress)` runs in a thread.

    The consumer stops at hold_frac of the epoch until the fault thread has finished, so every
    fault happens while seqs are still outstanding, however fast the epoch goes.
    """
    with srv.client(timeout=30.0) as client:
        it = client.epoch(epoch)
        progress = Progress(len(it))
        hold_at = int(progress.total * hold_frac) if fault else progress.total + 1
        errors: List[BaseException] = []

        def body() -> None:
            try:
                fault(progress)
            except BaseException as exc:
                errors.append(exc)
            finally:
                progress.fault_done.set()

        thread = threading.Thread(target=body, name="fault", daemon=True) if fault else None
        got: List[dict] = []
        try:
            if thread:
                thread.start()
            for seq in it:
                got.append(dict(seq))
                progress.n = len(got)
                if progress.n == hold_at and not progress.fault_done.wait(timeout=90.0):
                    raise AssertionError("the fault thread did not finish within 90 s")
                if errors:
                    break
        finally:
            progress.finished.set()
            if thread:
                thread.join(timeout=60.0)
                assert not thread.is_alive(), "the fault thread did not stop"
        if errors:
            raise errors[0]
        if stats is not None:
            stats["duplicates"] = it.duplicates
        return got


def lost_lines(srv: ServerHandle, pid: int) -> List[str]:
    return [ln for ln in srv.proc.log().splitlines() if f"pid {pid}) lost" in ln]


# ---------------------------------------------------------------------------------------
def test_worker_host_joins_mid_epoch(net, tmp_path):
    """A host joining is no fault, so only in the direct path, where the new host must also reach
    the client (the faults below run in both)."""
    n = 1000
    cfg = make_config(tmp_path, n, "direct")
    host_a = start_host(net, 1, cfg)
    srv = net.start_server(cfg, port=PORT)
    a_pids = host_pids(host_a, 2)
    srv.wait_pids(a_pids, REGISTER_TIMEOUT)
    joined: Dict[str, object] = {}

    def fault(progress: Progress) -> None:
        progress.wait(n // 3)
        host_b = start_host(net, 2, cfg)
        b_pids = host_pids(host_b, 2)
        srv.wait_pids(b_pids, REGISTER_TIMEOUT)
        joined.update(b_pids=b_pids, at=progress.n)

    got = run_epoch(srv, 1, fault)
    assert_same_epoch(got, reference(cfg, 1))
    assert joined["at"] < n, joined
    workers = workers_by_pid(srv)
    assert set(a_pids) | set(joined["b_pids"]) <= set(workers), workers
    for pid in joined["b_pids"]:
        assert workers[pid]["seqs_done"] > 0, (pid, workers[pid])
        assert workers[pid]["host"] == net.hostname(2)  # a host of its own, as far as its processes know
    assert_path("direct", host_a)


def test_link_down_then_up(net, tmp_path, data_path):
    n = 1200
    cfg = make_config(tmp_path, n, data_path)
    host_a, host_b = start_host(net, 1, cfg), start_host(net, 2, cfg)
    srv = net.start_server(cfg, port=PORT)
    a_pids, b_pids = host_pids(host_a, 2), host_pids(host_b, 2)
    srv.wait_pids(a_pids + b_pids, REGISTER_TIMEOUT)
    events: Dict[str, int] = {}

    def fault(progress: Progress) -> None:
        progress.wait(n // 4)
        net.host_link(1, up=False)
        events["down_at"] = progress.n
        srv.wait_pids(a_pids, 10.0, present=False)  # declared dead after heartbeat_timeout
        events["dead_at"] = k = progress.n
        progress.wait(k + 50, timeout=10.0)  # host B carries on alone
        assert set(b_pids) <= set(workers_by_pid(srv))
        net.host_link(1, up=True)
        events["up_at"] = progress.n

    got = run_epoch(srv, 1, fault)
    assert_same_epoch(got, reference(cfg, 1))
    assert events["up_at"] < n, events
    for pid in a_pids:
        assert lost_lines(srv, pid), f"worker {pid} of host A was not declared lost"
    st = srv.status()  # both counted lost, and what they held was made again elsewhere
    assert st["departures"].get("lost", 0) >= 2 and st["handed_back"] >= 1, st

    # host A's workers (the same processes) register again within a few seconds
    start = time.monotonic()
    srv.wait_pids(a_pids, REJOIN_TIMEOUT)
    rejoin_s = time.monotonic() - start
    assert sorted(host_a.children()) == sorted(a_pids), "host A's workers were restarted"
    got2 = run_epoch(srv, 2)
    assert_same_epoch(got2, reference(cfg, 2))
    workers = workers_by_pid(srv)
    assert all(workers[pid]["seqs_done"] > 0 for pid in a_pids + b_pids), (workers, rejoin_s)
    assert_path(data_path, host_a, host_b)


def test_sigstop_worker_declared_dead_then_rejoins(net, tmp_path, data_path):
    n = 1000
    cfg = make_config(tmp_path, n, data_path)
    host_a, host_b = start_host(net, 1, cfg), start_host(net, 2, cfg)
    srv = net.start_server(cfg, port=PORT)
    a_pids, b_pids = host_pids(host_a, 2), host_pids(host_b, 2)
    srv.wait_pids(a_pids + b_pids, REGISTER_TIMEOUT)
    stopped: Dict[str, float] = {}

    def fault(progress: Progress) -> None:
        progress.wait(n // 3)
        for _ in range(10):  # stop a worker of host A that holds seqs (the server's view, after the stop)
            busy = wait_for(
                lambda: [p for p in a_pids if workers_by_pid(srv).get(p, {}).get("in_flight")],
                10.0,
                "a busy worker on host A",
            )
            pid = busy[0]
            os.kill(pid, signal.SIGSTOP)
            stopped.update(pid=pid, t=time.monotonic())
            time.sleep(0.05)  # let results sent before the stop arrive
            if workers_by_pid(srv).get(pid, {}).get("in_flight"):
                break
            os.kill(pid, signal.SIGCONT)
        try:
            srv.wait_pids([pid], 10.0, present=False)
            stopped["dead_after"] = time.monotonic() - stopped["t"]
            time.sleep(max(0.0, stopped["t"] + HB_TIMEOUT + 0.2 - time.monotonic()))
        finally:
            os.kill(pid, signal.SIGCONT)
        stopped["cont_after"] = time.monotonic() - stopped["t"]
        stopped["cont_at"] = progress.n

    try:
        got = run_epoch(srv, 1, fault)
    finally:
        if "pid" in stopped:
            os.kill(int(stopped["pid"]), signal.SIGCONT)
    assert_same_epoch(got, reference(cfg, 1))
    pid = int(stopped["pid"])
    assert stopped["cont_after"] > HB_TIMEOUT, stopped
    assert stopped["cont_at"] < n, stopped
    lines = lost_lines(srv, pid)
    assert lines, f"worker {pid} was not declared lost"
    handed_back = int(re.search(r"; (\d+) seqs and", lines[0]).group(1))
    assert handed_back >= 1, lines[0]
    # the stopped process itself comes back (not a respawned one)
    srv.wait_pids([pid], REJOIN_TIMEOUT)
    assert sorted(host_a.children()) == sorted(a_pids)
    assert_path(data_path, host_a, host_b)


def test_twenty_kills_during_one_epoch(net, tmp_path, data_path):
    n, kills, gap = 1800, 20, 0.25
    cfg = make_config(tmp_path, n, data_path)
    hosts = [start_host(net, 1, cfg, procs=3), start_host(net, 2, cfg, procs=3)]
    srv = net.start_server(cfg, port=PORT)
    srv.wait_pids(host_pids(hosts[0], 3) + host_pids(hosts[1], 3), REGISTER_TIMEOUT)
    rng = random.Random(1234)
    killed: List[tuple] = []

    def fault(progress: Progress) -> None:
        progress.wait(n // 20)
        last = 0.0
        for i in range(kills):
            # a random registered worker, busy if one becomes busy within 2 s (none is while the
            # consumer holds the epoch's tail); the first two kills go to one host each
            choices = [hosts[i]] if i < 2 else hosts
            since = time.monotonic()

            def targets(choices=choices, since=since):
                workers = srv.status()["workers"]
                busy_ok = time.monotonic() - since < 2.0
                pids = {w["pid"] for w in workers if w["in_flight"] > 0 or not busy_ok}
                found = [
                    (pid, h)
                    for h in choices
                    for pid in h.children()
                    if pid in pids and pid not in {k[0] for k in killed}
                ]
                return found or None

            found = wait_for(targets, 20.0, "a registered worker to kill", interval=0.02)
            time.sleep(max(0.0, last + gap - time.monotonic()))
            pid, host = rng.choice(found)
            os.kill(pid, signal.SIGKILL)
            last = time.monotonic()
            killed.append((pid, host.name, progress.n))

    got = run_epoch(srv, 1, fault, hold_frac=0.95)
    assert_same_epoch(got, reference(cfg, 1))
    assert len(killed) == kills and {h for _, h, _ in killed} == {"host1", "host2"}, killed
    assert max(at for _, _, at in killed) < n, killed
    # every kill hit a registered worker: the server declared each one lost, and its host respawned it
    wait_for(lambda: all(lost_lines(srv, pid) for pid, _, _ in killed), 5.0, "every killed worker declared lost")
    respawned = lambda: sum(h.log().count("exited with signal SIGKILL; respawning") for h in hosts)
    wait_for(lambda: respawned() == kills, 5.0, f"{kills} respawns")
    print("kills (pid, host, seqs consumed):", killed)
    assert_path(data_path, *hosts)


def test_server_restart_while_workers_wait(net, tmp_path, data_path):
    n = 400
    cfg = make_config(tmp_path, n, data_path)
    host_a, host_b = start_host(net, 1, cfg), start_host(net, 2, cfg)
    pids = host_pids(host_a, 2) + host_pids(host_b, 2)
    for host in (host_a, host_b):
        wait_for(
            lambda h=host: h.log().count("waiting for server at") >= 2, 30.0, f"{host.name} to wait for the server"
        )

    srv = net.start_server(cfg, port=PORT, name="server1")
    srv.wait_pids(pids, REGISTER_TIMEOUT)
    assert_same_epoch(run_epoch(srv, 1), reference(cfg, 1))

    assert srv.stop(timeout=10.0) == 0
    lost = lambda: sum(h.log().count("lost the server; registering again") for h in (host_a, host_b))
    wait_for(lambda: lost() >= 4, 10.0, "every worker to notice the server is gone")

    srv2 = net.start_server(cfg, port=PORT, name="server2")
    assert srv2.address == srv.address
    srv2.wait_pids(pids, REJOIN_TIMEOUT)
    assert_same_epoch(run_epoch(srv2, 2), reference(cfg, 2))
    assert sorted(host_a.children() + host_b.children()) == sorted(pids), "workers were restarted"
    assert "respawning" not in host_a.log() + host_b.log()
    assert_path(data_path, host_a, host_b)


def test_results_reach_the_client_but_the_server_never_hears(net, tmp_path):
    """Host A's link to the server goes down while its link to the client stays up: its last
    results reach the client directly but the server never hears of them. The server declares
    its workers lost and has their seqs made again; they are killed. The client drops the seqs
    that came twice, and the epoch is exact."""
    n = 1000
    cfg = make_config(tmp_path, n, "direct")
    host_a, host_b = start_host(net, 1, cfg), start_host(net, 2, cfg)
    srv = net.start_server(cfg, port=PORT)
    a_pids, b_pids = host_pids(host_a, 2), host_pids(host_b, 2)
    srv.wait_pids(a_pids + b_pids, REGISTER_TIMEOUT)
    stats: dict = {}

    def fault(progress: Progress) -> None:
        progress.wait(n // 3)
        net.host_link(1, up=False)
        srv.wait_pids(a_pids, 10.0, present=False)
        for pid in a_pids:
            os.kill(pid, signal.SIGKILL)
        net.host_link(1, up=True)

    got = run_epoch(srv, 1, fault, stats=stats)
    assert_same_epoch(got, reference(cfg, 1))
    assert stats["duplicates"] > 0, stats  # what host A sent after its link to the server went down came twice
    assert_path("direct", host_a, host_b)


# ---- a self-sizing worker host (`ppserver worker --procs auto`) --------------------------------
AUTO_POOL = """
num_workers = "auto"
max_workers = 0
elastic_settle = 0.5
elastic_window = 1.5
progress_interval = 0
"""


def test_a_self_sizing_host_runs_as_many_processes_as_the_trainer_needs(net, tmp_path):
    """The server has no local workers (max_workers = 0); a host with `--procs auto` starts with
    one process, gets a second while the workers hold the epoch back, and has one retired once
    the trainer slows down; the epoch is the reference all along."""
    cfg = numpy_config(tmp_path, MAPPER, n=480, extra=SETTINGS + AUTO_POOL)
    srv = net.start_server(cfg, port=PORT, extra=["--workers", "auto"])
    host = net.start_workers(1, cfg, port=PORT, procs="auto", env={"PP_NETNS_MAP_DELAY": "0.04"})
    host_pids(host, 1)
    sizes: List[int] = []
    got: List[dict] = []
    with srv.client(timeout=30.0) as client:
        step_end = time.monotonic()
        for seq in client.epoch(1):  # ~25 seqs/s per process: 40/s needs two, 8/s one
            got.append(dict(seq))
            rate = 40.0 if len(got) < 400 else 8.0
            step_end = max(step_end, time.monotonic()) + 1 / rate
            time.sleep(max(step_end - time.monotonic(), 0))
            if len(got) % 20 == 0:
                pool = srv.status()["pool"]
                sizes.append(pool["current"])
    pool = srv.status()["pool"]
    assert_same_epoch(got, reference(cfg, 1))
    assert pool["auto"] and [h["max_procs"] for h in pool["hosts"]] == [len(os.sched_getaffinity(0))], pool
    assert 2 <= max(sizes) <= 3, sizes  # two needed; one more at most (more cores than here)
    assert sizes[-1] == 1, sizes
    totals = {(d, r): n for d, r, n in pool["changes_total"]}
    assert totals.get(("up", "workers_hold_back"), 0) >= 1 and totals.get(("down", "trainer_holds_back"), 0) >= 1
    log = host.log()
    assert "the server wants 2 processes here" in log and "retired" in log, log[-2000:]

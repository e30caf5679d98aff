"""Progress and metrics of a real `ppserver serve` on loopback: Prometheus metrics scraped over
HTTP while and after an epoch runs, status fields (rolling rate, ETA, the side that holds the
epoch back) for a slow trainer, slow workers and a slow dataset, and the progress log line."""

from __future__ import annotations

import json
import os
import resource
import selectors
import socket
import time
import urllib.request
from typing import Callable, Dict, List, Tuple

import pytest
import zmq
from conftest import (
    SLOW_MAPPER,
    collect,
    error_line,
    free_port,
    numpy_config,
    read,
    run_cli,
    run_server,
    wait_for,
    write_config,
)

from ppserver.observe.metrics import MAX_CONNECTIONS, REQUEST_TIMEOUT_S
from ppserver.observe.stages import STAGES

pytestmark = pytest.mark.processes

IDENTITY_STREAM = """
def map_seq_stream(seqs, **kwargs):
    for seq in seqs:
        yield seq
"""

# A corpus whose reads take `delay` seconds each, from a module next to the config.
SLOW_CORPUS = """
import time
import numpy as np
from ppserver.datasets.base import Dataset

class SlowCorpus(Dataset):
    def __init__(self, n=100, delay=0.0, **kwargs):
        super().__init__(**kwargs)
        self.n, self.delay = n, delay
    def _num_corpus_seqs(self):
        return self.n
    def _load(self, i):
        time.sleep(self.delay)
        return {"data": np.full((4, 2), i, dtype="float32")}
    def _tag(self, i):
        return f"s{i}"
    def _seq_len(self, i):
        return 4
    def _compute_data_keys(self):
        return {"data": {"shape": [None, 2], "dtype": "float32"}}
"""

Metrics = Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]


def scrape(port: int) -> Metrics:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(m: Metrics, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def delivered(m: Metrics) -> float:
    return value(m, "ppserver_seqs_delivered_total", job="default", rank="0")


def scrape_until(port: int, ok: Callable[[Metrics], bool], what: str) -> Metrics:
    """Metrics are published about once a second (and mapper counts come with heartbeats)."""
    return wait_for(lambda: (lambda m: m if ok(m) else None)(scrape(port)), 10, what, interval=0.2)


def test_metrics_scraped_during_and_after_an_epoch(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.01), n=80, extra="buf_size = 2\n")
    port = free_port()
    host = socket.gethostname()
    with run_server(cfg, workers=2, extra=["--metrics", f"127.0.0.1:{port}"]) as srv, srv.client() as c:
        it = c.epoch(1)
        got = [next(it) for _ in range(30)]
        during = scrape_until(port, lambda m: delivered(m) >= 1, "a first count")
        got += collect(it)
        assert len(got) == 80
        after = scrape_until(
            port, lambda m: value(m, "ppserver_mapper_seqs_total", host=host) >= 80, "the workers' mapper counts"
        )
        assert delivered(during) < delivered(after) == 80
        assert value(after, "ppserver_bytes_delivered_total", job="default", rank="0") > 0
        for stage in STAGES:
            assert value(after, "ppserver_stage_seqs_total", stage=stage) >= 80, stage
            assert ("ppserver_stage_seconds_total", (("stage", stage),)) in after, stage
        assert value(after, "ppserver_stage_seconds_total", stage="mapper") >= 80 * 0.01 * 0.9
        assert value(after, "ppserver_stage_seconds_total", stage="transfer") > 0
        assert value(after, "ppserver_dataset_calls_total", call="init_seq_order") == 1
        assert value(after, "ppserver_worker_results_total", host=host) == 80
        assert value(after, "ppserver_mapper_seconds_total", host=host) > 0
        assert value(after, "ppserver_workers", host=host) == 2
        assert value(after, "ppserver_epoch") == 1
        # junk on the worker socket is dropped and counted
        assert value(after, "ppserver_malformed_messages_total") == 0
        ctx = zmq.Context()
        try:
            junk = ctx.socket(zmq.DEALER)
            junk.linger = 0
            junk.connect(c.status()["worker_address"])
            junk.send_multipart([b"\xc1 not msgpack"])
            wait_for(lambda: value(scrape(port), "ppserver_malformed_messages_total") >= 1, 10, "the malformed count")
            junk.close(linger=0)
        finally:
            ctx.term()
        for name in ("reassigned", "malformed_results", "refused_handshakes", "local_worker_respawns"):
            assert (f"ppserver_{name}_total", ()) in after, name
        assert collect(c.epoch(2)) and c.status()["malformed_messages"] >= 1  # still serving


def test_metrics_in_stream_mode(tmp_path):
    cfg = numpy_config(tmp_path, IDENTITY_STREAM, n=30)
    port = free_port()
    with run_server(cfg, workers=2, extra=["--metrics", f":{port}"]) as srv, srv.client() as c:
        assert len(collect(c.epoch(1))) == 30
        host = socket.gethostname()
        m = scrape_until(
            port,
            lambda m: delivered(m) == 30 and value(m, "ppserver_mapper_seqs_total", host=host) >= 30,
            "the epoch's counts",
        )
        for stage in ("wait_worker", "reorder", "wait_trainer", "mapper"):
            assert value(m, "ppserver_stage_seqs_total", stage=stage) >= 30, stage


@pytest.mark.parametrize("addr", ["9100", "127.0.0.1:99999", "tcp://127.0.0.1:9100", "no such host:1"])
def test_bad_metrics_address_exits_2_with_one_line(tmp_path, addr):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=3)
    assert "'--metrics'" in error_line(run_cli("serve", cfg, "--bind", "tcp://127.0.0.1:0", "--metrics", addr))


def test_metrics_port_in_use_is_one_line_and_exit_1(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=3)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = run_cli("serve", cfg, "--bind", "tcp://127.0.0.1:0", "--workers", "0", "--metrics", f"127.0.0.1:{port}")
    assert res.returncode == 1, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and "cannot serve metrics" in errors[0], res.stderr
    assert "Traceback" not in res.stderr


def slow_corpus_config(tmp_path, n: int, delay: float) -> str:
    write_config(tmp_path, SLOW_CORPUS, name="slow_corpus.py")
    return write_config(
        tmp_path,
        f"""
    dataset = {{"class": "slow_corpus:SlowCorpus", "n": {n}, "delay": {delay}}}
    def map_seq(seq, **kwargs):
        return seq
    buf_size = 2
    """,
    )


@pytest.mark.parametrize("side", ["trainer", "workers", "dataset"])
def test_status_shows_rate_eta_and_the_side_that_holds_the_epoch_back(tmp_path, side):
    if side == "dataset":
        cfg, workers, pause = slow_corpus_config(tmp_path, n=200, delay=0.03), 2, 0.0
    elif side == "workers":
        cfg, workers, pause = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.03), n=200), 1, 0.0
    else:
        cfg, workers, pause = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=200), 2, 0.03
    with run_server(cfg, workers=workers) as srv, srv.client() as c:
        it = c.epoch(1)
        start = time.monotonic()
        n = 0
        while time.monotonic() - start < 3.5:
            next(it)
            n += 1
            time.sleep(pause)
        st = c.status()
        res = run_cli("status", srv.address, timeout=30)
        rest = collect(it)
    assert n + len(rest) == 200
    assert st["held_back_by"] == side, json.dumps({k: st[k] for k in ("stage_ms", "waiting_for", "queues")})
    assert st["rate_seqs_per_sec"] > 0 and st["rate_window_s"] >= 2
    (run,) = st["progress"]
    assert run["epoch"] == 1 and run["seqs_total"] == 200 and 0 < run["seqs_done"] < 200
    assert st["eta_s"] == run["eta_s"] and 0 < st["eta_s"] < 60
    assert set(st["stage_ms"]) == set(STAGES)
    assert res.returncode == 0, res.stderr
    assert f"held back by the {side}" in res.stdout and "ETA" in res.stdout and "ms per seq" in res.stdout
    # the reader's dataset computing is the one side more workers cannot help: status says what to do
    assert (st["advice"] is not None) == (side == "dataset")
    assert ("the reader holds the epoch back" in res.stdout) == (side == "dataset"), res.stdout


def test_status_story_prints_a_seqs_moves_mid_epoch(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=40)
    with run_server(cfg, workers=1) as srv, srv.client() as c:
        it = c.epoch(1)
        taken = [next(it) for _ in range(5)]
        res = run_cli("status", "--story", "3", srv.address, timeout=30)
        js = run_cli("status", "--story", "3", "--story", "worker:nobody", "--json", srv.address, timeout=30)
        bad = run_cli("status", "--story", "seq:3", srv.address, timeout=30)
        rest = collect(it)
    assert len(taken) + len(rest) == 40
    assert res.returncode == 0, res.stderr
    header, *rows = res.stdout.splitlines()
    assert header.split() == ["ago", "s", "what", "run", "from", "to", "worker", "stimulus", "note"]
    assert [row.split()[5] for row in rows] == ["asked", "queued", "running", "ready", "delivered"], res.stdout
    assert js.returncode == 0, js.stderr
    story = json.loads(js.stdout)
    moves = [(e["subject"], e["key"], e["from"], e["to"]) for e in story["entries"]]
    assert moves == [
        ("pos", 3, "-", "asked"),
        ("pos", 3, "asked", "queued"),
        ("pos", 3, "queued", "running"),
        ("pos", 3, "running", "ready"),
        ("pos", 3, "ready", "delivered"),
    ]
    asked, queued, running, ready, delivered = story["entries"]
    assert queued["stimulus"].startswith("inputs-read-")  # the reader's hand-over
    assert ready["stimulus"].split("-")[0] in ("results", "completed") and ready["worker"] == running["worker"] != ""
    assert len({asked["run"], ready["run"], delivered["run"]}) == 1 and story["total"] == 5
    assert all(e["time"] <= story["now"] for e in story["entries"])
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "'seq:3' is not POS" in bad.stderr, bad.stderr


def test_progress_line_in_the_server_log(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.02), n=100, extra="progress_interval = 0.5\n")
    slog = str(tmp_path / "server.log")
    with run_server(cfg, workers=1, log_path=slog) as srv, srv.client() as c:
        assert len(collect(c.epoch(1))) == 100
        time.sleep(1.0)  # no epoch runs now: no line
    log_lines = read(slog).splitlines()
    lines = [ln for ln in log_lines if "seqs/s, ETA" in ln]
    assert len(lines) >= 2, read(slog)[-2000:]
    done = next(i for i, ln in enumerate(log_lines) if ") done: 100 seqs" in ln)
    assert all("seqs/s, ETA" not in ln for ln in log_lines[done:])  # nothing while no epoch runs
    assert "epoch 1 (run " in lines[-1] and "/100 seqs, " in lines[-1] and "held back by the workers" in lines[-1]

    quiet = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.02), n=60, extra="progress_interval = 0\n", name="q.py")
    qlog = str(tmp_path / "quiet.log")
    with run_server(quiet, workers=1, log_path=qlog) as srv, srv.client() as c:
        assert len(collect(c.epoch(1))) == 60
    assert "seqs/s, ETA" not in read(qlog)


def open_idle(port: int, n: int, batch: int = 8, timeout: float = 60.0) -> List[socket.socket]:
    """Up to `n` TCP connections to the port that send nothing, opened `batch` at a time, as many
    as connect within `timeout` (a server that stops accepting them leaves the rest unconnected)."""
    socks: List[socket.socket] = []
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        while len(socks) < n and time.monotonic() < deadline:
            for _ in range(min(batch, n - len(socks)) - len(sel.get_map())):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", port))
                sel.register(s, selectors.EVENT_WRITE)
            for key, _ in sel.select(0.5):
                sel.unregister(key.fileobj)
                s = key.fileobj
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    socks.append(s)
                else:
                    s.close()
        for key in list(sel.get_map().values()):
            key.fileobj.close()
    return socks


def wait_closed(socks: List[socket.socket], timeout: float) -> int:
    """Wait until the peer has closed every socket (or `timeout`); how many it closed."""
    closed = 0
    with selectors.DefaultSelector() as sel:
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while sel.get_map() and time.monotonic() < deadline:
            for key, _ in sel.select(0.5):
                try:
                    data = key.fileobj.recv(64)
                except ConnectionError:
                    data = b""
                assert data == b"", data  # an idle connection is closed unanswered
                sel.unregister(key.fileobj)
                closed += 1
    return closed


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    (line,) = [ln for ln in read(f"/proc/{pid}/status").splitlines() if ln.startswith("Threads:")]
    return int(line.split()[1])


def test_idle_metrics_connections_cost_a_bounded_number_of_descriptors_and_are_closed(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=20)
    port = free_port()
    with run_server(cfg, workers=1, extra=["--metrics", f"127.0.0.1:{port}"]) as srv:
        pid = srv.proc.pid
        scrape_until(port, lambda m: value(m, "ppserver_workers", host=socket.gethostname()) == 1, "the worker")
        fds, nthreads = descriptors(pid), threads(pid)
        # the server may have 128 descriptors open (the default limit, 1024, made cheap to reach):
        # more idle connections than that would take every one it has for its clients
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (128, hard))
        n = 300
        idle = open_idle(port, n, timeout=30)
        try:
            with srv.client(timeout=20) as c:  # new connections of a client, and its epoch
                assert c.info()["num_seqs"] == 20
                assert len(collect(c.epoch(1))) == 20
            m = scrape_until(port, lambda m: delivered(m) == 20, "the epoch's count")
            assert len(idle) == n  # every connection was accepted (the oldest ones closed since)
            assert value(m, "process_open_fds") <= fds + MAX_CONNECTIONS + 8 and threads(pid) == nthreads
            # every idle connection is closed by the server: the oldest at once, the last within the timeout
            assert wait_closed(idle, REQUEST_TIMEOUT_S + 10) == n
            assert descriptors(pid) <= fds + 4  # (the client's connection may linger a moment)
        finally:
            for s in idle:
                s.close()


def http(port: int, request: bytes) -> Tuple[str, Dict[str, str], bytes]:
    """One raw HTTP exchange: the status line, the headers (lower-case names), the body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    assert int(headers["content-length"]) == len(body)
    return status, headers, body


def test_metrics_endpoint_answers_as_prometheus_asks(tmp_path):
    import gzip

    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0), n=3)
    port = free_port()
    with run_server(cfg, workers=1, extra=["--metrics", f"127.0.0.1:{port}"]):
        scrape_until(port, lambda m: value(m, "ppserver_workers", host=socket.gethostname()) == 1, "the worker")
        get = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
        status, headers, body = http(port, get + b"\r\n")
        assert status == "HTTP/1.1 200 OK" and headers["content-type"].startswith("text/plain; version=0.0.4")
        assert f'ppserver_workers{{host="{socket.gethostname()}"}} 1.0' in body.decode().splitlines()
        asked = b"Accept: application/openmetrics-text; version=1.0.0\r\nAccept-Encoding: gzip\r\n\r\n"
        status, headers, body = http(port, get + asked)
        assert headers["content-type"].startswith("application/openmetrics-text")
        assert headers["content-encoding"] == "gzip" and gzip.decompress(body).endswith(b"# EOF\n")
        status, headers, body = http(port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
        assert status == "HTTP/1.1 200 OK" and body == b""
        post = b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
        assert http(port, post)[0] == "HTTP/1.1 405 Method Not Allowed"
        assert http(port, b"nonsense\r\n\r\n")[0] == "HTTP/1.1 400 Bad Request"
        huge = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"x" * 10000 + b"\r\n\r\n"
        assert http(port, huge)[0] == "HTTP/1.1 431 Request Header Fields Too Large"
        assert value(scrape(port), "ppserver_workers", host=socket.gethostname()) == 1  # still serving

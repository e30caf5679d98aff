"""End-to-end behaviour of `ppserver serve` with local workers and ppclient, over loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Dict

import pytest
import zmq
from conftest import (
    DATA_PATHS,
    NOISY_MAPPER,
    REPO,
    SLOW_MAPPER,
    STREAM_MAPPER,
    assert_data_path,
    assert_same_epoch,
    children_of,
    collect,
    collect_with,
    error_line,
    numpy_config,
    read,
    reference,
    run_cli,
    run_server,
    wait_for,
    wait_gone,
    write_config,
)

import ppclient
from ppclient import protocol, wire
from ppserver.scheduler import Settings
from ppserver.server.handover import MAX_BATCH

# Merges pairs of seqs and drops every 5th input: changes the number of seqs.
STREAM = STREAM_MAPPER.format(delay=0)


@pytest.mark.processes
def test_epoch_in_order_matches_reference(tmp_path):
    cfg = numpy_config(tmp_path, NOISY_MAPPER, n=60, extra="buf_size = 3\n")
    with run_server(cfg, workers=2) as srv, srv.client() as c:
        info = c.info()
        assert info["protocol"] == ppclient.PROTOCOL
        assert info["num_seqs"] == 60
        assert info["data_keys"]["data"] == {"shape": [None, 8], "dtype": "float32"}
        it = c.epoch(1)
        assert len(it) == 60
        got = collect(it)
        assert info["fingerprint"] and it.state_dict()["fingerprint"] == info["fingerprint"]
    assert [s["seq_idx"] for s in got] == list(range(60))
    assert [s["seq_tag"] for s in got] == [f"seq-{i}" for i in range(60)]
    fracs = [s["complete_frac"] for s in got]
    assert fracs == sorted(fracs) and fracs[-1] == pytest.approx(1.0)
    assert_same_epoch(got, reference(cfg, 1))


@pytest.mark.processes
def test_back_to_back_epochs_and_random_ordering(tmp_path):
    cfg = numpy_config(tmp_path, NOISY_MAPPER, n=30, ordering="random")
    with run_server(cfg, workers=2) as srv, srv.client() as c:
        epochs = {e: collect(c.epoch(e)) for e in (1, 2, 3)}
        again = collect(c.epoch(1))
    for e, got in epochs.items():
        assert_same_epoch(got, reference(cfg, e))
    assert [s["seq_tag"] for s in epochs[1]] != [s["seq_tag"] for s in epochs[2]]
    assert_same_epoch(again, epochs[1])


@pytest.mark.processes
@pytest.mark.parametrize("ordering", ["default", "reverse", "sorted", "sorted_reverse", "random", "laplace:.7"])
def test_every_seq_ordering(tmp_path, ordering):
    cfg = numpy_config(tmp_path, NOISY_MAPPER, n=25, ordering=ordering)
    with run_server(cfg, workers=2) as srv, srv.client() as c:
        got = collect(c.epoch(4))
    want = reference(cfg, 4)
    assert_same_epoch(got, want)
    lens = [s["data"].shape[0] for s in got]
    if ordering == "sorted":
        assert lens == sorted(lens)
    if ordering == "sorted_reverse":
        assert lens == sorted(lens, reverse=True)


@pytest.mark.processes
def test_seq_list_and_seq_order(tmp_path):
    cfg = numpy_config(tmp_path, NOISY_MAPPER, n=20)
    tags = ["seq-7", "seq-3", "seq-19", "seq-0"]
    with run_server(cfg, workers=2) as srv, srv.client() as c:
        by_tag = collect(c.epoch(2, seq_list=tags))
        by_idx = collect(c.epoch(2, seq_order=[5, 1, 1, 12]))
        with pytest.raises(ppclient.Error, match="no-such-tag"):
            c.epoch(2, seq_list=["seq-1", "no-such-tag"])
        assert len(collect(c.epoch(3))) == 20  # the server still serves
    assert [s["seq_tag"] for s in by_tag] == tags
    assert_same_epoch(by_tag, reference(cfg, 2, seq_list=tags))
    assert [s["seq_tag"] for s in by_idx] == ["seq-5", "seq-1", "seq-1", "seq-12"]
    assert_same_epoch(by_idx, reference(cfg, 2, seq_order=[5, 1, 1, 12]))


@pytest.mark.processes
def test_new_epoch_cancels_old_feeder(tmp_path):
    # 200 seqs x 50 ms on 2 workers: finishing the old epoch would take 5 s.
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.05), n=200, extra="buf_size = 8\n")
    with run_server(cfg, workers=2) as srv, srv.client() as c:
        old = c.epoch(1)
        first = [next(old) for _ in range(5)]
        assert [s["seq_idx"] for s in first] == list(range(5))
        start = time.monotonic()
        new = c.epoch(2, seq_order=[3, 2, 1])
        seq = next(new)
        latency = time.monotonic() - start
        rest = collect(new)
        with pytest.raises(ppclient.Error, match="superseded"):
            next(old)
        status = c.status()
    assert [s["seq_tag"] for s in [seq] + rest] == ["seq-3", "seq-2", "seq-1"]
    assert_same_epoch([seq] + rest, reference(cfg, 2, seq_order=[3, 2, 1]))
    # the old epoch's queued work (buf_size 8 per worker, 50 ms each) was dropped, not finished
    assert latency < 1.0, latency
    assert status["epoch"] == 2 and status["state"] == "done"


@pytest.mark.processes
def test_map_seq_stream_matches_reference(tmp_path):
    cfg = numpy_config(tmp_path, STREAM, n=47, extra="stream_partitions = 3\nbuf_size = 2\n")
    with run_server(cfg, workers=2) as srv, srv.client() as c:
        info = c.info()
        assert info["num_seqs"] is None
        it = c.epoch(1)
        assert it.num_seqs is None
        got = collect(it)
        got2 = collect(c.epoch(2))
        with pytest.raises(ppclient.Error, match="seq_list"):
            c.epoch(1, seq_list=["seq-1"])
    want = reference(cfg, 1)
    assert len(want) < 47
    assert_same_epoch(got, want)
    assert_same_epoch(got2, reference(cfg, 2))


@pytest.mark.processes
def test_laplace_ordering_stream_mapper(tmp_path):
    body = """
    from ppserver.mappers.compose import LaplaceOrdering, Sequential
    def _scale(seqs, *, rng, **kwargs):
        for s in seqs:
            s["data"] = s["data"] * rng.uniform(0.9, 1.1)
            yield s
    _scale.preserves_num_seqs = True
    map_seq_stream = Sequential(_scale, LaplaceOrdering(4))
    """
    cfg = numpy_config(tmp_path, body, n=30)
    with run_server(cfg, workers=2) as srv, srv.client() as c:
        assert c.info()["num_seqs"] == 30
        it = c.epoch(1)
        assert len(it) == 30
        got = collect(it)
    assert_same_epoch(got, reference(cfg, 1))
    fracs = [s["complete_frac"] for s in got]
    assert fracs == sorted(fracs)


@pytest.mark.processes
@pytest.mark.parametrize("mode", ["map_seq", "map_seq_stream"])
def test_outputs_identical_for_1_2_3_workers(tmp_path, mode):
    if mode == "map_seq":
        body = "from ppserver.mappers.builtin import spec_augment as map_seq\n"
        extra = "buf_size = 2\n"
    else:
        body = STREAM
        extra = "buf_size = 2\nnum_workers = 2\n"
    cfg = numpy_config(tmp_path, body, n=40, ordering="random", extra=extra)
    runs = []
    for workers in (1, 2, 3):
        with run_server(cfg, workers=workers) as srv, srv.client() as c:
            runs.append(collect(c.epoch(5)))
    assert_same_epoch(runs[1], runs[0])
    assert_same_epoch(runs[2], runs[0])
    assert_same_epoch(runs[0], reference(cfg, 5))


@pytest.mark.processes
def test_mapper_exception_reaches_client_and_server_stays_up(tmp_path):
    body = """
    def map_seq(seq, *, epoch, **kwargs):
        if epoch == 1 and seq["seq_tag"] == "seq-13":
            raise RuntimeError("bad seq on purpose")
        return seq
    """
    cfg = numpy_config(tmp_path, body, n=30)
    with run_server(cfg, workers=2) as srv, srv.client() as c:
        with pytest.raises(ppclient.MapperError) as info:
            collect(c.epoch(1))
        assert info.value.seq_tag == "seq-13"
        assert "bad seq on purpose" in str(info.value)
        assert "RuntimeError" in info.value.remote_traceback
        assert "map_seq" in info.value.remote_traceback
        # uncaught, it prints the mapper's traceback (the config's file and line) as its cause
        printed = "".join(traceback.format_exception(info.value))
        assert f'File "{cfg}", line' in printed and "bad seq on purpose" in printed, printed
        assert len(collect(c.epoch(2))) == 30


@pytest.mark.processes
@pytest.mark.parametrize(
    "ret, match",
    [
        ('{**seq, "data": seq["data"].astype("float64")}', "dtype mismatch for 'data'"),
        ('{**seq, "data": seq["data"][None]}', "ndim mismatch for 'data'"),
        ('{**seq, "data": seq["data"][:, :3]}', "dim 1 mismatch for 'data'"),
        ('{**seq, "classes": [1, 2]}', "'classes'"),
        ('{k: v for k, v in seq.items() if k != "classes"}', "missing key 'classes'"),
    ],
)
def test_output_validation_names_the_key(tmp_path, ret, match):
    cfg = numpy_config(tmp_path, f"def map_seq(seq, **kwargs):\n    return {ret}\n", n=6)
    with run_server(cfg, workers=1) as srv, srv.client() as c:
        with pytest.raises(ppclient.MapperError, match=match.replace("[", r"\[")):
            collect(c.epoch(1))


@pytest.mark.processes
def test_map_outputs_template_and_dropped_meta(tmp_path):
    body = """
    import numpy as np
    def map_seq(seq, **kwargs):
        return {"feat": np.asarray(seq["data"].mean(axis=0), dtype="float32")}
    map_outputs = {"feat": {"shape": (8,), "dtype": "float32"}}
    """
    cfg = numpy_config(tmp_path, body, n=10)
    with run_server(cfg, workers=1) as srv, srv.client() as c:
        assert c.info()["data_keys"] == {"feat": {"shape": [8], "dtype": "float32"}}
        got = collect(c.epoch(1))
    assert [s["seq_tag"] for s in got] == [f"seq-{i}" for i in range(10)]  # meta put back
    assert all(set(s) == {"feat", "seq_tag", "seq_idx", "complete_frac"} for s in got)


@pytest.mark.processes
def test_mapper_must_accept_kwargs(tmp_path):
    cfg = numpy_config(tmp_path, "def map_seq(seq, *, epoch, seq_idx, rng):\n    return seq\n", n=3)
    with run_server(cfg, workers=1) as srv, srv.client() as c:
        with pytest.raises(ppclient.MapperError, match="unexpected keyword"):
            collect(c.epoch(1))


@pytest.mark.processes
@pytest.mark.parametrize("path", ["direct", "via-server"])
def test_killed_worker_is_respawned_and_its_seqs_redone(tmp_path, path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.01), n=150, extra="buf_size = 4\n" + DATA_PATHS[path])
    slog = str(tmp_path / "server.log")
    with run_server(cfg, workers=2, log_path=slog) as srv, srv.client() as c:
        pids = srv.worker_pids()
        got = collect_with(c.epoch(1), {30: lambda: os.kill(pids[0], signal.SIGKILL)})
        status = c.status()
        assert status["local_worker_respawns"] >= 1
        # killed mid-epoch: the server counted it gone with seqs it had yet to send back
        assert status["departures"].get("exited") == 1 and status["handed_back"] >= 1, status
        srv.wait_workers(2)
        assert pids[0] not in srv.worker_pids()
        again = collect(c.epoch(2))
    assert_same_epoch(got, reference(cfg, 1))
    assert_same_epoch(again, reference(cfg, 2))
    assert_data_path(read(slog), path)


SLOW_STREAM_MAPPER = STREAM_MAPPER.format(delay=0.01)


@pytest.mark.processes
def test_killed_worker_in_stream_mode_is_replayed(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_STREAM_MAPPER, n=120, extra="buf_size = 2\nstream_partitions = 2\n")
    with run_server(cfg, workers=2) as srv, srv.client() as c:
        pids = srv.worker_pids()
        got = collect_with(c.epoch(1), {15: lambda: os.kill(pids[1], signal.SIGKILL)})
        status = c.status()
    assert_same_epoch(got, reference(cfg, 1))
    # killed while it held its partition, which another worker played again from its start
    assert status["departures"].get("exited") == 1 and status["handed_back"] >= 1, status
    assert status["local_worker_respawns"] >= 1


@pytest.mark.processes
@pytest.mark.parametrize("path", ["direct", "via-server"])
def test_server_killed_client_raises_unavailable(tmp_path, path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.05), n=200, extra=DATA_PATHS[path])
    slog = str(tmp_path / "server.log")
    with run_server(cfg, workers=2, log_path=slog) as srv:
        kids = children_of(srv.proc.pid)
        with srv.client(timeout=2.0) as c:
            it = c.epoch(1)
            next(it)
            if path == "direct":  # killed once results come straight from the workers
                wait_for(lambda: next(it) and "sending results directly" in read(slog), 10, "direct results")
            srv.proc.kill()
            srv.proc.wait()
            start = time.monotonic()
            with pytest.raises(ppclient.ServerUnavailable):
                collect(it)
            assert time.monotonic() - start < 4.0
            start = time.monotonic()
            with pytest.raises(ppclient.ServerUnavailable):
                c.status()
            assert time.monotonic() - start < 4.0
        # local workers follow their parent instead of lingering
        assert wait_gone(kids, 10.0) == []
    assert_data_path(read(slog), path)


@pytest.mark.processes
def test_sigterm_shuts_down_cleanly_without_children(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.05), n=100)
    for sig in (signal.SIGTERM, signal.SIGINT):
        with run_server(cfg, workers=2) as srv, srv.client() as c:
            it = c.epoch(1)
            next(it)
            kids = children_of(srv.proc.pid)
            assert len(kids) >= 2
            start = time.monotonic()
            srv.proc.send_signal(sig)
            assert srv.proc.wait(timeout=5) == 0
            assert time.monotonic() - start < 5.0
            assert wait_gone(kids, 1.0) == []


@pytest.mark.processes
@pytest.mark.parametrize(
    "body, key",
    [
        ("map_seq = lambda s, **k: s\n", "dataset"),
        ("dataset = {'class': 'DemoDataset'}\n", "map_seq"),
        (
            "dataset = {'class': 'DemoDataset'}\nmap_seq = lambda s, **k: s\nmap_seq_stream = lambda s, **k: s\n",
            "map_seq_stream",
        ),
        ("dataset = {'class': 'DemoDataset'}\nmap_seq = lambda s, **k: s\nbuf_size = 0\n", "buf_size"),
        ("dataset = {'class': 'DemoDataset'}\nmap_seq = lambda s, **k: s\nbuf_sise = 2\n", "buf_sise"),
        ("dataset = {'class': 'no_such_pkg.mod:Thing'}\nmap_seq = lambda s, **k: s\n", "dataset"),
        (
            "dataset = {'class': 'DemoDataset', 'seq_ordering': 'shuffled'}\nmap_seq = lambda s, **k: s\n",
            "seq_ordering",
        ),
        ("dataset = {'class': 'DemoDataset'}\nmap_seq = lambda s, **k: s\nnum_workers = 0\n", "num_workers"),
    ],
)
def test_bad_config_exits_2_with_one_line(tmp_path, body, key):
    cfg = write_config(tmp_path, body)
    assert f"'{key}'" in error_line(run_cli("serve", cfg, "--bind", "tcp://127.0.0.1:0"))


@pytest.mark.processes
def test_protocol_mismatch_is_a_clear_error(tmp_path):
    cfg = numpy_config(tmp_path, NOISY_MAPPER, n=5)
    with run_server(cfg, workers=1) as srv:
        ctx = zmq.Context()
        req = ctx.socket(zmq.REQ)
        req.linger = 0
        req.connect(srv.address)
        req.send(wire.pack({"t": "info", "proto": protocol.PROTOCOL + 1}))
        assert req.poll(10000)
        reply = wire.unpack(req.recv())
        req.close()
        ctx.term()
        assert reply["t"] == "error_reply" and reply["reason"] == "protocol"
        assert "protocol version mismatch" in reply["error"]
        with srv.client() as c:  # still serving
            assert len(collect(c.epoch(1))) == 5


@pytest.mark.processes
def test_status_cli_and_json(tmp_path):
    cfg = numpy_config(tmp_path, NOISY_MAPPER, n=12)
    with run_server(cfg, workers=2) as srv:
        with srv.client() as c:
            collect(c.epoch(3))
            st = c.status()
        res = run_cli("status", srv.address, "--json", timeout=30)
        assert res.returncode == 0, res.stderr
        js = json.loads(res.stdout)
        assert js["epoch"] == 3 and js["seqs_delivered"] == 12 and js["workers_alive"] == 2
        assert set(js) == set(st)
        res = run_cli("status", srv.address, timeout=30)
        assert res.returncode == 0
        assert "epoch       3" in res.stdout and "2 alive" in res.stdout
    res = run_cli("status", srv.address, "--timeout", "1", timeout=30)
    assert res.returncode == 1 and "no answer" in res.stderr


@pytest.mark.processes
def test_demo_runs_two_epochs_and_exits_0(tmp_path):
    log_path = str(tmp_path / "demo.log")
    res = run_cli("demo", "--log", log_path, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "epoch 1: 400 seqs" in res.stdout and "epoch 2: 400 seqs" in res.stdout
    assert "seqs/s" in res.stdout and "MB/s" in res.stdout
    # not a terminal: plain lines of its own, no carriage returns, the logs in the file it was given (kept)
    assert "\r" not in res.stdout and res.stderr == ""
    assert all(line.startswith("demo: ") for line in res.stdout.splitlines()), res.stdout
    assert res.stdout.splitlines()[0] == f"demo: server and worker logs go to {log_path} (kept)"
    assert "serving" in read(log_path) and "registered with" in read(log_path)


@pytest.mark.processes
def test_demo_on_a_terminal_rewrites_its_progress_line_without_log_lines():
    import pty
    import select

    main, sub = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ppserver", "demo"], stdout=sub, stderr=sub, cwd=REPO)
    os.close(sub)
    out = b""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if select.select([main], [], [], 1.0)[0]:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # the demo exited and closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=30) == 0, out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main)
    text = out.decode()
    assert "\rdemo: epoch 1: 20/400 seqs" in text and "epoch 2: 400 seqs in" in text
    assert "INFO" not in text and "WARNING" not in text, text[-2000:]
    log_path = text.split(" go to ")[1].split()[0]
    assert "(removed at the end unless the demo fails)" in text
    assert not os.path.exists(log_path)  # a clean exit leaves no temporary log behind


@pytest.mark.processes
def test_memory_is_bounded_by_credits_not_epoch_size(tmp_path):
    body = """
    dataset = {"class": "DemoDataset", "num_seqs": 3000, "seed": 3, "min_frames": 5, "max_frames": 20}
    def map_seq(seq, **kwargs):
        return seq
    buf_size = 2
    """
    cfg = write_config(tmp_path, body)
    with run_server(cfg, workers=2) as srv, srv.client(window=6) as c:
        it = c.epoch(1)
        next(it)
        time.sleep(1.0)  # a stalled trainer: the server must stop reading, not buffer the epoch
        st = c.status()
        q = st["queues"]
        assert st["seqs_delivered"] <= 6 + 1
        # in flight (2 workers x buf_size 2) + reorder slack + at most one feeder batch
        assert q["fed"] - st["seqs_delivered"] <= 2 * 2 + Settings().read_slack + MAX_BATCH
        assert q["client_credit"] == 0
        assert sum(1 for _ in it) == 2999


ADAPTERS = ("ppclient.torch", "ppclient.returnn")  # they import PyTorch and RETURNN by design
IMPORTED = f"""
import importlib, json, pkgutil, sys
import ppclient
names = sys.argv[1:] or sorted(
    m.name for m in pkgutil.walk_packages(ppclient.__path__, "ppclient.") if m.name not in {set(ADAPTERS)!r}
)
for name in names:
    importlib.import_module(name)
heavy = sorted({{m.split(".")[0] for m in sys.modules}} & {{"ppserver", "torch", "returnn"}})
print(json.dumps({{"modules": names, "file": ppclient.__file__, "heavy": heavy}}))
"""


def imported(*modules: str) -> Dict[str, Any]:
    """In a fresh interpreter: import `modules` (none: every module of ppclient but the adapters);
    which of ppserver, torch and returnn came with them."""
    res = subprocess.run(
        [sys.executable, "-c", IMPORTED, *modules], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.processes
def test_no_module_of_the_client_package_imports_the_server_torch_or_returnn():
    got = imported()
    package = os.path.dirname(got["file"])
    assert package == os.path.join(REPO, "client", "ppclient")
    files = {
        os.path.relpath(os.path.join(folder, name), os.path.dirname(package))[: -len(".py")].replace(os.sep, ".")
        for folder, _, names in os.walk(package)
        if "__pycache__" not in folder
        for name in names
        if name.endswith(".py")
    }
    every = {name[: -len(".__init__")] if name.endswith(".__init__") else name for name in files} - {"ppclient"}
    assert set(got["modules"]) == every - set(ADAPTERS)  # the walk imported every module
    assert got["heavy"] == []


@pytest.mark.processes
def test_a_worker_process_loads_neither_the_scheduler_nor_the_server():
    """The layers at run time (tests/test_layers.py reads the imports): a worker's modules, and the
    hash of the modules that decide a mapped seq it makes at start (scheduler/cut.py among them)."""
    code = (
        "import sys, ppserver.worker.main\n"
        "from ppserver.config import fingerprint\n"
        "fingerprint._semantics()\n"
        "print(sorted(m for m in sys.modules if m.startswith(('ppserver.scheduler', 'ppserver.server'))))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


@pytest.mark.processes
@pytest.mark.parametrize(
    "adapter, heavy",
    [
        pytest.param("ppclient.torch", ["torch"], marks=pytest.mark.torch),
        pytest.param("ppclient.returnn", ["returnn"], marks=pytest.mark.returnn),
    ],
)
def test_the_framework_adapters_import_their_framework_only(adapter, heavy):
    assert imported(adapter)["heavy"] == heavy


@pytest.mark.sockets
def test_client_reports_a_server_with_another_protocol():
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.linger = 0
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    try:
        with ppclient.Client(f"tcp://127.0.0.1:{port}", timeout=10) as c:
            import threading

            def answer():
                if fake.poll(10000):
                    ident, empty, _ = fake.recv_multipart()
                    fake.send_multipart([ident, empty, wire.pack({"t": "info_reply", "proto": protocol.PROTOCOL + 1})])

            t = threading.Thread(target=answer)
            t.start()
            with pytest.raises(ppclient.Error, match="protocol version mismatch"):
                c.info()
            t.join(timeout=10)
    finally:
        fake.close()
        ctx.term()


@pytest.mark.processes
def test_dataset_failure_mid_epoch_is_an_error_not_a_hang(tmp_path):
    body = """
    import numpy as np
    from ppserver.datasets.base import Dataset
    class Flaky(Dataset):
        def _num_corpus_seqs(self):
            return 10
        def _load(self, i):
            if i == 6:
                raise IOError("disk gone")
            return {"data": np.zeros((3, 2), "float32")}
        def _tag(self, i):
            return f"t{i}"
        def _seq_len(self, i):
            return 3
        def _compute_data_keys(self):
            return {"data": {"shape": [None, 2], "dtype": "float32"}}
    """
    data_mod = write_config(tmp_path, body, name="flaky_data.py")
    assert os.path.dirname(data_mod) == str(tmp_path)
    cfg = write_config(  # the module next to the config imports without sys.path changes
        tmp_path,
        """
    dataset = {"class": "flaky_data:Flaky"}
    def map_seq(seq, **kwargs):
        return seq
    """,
    )
    slog = str(tmp_path / "server.log")
    with run_server(cfg, workers=1, log_path=slog) as srv, srv.client(timeout=10) as c:
        with pytest.raises(ppclient.DatasetError, match="disk gone") as info:
            collect(c.epoch(1))
        assert "_load" in info.value.remote_traceback and "OSError: disk gone" in info.value.remote_traceback
        assert c.status()["state"] == "failed"
    assert "disk gone" in read(slog) and "Traceback" in read(slog)


@pytest.mark.processes
@pytest.mark.parametrize(
    "argv, key",
    [
        (["--bind", "tcp://127.0.0.1:99999"], "--bind"),
        (["--bind", "127.0.0.1:5555"], "--bind"),
        (["--workers", "-1"], "--workers"),
    ],
)
def test_bad_command_line_exits_2_with_one_line(tmp_path, argv, key):
    cfg = numpy_config(tmp_path, NOISY_MAPPER, n=3)
    assert f"'{key}'" in error_line(run_cli("serve", cfg, *argv))


@pytest.mark.processes
def test_empty_epoch_ends_cleanly_every_time(tmp_path):
    cfg = numpy_config(tmp_path, NOISY_MAPPER, n=5)
    with run_server(cfg, workers=1) as srv:
        for e in range(20):
            with srv.client(timeout=10) as c:  # a fresh data socket each time
                assert collect(c.epoch(e, seq_order=[])) == []


@pytest.mark.processes
def test_stuck_mapper_is_an_error_within_the_timeout(tmp_path):
    body = """
    import time
    def map_seq(seq, **kwargs):
        if seq["seq_tag"] == "seq-3":
            time.sleep(600)
        return seq
    """
    cfg = numpy_config(tmp_path, body, n=10)
    with run_server(cfg, workers=1) as srv, srv.client(timeout=3) as c:
        start = time.monotonic()
        got = []
        with pytest.raises(ppclient.Error, match="no progress"):
            for seq in c.epoch(1):
                got.append(seq)
        assert time.monotonic() - start < 8
        assert [s["seq_tag"] for s in got] == ["seq-0", "seq-1", "seq-2"]
        for pid in srv.worker_pids():  # stuck for ten minutes: spare the shutdown the wait for it
            os.kill(pid, signal.SIGKILL)


@pytest.mark.processes
def test_stream_partition_survives_repeated_kills(tmp_path):
    cfg = numpy_config(
        tmp_path, SLOW_STREAM_MAPPER, n=150, extra="buf_size = 2\nstream_partitions = 1\nmax_seq_retries = 3\n"
    )
    with run_server(cfg, workers=1) as srv, srv.client() as c:

        def crash():
            victim = srv.worker_pids()[0]
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: srv.worker_pids() not in ([], [victim]), 20, "the respawned worker")

        # more crashes than max_seq_retries, with progress between them
        got = collect_with(c.epoch(1), {n: crash for n in (10, 25, 40, 55)})
        status = c.status()
    assert_same_epoch(got, reference(cfg, 1))
    # each crash took the partition with it, and it was played again
    assert status["departures"].get("exited") == 4 and status["handed_back"] >= 4, status


@pytest.mark.processes
def test_serves_on_a_unix_socket(tmp_path):
    cfg = numpy_config(tmp_path, NOISY_MAPPER, n=12)
    address = f"ipc://{tmp_path}/ppserver.sock"
    with run_server(cfg, workers=2, bind=address) as srv, srv.client() as c:
        assert srv.address == address
        assert_same_epoch(collect(c.epoch(1)), reference(cfg, 1))

"""Remote worker hosts (`ppserver worker`), registration checks, CURVE keys and fuzzing, on loopback."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import msgpack
import pytest
import zmq
from conftest import (
    DATA_PATHS,
    REPO,
    SCALE_MAPPER,
    SLOW_MAPPER,
    assert_data_path,
    assert_same_epoch,
    children_of,
    collect,
    collect_with,
    error_line,
    free_port,
    numpy_config,
    read,
    reference,
    run_cli,
    run_server,
    run_worker_host,
    wait_for,
)

import ppclient
from ppclient import keyfiles, protocol, wire

pytestmark = pytest.mark.processes

FAST_HB = "heartbeat_interval = 0.2\nheartbeat_timeout = 1.5\n"


def test_worker_host_joins_mid_epoch_and_leaves_on_sigterm(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.01), n=240, extra=FAST_HB + "buf_size = 2\n")
    slog, wlog = str(tmp_path / "server.log"), str(tmp_path / "worker.log")
    with run_server(cfg, workers=1, log_path=slog) as srv, srv.client() as c:
        got = []
        with run_worker_host(cfg, srv.address, procs=2, log_path=wlog) as host:
            it = c.epoch(1)
            for seq in it:
                got.append(seq)
                if len(got) == 40:
                    wait_for(lambda: c.status()["workers_alive"] == 3, 20, "the worker host to join")
                if len(got) == 120:
                    st = c.status()
                    remote = [w for w in st["workers"] if not w["local"]]
                    assert len(remote) == 2 and all(w["seqs_done"] > 0 for w in remote), remote
                    start = time.monotonic()
                    host.send_signal(signal.SIGTERM)
                    assert host.wait(timeout=5) == 0
                    assert time.monotonic() - start < 5
                    break
            got.extend(collect(it))
        st = c.status()
        assert st["workers_alive"] == 1
    assert_same_epoch(got, reference(cfg, 1))
    # both of the host's workers left mid-epoch (seq 120 of 240), each counted gone
    departures = st["departures"]
    assert departures.get("departed", 0) + departures.get("lost", 0) == 2, departures
    done = [w for w in read(slog).splitlines() if "joined" in w]
    assert len(done) >= 3


def test_worker_started_before_server_waits_and_joins(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.0), n=30, extra=FAST_HB)
    port = free_port()
    wlog = str(tmp_path / "worker.log")
    address = f"tcp://127.0.0.1:{port}"
    with run_worker_host(cfg, address, procs=2, log_path=wlog):
        wait_for(lambda: "waiting for server" in read(wlog), 20, "the worker to report waiting")
        with run_server(cfg, workers=0, bind=address, wait_workers=False) as srv:
            srv.wait_workers(2, timeout=20)
            with srv.client() as c:
                assert_same_epoch(collect(c.epoch(1)), reference(cfg, 1))


def test_config_fingerprint_mismatch_is_refused(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.0), n=10)
    other = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.0) + "EDITED = 1\n", n=10, name="other.py")
    slog, wlog = str(tmp_path / "server.log"), str(tmp_path / "worker.log")
    with run_server(cfg, workers=1, log_path=slog) as srv:
        with run_worker_host(other, srv.address, procs=1, log_path=wlog) as host:
            assert host.wait(timeout=30) == 2
        assert "config fingerprint mismatch" in read(wlog)
        assert "refused worker" in read(slog) and "config fingerprint mismatch" in read(slog)
        with srv.client() as c:
            assert c.status()["workers_alive"] == 1
            assert len(collect(c.epoch(1))) == 10


ENV_CONFIG = """
import os
seed = int(os.environ["PP_SEED"])
num_workers = int(os.environ.get("PP_WORKERS", "1"))
"""


def test_a_worker_host_whose_environment_gives_another_seed_is_refused(tmp_path, monkeypatch):
    """The same file, evaluated on a host with another seed in its environment, would map every seq
    otherwise: refused. Another number of local workers (a resource, not an output) is welcome."""
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.0), n=12, extra=ENV_CONFIG)
    slog, wlog = str(tmp_path / "server.log"), str(tmp_path / "worker.log")
    with run_server(cfg, workers=0, log_path=slog, env={"PP_SEED": "1"}, wait_workers=False) as srv:
        with run_worker_host(cfg, srv.address, procs=1, log_path=wlog, prefix=["env", "PP_SEED=2"]) as host:
            assert host.wait(timeout=30) == 2
        assert "config fingerprint mismatch" in read(wlog) and "refused worker" in read(slog)
        with run_worker_host(cfg, srv.address, procs=1, prefix=["env", "PP_SEED=1", "PP_WORKERS=3"]) as host:
            srv.wait_workers(1)
            with srv.client() as c:
                got = collect(c.epoch(1))
            assert host.poll() is None
    monkeypatch.setenv("PP_SEED", "1")
    assert_same_epoch(got, reference(cfg, 1))


def test_a_worker_host_runs_the_config_it_loaded_after_the_file_was_edited(tmp_path):
    """A host's worker process that dies is started again with the config the host loaded, not with
    the file edited meanwhile (which the server would refuse)."""
    cfg = numpy_config(tmp_path, SCALE_MAPPER, n=16, extra=FAST_HB)
    want = reference(cfg, 1)
    with run_server(cfg, workers=0, wait_workers=False) as srv:
        with run_worker_host(cfg, srv.address, procs=1) as host:
            srv.wait_workers(1)
            with open(cfg) as f:
                text = f.read()
            with open(cfg, "w") as f:
                f.write(text.replace('seq["data"] * rng.uniform(0.5, 1.5)', 'seq["data"] * 100'))
            (old,) = children_of(host.pid)
            os.kill(old, signal.SIGKILL)
            wait_for(lambda: children_of(host.pid) not in ([], [old]), 20, "the host to start its worker again")
            srv.wait_workers(1)
            with srv.client() as c:
                got = collect(c.epoch(1))
            assert host.poll() is None
    assert_same_epoch(got, want)


def _worker_endpoint(srv) -> str:
    with srv.client() as c:
        return c.status()["worker_address"]


def test_worker_protocol_mismatch_is_refused(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.0), n=5)
    with run_server(cfg, workers=1) as srv:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(_worker_endpoint(srv))
        sock.send(wire.pack({"t": "hello", "proto": protocol.PROTOCOL + 7, "fingerprint": "x", "host": "h", "pid": 1}))
        assert sock.poll(10000)
        reply = wire.unpack(sock.recv())
        sock.close()
        ctx.term()
        assert reply["t"] == "refuse" and "protocol version mismatch" in reply["reason"]


@pytest.mark.parametrize("buf_size, path", [(1, "direct"), (4, "direct"), (4, "via-server")])
def test_poison_seq_fails_epoch_after_max_retries(tmp_path, buf_size, path):
    # with buf_size 4 the seqs finished just before the poison one die unreported with it:
    # they must not be blamed
    body = f"""
    import os
    def map_seq(seq, *, epoch, **kwargs):
        if epoch == 1 and seq["seq_tag"] == "seq-5":
            os.kill(os.getpid(), 9)
        return seq
    max_seq_retries = 3
    buf_size = {buf_size}
    """
    cfg = numpy_config(tmp_path, body, n=20, extra=DATA_PATHS[path])
    slog = str(tmp_path / "server.log")
    with run_server(cfg, workers=2, log_path=slog) as srv, srv.client() as c:
        with pytest.raises(ppclient.MapperError) as info:
            collect(c.epoch(1))
        assert info.value.seq_tag == "seq-5"
        assert "3 workers" in str(info.value)
        assert c.status()["departures"].get("exited") == 3  # each crash counted
        srv.wait_workers(2)
        assert c.status()["local_worker_respawns"] >= 3  # and each dead worker started again
        assert len(collect(c.epoch(2))) == 20
    assert_data_path(read(slog), path)


def test_curve_keys_admit_authorised_peers_only(tmp_path, caplog):
    good, bad = str(tmp_path / "keys"), str(tmp_path / "other")
    for d in (good, bad):
        res = keygen(d)
        assert res.returncode == 0, res.stderr
    # the stranger knows the server's public key, but its own key is not authorised
    shutil.copy(os.path.join(good, "server.key"), os.path.join(bad, "server.key"))
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.0), n=12)
    slog = str(tmp_path / "server.log")
    with run_server(cfg, workers=2, extra=["--keys", good], log_path=slog, wait_workers=False) as srv:
        with ppclient.Client(srv.address, keys=good, timeout=20) as c:
            wait_for(lambda: c.status()["workers_alive"] == 2, 20, "keyed workers")
            assert_same_epoch(collect(c.epoch(1)), reference(cfg, 1))
            # the workers' keys are authorised at the client too: their direct routes are welcomed
            # (12 quick seqs may all have gone through the server before the CURVE handshake ended)
            wait_for(lambda: "sending results directly" in read(slog), 10, "a worker's direct route welcomed")
            # a stranger who knows the client's public key is refused at its result socket
            stranger = keyfiles.client_keys(bad)
            ctx = zmq.Context()
            try:
                sock = ctx.socket(zmq.DEALER)
                sock.linger = 0
                sock.curve_publickey, sock.curve_secretkey = stranger.public, stranger.secret
                sock.curve_serverkey = keyfiles.client_keys(good).public
                sock.connect(c._results.endpoint)
                with caplog.at_level("WARNING", logger="ppclient"):
                    wait_for(lambda: c.refused_workers >= 1, 10, "the client to refuse the stranger")
                assert "is not authorised" in caplog.text
            finally:
                ctx.destroy(linger=0)
        for keys in (bad, None):
            with ppclient.Client(srv.address, keys=keys, timeout=1.5) as c:
                with pytest.raises(ppclient.ServerUnavailable, match="CURVE keys that do not match"):
                    c.info()
        wait_for(lambda: "not authorised" in read(slog), 10, "the refusal in the server log")
        wait_for(lambda: "handshake failed" in read(slog), 10, "the keyless client in the server log")


KEY_FILES = ["server.key", "server.key_secret", "client.key", "client.key_secret", "authorized/client.key"]


def keygen(*argv: str) -> subprocess.CompletedProcess:
    return run_cli("keygen", *argv, timeout=30)


def keygen_error(res: subprocess.CompletedProcess) -> str:
    """The one stderr line of a refused keygen (exit 2, no traceback)."""
    line = error_line(res)
    assert line.startswith("ppserver keygen: error: "), line
    return line


def key_bytes(directory: str) -> dict:
    return {name: open(os.path.join(directory, name), "rb").read() for name in KEY_FILES}


def test_keygen_keeps_existing_keys_unless_forced(tmp_path):
    d = str(tmp_path / "keys")
    assert keygen(d).returncode == 0
    before = key_bytes(d)
    line = keygen_error(keygen(d))
    assert all(name in line for name in KEY_FILES) and "--force" in line, line
    assert key_bytes(d) == before
    assert "--force" in keygen("--help").stdout
    res = keygen(d, "--force")
    assert res.returncode == 0, res.stderr
    after = key_bytes(d)
    assert all(after[name] != before[name] for name in KEY_FILES)
    assert after["authorized/client.key"] == after["client.key"]
    assert keyfiles.client_keys(d).server_public == keyfiles.server_keys(d).public


def test_keygen_names_the_one_key_a_directory_already_holds(tmp_path):
    d = tmp_path / "flat"
    d.mkdir()
    (d / "client.key").write_text("a key of a deployed client\n")
    line = keygen_error(keygen(str(d)))
    assert "client.key" in line and "server.key" not in line, line
    assert sorted(os.listdir(d)) == ["client.key"]


def keygen_with_umask_0(*argv: str) -> subprocess.CompletedProcess:
    """`ppserver keygen ARGV...` in a process whose umask takes no bit away (files are made as
    readable as the code asks for)."""
    return subprocess.run(
        ["sh", "-c", 'umask 000 && exec "$0" -m ppserver keygen "$@"', sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
    )


def test_keygen_makes_secrets_its_owners_only_from_the_first_byte(tmp_path):
    d = str(tmp_path / "keys")
    res = keygen_with_umask_0(d)
    assert res.returncode == 0, res.stderr
    modes = {name: os.stat(os.path.join(d, name)).st_mode & 0o777 for name in ["", "authorized", *KEY_FILES]}
    assert modes == {
        "": 0o700,
        "authorized": 0o700,
        "server.key": 0o644,
        "server.key_secret": 0o600,
        "client.key": 0o644,
        "client.key_secret": 0o600,
        "authorized/client.key": 0o644,
    }
    assert keyfiles.client_keys(d).server_public == keyfiles.server_keys(d).public

    # Another user who opened the old secret (readable then) keeps a descriptor: replaced keys are
    # new files, so it never reads the new secrets.
    before = key_bytes(d)
    held = {}
    for name in ("server.key_secret", "client.key_secret"):
        os.chmod(os.path.join(d, name), 0o644)
        held[name] = os.open(os.path.join(d, name), os.O_RDONLY)
    try:
        res = keygen_with_umask_0(d, "--force")
        assert res.returncode == 0, res.stderr
        after = key_bytes(d)
        for name, fd in held.items():
            assert after[name] != before[name]
            assert os.pread(fd, 4096, 0) == before[name]  # the old file, not the new secret
            assert os.stat(os.path.join(d, name)).st_mode & 0o777 == 0o600
    finally:
        for fd in held.values():
            os.close(fd)


@pytest.mark.parametrize("where", ["under a file", "under /proc", "a file"])
def test_keygen_into_a_directory_that_cannot_be_made_is_one_line_and_exit_2(tmp_path, where):
    a_file = tmp_path / "file"
    a_file.write_text("not a directory\n")
    d = {"under a file": str(a_file / "keys"), "under /proc": "/proc/ppserver-keys", "a file": str(a_file)}[where]
    assert d in keygen_error(keygen(d))
    assert a_file.read_text() == "not a directory\n"


def test_non_loopback_bind_needs_keys_or_insecure(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.0), n=6)
    line = error_line(run_cli("serve", cfg, "--bind", "tcp://0.0.0.0:0"))
    assert "'--bind'" in line and "--insecure" in line
    slog = str(tmp_path / "server.log")
    with run_server(
        cfg, workers=1, bind="tcp://0.0.0.0:0", extra=["--insecure"], log_path=slog, wait_workers=False
    ) as srv:
        port = srv.address.rsplit(":", 1)[1]
        with ppclient.Client(f"tcp://127.0.0.1:{port}") as c:
            wait_for(lambda: c.status()["workers_alive"] == 1, 20, "the local worker")
            assert len(collect(c.epoch(1))) == 6
    assert "--insecure" in read(slog)


# ---- fuzzing ------------------------------------------------------------------------------


def _valid_messages(rng: random.Random):
    """Headers of real protocol messages (and batch messages with one item and its frame)."""
    msgs = [
        protocol.InfoRequest(),
        protocol.StatusRequest(),
        protocol.DiscoverRequest(),
        protocol.EpochRequest(epoch=rng.randrange(5), consumer=os.urandom(4)),
        protocol.Credit(run=rng.randrange(5), total=rng.randrange(50)),
        protocol.Hello(fingerprint="0" * 16, host="fuzz", pid=1),
        protocol.TaskFailed(run=1, pos=0, message="x"),
        protocol.StreamAck(run=1, partition=rng.randrange(4), n=1),
        protocol.StreamDone(run=1, partition=0),
        protocol.Bye(),
        protocol.Heartbeat(),
    ]
    out = [[wire.unpack(protocol.encode(m)[0])] for m in msgs]
    item = {"i": rng.randrange(50), "meta": {"seq_tag": "x"}, "arrays": [["data", "<f4", [2, 8]]]}
    for batch in (protocol.Results(run=rng.randrange(5)), protocol.StreamOutputs(run=1, partition=0)):
        out.append([{**wire.unpack(protocol.encode(batch)[0]), "items": [item]}, bytes(64)])
    return out


_WEIRD = [
    None,
    -1,
    0,
    2**63 - 1,
    -(2**63),
    1.5,
    float("nan"),
    "",
    "x" * 300,
    b"\x00" * 40,
    [],
    {},
    [1, [2]],
    {"a": {"b": None}},
    True,
    [["data", "|O", [1]]],
    [["k", "<f4", [-1]]],
    [["k", "<f4", [10**9, 10**9]]],
]


def _mutate(rng: random.Random, msg):
    header = dict(msg[0])
    bufs = list(msg[1:])
    choice = rng.randrange(6)
    if choice == 0 and header:
        header[rng.choice(list(header))] = rng.choice(_WEIRD)
    elif choice == 1:
        header[rng.choice(["t", "run", "items", "partition", "pos", "proto", "n", "total", "epoch"])] = rng.choice(
            _WEIRD
        )
    elif choice == 2:
        packed = bytearray(msgpack.packb(header, use_bin_type=True))
        for _ in range(rng.randrange(1, 4)):
            packed[rng.randrange(len(packed))] = rng.randrange(256)
        return [bytes(packed)] + bufs
    elif choice == 3:
        packed = msgpack.packb(header, use_bin_type=True)
        return [packed[: rng.randrange(len(packed))]] + bufs
    elif choice == 4:
        bufs = [os.urandom(rng.randrange(0, 200)) for _ in range(rng.randrange(0, 4))]
    else:
        return [os.urandom(rng.randrange(0, 100)) for _ in range(rng.randrange(1, 5))]
    return [msgpack.packb(header, use_bin_type=True)] + bufs


def test_fuzzed_frames_never_break_the_server(tmp_path):
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.0), n=30, extra="max_message_bytes = 65536\n")
    rng = random.Random(1234)
    slog = str(tmp_path / "server.log")
    with run_server(cfg, workers=1, log_path=slog) as srv:
        control = srv.address
        workers = _worker_endpoint(srv)
        ctx = zmq.Context()
        sent = 0
        try:
            for endpoint in (control, workers):
                socks = []
                for k in range(8):
                    s = ctx.socket(zmq.DEALER)
                    s.linger = 0
                    s.sndhwm = 0
                    if k % 2:
                        s.identity = os.urandom(6) + (b"|hb" if k == 3 else b"")
                    s.connect(endpoint)
                    socks.append(s)
                for n in range(6000):
                    valid = rng.choice(_valid_messages(rng))
                    if rng.random() < 0.3:
                        frames = [msgpack.packb(valid[0], use_bin_type=True)] + list(valid[1:])
                    else:
                        frames = _mutate(rng, valid)
                    if endpoint == control and rng.random() < 0.7:
                        frames = [b""] + frames  # REQ-style envelope
                    rng.choice(socks).send_multipart(frames)
                    sent += 1
                    if n % 500 == 0:  # oversized message: the peer is disconnected, the server lives
                        rng.choice(socks).send_multipart([b"", b"\x81\xa1t\xa4info", os.urandom(200_000)])
                        sent += 1
                # raw bytes that are not ZMTP at all
                host, port = endpoint.rsplit(":", 1)[0][6:], int(endpoint.rsplit(":", 1)[1])
                for _ in range(20):
                    with socket.create_connection((host, port), timeout=5) as raw:
                        raw.sendall(os.urandom(rng.randrange(1, 3000)))
                    sent += 1
                time.sleep(0.5)
                for s in socks:
                    s.close(linger=0)
        finally:
            ctx.term()
        assert sent >= 10_000
        assert srv.proc.poll() is None
        with srv.client() as c:
            srv.wait_workers(1)
            assert_same_epoch(collect(c.epoch(1)), reference(cfg, 1))
            assert c.status()["malformed_messages"] > 0
    assert "Traceback" not in read(slog)


def test_curve_keys_in_flat_directories(tmp_path):
    """Per-side key directories without authorized/ (as a Kubernetes Secret mounts them)."""
    made = str(tmp_path / "made")
    assert keygen(made).returncode == 0
    server_dir, worker_dir = tmp_path / "server-keys", tmp_path / "worker-keys"
    server_dir.mkdir()
    worker_dir.mkdir()
    for name in ("server.key", "server.key_secret", "client.key"):
        shutil.copy(os.path.join(made, name), server_dir / name)
    for name in ("client.key", "client.key_secret", "server.key"):
        shutil.copy(os.path.join(made, name), worker_dir / name)
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.0), n=8)
    with run_server(cfg, workers=0, extra=["--keys", str(server_dir)], wait_workers=False) as srv:
        with run_worker_host(cfg, srv.address, procs=1, extra=["--keys", str(worker_dir)]):
            with ppclient.Client(srv.address, keys=str(worker_dir), timeout=20) as c:
                wait_for(lambda: c.status()["workers_alive"] == 1, 20, "the keyed remote worker")
                assert_same_epoch(collect(c.epoch(1)), reference(cfg, 1))


class _Forwarder:
    """A TCP forwarder on loopback whose live connections can be reset (RST both ways)."""

    def __init__(self, port: int):
        import threading

        self.target = ("127.0.0.1", port)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.pairs = []
        self.closed = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        import threading

        while not self.closed:
            try:
                a, _ = self.listener.accept()
            except OSError:
                continue
            b = socket.create_connection(self.target, timeout=5)
            for s in (a, b):
                s.settimeout(None)
            self.pairs.append((a, b))
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass

    def reset_all(self) -> int:
        import struct

        pairs, self.pairs = self.pairs, []
        for a, b in pairs:
            for s in (a, b):
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    s.close()
                except OSError:
                    pass
        return len(pairs)

    def close(self):
        self.closed = True
        self.reset_all()
        self.listener.close()
        self.thread.join(timeout=5)


@pytest.mark.parametrize("path", ["direct", "via-server"])
def test_reset_worker_connection_loses_nothing(tmp_path, path):
    """A reset shorter than the heartbeat timeout drops queued messages; the worker registers afresh
    and its seqs are redone at once."""
    cfg = numpy_config(tmp_path, SLOW_MAPPER.format(delay=0.01), n=200, extra="buf_size = 4\n" + DATA_PATHS[path])
    slog = str(tmp_path / "server.log")
    with run_server(cfg, workers=0, log_path=slog, wait_workers=False) as srv:
        port = int(_worker_endpoint(srv).rsplit(":", 1)[1])
        fwd = _Forwarder(port)
        argv = [
            sys.executable,
            "-m",
            "ppserver.worker",
            cfg,
            "--connect",
            srv.address,
            "--worker-endpoint",
            f"tcp://127.0.0.1:{fwd.port}",
        ]
        worker = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(str(tmp_path / "w.log"), "w"))
        try:
            srv.wait_workers(1)
            resets = []
            with srv.client(timeout=20) as c:
                reset = lambda: resets.append(fwd.reset_all())
                got = collect_with(c.epoch(1), {50: reset, 120: reset})
                st = c.status()
            assert_same_epoch(got, reference(cfg, 1))
            assert len(resets) == 2 and all(resets), resets  # each reset cut live connections mid-epoch
            # the worker registered afresh, and what it held was made again
            assert st["departures"].get("reconnected", 0) >= 1 and st["handed_back"] >= 1, st
            assert "reconnected" in read(slog)
            assert_data_path(read(str(tmp_path / "w.log")), path)
        finally:
            from ppserver.worker.pool import stop_process

            stop_process(worker, timeout=10)
            fwd.close()

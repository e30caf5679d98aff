"""Servers started for a training and stopped with it: a RETURNN config whose PostprocessingDataset
dicts only changed their class (train and dev), the same file served by a daemon and its worker
hosts, a trainer killed with -9, start-up failures, and a PyTorch DDP job on one node."""

from __future__ import annotations

import ctypes
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest
from conftest import (
    REPO,
    RETURNN_L2_STEP,
    RETURNN_TRAINING,
    SCALE_MAPPER,
    children_of,
    collect,
    free_port,
    have_modules,
    held_by_others,
    numpy_config,
    read,
    reference_batches,
    returnn_batches,
    run_cli,
    run_group,
    run_returnn,
    run_server,
    run_worker_host,
    shard,
    wait_for,
    wait_gone,
    write_config,
)

from ppclient import Error, UsageError

pytestmark = [
    pytest.mark.processes,
    pytest.mark.returnn,
    pytest.mark.torch,
    pytest.mark.usefixtures("in_temporary_cwd"),
]

# A RETURNN training (PyTorch backend, 2 epochs) whose step writes, per batch: the dataset's
# name, the epoch, the sum of |data| and the seq tags. {train} and {dev}: the dataset dicts.
TRAIN_CONFIG = (
    '''
#!returnn.py
import sys
sys.path.insert(0, {root!r})
import numpy as np
import torch
import returnn.frontend as rf
from returnn.tensor import Dim, batch_dim
from ppclient.returnn import ServerDataset
from test_hdf import write_dense

log_verbosity = 4
batch_size = 100
extern_data = {{"data": {{"dims": [batch_dim, Dim(None, name="time"), Dim(8, name="in")], "dtype": "float32"}}}}


def scale(tdict, *, epoch, seq_idx, rng, **kwargs):
    """Defined here, in the RETURNN config: the server and its workers load this file too. rng-free."""
    t = tdict.data["data"]
    t.raw_tensor = t.raw_tensor * np.float32(2) + np.float32(epoch) + np.float32(SLEEP * 0)
    if SLEEP:
        import time
        time.sleep(SLEEP)
    return tdict


SLEEP = {sleep!r}
train = {train}
dev = {dev}

'''
    + RETURNN_TRAINING
    + RETURNN_L2_STEP
)


@pytest.fixture(scope="module")
def hdf_files(tmp_path_factory) -> Dict[str, str]:
    from test_hdf import write_dense

    root = tmp_path_factory.mktemp("hdf")
    return {name: write_dense(root / f"{name}.hdf", n, seed, name) for name, n, seed in (("a", 23, 1), ("b", 11, 2))}


def spec(files: List[str], **kw) -> dict:
    return {"class": "HDFDataset", "files": files, **kw}


def dataset_dict(cls: str, inner: dict, **kw) -> str:
    """A PostprocessingDataset dict of class `cls` (its expression), with scale as its map_seq."""
    extra = "".join(f", {k!r}: {v!r}" for k, v in kw.items())
    return f"{{'class': {cls}, 'dataset': {inner!r}, 'map_seq': scale, 'num_workers': 2{extra}}}"


class Training:
    """`python -m returnn` on a config made from TRAIN_CONFIG, in its own folder and temp folder."""

    def __init__(
        self, tmp_path, name: str, train: str, dev: str = "None", sleep: float = 0.0, tmp: Optional[str] = None
    ):
        self.dir = tmp_path / name
        self.dir.mkdir()
        # TMPDIR: the local servers' folders and logs are found there (a short one: Unix sockets)
        self.tmp = tmp or str(self.dir / "tmp")
        os.makedirs(self.tmp, exist_ok=True)
        self.tags = str(self.dir / "tags.txt")
        self.config = self.dir / "train.config"
        self.config.write_text(
            TRAIN_CONFIG.lstrip().format(
                root=os.path.join(REPO, "tests"),
                model=str(self.dir / "model"),
                log=str(self.dir / "returnn.log"),
                train=train,
                dev=dev,
                tags=self.tags,
                sleep=sleep,
            )
        )
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> subprocess.Popen:
        env = dict(os.environ, TMPDIR=self.tmp)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "returnn", str(self.config)],
            cwd=str(self.dir),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        return self.proc

    def run(self, timeout: float = 240) -> str:
        return run_returnn(str(self.config), str(self.dir), timeout=timeout, env=dict(os.environ, TMPDIR=self.tmp))

    def batches(self) -> Dict[str, Dict[int, list]]:
        """{"train"|"dev": {epoch: [(sum of |data|, [tags]) per batch]}}: dev's seqs are those of b.hdf."""
        out: Dict[str, Dict[int, list]] = {"train": {1: [], 2: []}, "dev": {1: [], 2: []}}
        for epoch, total, tags in returnn_batches(self.tags):
            out["dev" if tags[0].startswith("b-") else "train"][epoch].append((total, tags))
        return out

    @property
    def base(self) -> str:
        return os.path.join(self.tmp, f"ppserver-{os.getuid()}")

    def servers(self) -> List[dict]:
        """The states of the local servers serving now (server.json of each group)."""
        found = []
        for path in glob.glob(os.path.join(self.base, "*", "server.json")):
            try:
                with open(path) as f:
                    found.append(json.load(f))
            except (OSError, ValueError):
                pass
        return found

    def logs(self) -> List[str]:
        return sorted(glob.glob(os.path.join(self.base, "logs", "*.log")))


@pytest.fixture
def short_tmp() -> Iterator[str]:
    """A temp folder short enough for the local servers' Unix sockets (pytest's are long: they bind
    loopback TCP ports then)."""
    path = tempfile.mkdtemp(prefix="pp", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def assert_same_batches(got: Dict[int, list], want: Dict[int, list]) -> None:
    for epoch in (1, 2):
        assert [tags for _, tags in got[epoch]] == [tags for _, tags in want[epoch]], epoch
        assert [t for t, _ in got[epoch]] == pytest.approx([t for t, _ in want[epoch]], rel=1e-6), epoch


def test_returnn_trains_with_only_the_class_changed_a_dev_set_with_a_server_of_its_own(hdf_files, tmp_path, short_tmp):
    """train and dev both PostprocessingDataset dicts (a mapper defined in the config, 2 workers)
    with only their class changed: RETURNN trains 2 epochs on the same batches of the same seqs as
    RETURNN's own, from two local servers, one per dataset, gone with the trainer."""
    train_inner = spec([hdf_files["a"]], seq_ordering="laplace:.5", partition_epoch=2)
    dev_inner = spec([hdf_files["b"]])
    served = Training(
        tmp_path,
        "served",
        dataset_dict("ServerDataset", train_inner),
        dataset_dict("ServerDataset", dev_inner),
        tmp=short_tmp,
    )
    out = served.run()
    # RETURNN gives a dev set seq_ordering "sorted" by default, which PostprocessingDataset refuses
    own = Training(
        tmp_path,
        "own",
        dataset_dict("'PostprocessingDataset'", train_inner),
        dataset_dict("'PostprocessingDataset'", dev_inner, seq_ordering="default"),
        tmp=short_tmp,  # RETURNN's multiprocessing manager binds a Unix socket there too
    )
    own.run()
    got, want = served.batches(), own.batches()
    assert_same_batches(got["train"], want["train"])
    assert_same_batches(got["dev"], want["dev"])
    assert sum(len(tags) for _, tags in got["train"][1]) == 12  # partition_epoch 2 of a.hdf's 23 seqs
    assert [tags for _, tags in got["train"][1]] != [tags for _, tags in got["train"][2]]
    assert sum(len(tags) for _, tags in got["dev"][1]) == 11
    # start-up is logged with its time, once per dataset; nothing is left once the trainer has exited
    pids = []
    for name in ("train", "dev"):
        started = [
            line for line in out.splitlines() if f"local ppserver for dataset {name!r}" in line and " ready " in line
        ]
        assert len(started) == 1 and " s (pid " in started[0], out[-3000:]
        pids.append(int(started[0].split("(pid ")[1].split(",")[0]))
    assert len(served.logs()) == 2 and served.servers() == [] and os.listdir(served.base) == ["logs"]
    assert not wait_gone(pids, 0)
    for log in served.logs():
        text = read(log)
        assert "2 local workers" in text and "no process registered" in text, text[-3000:]


@contextmanager
def adopting_orphans() -> Iterator[List[int]]:
    """This process as a subreaper: the processes orphaned meanwhile (those of a killed trainer) become
    its children. At the end it ends and reaps those whose pids the test put in the list it gets:
    multiprocessing's resource tracker last and by itself, as it unlinks the semaphores the others
    leaked (RETURNN's DataLoader worker outlives its killed trainer)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    adopted: List[int] = []
    try:
        yield adopted
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0)
        trackers = [pid for pid in adopted if "resource_tracker" in cmdline(pid)]
        for group in ([pid for pid in adopted if pid not in trackers], trackers):
            for pid in wait_gone(group, 0 if group is not trackers else 10.0):
                os.kill(pid, signal.SIGKILL)
            for pid in group:
                with suppress(ChildProcessError):
                    os.waitpid(pid, 0)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


PR_SET_CHILD_SUBREAPER = 36


def test_killed_trainer_leaves_no_server_socket_or_segment(hdf_files, tmp_path, short_tmp):
    """kill -9 of `python -m returnn` mid-epoch: its two local servers (train and dev), their workers,
    sockets and shared memory are gone within a few seconds."""
    before = set(os.listdir("/dev/shm"))
    training = Training(
        tmp_path,
        "killed",
        dataset_dict("ServerDataset", spec([hdf_files["a"]], seq_ordering="random")),
        dataset_dict("ServerDataset", spec([hdf_files["b"]])),
        sleep=0.2,
        tmp=short_tmp,
    )
    with adopting_orphans() as adopted:
        proc = training.start()
        try:
            wait_for(lambda: len([s for s in training.servers() if s["state"] == "ready"]) == 2, 120, "two servers")
            wait_for(lambda: os.path.exists(training.tags), 120, "a first training step")
            states = training.servers()
            servers = [s["pid"] for s in states]
            workers = [kid for pid in servers for kid in children_of(pid)]
            assert len(workers) == 4  # two each
            sockets = [s["address"][len("ipc://") :] for s in states]
            assert all(os.path.exists(path) for path in sockets)
            # the servers, and RETURNN's DataLoader worker and resource tracker
            adopted += [pid for pid in children_of(proc.pid) if pid not in workers]
            start = time.monotonic()
            proc.kill()
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            assert proc.stdout is not None
            proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL  # the kill landed while the training ran
        left = wait_gone(servers + workers, 10.0)
        took = time.monotonic() - start
        assert set(servers) <= set(adopted)
    assert not left, f"still running {took:.1f} s after the kill: {left}"
    assert not any(os.path.exists(path) for path in sockets)
    assert os.listdir(training.base) == ["logs"], os.listdir(training.base)  # the servers' folders went too
    # ppserver's segments are memfds: a check that they never show. Files that other processes
    # hold are theirs, and so are Python's multiprocessing semaphores (sem.mp-*: RETURNN's and
    # PyTorch's, which the killed trainer's resource tracker removes; ppserver does not use them).
    new = [name for name in set(os.listdir("/dev/shm")) - before if not name.startswith("sem.mp-")]
    paths = [os.path.join("/dev/shm", name) for name in new]
    assert not [path for path in paths if os.path.exists(path) and not held_by_others(path)]
    for log in training.logs():
        text = read(log)
        assert "no process registered" in text and "shutting down" in text, text[-2000:]


def test_failed_start_is_one_line_in_the_trainer_naming_the_key_and_the_log(tmp_path):
    """A config the server refuses: the trainer's error says why in one line, with the server's log."""
    cfg = write_config(
        tmp_path,
        """
        dataset = {"class": "DemoDataset", "num_seqs": 5}
        map_seq = 42
        """,
    )
    from ppclient.local_server import local_address

    with pytest.raises(Error) as info:
        local_address(cfg, job="x", shared=False)
    message = str(info.value)
    assert "\n" not in message and "failed to start (exit code 2)" in message and "'map_seq'" in message, message
    log_path = message.rsplit("its log: ", 1)[1].rstrip(")")
    assert "must be callable" in read(log_path)
    with pytest.raises(UsageError, match="cannot be read"):
        local_address(str(tmp_path / "missing.py"), job="x", shared=False)


def scale(tdict, *, epoch, **kwargs):
    """TRAIN_CONFIG's scale (SLEEP 0), for RETURNN's own PostprocessingDataset in this process."""
    import numpy as np

    t = tdict.data["data"]
    t.raw_tensor = t.raw_tensor * np.float32(2) + np.float32(epoch)
    return tdict


def test_daemon_serves_the_returnn_config_with_remote_workers(hdf_files, tmp_path):
    """`ppserver serve --returnn-config` and `ppserver worker --returnn-config` on the trainer's file
    (train: ServerDataset with an address): the seqs PostprocessingDataset gives. A worker host for
    the file's other dataset is refused (the fingerprint covers the dataset's name)."""
    from returnn.datasets.basic import init_dataset
    from test_returnn import assert_like_returnn

    def pp_epoch(epoch: int) -> list:
        pp = init_dataset({"class": "PostprocessingDataset", "dataset": inner, "map_seq": scale})
        try:
            pp.init_seq_order(epoch=epoch)
            out, i = [], 0
            while pp.is_less_than_num_seqs(i):
                pp.load_seqs(i, i + 1)
                out.append((pp.get_tag(i), {k: pp.get_data(i, k) for k in pp.get_data_keys()}, pp.get_complete_frac(i)))
                i += 1
            return out
        finally:
            pp.finish_epoch(free_resources=True)

    inner = spec([hdf_files["a"]], seq_ordering="laplace:.5")
    port = free_port()
    training = Training(
        tmp_path,
        "daemon",
        dataset_dict("ServerDataset", inner, address=f"tcp://127.0.0.1:{port}"),
        dataset_dict("'PostprocessingDataset'", spec([hdf_files["b"]])),
    )
    source = f"--returnn-config={training.config}"
    with run_server(
        source, workers=0, bind=f"tcp://127.0.0.1:{port}", extra=["--dataset", "train"], wait_workers=False
    ) as srv:
        with run_worker_host(source, srv.address, procs=2, extra=["--dataset", "train"]):
            srv.wait_workers(2)
            with srv.client() as c:
                got = {epoch: collect(c.epoch(epoch)) for epoch in (1, 2)}
        with run_worker_host(source, srv.address, procs=1, extra=["--dataset", "dev"]) as other:
            assert other.wait(timeout=60) == 2
    for epoch, seqs in got.items():
        assert_like_returnn(seqs, pp_epoch(epoch))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dataset", "eval"], "option '--dataset': the RETURNN config has no dataset dict 'eval'"),
        (["--dataset", "dev"], "'dev' has class 'HDFDataset'"),
        (["--dataset", "train", "CONFIG"], "give either CONFIG or --returnn-config, not both"),
    ],
)
def test_bad_returnn_dataset_is_one_line_and_exit_2(hdf_files, tmp_path, args, message):
    training = Training(
        tmp_path, "bad", dataset_dict("ServerDataset", spec([hdf_files["a"]])), repr(spec([hdf_files["b"]]))
    )
    argv = ["serve", "--returnn-config", str(training.config)]
    argv += [str(training.config) if a == "CONFIG" else a for a in args]
    res = run_cli(*argv, timeout=120, cwd=str(training.dir))
    lines = [line for line in res.stderr.splitlines() if "error:" in line]
    assert res.returncode == 2 and len(lines) == 1 and message in lines[0], res.stderr[-2000:]


@pytest.mark.skipif(not have_modules("torchdata"), reason="needs torchdata")
def test_ddp_ranks_on_one_node_share_one_local_server(tmp_path, short_tmp):
    """torchrun with two gloo ranks, each making ServerDataset(config=...) (and a DataLoader worker
    each): one server starts, both ranks read their shards of one epoch from it, and it is gone
    when torchrun returns."""
    cfg = numpy_config(tmp_path, SCALE_MAPPER, n=41, ordering="random", extra="num_workers = 2\nbuf_size = 2\n")
    want = reference_batches(cfg, 1, {"max_frames": 80, "max_seqs": 2})  # as ddp_local.py batches
    tmp = Path(short_tmp)  # PyTorch passes tensors' fds between processes over Unix sockets there
    out = str(tmp_path / "seen")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv += [os.path.join(REPO, "tests", "ddp_local.py"), cfg, out]
    res = run_group(argv, timeout=240, text=True, cwd=str(tmp_path), env=dict(os.environ, TMPDIR=str(tmp)))
    assert res.returncode == 0, res.stderr[-4000:]
    ranks = []
    for rank in range(2):
        with open(f"{out}.rank{rank}.json") as f:
            ranks.append(json.load(f))
    assert ranks[0]["address"] == ranks[1]["address"]
    logs = glob.glob(str(tmp / f"ppserver-{os.getuid()}" / "logs" / "*.log"))
    assert len(logs) == 1, logs  # one server for the job
    started = [line for line in res.stderr.splitlines() if "local ppserver for" in line and " ready " in line]
    used = [line for line in res.stderr.splitlines() if "using the local ppserver for" in line]
    assert len(started) == 1 and len(used) == 1, res.stderr[-3000:]
    for rank, seen in enumerate(ranks):
        assert seen["steps"] == [b["seq_tag"] for b in shard(want, rank, 2)], rank  # batch j is rank j % 2's
    assert len(ranks[0]["steps"]) == len(ranks[1]["steps"])
    server = int(read(logs[0]).split("ppserver[", 1)[1].split("]", 1)[0])
    assert not wait_gone([server], 0), "the server outlived its training"
    assert os.listdir(tmp / f"ppserver-{os.getuid()}") == ["logs"]


TORCH_ALONE = """
import sys
from ppclient.torch import ServerDataset

ds = ServerDataset(config=sys.argv[1], job="alone")
assert "ppserver" not in sys.modules, "ppclient imported ppserver"
seqs = list(ds)
print(len(seqs), ds.address, flush=True)
if sys.argv[2] == "raise":
    raise RuntimeError("the training failed")
"""


@pytest.mark.parametrize("end", ["exit", "raise"])
def test_torch_dataset_with_a_config_reads_from_a_local_server_without_importing_ppserver(tmp_path, end):
    """The server is gone when the trainer has ended, normally or with an exception."""
    cfg = numpy_config(tmp_path, "map_seq = lambda seq, **kwargs: seq\n", n=9)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    res = run_group(
        [sys.executable, "-c", TORCH_ALONE, cfg, end],
        text=True,
        timeout=120,
        cwd=str(tmp_path),
        env=dict(os.environ, TMPDIR=str(tmp)),
    )
    assert res.returncode == (0 if end == "exit" else 1), res.stderr[-3000:]
    assert res.stdout.split()[0] == "9"
    base = tmp / f"ppserver-{os.getuid()}"
    assert os.listdir(base) == ["logs"]  # its folder went with it
    (log,) = glob.glob(str(base / "logs" / "*.log"))
    server = int(read(log).split("ppserver[", 1)[1].split("]", 1)[0])
    assert not wait_gone([server], 0)


def test_returnn_dataset_without_address_needs_its_keys_and_a_config_file():
    from ppclient.returnn import ServerDataset

    with pytest.raises(UsageError, match="give 'address'"):
        ServerDataset(name="train")
    with pytest.raises(UsageError, match="no RETURNN config"):
        ServerDataset(name="train", dataset={"class": "HDFDataset", "files": []}, map_seq=scale)


FINGERPRINT = "import sys\nfrom ppserver.config.settings import load\nprint(load(sys.argv[1], sys.argv[2]).fingerprint)"

RETURNN_CONFIG_WITH_MODULE = """
import sys, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mymappers
train = {"class": "PostprocessingDataset", "dataset": {"class": "HDFDataset", "files": []},
         "map_seq": mymappers.identity}
dev = {"class": "PostprocessingDataset", "dataset": {"class": "HDFDataset", "files": []},
       "map_seq": mymappers.identity}


def get_model(**kwargs):  # functions of the config itself: RETURNN's module of the config, the file
    return None
"""


def test_fingerprint_covers_the_returnn_config_its_local_modules_and_the_dataset(tmp_path):
    def fingerprint(name: str = "train") -> str:
        res = subprocess.run(
            [sys.executable, "-c", FINGERPRINT, str(config), name], capture_output=True, text=True, timeout=120
        )
        assert res.returncode == 0, res.stderr[-2000:]
        return res.stdout.strip()

    (tmp_path / "mymappers.py").write_text("def identity(tdict, **kwargs):\n    return tdict\n")
    config = tmp_path / "train.config"
    config.write_text("#!returnn.py\n" + RETURNN_CONFIG_WITH_MODULE)
    first = fingerprint()
    assert fingerprint() == first != fingerprint("dev")
    # the mapper's source is the same: the module's bytes count
    (tmp_path / "mymappers.py").write_text("def identity(tdict, **kwargs):\n    return tdict\n\nSCALE = 2\n")
    second = fingerprint()
    assert second != first
    config.write_text("#!returnn.py\n" + RETURNN_CONFIG_WITH_MODULE + "\nnum_epochs = 3\n")
    assert fingerprint() != second


STARTER = """
import sys
from ppclient import Error
from ppclient.local_server import local_address

try:
    print("ADDRESS", local_address(sys.argv[1], job="j", shared=sys.argv[2] == "shared"), flush=True)
except Error as exc:
    print("ERROR", exc, flush=True)
"""

# Two ranks of one launcher (as torchrun's), starting at once: one starts the server, one joins it.
LAUNCHER = """
import os, subprocess, sys
env = dict(os.environ, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
ranks = [
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], "shared"], env=dict(env, RANK=str(r)),
                     stdout=subprocess.PIPE, text=True)
    for r in range(2)
]
for rank in ranks:
    print(rank.communicate(timeout=90)[0], end="", flush=True)
"""


def test_ddp_ranks_of_a_failed_start_get_its_error_and_leave_no_folder(tmp_path, short_tmp):
    """A config the server refuses, two ranks: each gets the same one line with the server's error
    (the rank that joined waits for the starter's word, not only for the pid to go), and the
    group's folder (server.json, users, lock, sockets) is gone once both have left."""
    cfg = write_config(tmp_path, 'dataset = {"class": "DemoDataset", "num_seqs": 5}\nmap_seq = 42\n')
    env = dict(os.environ, TMPDIR=short_tmp)
    res = run_group([sys.executable, "-c", LAUNCHER, STARTER, cfg], timeout=120, text=True, cwd=str(tmp_path), env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    errors = [line for line in res.stdout.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 2 and errors[0] == errors[1], res.stdout
    assert "failed to start (exit code 2)" in errors[0] and "'map_seq'" in errors[0], errors[0]
    assert os.listdir(os.path.join(short_tmp, f"ppserver-{os.getuid()}")) == ["logs"]


def test_trainer_killed_during_its_servers_start_leaves_no_folder(tmp_path, short_tmp):
    """kill -9 of the trainer while its server still loads the config (2 s): the server, whose owner
    watch then finds no process, stops before serving and removes the group's folder."""
    cfg = write_config(
        tmp_path,
        """
        import time
        time.sleep(2)
        dataset = {"class": "DemoDataset", "num_seqs": 5}
        map_seq = lambda seq, **kwargs: seq
        """,
    )
    base = os.path.join(short_tmp, f"ppserver-{os.getuid()}")
    env = dict(os.environ, TMPDIR=short_tmp)
    with adopting_orphans() as adopted:
        proc = subprocess.Popen(
            [sys.executable, "-c", STARTER, cfg, "alone"], cwd=str(tmp_path), env=env, stdout=subprocess.DEVNULL
        )
        try:
            states = lambda: glob.glob(os.path.join(base, "*", "server.json"))
            wait_for(lambda: bool(states()), 30, "the server's start")
            with open(states()[0]) as f:
                server = json.load(f)["pid"]
            proc.kill()
        finally:
            proc.wait(timeout=10)
        adopted.append(server)
        assert not wait_gone([server], 20.0), "the server outlived its trainer"
    (log,) = glob.glob(os.path.join(base, "logs", "*.log"))
    assert os.listdir(base) == ["logs"], (os.listdir(base), read(log))
    assert "no process registered" in read(log) and "before serving" in read(log), read(log)[-2000:]


READER = """
import sys
from ppclient import Client
from ppclient.local_server import local_address

address = local_address(sys.argv[1], job="long", shared=False)
with Client(address) as client:
    print(address, len(list(client.epoch(1))), flush=True)
"""


def test_a_long_temp_folder_serves_over_loopback_tcp(tmp_path, short_tmp):
    """$TMPDIR too long for Unix sockets (90 characters): the local server and the socket of its
    local workers bind loopback TCP, an epoch is read, and the server's folder goes with the reader."""
    tmp = os.path.join(short_tmp, "t" * (90 - len(short_tmp) - 1))
    os.makedirs(tmp)
    assert len(tmp) == 90
    cfg = numpy_config(tmp_path, "map_seq = lambda seq, **kwargs: seq\n", n=7, extra="num_workers = 2\n")
    env = dict(os.environ, TMPDIR=tmp)
    res = run_group([sys.executable, "-c", READER, cfg], text=True, timeout=60, cwd=str(tmp_path), env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    address, count = res.stdout.split()
    assert address.startswith("tcp://127.0.0.1:") and count == "7", res.stdout
    base = os.path.join(tmp, f"ppserver-{os.getuid()}")
    assert os.listdir(base) == ["logs"]
    (log,) = glob.glob(os.path.join(base, "logs", "*.log"))
    assert "2 local workers" in read(log) and "(workers connect to tcp://127.0.0.1:" in read(log), read(log)[-2000:]
    assert [name for name in os.listdir(tmp) if name != f"ppserver-{os.getuid()}"] == []

"""ppclient.returnn against real servers: RETURNN's dataset API, its torch pipeline, shards, a training run."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import pytest
from conftest import (
    REPO,
    RETURNN_TRAINING,
    assert_same_epoch,
    children_of,
    free_port,
    in_threads,
    read,
    reference,
    restartable,
    run_group,
    run_returnn,
    run_server,
    wait_gone,
    write_config,
)
from returnn.datasets.basic import init_dataset
from returnn.util.basic import OptionalNotImplementedError

import ppclient
from ppclient.returnn import ServerDataset

pytestmark = [pytest.mark.processes, pytest.mark.returnn, pytest.mark.usefixtures("in_temporary_cwd")]

# Frame-wise classes with a sparse_dim declared in map_outputs; epoch 9 fails at its 4th seq, epoch 7
# skips its 6th and its last.
CONFIG = """
import numpy as np
_r = np.random.RandomState(3)
_LENS = [int(x) for x in _r.randint(5, 30, size=23)]
SEQS = [{"data": _r.randn(n, 8).astype("float32"), "classes": _r.randint(0, 10, size=n).astype("int32")} for n in _LENS]
dataset = {"class": "NumpyDataset", "seqs": SEQS, "seq_ordering": "random"}
map_outputs = {
    "data": {"shape": (None, 8), "dtype": "float32"},
    "classes": {"shape": (None,), "dtype": "int32", "sparse_dim": 10},
}
buf_size = 2
max_skipped = 0.1

def map_seq(seq, *, epoch, seq_idx, rng, **kwargs):
    if epoch == 9 and seq_idx == 3:
        raise ValueError("no good seq")
    if epoch == 7 and seq_idx in (5, 22):
        return None
    seq["data"] = seq["data"] * rng.uniform(0.5, 1.5)
    return seq
"""

# A dataset whose templates carry labels and a "string" key; a stream mapper that drops every
# third seq, so the server does not know an epoch's length in advance.
LABELLED_MODULE = """
from ppserver.datasets import NumpyDataset

class LabelledDataset(NumpyDataset):
    def data_keys(self):
        keys = super().data_keys()
        keys["classes"].update(sparse_dim=4, labels=["a", "b", "c", "d"])
        keys["orth"] = {"shape": [], "dtype": "string"}
        return keys
"""

LABELLED_CONFIG = """
import numpy as np
_r = np.random.RandomState(5)
SEQS = [
    {"data": _r.randn(n, 3).astype("float32"), "classes": _r.randint(0, 4, size=n).astype("int32"),
     "orth": np.array("w%02d" % i)}
    for i, n in enumerate(_r.randint(3, 12, size=14))
]
dataset = {"class": "labelled:LabelledDataset", "seqs": SEQS}

def map_seq_stream(seqs, *, rng, **kwargs):
    for n, seq in enumerate(seqs):
        if n % 3 != 2:
            seq["orth"] = np.array(str(seq["orth"]) + "!" * n)  # str arrays of any length
            yield seq
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory, in_temporary_cwd):
    cfg = write_config(tmp_path_factory.mktemp("returnn"), CONFIG)
    with run_server(cfg, workers=2) as srv:
        yield srv, cfg


@pytest.fixture(scope="module")
def labelled(tmp_path_factory, in_temporary_cwd):
    tmp = tmp_path_factory.mktemp("labelled")
    write_config(tmp, LABELLED_MODULE, name="labelled.py")
    cfg = write_config(tmp, LABELLED_CONFIG)
    with run_server(cfg, workers=2) as srv:
        yield srv, cfg


def dataset(address: str, **kwargs: Any) -> ServerDataset:
    ds = init_dataset({"class": ServerDataset, "address": address, **kwargs})
    assert isinstance(ds, ServerDataset)
    return ds


def read_epoch(
    ds: ServerDataset, epoch: int, actions: Optional[Dict[int, Callable[[], None]]] = None
) -> List[Dict[str, Any]]:
    """One epoch through RETURNN's dataset API, as its engines read it; actions[n]() right after the
    n-th seq was read (faults mid-epoch)."""
    ds.init_seq_order(epoch=epoch)
    got = []
    i = 0
    while ds.is_less_than_num_seqs(i):
        ds.load_seqs(i, i + 1)
        seq: Dict[str, Any] = {k: ds.get_data(i, k) for k in ds.get_data_keys()}
        seq["seq_tag"] = ds.get_tag(i)
        seq["complete_frac"] = ds.get_complete_frac(i, allow_only_lr_suitable=True)
        got.append(seq)
        i += 1
        if actions and i in actions:
            actions[i]()
    return got


def without_seq_idx(seqs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [{k: v for k, v in s.items() if k != "seq_idx"} for s in seqs]


def test_the_dataset_api_yields_the_reference_epochs(server):
    srv, cfg = server
    ds = dataset(srv.address, job="a")
    try:
        assert ds.get_total_num_seqs() == 23
        for epoch in (1, 2):
            want = reference(cfg, epoch)
            got = read_epoch(ds, epoch)
            assert ds.num_seqs == len(want)
            assert_same_epoch(got, without_seq_idx(want))
            ds.finish_epoch()
        assert [s["seq_tag"] for s in reference(cfg, 1)] != [s["seq_tag"] for s in reference(cfg, 2)]
    finally:
        ds.finish_epoch(free_resources=True)


def test_an_epoch_with_skipped_seqs_ends_where_they_run_out(server):
    srv, cfg = server
    ds = dataset(srv.address, job="skips")
    try:
        want = reference(cfg, 7)
        assert len(want) == 21  # two skipped, the last one too
        got = read_epoch(ds, 7)
        assert ds.num_seqs == 21
        assert_same_epoch(got, without_seq_idx(want))
    finally:
        ds.finish_epoch(free_resources=True)


def test_templates_become_returnn_meta_data(server, labelled):
    srv, _ = server
    ds = dataset(srv.address, job="b")
    assert ds.get_data_keys() == ["data", "classes"] and ds.get_target_list() == ["classes"]
    assert ds.num_outputs == {"data": (8, 2), "classes": (10, 1)} and ds.num_inputs == 8
    assert (ds.get_data_dim("data"), ds.get_data_shape("data"), ds.is_data_sparse("data")) == (8, [8], False)
    assert (ds.get_data_dim("classes"), ds.get_data_shape("classes"), ds.is_data_sparse("classes")) == (10, [], True)
    assert (ds.get_data_dtype("data"), ds.get_data_dtype("classes")) == ("float32", "int32")
    assert ds.labels == {}

    lsrv, _ = labelled
    lds = dataset(lsrv.address, job="b")
    with lsrv.client() as c:
        templates = c.info()["data_keys"]
    assert lds.get_data_keys() == list(templates)
    for key, tpl in templates.items():
        assert lds.get_data_shape(key) == tpl["shape"][1:]
        assert lds.is_data_sparse(key) == ("sparse_dim" in tpl)
        if "sparse_dim" in tpl:
            assert lds.get_data_dim(key) == tpl["sparse_dim"]
    assert lds.labels == {"classes": ["a", "b", "c", "d"]}
    assert [lds.get_data_dtype(k) for k in ("data", "classes", "orth")] == ["float32", "int32", "string"]
    assert lds.num_outputs["orth"] == (1, 0)


def test_an_epoch_of_unknown_length_and_string_keys(labelled):
    srv, cfg = labelled
    ds = dataset(srv.address, job="c")
    try:
        with pytest.raises(OptionalNotImplementedError, match="may change the count"):
            ds.get_total_num_seqs()
        with pytest.raises(OptionalNotImplementedError):
            ds.get_all_tags()
        ds.init_seq_order(epoch=1)
        with pytest.raises(NotImplementedError):
            ds.num_seqs  # noqa: B018  (known only once read)
        want = reference(cfg, 1)
        got = read_epoch(ds, 1)
        assert_same_epoch(got, without_seq_idx(want))
        assert ds.num_seqs == len(want) == 10
        assert got[3]["orth"].dtype.kind == "U" and str(got[3]["orth"]) == str(want[3]["orth"])
    finally:
        ds.finish_epoch(free_resources=True)


def test_server_errors_reach_the_trainer_and_the_next_epoch_works(server):
    srv, cfg = server
    ds = dataset(srv.address, job="d")
    try:
        with pytest.raises(ppclient.MapperError, match="no good seq"):
            read_epoch(ds, 9)
        assert_same_epoch(read_epoch(ds, 3), without_seq_idx(reference(cfg, 3)))
    finally:
        ds.finish_epoch(free_resources=True)


def test_bad_settings_fail_at_config_time_and_nothing_connects_early(server):
    srv, _ = server
    with pytest.raises(ppclient.UsageError, match="partition_epoch"):
        ServerDataset(srv.address, partition_epoch=2)
    with pytest.raises(ppclient.UsageError, match="address"):
        ServerDataset("localhost:5555")
    dead = ServerDataset(f"tcp://127.0.0.1:{free_port()}", timeout=0.5)  # constructing and pickling: no socket
    assert pickle.loads(pickle.dumps(dead))._client is None
    with pytest.raises(ppclient.ServerUnavailable):
        dead.initialize()  # RETURNN needs the data keys here
    with pytest.raises(KeyError, match="no data key 'nope'"):
        dataset(srv.address).get_data_dim("nope")


def test_a_pickled_copy_reads_without_the_connection(server):
    srv, cfg = server
    ds = dataset(srv.address, job="e")
    copy = None
    try:
        read_epoch(ds, 1)  # a live client in this process
        copy = pickle.loads(pickle.dumps(ds))
        assert copy._client is None and copy.num_outputs == ds.num_outputs and copy.labels == ds.labels
        assert_same_epoch(read_epoch(copy, 4), without_seq_idx(reference(cfg, 4)))
    finally:
        ds.finish_epoch(free_resources=True)
        if copy is not None:
            copy.finish_epoch(free_resources=True)


def batches_by_epoch(ds: ServerDataset, epochs: List[int], num_workers: int) -> Dict[int, List[Dict[str, Any]]]:
    """RETURNN's torch pipeline as its engine builds it (returnn/torch/engine.py _create_data_loader);
    `epochs` consecutive, counted in the (persistent) workers."""
    import returnn.torch.data.returnn_dataset_wrapper as wrapper  # imports torch: only where it is used
    from returnn.torch.data import pipeline

    reset = wrapper.ReturnnDatasetResetDefaultEpochCounterCallback(ds, epoch0=epochs[0] - 1)
    pipe = wrapper.ReturnnDatasetIterDataPipe(ds, reset_callback=reset, shard_workers=True)
    batches = pipeline.BatchingIterDataPipe(pipe, batch_size=100, max_seqs=4)
    loader = pipeline.create_data_loader_from_batches(batches, {"num_workers": num_workers})
    ds.finish_epoch(free_resources=True)  # as the engine does: only the workers read
    out: Dict[int, List[Dict[str, Any]]] = {}
    workers: List[int] = []
    try:
        for epoch in epochs:
            out[epoch] = list(loader)
        workers = [w.pid for w in loader._iterator._workers]  # persistent: kept for the next epoch
        assert len(workers) == num_workers and all(p in children_of(os.getpid()) for p in workers)
    finally:
        pipeline.shutdown_data_loader(loader)
    assert not wait_gone(workers, 10.0)
    return out


def unbatch(batches: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    seqs = []
    for batch in batches:
        for j, tag in enumerate(batch["seq_tag"]):
            seq = {"seq_tag": str(tag)}
            for key in ("data", "classes"):
                seq[key] = batch[key][j, : int(batch[key + ":seq_len"][j])].numpy()
            seqs.append(seq)
    return seqs


@pytest.mark.torch
def test_returnns_torch_data_loader_reads_epochs_in_a_spawned_worker(server):
    srv, cfg = server
    got = batches_by_epoch(dataset(srv.address, job="f"), [1, 2], num_workers=1)
    for epoch in (1, 2):
        want = [{k: s[k] for k in ("seq_tag", "data", "classes")} for s in reference(cfg, epoch)]
        assert_same_epoch(unbatch(got[epoch]), want)
        assert all(int(b["epoch"]) == epoch and int(b["num_seqs"]) == 23 for b in got[epoch])


@pytest.mark.torch
def test_data_loader_workers_are_the_readers_of_their_rank(tmp_path):
    """RETURNN with torch_dataloader_opts {"num_workers": 2} shards its two DataLoader workers:
    they read as the two readers of the one rank (the server's log says so), and drop_last takes
    nothing from them."""
    cfg = write_config(tmp_path, CONFIG)
    log = str(tmp_path / "server.log")
    with run_server(cfg, workers=2, log_path=log) as srv:
        got = unbatch(batches_by_epoch(dataset(srv.address, job="g"), [5], num_workers=2)[5])
    want = reference(cfg, 5)  # all 23 seqs: one rank, two readers
    assert sorted(s["seq_tag"] for s in got) == sorted(s["seq_tag"] for s in want)
    by_tag = {s["seq_tag"]: s for s in want}
    for seq in got:
        assert np.array_equal(seq["data"], by_tag[seq["seq_tag"]]["data"])
    text = read(log)
    assert "job 'g': world_size 1, drop_last True, 2 readers per rank, i.e. DataLoader num_workers 2" in text, text
    for reader in (0, 1):
        assert f"rank 0 (reader {reader} of 2) of job 'g' reads epoch 5" in text, text


def test_two_shards_are_two_ranks_of_one_job(server):
    """Strided shards, asked for (RETURNN's contiguous ones: test_returnn_sharding.py)."""
    srv, cfg = server
    want = without_seq_idx(reference(cfg, 6))
    got: Dict[int, List[Dict[str, Any]]] = {}

    def rank_main(rank: int) -> None:  # the ranks read at once, as DDP ranks do
        ds = dataset(srv.address, job="h", sharding="strided", _num_shards=2, _shard_index=rank)
        try:
            got[rank] = read_epoch(ds, 6)
            assert ds.num_seqs == 11
        finally:
            ds.finish_epoch(free_resources=True)

    in_threads(rank_main, (0, 1), timeout=60)
    for rank in (0, 1):
        assert_same_epoch(got[rank], want[rank:22:2])  # strided, 23 // 2 seqs each
    tags = [s["seq_tag"] for r in (0, 1) for s in got[r]]
    assert len(set(tags)) == len(tags) == 22


TRAIN_CONFIG = (
    """
#!returnn.py
import torch
import returnn.frontend as rf
from returnn.tensor import Dim, batch_dim
from ppclient.returnn import ServerDataset

log_verbosity = 3
batch_size = 60

time_dim = Dim(None, name="time")
extern_data = {{
    "data": {{"dims": [batch_dim, time_dim, Dim(8, name="in")], "dtype": "float32"}},
    "classes": {{"dims": [batch_dim, time_dim], "sparse_dim": Dim(10, name="classes"), "dtype": "int32"}},
}}
train = {{"class": ServerDataset, "address": {address!r}, "job": "train-run"}}


def get_model(**_kwargs):
    return torch.nn.Linear(8, 10)


def train_step(*, model, extern_data, **_kwargs):
    x = extern_data["data"].raw_tensor
    lens = extern_data["data"].dims[1].dyn_size_ext.raw_tensor
    with open({tags!r}, "a") as f:
        f.write("%d %s\\n" % (rf.get_run_ctx().epoch, " ".join(str(t) for t in extern_data["seq_tag"].raw_tensor)))
    mask = torch.arange(x.shape[1])[None, :] < lens[:, None]
    loss = torch.nn.functional.cross_entropy(model(x)[mask], extern_data["classes"].raw_tensor.long()[mask])
    rf.get_run_ctx().mark_as_loss(name="ce", loss=loss)
"""
    + RETURNN_TRAINING
)


@pytest.mark.torch
def test_a_returnn_training_reads_its_epochs_from_the_server(server, tmp_path):
    srv, cfg = server
    tags_path = str(tmp_path / "tags.txt")
    config = write_config(
        tmp_path,
        TRAIN_CONFIG.lstrip().format(
            model=str(tmp_path / "model"), log=str(tmp_path / "returnn.log"), address=srv.address, tags=tags_path
        ),
        name="train.config",
    )
    out = run_returnn(config, str(tmp_path), timeout=120)
    batches: Dict[int, List[List[str]]] = {1: [], 2: []}
    with open(tags_path) as f:
        for line in f:
            epoch, *tags = line.split()
            batches[int(epoch)].append(tags)
    for epoch in (1, 2):
        want = [s["seq_tag"] for s in reference(cfg, epoch)]
        got = [t for batch in batches[epoch] for t in batch]
        assert sorted(got) == sorted(want)
        assert got == want, "batches came in epoch order, each holding consecutive seqs"
        assert all(1 <= len(b) <= 3 for b in batches[epoch])
    assert "sequences: 23" in out + open(str(tmp_path / "returnn.log")).read()


DAEMON_CONFIG = """#!returnn.py
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shared
from ppclient.returnn import ServerDataset

train = {{
    "class": ServerDataset,
    "address": {address!r},
    "dataset": {{"class": "DummyDataset", "input_dim": 3, "output_dim": 4, "num_seqs": 6, "seq_len": 4}},
    "map_seq": shared.scale,
}}
"""
# A trainer's start: RETURNN's global config, and its train dataset made from it.
TRAINER = """
import sys
from returnn.config import Config, set_global_config
from returnn.datasets.basic import init_dataset
config = Config()
config.load_file(sys.argv[1])
set_global_config(config)
print("keys", sorted(init_dataset(config.typed_value("train")).get_data_keys()))
"""


def test_a_trainer_whose_dict_the_server_does_not_serve_is_an_error_naming_both_fingerprints(tmp_path):
    """`ppserver serve --returnn-config` ran on the file before its shared module was edited; a trainer
    started on the edited file computes its dict's config fingerprint and stops at its first request."""
    (tmp_path / "shared.py").write_text("def scale(tdict, **kwargs):\n    return tdict\n")
    address = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(tmp_path, DAEMON_CONFIG.format(address=address), name="train.config")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "client")])}

    def trainer() -> subprocess.CompletedProcess:
        argv = [sys.executable, "-c", TRAINER, config]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))

    with run_server(f"--returnn-config={config}", workers=1, bind=address, extra=["--dataset", "train"]) as srv:
        with srv.client() as c:
            served = c.info()["config_fingerprint"]
        res = trainer()
        assert res.returncode == 0 and "keys ['classes', 'data']" in res.stdout, res.stderr[-3000:]
        (tmp_path / "shared.py").write_text("def scale(tdict, **kwargs):\n    return tdict\n\nEDITED = 1\n")
        res = trainer()
    assert res.returncode != 0
    error = res.stderr.strip().splitlines()[-1]
    assert f"serves another config than this trainer's 'train' dict: its config fingerprint is {served!r}" in error
    theirs = re.search(r"this dict's is '([0-9a-f]+)'", error)
    assert theirs and theirs.group(1) != served


def test_the_dataset_reads_on_through_a_server_restart(tmp_path):
    """kill -9 of the server in the middle of a RETURNN epoch and a new one on its address 3 s
    later: RETURNN's dataset API goes on with the rest of the epoch, the reference's."""
    from test_server_restart import slow_config

    cfg = slow_config(tmp_path)
    want = without_seq_idx(reference(cfg, 1))
    with restartable(cfg, tmp_path) as service:
        ds = dataset(service.address, timeout=30)
        try:
            got = read_epoch(ds, 1, {6: service.restart_after})
            service.join()
        finally:
            ds.finish_epoch(free_resources=True)
        assert re.search(r"reads epoch 1 \(run \d+\) from seq [1-9]", read(service.log(2)))  # went on mid-epoch
    assert_same_epoch(got, want)


# A user's inspection script: a dataset as a global, a few seqs read, no finish_epoch; the client is
# closed at exit (from atexit, or from ServerDataset.__del__ while the interpreter finalizes).
INSPECT = """
import sys
import ppclient
from returnn.config import Config, set_global_config
from returnn.datasets.basic import init_dataset
from ppclient.returnn import ServerDataset

source, epoch = sys.argv[1], int(sys.argv[2])
if source.startswith("tcp://"):
    ds = init_dataset({"class": ServerDataset, "address": source})
else:  # a RETURNN config whose train dataset starts a local server
    config = Config()
    config.load_file(source)
    set_global_config(config)
    ds = init_dataset(config.typed_value("train"))
ds.init_seq_order(epoch=epoch)
try:
    ds.load_seqs(0, 5)
except ppclient.MapperError as exc:
    error = exc  # kept, with its traceback (and the dataset in it), as a notebook would
    print("MapperError", flush=True)
if sys.argv[3:] == ["no-atexit"]:  # left to __del__ alone, after the threads were frozen
    import atexit, ppclient.client
    atexit.unregister(ppclient.client._close_open)
print("read", flush=True)
"""

LOCAL_RETURNN_CONFIG = """
#!returnn.py
from ppclient.returnn import ServerDataset

def same(tdict, **kwargs):
    return tdict

train = {
    "class": ServerDataset,
    "dataset": {"class": "DummyDataset", "input_dim": 3, "output_dim": 2, "num_seqs": 6, "seq_len": 4},
    "map_seq": same,
    "num_workers": 1,
}
"""


@pytest.mark.parametrize(
    "source, epoch, extra",
    [("daemon", 1, []), ("daemon", 1, ["no-atexit"]), ("daemon", 9, ["no-atexit"]), ("local", 1, ["no-atexit"])],
)
def test_a_script_that_reads_without_finishing_the_epoch_exits(server, tmp_path, source, epoch, extra):
    """A script that reads a few seqs and ends (no finish_epoch) exits at once: its client is closed
    without waiting on a socket, also from __del__ while the interpreter finalizes, after a
    MapperError (epoch 9), and with a local server (gone with the script, its folder too)."""
    srv, _ = server
    tmp = tempfile.mkdtemp(prefix="pp", dir="/tmp")  # short: the local server's Unix sockets
    try:
        if source == "daemon":
            target = srv.address
        else:
            target = write_config(tmp_path, LOCAL_RETURNN_CONFIG.lstrip(), name="local.config")
        env = dict(os.environ, TMPDIR=tmp)
        res = run_group(
            [sys.executable, "-c", INSPECT, target, str(epoch), *extra],
            timeout=60 if source == "local" else 20,
            text=True,
            cwd=str(tmp_path),
            env=env,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert ("MapperError" in res.stdout) == (epoch == 9) and "read" in res.stdout, res.stdout
        base = os.path.join(tmp, f"ppserver-{os.getuid()}")
        assert not os.path.exists(base) or os.listdir(base) == ["logs"], os.listdir(base)
        assert not [name for name in os.listdir(tmp) if name.startswith("ppclient-")]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

"""RETURNN datasets served and RETURNN TensorDict mappers run by ppserver, compared seq by seq
with RETURNN's own PostprocessingDataset over the same dataset dict and mapper."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
from conftest import collect, collect_with, read, run_server
from returnn.datasets.basic import init_dataset
from test_hdf import LABELS, write_dense

from ppclient import DatasetError, MapperError
from ppserver.returnn_dataset import ReturnnDataset

pytestmark = pytest.mark.usefixtures("in_temporary_cwd")

MAPPERS = '''
import numpy as np
from returnn.tensor import TensorDict


def scale(tdict, *, epoch, seq_idx, rng, **kwargs):
    """rng-free, so RETURNN's per-worker rng streams do not matter."""
    assert isinstance(tdict, TensorDict)
    for key, t in tdict.data.items():
        if key not in ("seq_tag", "seq_idx", "complete_frac") and t.dims:
            assert t.dims[0].name == key + "_frame", t
    if "data" in tdict.data:
        t = tdict.data["data"]
        t.raw_tensor = t.raw_tensor * np.float32(2) + np.float32(epoch)
    return tdict


def check_vocab(tdict, **kwargs):
    t = tdict.data["classes"]
    assert t.sparse_dim.dimension == 10 and t.vocab.labels[3] == "lab3", t
    return tdict


def noisy(tdicts, *, epoch, rng, **kwargs):
    for td in tdicts:
        t = td.data["data"]
        t.raw_tensor = t.raw_tensor + rng.uniform(size=t.raw_tensor.shape).astype("float32")
        yield td


def drop_every_third(tdicts, **kwargs):
    for i, td in enumerate(tdicts):
        if i % 3 != 2:
            yield td


def get_sub_epoch_dataset(files):
    return {"class": "HDFDataset", "files": files, "seq_ordering": "random"}


def get_sub_epoch_dataset_unknown(files):
    """Sub-epochs whose count is known only once read: every third seq dropped."""
    inner = {"class": "HDFDataset", "files": files, "seq_ordering": "random"}
    return {"class": "PostprocessingDataset", "dataset": inner, "map_seq_stream": drop_every_third}
'''

FAILING = '''
from returnn.datasets.basic import DatasetSeq
from returnn.datasets.cached2 import CachedDataset2
import numpy as np


class Failing(CachedDataset2):
    """Seqs 0..9 of 3 frames; reading seq 5 fails."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.num_outputs = {"data": (2, 2)}
        self.num_inputs = 2

    def get_data_keys(self):
        return ["data"]

    def get_data_dtype(self, key):
        return "float32"

    def _collect_single_seq(self, seq_idx):
        if seq_idx >= 10:
            return None
        if seq_idx == 5:
            raise OSError("disk on fire at seq 5")
        return DatasetSeq(seq_idx, features={"data": np.zeros((3, 2), "float32")}, seq_tag=f"f{seq_idx}")
'''


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """HDF files, OggZip files (text only, and with audio) and the mapper module."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "tdmappers.py").write_text(MAPPERS)
    (root / "failing.py").write_text(FAILING)
    sys.path.insert(0, str(root))
    files = {
        "a": write_dense(root / "a.hdf", 23, 1, "a"),
        "b": write_dense(root / "b.hdf", 11, 2, "b"),
        "c": write_dense(root / "c.hdf", 9, 3, "c"),
        "d": write_dense(root / "d.hdf", 13, 4, "d"),
    }
    # a second view of a.hdf's seqs, for MetaDataset: the same tags, other values
    files["a2"] = write_dense(root / "a2.hdf", 23, 7, "a")
    files["text"] = _text_zip(root / "text.zip")
    files["audio"] = _audio_zip(root / "audio.zip")
    yield {k: str(v) for k, v in files.items()} | {"root": str(root)}
    sys.path.remove(str(root))


def _text_zip(path):
    rng = np.random.RandomState(0)
    words = ["hello", "world", "foo", "bar"]
    entries = [
        {"text": " ".join(rng.choice(words, size=rng.randint(1, 5))), "duration": rng.randint(5, 50) / 10,
         "seq_name": f"text/seq{i}"}
        for i in range(12)
    ]  # fmt: skip
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("text.txt", repr(entries))
    return path


def _audio_zip(path):
    import soundfile

    rng = np.random.RandomState(1)
    entries = []
    with zipfile.ZipFile(path, "w") as z:
        for i in range(6):
            duration = rng.randint(2, 8) / 10
            t = np.arange(int(16000 * duration)) / 16000
            buf = io.BytesIO()
            soundfile.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype("float32"), 16000, format="OGG")
            z.writestr(f"audio/utt{i}.ogg", buf.getvalue())
            entries.append({"text": "hello world"[: i + 3], "duration": duration, "file": f"utt{i}.ogg"})
        z.writestr("audio.txt", repr(entries))
    return path


def specs(corpus):
    hdf = lambda *keys, **kw: {"class": "HDFDataset", "files": [corpus[k] for k in keys], **kw}
    return {
        "hdf-random": hdf("a", "b", seq_ordering="random"),
        "hdf-laplace": hdf("a", "b", seq_ordering="laplace:.5", partition_epoch=2),
        "meta-random": {
            "class": "MetaDataset",
            "datasets": {"x": hdf("a"), "y": hdf("a2")},
            "data_map": {"data": ("x", "data"), "classes": ("y", "classes")},
            "seq_ordering": "random",
        },
        "oggzip-text-laplace": {
            "class": "OggZipDataset",
            "path": corpus["text"],
            "audio": None,
            "targets": None,
            "seq_ordering": "laplace:3",
        },
        "oggzip-audio-random": {
            "class": "OggZipDataset",
            "path": corpus["audio"],
            "audio": {"features": "raw", "num_feature_filters": 1, "sample_rate": 16000},
            "targets": None,
            "seq_ordering": "random",
        },
        "dfd-random": {
            "class": "DistributeFilesDataset",
            "files": [corpus[k] for k in "abcd"],
            "get_sub_epoch_dataset": "GET_SUB_EPOCH_DATASET",  # replaced by the function below
            "partition_epoch": 2,
            "seq_ordering": "random",
        },
        "dfd-unknown": {
            "class": "DistributeFilesDataset",
            "files": [corpus[k] for k in "abcd"],
            "get_sub_epoch_dataset": "GET_SUB_EPOCH_DATASET_UNKNOWN",
            "partition_epoch": 2,
            "seq_ordering": "random",
        },
    }


def _resolve(spec):
    import tdmappers

    name = spec.get("get_sub_epoch_dataset")
    if isinstance(name, str) and name.startswith("GET_SUB_EPOCH_DATASET"):
        return {**spec, "get_sub_epoch_dataset": getattr(tdmappers, name.lower())}
    return spec


def pp_epoch(spec, epoch, **pp_kwargs):
    """What RETURNN's PostprocessingDataset gives for this epoch: (tag, {key: array}, complete_frac)."""
    pp = init_dataset({"class": "PostprocessingDataset", "dataset": _resolve(spec), **pp_kwargs})
    try:
        pp.init_seq_order(epoch=epoch)
        keys = pp.get_data_keys()
        out, i = [], 0
        while pp.is_less_than_num_seqs(i):
            pp.load_seqs(i, i + 1)
            out.append((pp.get_tag(i), {k: pp.get_data(i, k) for k in keys}, pp.get_complete_frac(i)))
            i += 1
        return out
    finally:
        pp.finish_epoch(free_resources=True)


def direct_epoch(spec, epoch, *, scale=False):
    """The epoch read from the dataset itself with PostprocessingDataset's loop, tdmappers.scale's
    arithmetic applied to "data"."""
    ds = init_dataset(_resolve(spec))
    try:
        ds.init_seq_order(epoch=epoch)
        keys = ds.get_data_keys()
        out, i = [], 0
        while ds.is_less_than_num_seqs(i):
            ds.load_seqs(i, i + 1)
            arrays = {k: np.array(ds.get_data(i, k)) for k in keys}
            if scale:
                arrays["data"] = arrays["data"] * np.float32(2) + np.float32(epoch)
            frac = ds.get_complete_frac(i, allow_only_lr_suitable=True)
            out.append((ds.get_tag(i), arrays, None if frac is None else float(np.float32(frac))))
            i += 1
        return out
    finally:
        ds.finish_epoch(free_resources=True)


def config_text(spec, body):
    """A config serving `spec` (a RETURNN dataset dict) with the mappers of tdmappers.py."""
    dataset = repr({"class": "returnn", "dataset": spec})
    for name in ("GET_SUB_EPOCH_DATASET_UNKNOWN", "GET_SUB_EPOCH_DATASET"):
        dataset = dataset.replace(repr(name), f"tdmappers.{name.lower()}")
    return f"import tdmappers\nmapper_api = 'returnn'\ndataset = {dataset}\n" + textwrap.dedent(body)


def assert_like_returnn(got, want, *, stream=False):
    assert [s["seq_tag"] for s in got] == [tag for tag, _, _ in want]
    for i, (seq, (tag, arrays, frac)) in enumerate(zip(got, want)):
        assert stream or seq["seq_idx"] == i  # a stream's outputs keep their inputs' seq_idx
        assert set(arrays) <= set(seq), (tag, set(arrays) ^ set(seq))
        for key, arr in arrays.items():
            arr = np.asarray(arr)
            assert seq[key].dtype == arr.dtype, (tag, key, seq[key].dtype, arr.dtype)
            np.testing.assert_array_equal(seq[key], arr, err_msg=f"{tag} {key}")
        assert seq.get("complete_frac") == frac, (tag, seq.get("complete_frac"), frac)


@pytest.mark.parametrize("name", ["hdf-random", "hdf-laplace", "meta-random", "oggzip-text-laplace",
                                  "oggzip-audio-random", "dfd-random", "dfd-unknown"])  # fmt: skip
def test_dataset_served_as_postprocessing_dataset_gives_it(corpus, tmp_path, name):
    """Each dataset class, 2 epochs, a TensorDict map_seq through 2 workers."""
    spec = specs(corpus)[name]
    cfg = _cfg(corpus, f"cfg_{name}", config_text(spec, "map_seq = tdmappers.scale\nnum_workers = 2\n"))
    import tdmappers

    with run_server(cfg, workers=2, log_path=str(tmp_path / "server.log")) as srv, srv.client() as c:
        info = c.info()
        got = {e: (collect(it), it.num_seqs) for e in (1, 2) for it in [c.epoch(e)]}
    for epoch, (seqs, num_seqs) in got.items():
        if name.startswith("dfd"):
            want = direct_epoch(spec, epoch, scale=True)  # PostprocessingDataset cannot wrap it (KeyError: None)
        else:
            want = pp_epoch(spec, epoch, map_seq=tdmappers.scale)
        assert_like_returnn(seqs, want)
        assert (num_seqs is None) == name.endswith("unknown")  # the count is known as RETURNN knows it
    if name.startswith("dfd"):
        assert info["num_seqs"] is None
    if "classes" in info["data_keys"]:
        assert info["data_keys"]["classes"] == {"shape": [None], "dtype": "int32", "sparse_dim": 10, "labels": LABELS}
    if name.startswith("oggzip-text"):
        assert info["data_keys"]["raw"] == {"shape": [], "dtype": "string"}
        assert info["data_keys"]["orth"]["sparse_dim"] == 256


def _cfg(corpus, name, body):
    path = os.path.join(corpus["root"], f"{name}.py")
    with open(path, "w") as f:
        f.write(body)
    return path


def test_tensor_dicts_carry_sparse_dims_and_vocab(corpus, tmp_path):
    spec = specs(corpus)["hdf-random"]
    cfg = _cfg(corpus, "cfg_vocab", config_text(spec, "map_seq = tdmappers.check_vocab\n"))
    with run_server(cfg, workers=1) as srv, srv.client() as c:
        assert len(collect(c.epoch(1))) == 34


@pytest.mark.parametrize("partitions", [1, 2])
def test_map_seq_stream_with_rng_equals_returnn(corpus, tmp_path, partitions):
    """The rng of a partition is that of PostprocessingDataset's worker of the same index (one
    partition: num_workers=0), so even a mapper using rng, behind RETURNN's LaplaceOrdering, is
    bit-identical; the seqs go through 2 workers."""
    import tdmappers
    from returnn.datasets.postprocessing import LaplaceOrdering, Sequential

    spec = specs(corpus)["hdf-random"]
    body = f"""
        from returnn.datasets.postprocessing import LaplaceOrdering, Sequential
        map_seq_stream = Sequential(LaplaceOrdering(4), tdmappers.noisy)
        stream_partitions = {partitions}
        seed = 5
        """
    cfg = _cfg(corpus, f"cfg_stream{partitions}", config_text(spec, body))
    with run_server(cfg, workers=2) as srv, srv.client() as c:
        got = {e: collect(c.epoch(e)) for e in (1, 2)}
    for epoch in (1, 2):
        want = pp_epoch(
            spec,
            epoch,
            map_seq_stream=Sequential(LaplaceOrdering(4), tdmappers.noisy),
            num_workers=0 if partitions == 1 else partitions,
            random_seed_offset=5,
        )
        assert_like_returnn(got[epoch], want, stream=True)


def test_unknown_count_served_with_its_own_complete_frac(corpus, tmp_path):
    """A dataset that learns its count by reading (a PostprocessingDataset dropping seqs)."""
    import tdmappers

    inner = {
        "class": "PostprocessingDataset",
        "dataset": specs(corpus)["hdf-random"],
        "map_seq_stream": "DROP",
    }
    text = config_text(inner, "map_seq = tdmappers.scale\n").replace("'DROP'", "tdmappers.drop_every_third")
    cfg = _cfg(corpus, "cfg_unknown", text)
    with run_server(cfg, workers=2) as srv, srv.client() as c:
        assert c.info()["num_seqs"] is None
        it = c.epoch(1)
        with pytest.raises(TypeError):
            len(it)
        got = collect(it)
    want = pp_epoch({**inner, "map_seq_stream": tdmappers.drop_every_third}, 1, map_seq=tdmappers.scale)
    assert len(want) == 23  # 34 seqs, every third dropped
    assert_like_returnn(got, want)


def test_forward_only_dataset_replays_after_a_killed_worker(corpus, tmp_path):
    """MetaDataset reads forward only; a stream partition restarted elsewhere re-reads its inputs
    from the adapter's cache or by reading the epoch again: the epoch is still exactly RETURNN's."""
    import tdmappers
    from returnn.datasets.postprocessing import LaplaceOrdering, Sequential

    spec = specs(corpus)["meta-random"]
    body = """
        import time
        from returnn.datasets.postprocessing import LaplaceOrdering, Sequential

        def slow(tdicts, **kwargs):
            for td in tdicts:
                time.sleep(0.02)
                yield td

        map_seq_stream = Sequential(LaplaceOrdering(3), slow, tdmappers.noisy)
        stream_partitions = 1
        buf_size = 2
        """
    cfg = _cfg(corpus, "cfg_replay", config_text(spec, body))
    with run_server(cfg, workers=2, log_path=str(tmp_path / "server.log")) as srv, srv.client(window=2) as c:
        it = c.epoch(1)
        pids = srv.worker_pids()

        def kill_owner():
            owners = [w["pid"] for w in c.status()["workers"] if w.get("partitions")]
            for pid in owners or pids[:1]:
                os.kill(pid, signal.SIGKILL)

        got = collect_with(it, {8: kill_owner})
    want = pp_epoch(spec, 1, map_seq_stream=Sequential(LaplaceOrdering(3), tdmappers.noisy))
    assert_like_returnn(got, want, stream=True)


def test_dataset_error_reaches_the_client_with_its_traceback(corpus, tmp_path):
    cfg = _cfg(
        corpus,
        "cfg_failing",
        "from failing import Failing\nmapper_api = 'returnn'\n"
        "dataset = {'class': 'returnn', 'dataset': {'class': Failing}}\n"
        "map_seq = lambda tdict, **kwargs: tdict\n",
    )
    log_path = str(tmp_path / "server.log")
    with run_server(cfg, workers=1, log_path=log_path) as srv, srv.client() as c:
        it = c.epoch(1)
        with pytest.raises(DatasetError, match="disk on fire at seq 5") as info:
            collect(it)
    assert "_collect_single_seq" in info.value.remote_traceback
    log = read(log_path)
    assert "disk on fire at seq 5" in log and "Traceback" in log


def test_map_outputs_in_returnn_form_checked(corpus, tmp_path):
    """map_outputs as RETURNN Tensor arguments: a mapper stacking frame pairs passes; one whose
    output does not fit fails naming the key."""
    spec = specs(corpus)["hdf-random"]
    body = """
        import numpy as np
        from returnn.tensor import Dim, Tensor

        def stack(tdict, **kwargs):
            x = tdict.data["data"].raw_tensor
            x = x[: len(x) // 2 * 2].reshape(-1, 16)
            time = Dim(None, name="stacked_time")
            tdict.data["data"] = Tensor("data", dims=[time, Dim(16, name="f")], dtype="float32", raw_tensor=x)
            return tdict

        map_seq = stack
        map_outputs = {
            "data": {"dims": [Dim(None, name="time"), Dim(16, name="feat")], "dtype": "float32"},
            "classes": {"shape": (None,), "dtype": "int32", "sparse_dim": Dim(10, name="classes")},
            "feat2": {"shape": (None, WIDTH), "dtype": "float32"},
        }
        """
    good = _cfg(corpus, "cfg_outputs", config_text(spec, body.replace("WIDTH", "3")))
    with run_server(good, workers=1) as srv, srv.client() as c:
        info = c.info()
        got = collect(c.epoch(1))
    assert info["data_keys"]["data"] == {"shape": [None, 16], "dtype": "float32"}
    assert info["data_keys"]["classes"] == {"shape": [None], "dtype": "int32", "sparse_dim": 10}
    assert all(s["data"].shape[1] == 16 for s in got) and len(got) == 34
    bad = _cfg(corpus, "cfg_outputs_bad", config_text(spec, body.replace("WIDTH", "4")))
    with run_server(bad, workers=1) as srv, srv.client() as c:
        with pytest.raises(MapperError, match="'feat2'"):
            collect(c.epoch(1))


# ---- the adapter alone -------------------------------------------------------------------------


@pytest.mark.parametrize("cache_mb", [0, 256])
def test_adapter_answers_any_access_pattern_from_one_forward_pass(corpus, cache_mb):
    """Backward and forward jumps on a forward-only dataset give the seqs of a plain pass."""
    spec = specs(corpus)["meta-random"]
    plain = ReturnnDataset(dataset=spec)
    plain.init_seq_order(2)
    want = [plain.get_seq(i) for i in range(plain.num_seqs)]
    ds = ReturnnDataset(dataset=spec, cache_mb=cache_mb)
    assert not ds.random_access
    ds.init_seq_order(2)
    pattern = [0, 1, 2, 10, 3, 4, 11, 12, 5, 20, 21, 6, 22, 7, 8, 9, 13, 14, 15, 16, 17, 18, 19]
    for pos in pattern:
        got = ds.get_seq(pos)
        assert got["seq_tag"] == want[pos]["seq_tag"]
        np.testing.assert_array_equal(got["data"], want[pos]["data"])
    # with the cache, the jumps back are answered from it; without, the epoch is read again
    assert (ds.rewinds == 0) == (cache_mb > 0), ds.rewinds
    with pytest.raises(IndexError):
        ds.get_seq(23)


def test_adapter_unknown_count(corpus):
    import tdmappers

    inner = {"class": "PostprocessingDataset", "dataset": specs(corpus)["hdf-random"],
             "map_seq_stream": tdmappers.drop_every_third}  # fmt: skip
    ds = ReturnnDataset(dataset=inner)
    ds.init_seq_order(1)
    assert ds.num_seqs is None
    assert ds.is_less_than_num_seqs(22) and not ds.is_less_than_num_seqs(23)
    assert ds.get_seq(3)["seq_tag"] == ds.get_seq(3)["seq_tag"]
    with pytest.raises(IndexError):
        ds.get_seq(23)


# ---- a RETURNN training ------------------------------------------------------------------------

TRAIN_CONFIG = """
#!returnn.py
import sys
sys.path.insert(0, {root!r})
import torch
import returnn.frontend as rf
from returnn.tensor import Dim, batch_dim
from ppclient.returnn import ServerDataset
import tdmappers

backend = "torch"
device = "cpu"
behavior_version = 24
task = "train"
num_epochs = 2
model = {model!r}
log = [{log!r}]
log_verbosity = 3
batch_size = 100
max_seqs = 3
optimizer = {{"class": "adam"}}
learning_rate = 1e-3
torch_dataloader_opts = {{"num_workers": 1}}
extern_data = {{"data": {{"dims": [batch_dim, Dim(None, name="time"), Dim(8, name="in")], "dtype": "float32"}}}}
train = {train}


def get_model(**_kwargs):
    return torch.nn.Linear(8, 2)


def train_step(*, model, extern_data, **_kwargs):
    x = extern_data["data"].raw_tensor
    with open({tags!r}, "a") as f:
        tags = " ".join(str(t) for t in extern_data["seq_tag"].raw_tensor)
        f.write("%d %.4f %s\\n" % (rf.get_run_ctx().epoch, float(x.abs().sum()), tags))
    rf.get_run_ctx().mark_as_loss(name="l2", loss=(model(x) ** 2).mean())
"""


def _train(tmp_path, corpus, name, train):
    """Run `python -m returnn` for 2 epochs; returns {epoch: [(sum of |data|, [tags]) per batch]}."""
    out_dir = tmp_path / name
    out_dir.mkdir()
    tags_path = str(out_dir / "tags.txt")
    config = out_dir / "train.config"
    config.write_text(
        TRAIN_CONFIG.lstrip().format(
            root=corpus["root"],
            model=str(out_dir / "model"),
            log=str(out_dir / "returnn.log"),
            train=train,
            tags=tags_path,
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "returnn", str(config)],
        cwd=str(out_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, out[-4000:]
    batches: dict = {1: [], 2: []}
    with open(tags_path) as f:
        for line in f:
            epoch, total, *tags = line.split()
            batches[int(epoch)].append((float(total), tags))
    return batches


def test_returnn_trains_from_the_server_as_from_postprocessing_dataset(corpus, tmp_path):
    """The same HDF file and TensorDict mapper: RETURNN's training sees the same batches of the
    same seqs (tags and data) from ppserver as from its own PostprocessingDataset."""
    spec = specs(corpus)["hdf-laplace"]
    cfg = _cfg(corpus, "cfg_train", config_text(spec, "map_seq = tdmappers.scale\nnum_workers = 2\n"))
    with run_server(cfg, workers=2) as srv:
        served = _train(tmp_path, corpus, "served", f"{{'class': ServerDataset, 'address': {srv.address!r}}}")
    own = _train(
        tmp_path,
        corpus,
        "own",
        f"{{'class': 'PostprocessingDataset', 'dataset': {spec!r}, 'map_seq': tdmappers.scale}}",
    )
    for epoch in (1, 2):
        assert [tags for _, tags in served[epoch]] == [tags for _, tags in own[epoch]]
        assert [total for total, _ in served[epoch]] == pytest.approx([total for total, _ in own[epoch]], rel=1e-6)
        assert sum(len(tags) for _, tags in served[epoch]) == 17  # partition_epoch 2 of 34 seqs
    assert [tags for _, tags in served[1]] != [tags for _, tags in served[2]]

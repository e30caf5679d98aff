"""RETURNN datasets served and RETURNN TensorDict mappers run by ppserver, compared seq by seq
with RETURNN's own PostprocessingDataset over the same dataset dict and mapper."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import zipfile
from types import SimpleNamespace
from typing import List, Optional

import numpy as np
import pytest
from conftest import (
    RETURNN_L2_STEP,
    RETURNN_TRAINING,
    children_of,
    collect,
    collect_with,
    read,
    returnn_batches,
    run_returnn,
    run_server,
    run_worker_host,
)
from returnn.datasets.basic import DatasetSeq, init_dataset
from returnn.datasets.cached2 import CachedDataset2
from returnn.util.basic import OptionalNotImplementedError
from test_hdf import LABELS, write_dense

from ppclient import DatasetError, Error, MapperError
from ppclient.returnn import ServerDataset
from ppserver.datasets.returnn import ReturnnDataset

pytestmark = [pytest.mark.returnn, pytest.mark.usefixtures("in_temporary_cwd")]

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


def scale_checked(tdict, *, epoch, seq_idx, rng, **kwargs):
    """scale, after checking the vocabulary; in epoch 9 the 4th seq gets class indices past sparse_dim."""
    tdict = scale(check_vocab(tdict), epoch=epoch, seq_idx=seq_idx, rng=rng)
    if epoch == 9 and seq_idx == 3:
        t = tdict.data["classes"]
        t.raw_tensor = t.raw_tensor + np.int32(10)
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


def get_sub_epoch_dataset_laplace(files):
    return {"class": "HDFDataset", "files": files, "seq_ordering": "laplace:.5"}


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
    meta = lambda ordering: {
        "class": "MetaDataset",
        "datasets": {"x": hdf("a"), "y": hdf("a2")},
        "data_map": {"data": ("x", "data"), "classes": ("y", "classes")},
        "seq_ordering": ordering,
    }
    return {
        "hdf-random": hdf("a", "b", seq_ordering="random"),
        "hdf-laplace": hdf("a", "b", seq_ordering="laplace:.5", partition_epoch=2),
        "meta-random": meta("random"),
        "meta-laplace": meta("laplace:.5"),
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
        "dfd-laplace": {
            "class": "DistributeFilesDataset",
            "files": [corpus[k] for k in "abcd"],
            "get_sub_epoch_dataset": "GET_SUB_EPOCH_DATASET_LAPLACE",  # laplace within each sub-epoch
            "partition_epoch": 2,
            "seq_ordering": "random",  # DistributeFilesDataset's own: the files' order
            "use_worker_proc": False,  # the sub-epochs read in its own process (the others: in worker processes)
        },
        "dfd-unknown": {
            "class": "DistributeFilesDataset",
            "files": [corpus[k] for k in "abcd"],
            "get_sub_epoch_dataset": "GET_SUB_EPOCH_DATASET_UNKNOWN",
            "partition_epoch": 2,
            "seq_ordering": "random",
        },
    }


SUB_EPOCH_FUNCTIONS = ("GET_SUB_EPOCH_DATASET_UNKNOWN", "GET_SUB_EPOCH_DATASET_LAPLACE", "GET_SUB_EPOCH_DATASET")


def _resolve(spec):
    import tdmappers

    name = spec.get("get_sub_epoch_dataset")
    if name in SUB_EPOCH_FUNCTIONS:
        return {**spec, "get_sub_epoch_dataset": getattr(tdmappers, name.lower())}
    return spec


def pp_epoch(spec, epoch, *, seq_list=None, seq_order=None, **pp_kwargs):
    """What RETURNN's PostprocessingDataset gives for this epoch: (tag, {key: array}, complete_frac)."""
    pp = init_dataset({"class": "PostprocessingDataset", "dataset": _resolve(spec), **pp_kwargs})
    try:
        pp.init_seq_order(epoch=epoch, seq_list=seq_list, seq_order=seq_order)
        keys = pp.get_data_keys()
        out, i = [], 0
        while pp.is_less_than_num_seqs(i):
            pp.load_seqs(i, i + 1)
            out.append((pp.get_tag(i), {k: pp.get_data(i, k) for k in keys}, pp.get_complete_frac(i)))
            i += 1
        return out
    finally:
        pp.finish_epoch(free_resources=True)


def pp_loop_epochs(spec, epochs, *, map_seq):
    """PostprocessingDataset's loop run over a DistributeFilesDataset, which PostprocessingDataset
    itself cannot wrap (RETURNN fails with KeyError: None: it asks for the data keys before an
    epoch is set up, and DistributeFilesDataset knows them only after). These are RETURNN's own
    functions of that loop (_iterate_dataset, _build_mapping_iter) with the TensorDict templates
    PostprocessingDataset makes, and the same `map_seq` (rng-free, so its rng does not matter).
    {epoch: [(tag, {key: array}, complete_frac)]}, the epochs read one after the other."""
    ds = init_dataset(_resolve(spec))
    try:
        return {epoch: _pp_loop(ds, epoch, map_seq) for epoch in epochs}
    finally:
        ds.finish_epoch(free_resources=True)


def _pp_loop(ds, epoch, map_seq):
    from returnn.datasets import postprocessing
    from returnn.tensor import TensorDict

    ds.init_seq_order(epoch=epoch)
    keys = ds.get_data_keys()
    maker = SimpleNamespace(_dataset=ds)  # all that _make_tensor_template_from_input uses
    make = postprocessing.PostprocessingDataset._make_tensor_template_from_input
    in_template = TensorDict({k: make(maker, k) for k in keys})
    out_template = in_template.copy_template()
    in_template.update(
        {
            "complete_frac": {"dims": (), "dtype": "float32"},
            "seq_idx": {"dims": (), "dtype": "int32"},
            "seq_tag": {"dims": (), "dtype": "string"},
        },
        auto_convert=True,
    )
    tdicts = postprocessing._build_mapping_iter(
        postprocessing._iterate_dataset(ds, in_tensor_dict_template=in_template),
        map_seq=map_seq,
        epoch=epoch,
        out_tensor_dict_template=out_template,
        rng=np.random.RandomState(0),
    )
    out = []
    for td in tdicts:
        frac = td.data["complete_frac"].raw_tensor
        arrays = {k: np.array(td.data[k].raw_tensor) for k in keys}
        out.append((str(td.data["seq_tag"].raw_tensor), arrays, None if frac is None else float(frac)))
    return out


def config_text(spec, body):
    """A config serving `spec` (a RETURNN dataset dict) with the mappers of tdmappers.py."""
    dataset = repr({"class": "returnn", "dataset": spec})
    for name in SUB_EPOCH_FUNCTIONS:
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


@pytest.mark.processes
@pytest.mark.parametrize(
    "name, workers",
    [("hdf-random", 2), ("hdf-laplace", 2), ("meta-random", 2), ("meta-laplace", 1), ("oggzip-text-laplace", 2),
     ("oggzip-audio-random", 2), ("dfd-random", 2), ("dfd-laplace", 1), ("dfd-unknown", 2)],
)  # fmt: skip
def test_dataset_served_as_postprocessing_dataset_gives_it(corpus, tmp_path, name, workers):
    """Each dataset class, 2 epochs of a random and of a laplace ordering, a TensorDict map_seq
    through 2 workers (1 for a class's second ordering: the 2 workers are the first one's)."""
    spec = specs(corpus)[name]
    cfg = _cfg(corpus, f"cfg_{name}", config_text(spec, "map_seq = tdmappers.scale\nnum_workers = 2\n"))
    import tdmappers

    with run_server(cfg, workers=workers, log_path=str(tmp_path / "server.log")) as srv, srv.client() as c:
        info = c.info()
        got = {e: (collect(it), it.num_seqs) for e in (1, 2) for it in [c.epoch(e)]}
    if name.startswith("dfd"):  # PostprocessingDataset cannot wrap it: its loop over the dataset
        wants = pp_loop_epochs(spec, got, map_seq=tdmappers.scale)
    else:
        wants = {epoch: pp_epoch(spec, epoch, map_seq=tdmappers.scale) for epoch in got}
    for epoch, (seqs, num_seqs) in got.items():
        want = wants[epoch]
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


@pytest.fixture(scope="module")
def hdf_server(corpus, in_temporary_cwd, tmp_path_factory):
    """One server for the tests of epoch requests and of output checks: hdf-laplace (epochs are
    halves of the corpus) and tdmappers.scale_checked, 1 worker."""
    spec = specs(corpus)["hdf-laplace"]
    cfg = _cfg(corpus, "cfg_shared", config_text(spec, "map_seq = tdmappers.scale_checked\n"))
    log_path = str(tmp_path_factory.mktemp("shared") / "server.log")
    with run_server(cfg, workers=1, log_path=log_path) as srv:
        yield srv, spec


@pytest.mark.processes
def test_tensor_dicts_carry_sparse_dims_and_vocab(hdf_server):
    import tdmappers

    srv, spec = hdf_server
    with srv.client() as c:
        got = collect(c.epoch(1))
    assert len(got) == 17  # half of 34 seqs
    assert_like_returnn(got, pp_epoch(spec, 1, map_seq=tdmappers.scale_checked))


@pytest.mark.processes
def test_class_indices_past_sparse_dim_fail_naming_the_seq(hdf_server):
    srv, spec = hdf_server
    ds = init_dataset(spec)
    ds.init_seq_order(epoch=9)
    tag = ds.get_tag(3)  # the seq scale_checked moves past sparse_dim in epoch 9
    with srv.client() as c:
        with pytest.raises(MapperError, match=r"'classes' holds class indices outside \[0, 10\)") as info:
            collect(c.epoch(9))
    assert info.value.seq_tag == tag and repr(tag) in str(info.value)


@pytest.mark.processes
def test_a_returnn_hdf_dataset_is_cut_into_batches_up_front_from_its_lengths(hdf_server):
    """RETURNN's HDFDataset knows every seq's length once the epoch is set up: the server cuts the
    epoch's batches at once (len() is known) from those lengths, and each batch holds the mapped
    seqs PostprocessingDataset gives, padded."""
    import tdmappers

    from ppclient.batching import Batching
    from ppserver.scheduler.cut import cut_epoch

    srv, spec = hdf_server
    batching = {"max_frames": 40, "bucket_window": 4}
    ds = init_dataset(spec)
    ds.init_seq_order(epoch=6)
    lengths = [int(ds.get_seq_length(i)["data"]) for i in range(ds.num_seqs)]
    want = pp_epoch(spec, 6, map_seq=tdmappers.scale_checked)
    with srv.client(batching=batching, job="returnn-batches") as c:
        it = c.epoch(6)
        cut = cut_epoch(lengths, Batching.from_dict(batching))
        assert len(it) == len(cut) > 1
        got = collect(it)
    for batch, positions in zip(got, cut):
        assert batch["seq_tag"] == [want[p][0] for p in positions]
        for row, p in enumerate(positions):
            data = want[p][1]["data"]
            assert batch["data:lengths"][row] == len(data)
            np.testing.assert_array_equal(batch["data"][row, : len(data)], data)


SEQ_LIST = ["b-1", "a-0", "a-22", "a-0"]  # from both files, one tag twice; a seq_list is served whole
SEQ_ORDER = [33, 0, 5, 5, 20]


@pytest.mark.processes
def test_seq_list_and_seq_order_as_returnn(hdf_server):
    """Through the client and through ServerDataset, the same seqs as PostprocessingDataset."""
    import tdmappers

    srv, spec = hdf_server
    with srv.client() as c:
        by_list = collect(c.epoch(2, seq_list=SEQ_LIST))
        by_order = collect(c.epoch(3, seq_order=SEQ_ORDER))
    assert [s["seq_tag"] for s in by_list] == SEQ_LIST
    assert_like_returnn(by_list, pp_epoch(spec, 2, seq_list=SEQ_LIST, map_seq=tdmappers.scale_checked))
    want = pp_epoch(spec, 3, seq_order=SEQ_ORDER, map_seq=tdmappers.scale_checked)
    assert [tag for tag, _, _ in want] == ["b-10", "a-0", "a-5", "a-5", "a-20"]
    assert_like_returnn(by_order, want)

    ds = ServerDataset(srv.address, job="returnn-api")
    try:
        for epoch, kwargs in ((4, {"seq_list": SEQ_LIST}), (5, {"seq_order": SEQ_ORDER})):
            ds.init_seq_order(epoch=epoch, **kwargs)
            got, i = [], 0
            while ds.is_less_than_num_seqs(i):
                ds.load_seqs(i, i + 1)
                seq = {k: ds.get_data(i, k) for k in ds.get_data_keys()}
                frac = ds.get_complete_frac(i, allow_only_lr_suitable=True)
                got.append({**seq, "seq_tag": ds.get_tag(i), "seq_idx": i, "complete_frac": frac})
                i += 1
            assert_like_returnn(got, pp_epoch(spec, epoch, **kwargs, map_seq=tdmappers.scale_checked))
            ds.finish_epoch()
        with pytest.raises(OptionalNotImplementedError, match="partition_epoch"):
            ds.get_total_num_seqs()  # known to RETURNN, but the server's epochs are halves of it
    finally:
        ds.finish_epoch(free_resources=True)


@pytest.mark.processes
def test_unknown_tag_or_seq_order_past_the_corpus_is_refused_and_the_running_epoch_goes_on(hdf_server):
    import tdmappers

    srv, spec = hdf_server
    with srv.client() as a, srv.client() as b:
        it = a.epoch(6)
        got = [dict(next(it)) for _ in range(3)]
        with pytest.raises(Error, match=r"cannot start epoch 7: seq_order entry 34 out of range \[0, 34\)"):
            b.epoch(7, seq_order=[0, 34])
        with pytest.raises(Error, match="cannot start epoch 7: unknown seq tag 'nope'"):
            b.epoch(7, seq_list=["a-0", "nope"])
        got += collect(it)
    assert_like_returnn(got, pp_epoch(spec, 6, map_seq=tdmappers.scale_checked))


@pytest.mark.processes
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


PRINTING = """
import os
print("the config prints")
os.write(1, b"the config writes to descriptor 1\\n")
"""


@pytest.mark.processes
def test_remote_worker_host_runs_returnn_mappers_and_stdout_carries_only_ready(corpus, tmp_path):
    """`ppserver worker` on a config and mapper module in a folder of its own runs the TensorDict
    mapper as a local worker does (the seqs RETURNN gives); the config and RETURNN print, but
    the server's stdout is its ready line and the worker host's is empty."""
    import tdmappers

    spec = specs(corpus)["hdf-random"]
    cfg = _cfg(corpus, "cfg_remote", PRINTING + config_text(spec, "map_seq = tdmappers.scale\n"))
    host = tmp_path / "host"
    host.mkdir()
    shutil.copy(cfg, host)
    shutil.copy(os.path.join(corpus["root"], "tdmappers.py"), host)
    slog, wlog = str(tmp_path / "server.log"), str(tmp_path / "worker.log")
    with run_server(cfg, workers=0, log_path=slog) as srv:
        with run_worker_host(
            str(host / "cfg_remote.py"), srv.address, procs=1, log_path=wlog, stdout=subprocess.PIPE
        ) as w:
            srv.wait_workers(1)
            assert srv.worker_pids() == children_of(w.pid)
            with srv.client() as c:
                got = {e: collect(c.epoch(e)) for e in (1, 2)}
        worker_stdout = w.stdout.read()
        w.stdout.close()
    server_stdout = srv.proc.stdout.read()
    srv.proc.stdout.close()
    for epoch in (1, 2):
        assert_like_returnn(got[epoch], pp_epoch(spec, epoch, map_seq=tdmappers.scale))
    assert srv.before_ready == [] and server_stdout == "" and worker_stdout == b""
    server_log, worker_log = read(slog), read(wlog)
    for text in ("the config prints", "the config writes to descriptor 1", "parsing file"):
        assert text in server_log, text  # "parsing file": RETURNN's HDFDataset, building the dataset
    assert "Reinitialize dataset seq order for epoch 2" in server_log  # RETURNN, in the reader thread
    assert "the config prints" in worker_log and "the config writes to descriptor 1" in worker_log


@pytest.mark.processes
def test_tensor_dict_mapper_without_mapper_api_returnn_gets_a_hint(corpus, tmp_path):
    """The most likely first mistake: the mapper gets seq dicts, and fails reaching for `.data`."""
    cfg = _cfg(
        corpus,
        "cfg_no_api",
        f"dataset = {{'class': 'HDFDataset', 'files': [{corpus['a']!r}]}}\n"
        "def map_seq(tdict, **kwargs):\n"
        "    t = tdict.data['data']\n"
        "    t.raw_tensor = t.raw_tensor * 2\n"
        "    return tdict\n",
    )
    with run_server(cfg, workers=1) as srv, srv.client() as c:
        with pytest.raises(MapperError, match="is mapper_api = 'returnn' missing") as info:
            collect(c.epoch(1))
    assert "AttributeError: 'dict' object has no attribute 'data'" in str(info.value)
    assert info.value.seq_tag == "a-0"


@pytest.mark.processes
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


@pytest.mark.processes
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
        st = c.status()
    # killed mid-epoch, holding the partition, which another worker played again
    assert st["departures"].get("exited") == 1 and st["handed_back"] >= 1, st
    want = pp_epoch(spec, 1, map_seq_stream=Sequential(LaplaceOrdering(3), tdmappers.noisy))
    assert_like_returnn(got, want, stream=True)
    # the restarted partition started from seq 0, which the one forward pass had passed
    assert "re-reading epoch 1 from its start to reach seq 0 again: MetaDataset reads forward only" in read(
        str(tmp_path / "server.log")
    )


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.mark.returnn
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


class Counting(CachedDataset2):
    """12 forward-only seqs of 3 frames (24 bytes each), seq i filled with i; `loaded` lists every
    seq RETURNN loads, so a test sees what a replay costs the dataset."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.num_outputs = {"data": (2, 2)}
        self.num_inputs = 2
        self.loaded: List[int] = []

    def get_data_keys(self):
        return ["data"]

    def get_data_dtype(self, key):
        return "float32"

    def init_seq_order(self, epoch=None, seq_list=None, seq_order=None):
        super().init_seq_order(epoch=epoch, seq_list=seq_list, seq_order=seq_order)
        self._num_seqs = 12
        return True

    def _collect_single_seq(self, seq_idx: int) -> Optional[DatasetSeq]:
        self.loaded.append(seq_idx)
        return DatasetSeq(seq_idx, features={"data": np.full((3, 2), seq_idx, "float32")}, seq_tag=f"c{seq_idx}")


@pytest.mark.returnn
def test_rewind_keeps_the_cached_seqs():
    """A jump back past the cache re-reads the prefix once; the seqs cached before it are still
    served from the cache afterwards, not by a second re-read of the forward-only dataset."""
    ds = ReturnnDataset(dataset={"class": Counting}, cache_mb=48 / (1 << 20))  # room for 2 seqs
    ds.init_seq_order(1)
    for pos in [0, 10, 5, 2, 1, 6]:  # 10 caches 1 and 2; 5 (not cached) rewinds; 2 and 1 are cached
        seq = ds.get_seq(pos)
        assert seq["seq_tag"] == f"c{pos}"
        np.testing.assert_array_equal(seq["data"], np.full((3, 2), pos, "float32"))
    assert ds.ds.loaded == [*range(11), *range(7)]
    assert ds.rewinds == 1


@pytest.mark.returnn
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


def test_what_makes_a_failing_dict_api_mapper_look_written_for_tensor_dicts():
    import functools

    from returnn.datasets.postprocessing import LaplaceOrdering, Sequential
    from returnn.tensor import TensorDict

    from ppserver.config.mappers import missing_returnn_api_hint
    from ppserver.config.settings import Config
    from ppserver.mappers.apply import MappingError

    def checks(tdict, **kwargs):
        assert isinstance(tdict, TensorDict)

    def annotated(tdict: TensorDict, **kwargs) -> TensorDict:
        return tdict

    def plain(seq, **kwargs):
        return seq

    class Mapper:
        def __call__(self, tdict, **kwargs):
            return TensorDict()

    def hint(what, fn, exc, api="dict"):
        cfg = Config(path="c.py", fingerprint="", dataset={}, mapper_api=api, **{what: fn})
        return missing_returnn_api_hint(cfg, what, exc)

    failed = AssertionError()
    for fn in (checks, annotated, Mapper(), functools.partial(checks)):
        assert "is mapper_api = 'returnn' missing?" in hint("map_seq", fn, failed), fn
    assert "This map_seq_stream looks written" in hint("map_seq_stream", Sequential(LaplaceOrdering(3)), failed)
    # failures that show it, whatever the mapper's code
    assert hint("map_seq", plain, AttributeError("'dict' object has no attribute 'data'"))
    assert hint("map_seq", plain, MappingError("map_seq must return a dict, got TensorDict"))
    # a dict mapper failing otherwise, and RETURNN mappers under mapper_api "returnn": no hint
    assert hint("map_seq", plain, failed) == hint("map_seq", plain, KeyError("data")) == ""
    assert hint("map_seq", checks, failed, api="returnn") == ""


# ---- a RETURNN training ------------------------------------------------------------------------

TRAIN_CONFIG = (
    """
#!returnn.py
import sys
sys.path.insert(0, {root!r})
import torch
import returnn.frontend as rf
from returnn.tensor import Dim, batch_dim
from ppclient.returnn import ServerDataset
import tdmappers

log_verbosity = 3
batch_size = 100
extern_data = {{"data": {{"dims": [batch_dim, Dim(None, name="time"), Dim(8, name="in")], "dtype": "float32"}}}}
train = {train}
"""
    + RETURNN_TRAINING
    + RETURNN_L2_STEP
)


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
    run_returnn(str(config), str(out_dir), timeout=180)
    batches: dict = {1: [], 2: []}
    for epoch, total, tags in returnn_batches(tags_path):
        batches[epoch].append((total, tags))
    return batches


@pytest.mark.processes
@pytest.mark.torch
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

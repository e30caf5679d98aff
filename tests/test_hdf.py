"""HDFDataset against RETURNN's HDFDataset on files RETURNN's SimpleHDFWriter wrote."""

from __future__ import annotations

import sys

import h5py
import numpy as np
import pytest
from conftest import collect, run_server, write_config
from returnn.datasets.hdf import HDFDataset as ReturnnHDFDataset
from returnn.datasets.hdf import SimpleHDFWriter

from ppserver.datasets import make_dataset
from ppserver.datasets.hdf import HDFDataset
from ppserver.errors import ConfigError

pytestmark = [pytest.mark.returnn, pytest.mark.usefixtures("in_temporary_cwd")]

LABELS = [f"lab{i}" for i in range(10)]


def write_dense(path, n, seed, prefix):
    """inputs float32 (T, 8); "classes" sparse int32 (L,) with labels; "feat2" float32 (F, 3)."""
    rng = np.random.RandomState(seed)
    writer = SimpleHDFWriter(
        str(path),
        dim=8,
        ndim=2,
        extra_type={"classes": (10, 1, "int32"), "feat2": (3, 2, "float32")},
        extra_labels={"classes": LABELS},
    )
    for i in range(n):
        frames, labels, feats = rng.randint(1, 40), rng.randint(1, 12), rng.randint(1, 7)
        writer.insert_batch(
            rng.randn(1, frames, 8).astype(np.float32),
            seq_len=[frames],
            seq_tag=[f"{prefix}-{i}"],
            extra={
                "classes": rng.randint(0, 10, size=(1, labels)).astype(np.int32),
                "feat2": rng.randn(1, feats, 3).astype(np.float32),
            },
        )
    writer.close()
    return str(path)


def write_sparse(path):
    """inputs sparse int32 (T,) of dim 10 with labels; "align" int64 with a (4, 1) size; "score"
    float32, "raw" int64 and "pos" dense int32 (T, 2) given without a type (the writer guesses the dim)."""
    rng = np.random.RandomState(5)
    writer = SimpleHDFWriter(
        str(path), dim=10, ndim=1, labels=[f"w{i}" for i in range(10)], extra_type={"align": (4, 1, "int64")}
    )
    for i in range(9):
        frames = rng.randint(1, 9)
        writer.insert_batch(
            rng.randint(0, 10, size=(1, frames)).astype(np.int32),
            seq_len=[frames],
            seq_tag=[f"sp/{i}"],
            extra={
                "align": rng.randint(0, 4, size=(1, frames + 1)).astype(np.int64),
                "score": np.array([[rng.rand()]], dtype=np.float32),
                "raw": rng.randint(0, 99, size=(1, 2)).astype(np.int64),
                "pos": rng.randint(0, 99, size=(1, frames, 2)).astype(np.int32),
            },
        )
    writer.close()
    return str(path)


def write_strings(path):
    writer = SimpleHDFWriter(str(path), dim=2, ndim=2)
    for i in range(4):
        writer.insert_batch(
            np.full((1, i + 1, 2), i, np.float32),
            seq_len=[i + 1],
            seq_tag=[f"s{i}"],
            extra={"orth": np.array([[f"hello wörld {i}"]], dtype=object)},
        )
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hdf")
    return {
        "a": write_dense(d / "a.hdf", 41, 1, "aseq"),
        "b": write_dense(d / "b.hdf", 20, 2, "bseq"),
        "sparse": write_sparse(d / "sparse.hdf"),
        "strings": write_strings(d / "strings.hdf"),
    }


def returnn_dataset(paths, **kwargs):
    ds = ReturnnHDFDataset(files=list(paths), **kwargs)
    ds.initialize()
    return ds


def returnn_epoch(ds, epoch):
    """[(corpus index, tag, {key: array})] of one RETURNN epoch."""
    ds.init_seq_order(epoch=epoch)
    out = []
    for i in range(ds.num_seqs):
        ds.load_seqs(i, i + 1)
        out.append((int(ds.get_corpus_seq_idx(i)), ds.get_tag(i), {k: ds.get_data(i, k) for k in ds.get_data_keys()}))
    return out


def assert_same_epoch(ours, epoch, want):
    ours.init_seq_order(epoch)
    assert ours.order == [idx for idx, _, _ in want]
    assert ours.num_seqs == len(want)
    for pos, (_, tag, arrays) in enumerate(want):
        seq = ours.get_seq(pos)
        assert seq["seq_tag"] == tag and seq["seq_idx"] == pos and seq["complete_frac"] == (pos + 1) / len(want)
        assert sorted(seq) == sorted([*arrays, "seq_tag", "seq_idx", "complete_frac"])
        for key, arr in arrays.items():
            if arr.dtype.hasobject:  # strings: RETURNN gives bytes objects, ppserver str arrays
                arr = np.array([x.decode() for x in arr], dtype=str)
            assert seq[key].dtype == arr.dtype, (tag, key)
            np.testing.assert_array_equal(seq[key], arr)


ORDERINGS = ["default", "sorted", "random", "random:2", "laplace:.10", "laplace:3", "sort_bin_shuffle:.10"]


@pytest.mark.parametrize("ordering", ORDERINGS)
@pytest.mark.parametrize("partition_epoch", [1, 2])
@pytest.mark.parametrize("offset", [0, 3])
def test_epochs_equal_returnn(files, ordering, partition_epoch, offset):
    paths = [files["a"], files["b"]]
    options = {"seq_ordering": ordering, "partition_epoch": partition_epoch}
    theirs = returnn_dataset(paths, random_seed_offset=offset, **options)
    ours = HDFDataset(files=paths, order_seed=offset, **options)
    assert ours.total_num_seqs == theirs.get_total_num_seqs() == 61
    for epoch in (1, 2, 3):
        assert_same_epoch(ours, epoch, returnn_epoch(theirs, epoch))


@pytest.mark.parametrize("which", ["sparse", "strings"])
@pytest.mark.parametrize("ordering", ["sorted_reverse", "laplace:.3", "sort_bin_shuffle_x2:2"])
def test_other_layouts_equal_returnn(files, which, ordering):
    theirs = returnn_dataset([files[which]], seq_ordering=ordering, fixed_random_seed=9)
    ours = make_dataset(
        {"class": "HDFDataset", "files": [files[which]], "seq_ordering": ordering, "fixed_random_seed": 9}
    )
    for epoch in (1, 2):
        assert_same_epoch(ours, epoch, returnn_epoch(theirs, epoch))


@pytest.mark.parametrize("which", [("a",), ("a", "b"), ("sparse",), ("strings",)])
def test_templates_equal_returnn(files, which):
    paths = [files[w] for w in which]
    theirs = returnn_dataset(paths)
    templates = HDFDataset(files=paths).data_keys()
    assert list(templates) == theirs.get_data_keys()
    for key, tpl in templates.items():
        dtype = theirs.get_data_dtype(key)
        assert tpl["dtype"] == ("string" if dtype == "object" else dtype), key
        shape = theirs.get_data_shape(key)  # without the time axis; None where RETURNN does not say
        assert len(tpl["shape"]) == 1 + len(shape) and tpl["shape"][0] is None
        assert all(want is None or got == want for got, want in zip(tpl["shape"][1:], shape)), (key, tpl, shape)
        dim = theirs.get_data_dim(key)
        if theirs.is_data_sparse(key):
            assert tpl["sparse_dim"] == dim, key
            labels = theirs.labels.get(key)
            assert tpl.get("labels") == (labels if labels is not None and len(labels) == dim else None), key
        else:
            assert "sparse_dim" not in tpl and "labels" not in tpl, key
            if len(tpl["shape"]) > 1:
                assert tpl["shape"][-1] == dim, key
    if which == ("a",):
        assert templates == {
            "data": {"shape": [None, 8], "dtype": "float32"},
            "classes": {"shape": [None], "dtype": "int32", "sparse_dim": 10, "labels": LABELS},
            "feat2": {"shape": [None, 3], "dtype": "float32"},
        }
    if which == ("sparse",):
        assert templates["data"] == {
            "shape": [None],
            "dtype": "int32",
            "sparse_dim": 10,
            "labels": theirs.labels["data"],
        }
        assert templates["align"] == {"shape": [None], "dtype": "int64", "sparse_dim": 4}  # only dummy labels
        assert templates["pos"] == {"shape": [None, 2], "dtype": "int32"}


def test_tags_lengths_and_seq_list(files):
    paths = [files["a"], files["b"]]
    theirs = returnn_dataset(paths, seq_ordering="sorted")
    theirs.init_seq_order(epoch=1)
    ours = HDFDataset(files=paths)
    lens = ours.seq_lens()
    assert lens.dtype == np.int64
    for i in range(theirs.num_seqs):
        idx = theirs.get_corpus_seq_idx(i)
        assert lens[idx] == theirs.get_seq_length(i)["data"]
    tags = ["bseq-3", "aseq-40", "aseq-0", "bseq-3"]
    theirs.init_seq_order(epoch=1, seq_list=tags)
    ours.init_seq_order(1, seq_list=tags)
    assert [s["seq_tag"] for s in ours.iterate()] == tags
    assert ours.order == [theirs.get_corpus_seq_idx(i) for i in range(4)] == [44, 40, 0, 44]
    ours.init_seq_order(2, seq_order=[60, 1])
    assert [s["seq_tag"] for s in ours.iterate()] == ["bseq-19", "aseq-1"]


def test_old_one_column_seq_lengths(tmp_path):
    """Old files have one length per seq for all keys."""
    lens = [3, 1, 4]
    frames = np.arange(sum(lens) * 2, dtype=np.float32).reshape(-1, 2)
    classes = np.arange(sum(lens), dtype=np.int32) % 5
    path = str(tmp_path / "old.hdf")
    with h5py.File(path, "w") as f:
        f["inputs"] = frames
        f["seqLengths"] = np.array(lens, dtype=np.int32)
        f.create_dataset("seqTags", data=np.array([b"x0", b"x1\0\0", b"x2"], dtype="S4"))
        f.attrs["inputPattSize"] = 2
        f["targets/data/classes"] = classes
        f.create_group("targets/size").attrs["classes"] = 5
        f.create_group("targets/labels")
    ds = HDFDataset(files=[path], seq_ordering="sorted")
    assert ds.data_keys()["classes"] == {"shape": [None], "dtype": "int32", "sparse_dim": 5}
    ds.init_seq_order(1)
    seqs = list(ds.iterate())
    assert [s["seq_tag"] for s in seqs] == ["x1", "x0", "x2"]
    np.testing.assert_array_equal(seqs[2]["data"], frames[4:8])
    np.testing.assert_array_equal(seqs[0]["classes"], classes[3:4])


def expect_config_error(key, fn, *args, **kwargs):
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert info.value.key == key, info.value
    assert key in str(info.value) and "\n" not in str(info.value)
    return str(info.value)


def test_one_line_errors(files, tmp_path, monkeypatch):
    missing = str(tmp_path / "missing.hdf")
    assert missing in expect_config_error("files", HDFDataset, files=[files["a"], missing])
    text = tmp_path / "text.hdf"
    text.write_text("not hdf\n")
    assert str(text) in expect_config_error("files", make_dataset, {"class": "HDFDataset", "files": [str(text)]})
    empty = tmp_path / "empty.hdf"
    h5py.File(empty, "w").close()
    assert str(empty) in expect_config_error("files", HDFDataset, files=[str(empty)])
    assert "differs from the first file" in expect_config_error(
        "files", HDFDataset, files=[files["a"], files["sparse"]]
    )
    for bad in ([], files["a"], None, [3]):
        expect_config_error("files", HDFDataset, files=bad)
    expect_config_error("seq_ordering", HDFDataset, files=[files["a"]], seq_ordering="laplace:.10:0")
    expect_config_error(
        "partition_epoch", make_dataset, {"class": "HDFDataset", "files": [files["a"]], "partition_epoch": 0}
    )
    expect_config_error("fixed_random_seed", HDFDataset, files=[files["a"]], fixed_random_seed=-2)
    err = expect_config_error("dataset", make_dataset, {"class": "HDFDataset", "files": [files["a"]], "window": 3})
    assert "window" in err
    monkeypatch.setitem(sys.modules, "h5py", None)  # as if h5py were not installed
    assert "pip install 'ppserver[hdf]'" in expect_config_error("dataset", HDFDataset, files=[files["a"]])


@pytest.mark.processes
def test_served_epochs_equal_returnn(files, tmp_path):
    """Through the server (built in its main thread, read in its reader thread), workers and a client."""
    paths = [files["a"], files["b"]]
    cfg = write_config(
        tmp_path,
        f"""
        dataset = {{"class": "HDFDataset", "files": {paths!r}, "seq_ordering": "random", "partition_epoch": 2}}
        map_seq = lambda seq, **kwargs: seq
        seed = 3
        """,
    )
    theirs = returnn_dataset(paths, seq_ordering="random", partition_epoch=2, random_seed_offset=3)
    with run_server(cfg, workers=2) as srv, srv.client() as c:
        info = c.info()
        epochs = {e: collect(c.epoch(e)) for e in (1, 2, 3)}
    assert info["data_keys"]["classes"] == {"shape": [None], "dtype": "int32", "sparse_dim": 10, "labels": LABELS}
    assert info["num_seqs"] is None  # an epoch is a part of the corpus (partition_epoch 2)
    for epoch, got in epochs.items():
        want = returnn_epoch(theirs, epoch)
        assert [s["seq_tag"] for s in got] == [tag for _, tag, _ in want]
        assert [s["seq_idx"] for s in got] == list(range(len(want)))
        for seq, (_, tag, arrays) in zip(got, want):
            for key, arr in arrays.items():
                assert seq[key].dtype == arr.dtype, (tag, key)
                np.testing.assert_array_equal(seq[key], arr)
    assert sorted(s["seq_tag"] for e in (1, 2) for s in epochs[e]) == sorted(theirs.get_all_tags())

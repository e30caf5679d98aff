"""In-process tests of ppserver.datasets, ppserver.mappers.compose and ppserver.mappers.builtin."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from ppserver.datasets import (
    Dataset,
    DemoDataset,
    NumpyDataset,
    UnknownSeqTagError,
    epoch_random_seed,
    load_npz,
    make_dataset,
    save_npz,
)
from ppserver.errors import ConfigError
from ppserver.mappers.builtin import double, spec_augment
from ppserver.mappers.compose import LaplaceOrdering, Sequential

pytestmark = pytest.mark.unit

LENS = [5, 3, 9, 1, 7, 7, 2, 8, 4, 6, 3, 10, 2]


def make_seqs(lens=LENS, feat=3):
    return [
        {
            "data": np.full((n, feat), i, dtype=np.float32),
            "classes": np.arange(max(1, n // 2), dtype=np.int32),
        }
        for i, n in enumerate(lens)
    ]


def make_ds(seq_ordering="default", order_seed=0, lens=LENS):
    return NumpyDataset(seqs=make_seqs(lens), seq_ordering=seq_ordering, order_seed=order_seed)


def reference_laplace(lens, bins, seed):
    """The laplace ordering as RETURNN's Dataset.get_seq_order_for_epoch computes it."""
    lens = np.asarray(lens)
    seq_index = np.random.RandomState(seed).permutation(len(lens))
    out = []
    for i in range(bins):
        part = seq_index[i * len(seq_index) // bins : (i + 1) * len(seq_index) // bins]
        part_lens = lens[part]
        if i % 2 == 1:
            part_lens = -part_lens
        out.append(part[np.argsort(part_lens, kind="stable")])
    return [int(i) for i in np.concatenate(out)]


def expect_config_error(key, fn, *args, **kwargs):
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert info.value.key == key
    assert key in str(info.value) and "\n" not in str(info.value)
    return info.value


# ---- orderings ------------------------------------------------------------------------------


def test_default_and_reverse():
    ds = make_ds("default")
    ds.init_seq_order(1)
    assert ds.order == list(range(len(LENS)))
    ds = make_ds("reverse")
    ds.init_seq_order(1)
    assert ds.order == list(range(len(LENS)))[::-1]


def test_sorted_orderings_are_stable():
    ds = make_ds("sorted")
    ds.init_seq_order(1)
    assert ds.order == sorted(range(len(LENS)), key=lambda i: LENS[i])
    ds = make_ds("sorted_reverse")
    ds.init_seq_order(1)
    assert ds.order == sorted(range(len(LENS)), key=lambda i: LENS[i], reverse=True)
    # equal lengths keep corpus order: 4 and 5 both have length 7
    assert ds.order.index(4) < ds.order.index(5)


def test_random_deterministic_per_seed_and_epoch():
    orders = {}
    for seed in (0, 1):
        for epoch in (1, 2):
            ds = make_ds("random", order_seed=seed)
            ds.init_seq_order(epoch)
            again = make_ds("random", order_seed=seed)
            again.init_seq_order(epoch)
            assert ds.order == again.order
            assert sorted(ds.order) == list(range(len(LENS)))
            orders[seed, epoch] = ds.order
    assert orders[0, 1] != orders[0, 2]
    assert orders[0, 1] != orders[1, 1]
    expected = np.random.RandomState(epoch_random_seed(0, 1)).permutation(len(LENS)).tolist()
    assert orders[0, 1] == expected


@pytest.mark.parametrize(
    "ordering, bins",
    [("laplace", 2), ("laplace:3", 3), ("laplace:1", 1), ("laplace:.4", len(LENS) // 4), ("laplace:.100", 2)],
)
def test_laplace_matches_returnn_algorithm(ordering, bins):
    for epoch in (1, 2, 7):
        ds = make_ds(ordering, order_seed=5)
        ds.init_seq_order(epoch)
        assert ds.order == reference_laplace(LENS, bins, epoch_random_seed(5, epoch))


def test_laplace_bins_alternate_direction():
    lens = list(range(1, 21))
    ds = NumpyDataset(seqs=make_seqs(lens), seq_ordering="laplace:4", order_seed=3)
    ds.init_seq_order(1)
    got = [lens[i] for i in ds.order]
    for b in range(4):
        part = got[b * 5 : (b + 1) * 5]
        assert part == sorted(part, reverse=b % 2 == 1)


def test_bad_seq_ordering_is_config_error():
    for bad in ("shuffle", "laplace:", "laplace:x", "laplace:0", "laplace:.0", 3):
        expect_config_error("seq_ordering", make_ds, bad)
    expect_config_error("order_seed", make_ds, "default", order_seed=-1)


def test_seq_list_and_seq_order():
    ds = make_ds("random")
    ds.init_seq_order(1, seq_list=["seq-3", "seq-0", "seq-3"])
    assert ds.order == [3, 0, 3]
    assert [s["seq_tag"] for s in ds.iterate()] == ["seq-3", "seq-0", "seq-3"]
    with pytest.raises(ValueError, match="nope"):
        ds.init_seq_order(1, seq_list=["seq-1", "nope"])
    with pytest.raises(KeyError):
        ds.init_seq_order(1, seq_list=["nope"])
    ds.init_seq_order(2, seq_order=[5, 1])
    assert ds.order == [5, 1] and ds.num_seqs == 2
    for bad in ([len(LENS)], [-1], [1.5]):
        with pytest.raises(ValueError):
            ds.init_seq_order(1, seq_order=bad)
    with pytest.raises(ValueError):
        ds.init_seq_order(1, seq_list=["seq-1"], seq_order=[1])


def test_state_before_init_and_meta():
    ds = make_ds()
    assert ds.total_num_seqs == len(LENS)
    with pytest.raises(RuntimeError):
        _ = ds.num_seqs
    with pytest.raises(RuntimeError):
        ds.get_seq(0)
    ds.init_seq_order(1, seq_order=[2, 4, 6, 8])
    seqs = list(ds.iterate())
    assert [s["seq_idx"] for s in seqs] == [0, 1, 2, 3]
    assert [s["complete_frac"] for s in seqs] == [0.25, 0.5, 0.75, 1.0]
    assert [s["seq_tag"] for s in seqs] == ["seq-2", "seq-4", "seq-6", "seq-8"]
    assert seqs[1]["data"].shape == (7, 3) and np.all(seqs[1]["data"] == 4)
    with pytest.raises(IndexError):
        ds.get_seq(4)
    # get_seq hands out read-only views: nothing can change the corpus through them
    with pytest.raises(ValueError, match="read-only"):
        seqs[0]["data"][:] = -1
    assert np.all(ds.get_seq(0)["data"] == 2)


def test_data_keys():
    assert make_ds().data_keys() == {
        "data": {"shape": [None, 3], "dtype": "float32"},
        "classes": {"shape": [None], "dtype": "int32"},
    }
    ds = NumpyDataset(seqs=make_seqs([4, 4, 4]))
    assert ds.data_keys()["data"] == {"shape": [4, 3], "dtype": "float32"}


class _GenericDataset(Dataset):
    """Only the required hooks, to exercise the base-class defaults."""

    def __init__(self, lens, **kwargs):
        super().__init__(**kwargs)
        self.lens = lens

    def _num_corpus_seqs(self):
        return len(self.lens)

    def _load(self, corpus_idx):
        return {"feat": np.zeros((self.lens[corpus_idx], 2), np.float64)}

    def _tag(self, corpus_idx):
        return f"g{corpus_idx}"


def test_base_class_defaults():
    ds = _GenericDataset([3, 1, 2], seq_ordering="sorted")
    ds.init_seq_order(0)
    assert ds.order == [1, 2, 0]
    assert ds.data_keys() == {"feat": {"shape": [None, 2], "dtype": "float64"}}
    ds.init_seq_order(0, seq_list=["g2"])
    assert ds.get_seq(0)["seq_tag"] == "g2"


# ---- NumpyDataset ---------------------------------------------------------------------------


def test_npz_round_trip(tmp_path):
    seqs = make_seqs([3, 5, 2])
    path = tmp_path / "corpus.npz"
    save_npz(path, seqs, tags=["a", "b", "c"])
    assert path.exists()
    with np.load(path) as npz:
        assert sorted(npz.files) == sorted(["tags"] + [f"seq{i}/{k}" for i in range(3) for k in ("data", "classes")])
    ds = NumpyDataset(path=str(path))
    ds.init_seq_order(1, seq_list=["c", "a"])
    got = ds.get_seq(0)
    assert got["seq_tag"] == "c"
    np.testing.assert_array_equal(got["data"], seqs[2]["data"])
    assert got["data"].dtype == np.float32 and got["classes"].dtype == np.int32

    save_npz(tmp_path / "notags", seqs)
    loaded, tags = load_npz(tmp_path / "notags")
    assert tags is None and list(loaded[1]) == ["data", "classes"]
    ds = NumpyDataset(path=tmp_path / "notags", tags=["x", "y", "z"])
    ds.init_seq_order(0)
    assert [s["seq_tag"] for s in ds.iterate()] == ["x", "y", "z"]


def test_npz_errors(tmp_path):
    expect_config_error("path", NumpyDataset, path=tmp_path / "missing.npz")
    bad = tmp_path / "bad.npz"
    with open(bad, "wb") as f:
        np.savez(f, foo=np.zeros(3))
    expect_config_error("path", NumpyDataset, path=bad)


def test_tags_default_and_validation():
    ds = make_ds()
    ds.init_seq_order(0)
    assert [s["seq_tag"] for s in ds.iterate()][:3] == ["seq-0", "seq-1", "seq-2"]
    seqs = make_seqs([2, 3])
    expect_config_error("tags", NumpyDataset, seqs=seqs, tags=["a"])
    expect_config_error("tags", NumpyDataset, seqs=seqs, tags=["a", "a"])
    expect_config_error("tags", NumpyDataset, seqs=seqs, tags=["a", 1])


def test_seqs_validation():
    seqs = make_seqs([2, 3])
    expect_config_error("seqs", NumpyDataset)
    expect_config_error("seqs", NumpyDataset, seqs=seqs, path="x.npz")
    expect_config_error("seqs", NumpyDataset, seqs=[])
    expect_config_error("seqs", NumpyDataset, seqs="nope")
    expect_config_error("seqs", NumpyDataset, seqs=[seqs[0], {"data": seqs[1]["data"]}])
    expect_config_error("seqs", NumpyDataset, seqs=[seqs[0], {**seqs[1], "data": seqs[1]["data"].astype(np.float64)}])
    expect_config_error("seqs", NumpyDataset, seqs=[seqs[0], {**seqs[1], "data": np.zeros(3, np.float32)}])
    expect_config_error("seqs", NumpyDataset, seqs=[{"data": np.zeros(2), "seq_tag": np.zeros(2)}])


# ---- DemoDataset ----------------------------------------------------------------------------


def test_demo_dataset_shapes_and_determinism():
    ds = DemoDataset(num_seqs=6, num_features=16, num_classes=5, min_frames=8, max_frames=60, seed=1)
    ds.init_seq_order(1)
    seqs = list(ds.iterate())
    assert [s["seq_tag"] for s in seqs] == [f"demo-{i}" for i in range(6)]
    for s, n in zip(seqs, ds.seq_lens()):
        assert s["data"].dtype == np.float32 and s["data"].shape == (n, 16)
        assert s["classes"].dtype == np.int32 and s["classes"].shape == (max(1, n // 8),)
        assert 8 <= n <= 60
        assert s["data"].min() >= -10 and s["data"].max() <= 5
        assert 0 <= s["classes"].min() and s["classes"].max() < 5
    assert len(set(ds.seq_lens().tolist())) > 1
    other = DemoDataset(
        num_seqs=6, num_features=16, num_classes=5, min_frames=8, max_frames=60, seed=1, seq_ordering="reverse"
    )
    other.init_seq_order(3)
    twin = other.get_seq(5)  # corpus seq 0
    np.testing.assert_array_equal(twin["data"], seqs[0]["data"])
    np.testing.assert_array_equal(twin["classes"], seqs[0]["classes"])
    diff = DemoDataset(num_seqs=6, num_features=16, num_classes=5, min_frames=8, max_frames=60, seed=2)
    diff.init_seq_order(1)
    assert not np.array_equal(diff.get_seq(0)["data"][:8], seqs[0]["data"][:8])
    assert ds.data_keys() == {
        "data": {"shape": [None, 16], "dtype": "float32"},
        "classes": {"shape": [None], "dtype": "int32"},
    }


def test_demo_dataset_fixed_length_and_sorting():
    ds = DemoDataset(num_seqs=3, min_frames=16, max_frames=16, num_features=4)
    assert ds.data_keys() == {
        "data": {"shape": [16, 4], "dtype": "float32"},
        "classes": {"shape": [2], "dtype": "int32"},
    }
    ds = DemoDataset(num_seqs=50, seq_ordering="sorted")
    ds.init_seq_order(1)
    lens = ds.seq_lens()
    assert [lens[i] for i in ds.order] == sorted(lens)
    ds.init_seq_order(1, seq_list=["demo-49", "demo-0"])
    assert ds.order == [49, 0]
    for bad in ("demo-50", "demo-01", "seq-1"):
        with pytest.raises(UnknownSeqTagError):
            ds.init_seq_order(1, seq_list=[bad])


def test_demo_dataset_validation():
    expect_config_error("num_seqs", DemoDataset, num_seqs=0)
    expect_config_error("max_frames", DemoDataset, min_frames=10, max_frames=5)
    expect_config_error("num_features", DemoDataset, num_features=2.5)


# ---- make_dataset ---------------------------------------------------------------------------


def test_make_dataset_builtin_and_order_seed():
    ds = make_dataset({"class": "DemoDataset", "num_seqs": 5, "seq_ordering": "random"}, order_seed=7)
    assert isinstance(ds, DemoDataset) and ds.order_seed == 7 and ds.total_num_seqs == 5
    ds = make_dataset({"class": "DemoDataset", "num_seqs": 5, "order_seed": 2}, order_seed=7)
    assert ds.order_seed == 2
    ds = make_dataset({"class": "ppserver.datasets.arrays:NumpyDataset", "seqs": make_seqs([1, 2])})
    assert isinstance(ds, NumpyDataset)


def test_make_dataset_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_ds_mod.py").write_text(
        textwrap.dedent(
            """
            import numpy as np
            from ppserver.datasets.base import Dataset

            class Tiny(Dataset):
                def __init__(self, *, n=2, **kwargs):
                    super().__init__(**kwargs)
                    self.n = n
                def _num_corpus_seqs(self):
                    return self.n
                def _load(self, i):
                    return {"data": np.zeros((i + 1, 1), np.float32)}
                def _tag(self, i):
                    return f"t{i}"

            class NotADataset:
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    ds = make_dataset({"class": "my_ds_mod:Tiny", "n": 3, "seq_ordering": "sorted_reverse"})
    ds.init_seq_order(1)
    assert ds.order == [2, 1, 0] and ds.get_seq(0)["data"].shape == (3, 1)

    err = expect_config_error("dataset", make_dataset, {"class": "my_ds_mod:Missing"})
    assert "cannot import class 'my_ds_mod:Missing'" in str(err)
    err = expect_config_error("dataset", make_dataset, {"class": "no_such_pkg_xyz.mod:Thing"})
    assert "cannot import class 'no_such_pkg_xyz.mod:Thing'" in str(err)
    expect_config_error("dataset", make_dataset, {"class": "my_ds_mod:NotADataset"})
    expect_config_error("dataset", make_dataset, {"class": "my_ds_mod:Tiny", "bogus": 1})


def test_make_dataset_constructor_failures_are_config_errors(tmp_path, monkeypatch):
    (tmp_path / "failing_ds_mod.py").write_text(
        textwrap.dedent(
            """
            from ppserver.datasets.base import Dataset
            from ppserver.errors import ConfigError

            class Failing(Dataset):
                def __init__(self, *, exc, **kwargs):
                    super().__init__(**kwargs)
                    raise exc
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    err = expect_config_error("dataset", make_dataset, {"class": "failing_ds_mod:Failing", "exc": ValueError("a\nb")})
    assert str(err) == "config key 'dataset': Failing: ValueError: a b"
    missing = FileNotFoundError(2, "No such file or directory", "corpus.txt")
    err = expect_config_error("dataset", make_dataset, {"class": "failing_ds_mod:Failing", "exc": missing})
    assert "Failing: FileNotFoundError:" in str(err) and "corpus.txt" in str(err)
    expect_config_error("dataset", make_dataset, {"class": "failing_ds_mod:Failing", "exc": SystemExit(0)})
    # a ConfigError of the dataset's own keeps its key
    own = ConfigError("seq_ordering", "bad")
    assert expect_config_error("seq_ordering", make_dataset, {"class": "failing_ds_mod:Failing", "exc": own}) is own


def test_make_dataset_errors():
    expect_config_error("dataset", make_dataset, {"num_seqs": 3})
    expect_config_error("dataset", make_dataset, {"class": "NoSuchDataset"})
    expect_config_error("dataset", make_dataset, "DemoDataset")
    err = expect_config_error("dataset", make_dataset, {"class": "DemoDataset", "frames": 3})
    assert "frames" in str(err)
    # a dataset's own validation keeps its key
    expect_config_error("num_seqs", make_dataset, {"class": "DemoDataset", "num_seqs": -1})
    expect_config_error("seq_ordering", make_dataset, {"class": "DemoDataset", "seq_ordering": "bad"})


# ---- mapping --------------------------------------------------------------------------------


def test_sequential_composition_and_preserves_num_seqs():
    calls = []

    def add(x, **kwargs):
        calls.append(("add", kwargs))
        return x + 1

    def mul(x, **kwargs):
        calls.append(("mul", kwargs))
        return x * 10

    seq = Sequential(add, mul)
    assert seq(1, epoch=3) == 20
    assert calls == [("add", {"epoch": 3}), ("mul", {"epoch": 3})]
    assert Sequential()(5) == 5
    assert not seq.preserves_num_seqs
    add.preserves_num_seqs = True
    assert not seq.preserves_num_seqs
    mul.preserves_num_seqs = True
    assert seq.preserves_num_seqs
    assert Sequential(LaplaceOrdering(2), Sequential(LaplaceOrdering(3))).preserves_num_seqs
    with pytest.raises(TypeError):
        Sequential(3)


def laplace_stream(lens):
    n = len(lens)
    return [
        {"data": np.zeros((length, 2), np.float32), "id": i, "complete_frac": (i + 1) / n}
        for i, length in enumerate(lens)
    ]


def test_laplace_ordering():
    lens = [5, 3, 9, 1, 7, 7, 2, 8, 4, 6, 3]
    seqs = laplace_stream(lens)
    out = list(LaplaceOrdering(4)(iter(seqs), epoch=1))
    assert [s["id"] for s in out] == [3, 1, 0, 2, 7, 4, 5, 6, 10, 8, 9]
    got_lens = [s["data"].shape[0] for s in out]
    assert got_lens[0:4] == sorted(lens[0:4])
    assert got_lens[4:8] == sorted(lens[4:8], reverse=True)
    assert got_lens[8:] == sorted(lens[8:])
    # complete_frac stays in stream position
    assert [s["complete_frac"] for s in out] == [s["complete_frac"] for s in seqs]
    # inputs are not modified
    assert [s["complete_frac"] for s in seqs] == [(i + 1) / len(lens) for i in range(len(lens))]
    assert LaplaceOrdering.preserves_num_seqs and LaplaceOrdering(1).preserves_num_seqs


def test_laplace_ordering_edges():
    assert list(LaplaceOrdering(3)(iter([]))) == []
    seqs = laplace_stream([3, 1, 2])
    assert [s["id"] for s in LaplaceOrdering(3)(seqs)] == [1, 2, 0]
    assert [s["id"] for s in LaplaceOrdering(1)(seqs)] == [0, 1, 2]
    no_frac = [{"x": np.zeros(n)} for n in (3, 1, 2, 5)]
    out = list(LaplaceOrdering(2, length_key="x")(iter(no_frac)))
    assert [s["x"].shape[0] for s in out] == [1, 3, 5, 2]
    assert all("complete_frac" not in s for s in out)
    with pytest.raises(ValueError):
        LaplaceOrdering(0)


def test_laplace_ordering_pulls_lazily():
    pulled = []

    def source():
        for s in laplace_stream(list(range(1, 10))):
            pulled.append(s["id"])
            yield s

    it = LaplaceOrdering(3)(source())
    next(it)
    assert pulled == [0, 1, 2]
    next(it)
    assert pulled == [0, 1, 2, 3]  # one item of the next bin per yielded item
    next(it)
    assert pulled == [0, 1, 2, 3, 4]


# ---- mappers --------------------------------------------------------------------------------


def test_spec_augment_deterministic_and_masks_are_zero():
    base = np.random.RandomState(0).uniform(1.0, 2.0, size=(100, 40)).astype(np.float32)
    seq = {"data": base, "classes": np.arange(4, dtype=np.int32), "seq_tag": "t", "complete_frac": 0.5}
    out1 = spec_augment(seq, rng=np.random.RandomState(42), epoch=1, seq_idx=0, unused=1)
    out2 = spec_augment(seq, rng=np.random.RandomState(42))
    out3 = spec_augment(seq, rng=np.random.RandomState(43))
    np.testing.assert_array_equal(out1["data"], out2["data"])
    assert not np.array_equal(out1["data"], out3["data"])
    assert out1["data"].dtype == np.float32 and out1["data"].shape == base.shape
    assert np.all(seq["data"] == base) and seq["data"].min() > 0  # input untouched
    assert out1["classes"] is seq["classes"] and out1["seq_tag"] == "t" and out1["complete_frac"] == 0.5
    for out in (out1, out3):
        zero = out["data"] == 0
        rows = zero.all(axis=1)
        cols = zero.all(axis=0)
        assert rows.any() and cols.any()
        # every zero lies in a fully zeroed row or column; everything else is unchanged
        assert np.array_equal(zero, rows[:, None] | cols[None, :])
        np.testing.assert_array_equal(out["data"][~zero], base[~zero])
        assert rows.sum() <= 2 * 20 and cols.sum() <= 2 * 10


def test_spec_augment_limits():
    base = np.ones((5, 3), np.float32)
    out = spec_augment({"data": base}, rng=np.random.RandomState(0), max_time_masks=0, max_freq_masks=0)
    np.testing.assert_array_equal(out["data"], base)
    out = spec_augment({"feat": base}, rng=np.random.RandomState(0), key="feat", max_time_width=50)
    assert out["feat"].shape == (5, 3)
    with pytest.raises(ValueError):
        spec_augment({"data": np.ones(5)}, rng=np.random.RandomState(0))


def test_double():
    seq = {
        "data": np.array([[1.5, -2.0]], np.float32),
        "f64": np.array([0.25]),
        "classes": np.array([1, 2], np.int32),
        "seq_tag": "x",
        "complete_frac": 0.5,
    }
    out = double(seq, epoch=1)
    assert out["data"].dtype == np.float32
    np.testing.assert_array_equal(out["data"], [[3.0, -4.0]])
    np.testing.assert_array_equal(out["f64"], [0.5])
    assert out["classes"] is seq["classes"] and out["complete_frac"] == 0.5 and out["seq_tag"] == "x"
    np.testing.assert_array_equal(seq["data"], [[1.5, -2.0]])


def test_pipeline_over_demo_dataset():
    ds = DemoDataset(num_seqs=8, num_features=8, max_frames=60, seed=3)
    ds.init_seq_order(1)
    rng = np.random.RandomState(0)
    mapped = (Sequential(spec_augment, double)(s, rng=rng, epoch=1) for s in ds.iterate())
    out = list(LaplaceOrdering(4)(mapped))
    assert sorted(s["seq_tag"] for s in out) == sorted(f"demo-{i}" for i in range(8))
    assert [s["complete_frac"] for s in out] == [(i + 1) / 8 for i in range(8)]

"""Epoch orders of ppserver's datasets against RETURNN's Dataset.get_seq_order_for_epoch."""

from __future__ import annotations

import numpy as np
import pytest
from returnn.datasets.generating import StaticDataset

from ppserver.datasets import DemoDataset, NumpyDataset, epoch_random_seed, make_dataset
from ppserver.errors import ConfigError

pytestmark = pytest.mark.returnn  # compared with RETURNN, in this process

ORDERINGS = [
    "default",
    "reverse",
    "sorted",
    "sorted_reverse",
    "random",
    "random:2",
    "random:3",
    "laplace",
    "laplace:1",
    "laplace:3",
    "laplace:100",
    "laplace:.10",
    "laplace:.10:2",
    "laplace:3:3",
    "sort_bin_shuffle",
    "sort_bin_shuffle:1",
    "sort_bin_shuffle:.10",
    "sort_bin_shuffle:3:2",
    "sort_bin_shuffle_x2",
    "sort_bin_shuffle_x2:4",
    "sort_bin_shuffle_x2:.7:2",
]
# ppserver's order_seed plays RETURNN's random_seed_offset.
OPTIONS = [
    {},
    {"partition_epoch": 2},
    {"partition_epoch": 3},
    {"random_seed_offset": 5},
    {"fixed_random_seed": 42},
    {"partition_epoch": 2, "random_seed_offset": 3},
]


def returnn_orders(lens, ordering, epochs, **options):
    """RETURNN's corpus indices per epoch for seqs of these lengths."""
    seqs = [{"data": np.zeros((int(n), 2), np.float32)} for n in lens]
    ds = StaticDataset(seqs, output_dim={"data": (2, 2)}, seq_ordering=ordering, **options)
    ds.initialize()
    out = []
    for epoch in epochs:
        ds.init_seq_order(epoch=epoch)
        out.append([int(i) for i in ds.get_current_seq_order()])
    return out


def ours(options):
    options = dict(options)
    options["order_seed"] = options.pop("random_seed_offset", 0)
    return options


@pytest.mark.parametrize("ordering", ORDERINGS)
@pytest.mark.parametrize("n", [53, 5, 1])
def test_numpy_dataset_orders_equal_returnn(ordering, n):
    lens = np.random.RandomState(n).randint(1, 12, size=n)  # many equal lengths: ties must break alike
    epochs = [0, 1, 2, 3, 4, 5, 7]
    for options in OPTIONS:
        ds = NumpyDataset(
            seqs=[{"data": np.zeros((int(k), 2), np.float32)} for k in lens], seq_ordering=ordering, **ours(options)
        )
        got = []
        for epoch in epochs:
            ds.init_seq_order(epoch)
            got.append(ds.order)
        assert got == returnn_orders(lens, ordering, epochs, **options), options


@pytest.mark.parametrize("ordering", ["random:2", "laplace:.20", "sort_bin_shuffle_x2:.20"])
def test_demo_dataset_orders_equal_returnn(ordering):
    ds = make_dataset(
        {"class": "DemoDataset", "num_seqs": 90, "seq_ordering": ordering, "partition_epoch": 3}, order_seed=11
    )
    assert isinstance(ds, DemoDataset)
    got = []
    for epoch in range(1, 8):
        ds.init_seq_order(epoch)
        got.append(ds.order)
        assert ds.num_seqs == 30
        assert [s["complete_frac"] for s in ds.iterate()][-1] == 1.0
    want = returnn_orders(ds.seq_lens(), ordering, range(1, 8), partition_epoch=3, random_seed_offset=11)
    assert got == want


def test_seed_rule():
    assert [epoch_random_seed(0, e) for e in (0, 1, 2, 3)] == [1, 1, 2, 3]
    assert [epoch_random_seed(5, e) for e in (1, 2)] == [6, 7]
    assert [epoch_random_seed(0, e, nth=2) for e in (1, 2, 3, 4, 5)] == [1, 1, 2, 2, 3]
    assert [epoch_random_seed(0, e, partition_epoch=2) for e in (1, 2, 3, 4)] == [1, 1, 2, 2]
    assert [epoch_random_seed(1, e, partition_epoch=2, nth=2) for e in range(1, 6)] == [2, 2, 2, 2, 3]
    assert epoch_random_seed(9, 4, nth=3, partition_epoch=2, fixed_random_seed=7) == 7


def test_partitions_cover_the_full_epoch_once():
    ds = NumpyDataset(
        seqs=[{"data": np.zeros((k % 7 + 1, 1))} for k in range(11)], seq_ordering="random", partition_epoch=3
    )
    parts = []
    for epoch in (1, 2, 3):
        ds.init_seq_order(epoch)
        parts.append(ds.order)
    assert [len(p) for p in parts] == [4, 4, 3]
    assert sorted(i for part in parts for i in part) == list(range(11))
    ds.init_seq_order(4)  # the next full epoch: a new shuffle
    assert ds.order != parts[0]
    # a seq list overrides the ordering and is served whole
    ds.init_seq_order(2, seq_order=[3, 1, 4, 1, 5])
    assert ds.order == [3, 1, 4, 1, 5] and ds.num_seqs == 5


def expect_config_error(key, fn, *args, **kwargs):
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert info.value.key == key, info.value
    assert key in str(info.value) and "\n" not in str(info.value)
    return info.value


def test_bad_ordering_options_are_config_errors():
    seqs = [{"data": np.zeros((3, 1))}]
    for bad in ("random:", "random:0", "random:x", "random:2:2", "laplace:3:0", "laplace:.10:", "laplace:1:2:3",
                "sort_bin_shuffle:", "sort_bin_shuffle:.0", "sort_bin_shuffle_x2:x", "sort_bin_shuffle:2:-1",
                "default_every_n:2", "sorted:2"):  # fmt: skip
        expect_config_error("seq_ordering", NumpyDataset, seqs=seqs, seq_ordering=bad)
    for bad in (0, -1, 1.5, "2", True, None):
        expect_config_error("partition_epoch", NumpyDataset, seqs=seqs, partition_epoch=bad)
    for bad in (-1, 2**32, 1.0, "7", False):
        expect_config_error("fixed_random_seed", NumpyDataset, seqs=seqs, fixed_random_seed=bad)
    expect_config_error("order_seed", NumpyDataset, seqs=seqs, order_seed=2**32)
    expect_config_error("partition_epoch", make_dataset, {"class": "DemoDataset", "partition_epoch": 0})
    err = expect_config_error("seq_ordering", make_dataset, {"class": "DemoDataset", "seq_ordering": "shuffle"})
    assert "sort_bin_shuffle" in str(err)  # the message lists the orderings

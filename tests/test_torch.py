"""ppclient.torch against a real server: tensors, DataLoader workers, StatefulDataLoader resume, batching."""

from __future__ import annotations

import copy
import gc
import importlib
import threading
import warnings
from typing import Any, Dict, List

import numpy as np
import pytest
from conftest import assert_same_epoch, have_modules, numpy_config, reference, run_server, write_config

from ppclient.client import EpochIterator
from ppclient.errors import UsageError

# torch loads when a test first uses it, so collecting this module (e.g. for `-m unit`) stays cheap
pytestmark = pytest.mark.skipif(not have_modules("torch", "torchdata"), reason="needs torch and torchdata")


class _Lazy:
    """A module imported at its first attribute."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # what collection looks for on every name (torch has none such)
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)


torch = _Lazy("torch")
stateful = _Lazy("torchdata.stateful_dataloader")
data = _Lazy("torch.utils.data")
pptorch = _Lazy("ppclient.torch")


MAPPER = """
def map_seq(seq, *, rng, **kwargs):
    seq["data"] = seq["data"] * rng.uniform(0.5, 1.5)
    return seq
"""


def as_numpy(seq: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in seq.items()}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch")
    cfg = numpy_config(tmp, MAPPER, n=37, ordering="random", extra="buf_size = 4\n")
    with run_server(cfg, workers=2) as srv:
        yield srv, cfg


def test_seqs_come_as_tensors_without_a_copy_or_warning(server, monkeypatch):
    srv, cfg = server
    received: List[Dict[str, Any]] = []
    take = EpochIterator.__next__

    def recorded(it):
        seq = take(it)
        received.append(seq)
        return seq

    monkeypatch.setattr(EpochIterator, "__next__", recorded)
    ds = pptorch.ServerDataset(srv.address, job="t1", epoch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PyTorch's "non-writable array" warning would fail the test
        got = list(data.DataLoader(ds, batch_size=None))
    assert all(isinstance(s["data"], torch.Tensor) and s["data"].dtype == torch.float32 for s in got)
    assert_same_epoch([as_numpy(s) for s in got], reference(cfg, 2))
    assert len(received) == len(got)
    for seq, arrays in zip(got, received):
        for key in ("data", "classes"):  # each tensor is the received array's memory: no copy
            assert arrays[key].flags.writeable and seq[key].data_ptr() == arrays[key].ctypes.data, key


@pytest.mark.parametrize("world, workers", [(1, 2), (1, 3), (2, 2)])
def test_loader_workers_take_subshards_and_the_loader_yields_epoch_order(server, world, workers):
    srv, cfg = server
    want = reference(cfg, 1)
    got: Dict[int, List[Dict[str, Any]]] = {}

    def rank_main(rank: int) -> None:  # the ranks pull at once, as DDP ranks do
        ds = pptorch.ServerDataset(srv.address, job=f"t2-{world}-{workers}", rank=rank, world_size=world, epoch=1)
        got[rank] = [as_numpy(s) for s in data.DataLoader(ds, batch_size=None, num_workers=workers)]

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for rank in range(world):
        assert_same_epoch(got[rank], want[rank : len(want) // world * world : world])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("bucket", [1, 5])
def test_stateful_dataloader_resumes_exactly(server, workers, bucket):
    srv, cfg = server
    want = reference(cfg, 3)
    opts = dict(job=f"t3-{workers}-{bucket}", epoch=3, batch_frames=200, bucket_window=bucket)
    loader = stateful.StatefulDataLoader(
        pptorch.ServerDataset(srv.address, **opts), batch_size=None, num_workers=workers
    )
    it = iter(loader)
    first = [next(it) for _ in range(4)]
    state = loader.state_dict()
    straight = first + list(it)  # the uninterrupted epoch, batch by batch
    resumed = stateful.StatefulDataLoader(
        pptorch.ServerDataset(srv.address, **opts), batch_size=None, num_workers=workers
    )
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert [b["seq_tag"] for b in first + rest] == [b["seq_tag"] for b in straight]
    for got, exp in zip(first + rest, straight):
        assert torch.equal(got["data"], exp["data"]) and torch.equal(got["data:lengths"], exp["data:lengths"])
    tags = sorted(t for b in straight for t in b["seq_tag"])
    assert tags == sorted(s["seq_tag"] for s in want)  # every seq once


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loaded_state_resumes_its_epoch_and_set_epoch_picks_the_next(server, workers):
    srv, cfg = server
    want = {e: reference(cfg, e) for e in (1, 2, 3)}

    def loader(state=None):
        ds = pptorch.ServerDataset(srv.address, job=f"t6-{workers}")
        ld = stateful.StatefulDataLoader(ds, batch_size=None, num_workers=workers)
        if state is not None:
            ld.load_state_dict(copy.deepcopy(state))  # as from a checkpoint
        return ds, ld

    ds, ld = loader()
    ds.set_epoch(1)
    assert_same_epoch([as_numpy(s) for s in ld], want[1])
    at_end = ld.state_dict()  # a checkpoint after epoch 1
    ds.set_epoch(2)
    it = iter(ld)
    first = [as_numpy(next(it)) for _ in range(5)]
    mid = ld.state_dict()  # a checkpoint in the middle of epoch 2
    assert_same_epoch(first + [as_numpy(s) for s in it], want[2])

    # the training loop resumes as it runs: set_epoch, then iterate (the state loads lazily, after it)
    ds, ld = loader(at_end)
    ds.set_epoch(2)
    assert_same_epoch([as_numpy(s) for s in ld], want[2])  # epoch 2, not epoch 1 again
    ds, ld = loader(mid)
    ds.set_epoch(2)
    assert_same_epoch(first + [as_numpy(s) for s in ld], want[2])  # the rest of epoch 2
    ds, ld = loader(mid)
    assert ds.epoch == 1 and ds.state_dict()["epoch"] == 1  # nothing loaded yet: the loader loads lazily
    assert_same_epoch(first + [as_numpy(s) for s in ld], want[2])  # without set_epoch: the state's epoch
    ds, ld = loader(mid)
    ds.set_epoch(3)  # the rest of epoch 2 would be lost
    with pytest.raises(UsageError, match=r"in the middle of epoch 2, but set_epoch\(3\) was called"):
        list(ld)
    ds, ld = loader(at_end)
    assert_same_epoch([as_numpy(s) for s in ld], want[1])  # without set_epoch, epoch 1 again...
    assert_same_epoch([as_numpy(s) for s in ld], want[1])  # ...as the uninterrupted loader would
    ds.set_epoch(3)
    assert_same_epoch([as_numpy(s) for s in ld], want[3])


@pytest.mark.parametrize("name", ["DataLoader", "StatefulDataLoader"])
def test_set_epoch_reaches_persistent_workers(server, name):
    cls = data.DataLoader if name == "DataLoader" else stateful.StatefulDataLoader
    srv, cfg = server
    ds = pptorch.ServerDataset(srv.address, job=f"t7-{name}")
    loader = cls(ds, batch_size=None, num_workers=2, persistent_workers=True)
    for epoch in (1, 2, 3):
        ds.set_epoch(epoch)
        assert_same_epoch([as_numpy(s) for s in loader], reference(cfg, epoch))
    del loader  # its workers stop
    gc.collect()


@pytest.mark.parametrize("workers, bucket", [(0, 1), (2, 5)])
def test_ranks_batching_by_frames_agree_on_every_batch_size(server, workers, bucket):
    # cut alone, the two shards of epoch 7 make 7 and 8 batches of at most 150 frames (DDP would hang)
    srv, cfg = server
    want = reference(cfg, 7)
    got: Dict[int, List[Dict[str, Any]]] = {}

    def rank_main(rank: int) -> None:
        ds = pptorch.ServerDataset(
            srv.address, job=f"t11-{workers}", rank=rank, world_size=2, epoch=7, batch_frames=150, bucket_window=bucket
        )
        got[rank] = list(data.DataLoader(ds, batch_size=None, num_workers=workers))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and sorted(got) == [0, 1]
    sizes = [[len(b["seq_tag"]) for b in got[rank]] for rank in range(2)]
    assert sizes[0] == sizes[1]  # as many batches, and as many seqs in each: the ranks stay in step
    length = {s["seq_tag"]: s["data"].shape[0] for s in want}
    for rank in range(2):
        for b in got[rank]:
            n, t = b["data"].shape[:2]
            assert n * t <= 150 or n == 1
            assert b["data:lengths"].tolist() == [length[tag] for tag in b["seq_tag"]]
        tags = [tag for b in got[rank] for tag in b["seq_tag"]]
        shard = [s["seq_tag"] for s in want[rank:36:2]]
        assert sorted(tags) == sorted(shard)  # each seq of the shard once
        if (workers, bucket) == (0, 1):
            assert tags == shard  # in epoch order


def test_batches_are_padded_with_lengths_and_respect_the_caps(server):
    srv, cfg = server
    want = {s["seq_tag"]: s for s in reference(cfg, 4)}
    ds = pptorch.ServerDataset(srv.address, job="t4", epoch=4, batch_frames=150, max_seqs=4, pin_memory=True)
    batches = list(data.DataLoader(ds, batch_size=None))
    order: List[str] = []
    for b in batches:
        n, t = b["data"].shape[:2]
        assert n <= 4 and (n * t <= 150 or n == 1)
        assert b["data:lengths"].tolist() == [want[tag]["data"].shape[0] for tag in b["seq_tag"]]
        for i, tag in enumerate(b["seq_tag"]):
            length = int(b["data:lengths"][i])
            assert np.array_equal(b["data"][i, :length].numpy(), want[tag]["data"])
            assert not b["data"][i, length:].any()  # padding is zeros
        order += b["seq_tag"]
    assert order == list(want)  # without buckets, batches keep the epoch order


def test_pin_memory_pins_in_the_main_process_only(server, monkeypatch):
    srv, cfg = server
    pinned_here: List[str] = []

    def pin(tensor, *args, **kwargs):  # what pinning does on a machine with an accelerator, in effect
        if data.get_worker_info() is not None:
            raise RuntimeError("pinned in a DataLoader worker")  # reaches the test through the loader
        pinned_here.append("x")
        return tensor

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr("ppclient.torch._can_pin", lambda: True)
    want = sorted(s["seq_tag"] for s in reference(cfg, 5))
    for opts, pins in (({}, 2 * 37), ({"max_seqs": 4}, 4 * 10)):  # data, classes (and their lengths per batch)
        ds = pptorch.ServerDataset(srv.address, job="t9", epoch=5, pin_memory=True, **opts)
        got = list(data.DataLoader(ds, batch_size=None))  # num_workers=0: the dataset pins, here
        assert len(pinned_here) == pins
        pinned_here.clear()
        # forked workers pin nothing: the batches would come to this process copied, unpinned
        forked = list(data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
        assert not pinned_here
        for items in (got, forked):
            assert sorted(t for b in items for t in (b["seq_tag"] if opts else [b["seq_tag"]])) == want


STRINGS = """
import numpy as np
_r = np.random.RandomState(3)
SEQS = [
    {"data": _r.randn(5 + i, 4).astype("float32"), "orth": np.array(f"words {i}"), "chars": np.array(list(f"ab{i}"))}
    for i in range(9)
]
dataset = {"class": "NumpyDataset", "seqs": SEQS}
def map_seq(seq, **kwargs):
    return seq
"""


def test_string_keys_come_as_str_or_lists_of_str_also_in_batches(tmp_path):
    cfg = write_config(tmp_path, STRINGS)
    with run_server(cfg, workers=1) as srv:
        seqs = list(data.DataLoader(pptorch.ServerDataset(srv.address, job="t8"), batch_size=None))
        batches = list(data.DataLoader(pptorch.ServerDataset(srv.address, job="t8", max_seqs=4), batch_size=None))
    assert [s["orth"] for s in seqs] == [f"words {i}" for i in range(9)]
    assert [s["chars"] for s in seqs] == [["a", "b", str(i)] for i in range(9)]
    assert isinstance(seqs[0]["data"], torch.Tensor)
    assert [b["orth"] for b in batches] == [[f"words {i}" for i in range(j, min(j + 4, 9))] for j in (0, 4, 8)]
    assert batches[0]["chars"][1] == ["a", "b", "1"]
    assert batches[0]["data"].shape == (4, 8, 4) and batches[0]["data:lengths"].tolist() == [5, 6, 7, 8]


def test_cut_sorts_within_a_window_and_puts_a_long_seq_alone():
    seqs = [{"data": torch.zeros(n, 2)} for n in (5, 1, 30, 3, 2)]
    lengths = [[s["data"].shape[0] for s in b] for b in pptorch.cut(seqs, 10, None, None, sort=True)]
    assert lengths == [[1, 2, 3], [5], [30]]
    lengths = [[s["data"].shape[0] for s in b] for b in pptorch.cut(seqs, 10, 2, None, sort=False)]
    assert lengths == [[5, 1], [30], [3, 2]]
    batch = pptorch.collate_padded(
        [{"data": torch.ones(2, 3), "seq_tag": "a"}, {"data": torch.ones(4, 3), "seq_tag": "b"}]
    )
    assert batch["data"].shape == (2, 4, 3) and batch["data:lengths"].tolist() == [2, 4]


def test_len_is_the_ranks_seqs_and_a_type_error_with_batching(server):
    srv, _ = server
    assert len(data.DataLoader(pptorch.ServerDataset(srv.address), batch_size=None)) == 37  # e.g. for an LR schedule
    assert [len(pptorch.ServerDataset(srv.address, rank=r, world_size=2)) for r in (0, 1)] == [18, 18]
    assert [len(pptorch.ServerDataset(srv.address, rank=r, world_size=2, drop_last=False)) for r in (0, 1)] == [19, 18]
    with pytest.raises(TypeError, match=r"batches.*not known in advance"):
        len(data.DataLoader(pptorch.ServerDataset(srv.address, max_seqs=4), batch_size=None))


def test_rank_and_world_come_from_the_environment(monkeypatch, server):
    srv, _ = server
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    ds = pptorch.ServerDataset(srv.address)
    assert (ds.rank, ds.world_size) == (1, 3)

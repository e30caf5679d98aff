"""ppclient.torch against a real server: tensors, DataLoader workers, StatefulDataLoader resume, batching."""

from __future__ import annotations

import threading
import warnings
from typing import Any, Dict, List

import numpy as np
import pytest
from conftest import assert_same_epoch, have_modules, numpy_config, reference, run_server

# torch is imported by the tests that use it, so collecting this module stays cheap
pytestmark = pytest.mark.skipif(
    not have_modules("torch", "torchdata.stateful_dataloader"), reason="needs torch and torchdata"
)

MAPPER = """
def map_seq(seq, *, rng, **kwargs):
    seq["data"] = seq["data"] * rng.uniform(0.5, 1.5)
    return seq
"""


def as_numpy(seq: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in seq.items()}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch")
    cfg = numpy_config(tmp, MAPPER, n=37, ordering="random", extra="buf_size = 4\n")
    with run_server(cfg, workers=2) as srv:
        yield srv, cfg


def test_seqs_come_as_tensors_without_a_copy_or_warning(server):
    import torch
    from torch.utils.data import DataLoader

    from ppclient.torch import ServerDataset

    srv, cfg = server
    ds = ServerDataset(srv.address, job="t1", epoch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PyTorch's "non-writable array" warning would fail the test
        got = list(DataLoader(ds, batch_size=None))
    assert all(isinstance(s["data"], torch.Tensor) and s["data"].dtype == torch.float32 for s in got)
    assert_same_epoch([as_numpy(s) for s in got], reference(cfg, 2))


@pytest.mark.parametrize("world, workers", [(1, 2), (1, 3), (2, 2)])
def test_loader_workers_take_subshards_and_the_loader_yields_epoch_order(server, world, workers):
    from torch.utils.data import DataLoader

    from ppclient.torch import ServerDataset

    srv, cfg = server
    want = reference(cfg, 1)
    got: Dict[int, List[Dict[str, Any]]] = {}

    def rank_main(rank: int) -> None:  # the ranks pull at once, as DDP ranks do
        ds = ServerDataset(srv.address, job=f"t2-{world}-{workers}", rank=rank, world_size=world, epoch=1)
        got[rank] = [as_numpy(s) for s in DataLoader(ds, batch_size=None, num_workers=workers)]

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
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ppclient.torch import ServerDataset

    srv, cfg = server
    want = reference(cfg, 3)
    opts = dict(job=f"t3-{workers}-{bucket}", epoch=3, batch_frames=200, bucket_window=bucket)
    loader = StatefulDataLoader(ServerDataset(srv.address, **opts), batch_size=None, num_workers=workers)
    it = iter(loader)
    first = [next(it) for _ in range(4)]
    state = loader.state_dict()
    straight = first + list(it)  # the uninterrupted epoch, batch by batch
    resumed = StatefulDataLoader(ServerDataset(srv.address, **opts), batch_size=None, num_workers=workers)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert [b["seq_tag"] for b in first + rest] == [b["seq_tag"] for b in straight]
    for got, exp in zip(first + rest, straight):
        assert torch.equal(got["data"], exp["data"]) and torch.equal(got["data:lengths"], exp["data:lengths"])
    tags = sorted(t for b in straight for t in b["seq_tag"])
    assert tags == sorted(s["seq_tag"] for s in want)  # every seq once


def test_batches_are_padded_with_lengths_and_respect_the_caps(server):
    from torch.utils.data import DataLoader

    from ppclient.torch import ServerDataset

    srv, cfg = server
    want = {s["seq_tag"]: s for s in reference(cfg, 4)}
    ds = ServerDataset(srv.address, job="t4", epoch=4, batch_frames=150, max_seqs=4, pin_memory=True)
    batches = list(DataLoader(ds, batch_size=None))
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


def test_cut_sorts_within_a_window_and_puts_a_long_seq_alone():
    import torch

    from ppclient.torch import collate_padded, cut

    seqs = [{"data": torch.zeros(n, 2)} for n in (5, 1, 30, 3, 2)]
    lengths = [[s["data"].shape[0] for s in b] for b in cut(seqs, 10, None, None, sort=True)]
    assert lengths == [[1, 2, 3], [5], [30]]
    lengths = [[s["data"].shape[0] for s in b] for b in cut(seqs, 10, 2, None, sort=False)]
    assert lengths == [[5, 1], [30], [3, 2]]
    batch = collate_padded([{"data": torch.ones(2, 3), "seq_tag": "a"}, {"data": torch.ones(4, 3), "seq_tag": "b"}])
    assert batch["data"].shape == (2, 4, 3) and batch["data:lengths"].tolist() == [2, 4]


def test_rank_and_world_come_from_the_environment(monkeypatch, server):
    from ppclient.torch import ServerDataset

    srv, _ = server
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    ds = ServerDataset(srv.address)
    assert (ds.rank, ds.world_size) == (1, 3)

"""ppclient.torch against a real server: tensors, DataLoader workers, StatefulDataLoader resume, batching."""

from __future__ import annotations

import copy
import gc
import importlib
import re
import threading
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
from conftest import (
    SCALE_MAPPER,
    assert_same_batches,
    assert_same_epoch,
    collect_with,
    numpy_config,
    read,
    reference,
    reference_batches,
    restartable,
    run_server,
    shard,
    wait_for,
    write_config,
)
from test_server_restart import slow_config

from ppclient.client import EpochIterator
from ppclient.errors import Superseded, UsageError

# torch loads when a test first uses it, so collecting this module (e.g. for `-m unit`) stays cheap
pytestmark = pytest.mark.torch


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


MAPPER = SCALE_MAPPER


def as_numpy(seq: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in seq.items()}


# DataLoader workers of a loader started in a rank thread come from a forkserver: forked while
# other threads run (the other rank, clients' keepalive threads), a worker could inherit a lock
# held by one of them and hang. "spawn" is as safe, but each of its workers imports torch again
# (about 25 s more for the rank tests here on 2 busy cores); the forkserver imports it once.
START_METHOD = "forkserver"


def from_thread(workers: int) -> Dict[str, Any]:
    """DataLoader arguments for `workers` workers of a loader started from a rank thread."""
    if not workers:
        return {}
    import multiprocessing

    ctx = multiprocessing.get_context(START_METHOD)
    ctx.set_forkserver_preload(["torch", "ppclient.torch"])  # (once it runs, this changes nothing)
    return {"num_workers": workers, "multiprocessing_context": ctx}


@pytest.fixture(scope="module", autouse=True)
def forkserver_reaped() -> Iterator[None]:
    """The forkserver the rank tests started ends with this module, reaped."""
    yield
    from multiprocessing import forkserver

    # (as CPython's own tests do: it is told to exit, and waited for)
    forkserver._forkserver._stop()  # type: ignore[attr-defined]


def run_ranks(world: int, rank_main: Callable[[int], Any]) -> Tuple[Dict[int, Any], Dict[int, str]]:
    """`rank_main(rank)` for every rank at once, each in a thread (as DDP ranks pull): what each
    returned, and the error of each that raised."""
    got: Dict[int, Any] = {}
    errors: Dict[int, str] = {}

    def main(rank: int) -> None:
        try:
            got[rank] = rank_main(rank)
        except Exception as exc:  # (the test asserts on it)
            errors[rank] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    for t in threads:
        t.join(timeout=max(deadline - time.monotonic(), 0))
    assert not any(t.is_alive() for t in threads), f"a rank still runs after 120 s (errors: {errors})"
    return got, errors


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch")
    cfg = numpy_config(tmp, MAPPER, n=37, ordering="random", extra="buf_size = 4\n")
    with run_server(cfg, workers=2) as srv:
        yield srv, cfg


def record_taken(monkeypatch) -> List[Dict[str, Any]]:
    """The list of what ppclient's iterators hand out from now on (seqs or batches, as numpy arrays)."""
    received: List[Dict[str, Any]] = []
    take = EpochIterator.__next__

    def recorded(it):
        item = take(it)
        received.append(item)
        return item

    monkeypatch.setattr(EpochIterator, "__next__", recorded)
    return received


@pytest.mark.processes
def test_seqs_come_as_tensors_without_a_copy_or_warning(server, monkeypatch):
    srv, cfg = server
    received = record_taken(monkeypatch)
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


@pytest.mark.processes
@pytest.mark.parametrize("world, workers", [(1, 2), (1, 3), (2, 2)])
def test_loader_workers_take_subshards_and_the_loader_yields_epoch_order(server, world, workers):
    srv, cfg = server
    want = reference(cfg, 1)

    def rank_main(rank: int) -> List[Dict[str, Any]]:
        ds = pptorch.ServerDataset(srv.address, job=f"t2-{world}-{workers}", rank=rank, world_size=world, epoch=1)
        return [as_numpy(s) for s in data.DataLoader(ds, batch_size=None, **from_thread(workers))]

    got, errors = run_ranks(world, rank_main)
    assert not errors, errors
    for rank in range(world):
        assert_same_epoch(got[rank], want[rank : len(want) // world * world : world])


BATCHING = dict(batch_frames=200, max_seqs=6)


def batches_of(cfg: str, epoch: int, bucket: int = 1) -> List[Dict[str, Any]]:
    """The epoch's batches as ServerDataset(batch_frames=200, max_seqs=6, bucket_window=bucket) gets them."""
    return reference_batches(cfg, epoch, {"max_frames": 200, "max_seqs": 6, "bucket_window": bucket})


@pytest.mark.processes
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("bucket", [1, 5])
def test_stateful_dataloader_resumes_exactly(server, workers, bucket):
    srv, cfg = server
    want = batches_of(cfg, 3, bucket)
    opts = dict(job=f"t3-{workers}-{bucket}", epoch=3, bucket_window=bucket, **BATCHING)
    loader = stateful.StatefulDataLoader(
        pptorch.ServerDataset(srv.address, **opts), batch_size=None, num_workers=workers
    )
    it = iter(loader)
    first = [next(it) for _ in range(4)]
    state = copy.deepcopy(loader.state_dict())
    assert_same_batches(first + list(it), want)  # the uninterrupted epoch
    resumed = stateful.StatefulDataLoader(
        pptorch.ServerDataset(srv.address, **opts), batch_size=None, num_workers=workers
    )
    resumed.load_state_dict(state)
    assert_same_batches(first + list(resumed), want)


@pytest.mark.processes
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


@pytest.mark.processes
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batched", [False, True], ids=["seqs", "batches"])
def test_a_checkpoint_after_an_epochs_last_item_resumes_with_the_next_epoch(server, workers, batched):
    """A state taken inside the loop right after the epoch's last seq or batch (the loader has not
    seen the end yet) is "epoch n finished": resumed with set_epoch(n + 1), that epoch from its
    start, in order also when the loader's workers had yielded unequal numbers (its next turn is
    then not worker 0's); resumed with set_epoch(n), nothing more of epoch n."""
    srv, cfg = server
    opts: Dict[str, Any] = dict(job=f"t18-{workers}-{batched}", **(BATCHING if batched else {}))
    want = {e: batches_of(cfg, e) if batched else reference(cfg, e) for e in (2, 3, 4)}
    # (an odd count: with 2 workers, the next epoch begins with worker 1's turn, not worker 0's)
    assert len(want[2]) % 2 == 1 or len(want[3]) % 2 == 1

    def same(got: List[Dict[str, Any]], epoch: int) -> None:
        if batched:
            assert_same_batches(got, want[epoch])
        else:
            assert_same_epoch([as_numpy(s) for s in got], want[epoch])

    def loader(state=None):
        ds = pptorch.ServerDataset(srv.address, **opts)
        ld = stateful.StatefulDataLoader(ds, batch_size=None, num_workers=workers)
        if state is not None:
            ld.load_state_dict(copy.deepcopy(state))  # as from a checkpoint
        return ds, ld

    def read(ld, epoch: int) -> Tuple[List[Dict[str, Any]], Dict[str, Any], Dict[str, Any]]:
        """The epoch, with checkpoints after its 3rd and after its last item (inside the loop)."""
        got, mid, last = [], None, None
        for item in ld:
            got.append(item)
            if len(got) == 3:
                mid = copy.deepcopy(ld.state_dict())
            if len(got) == len(want[epoch]):
                last = copy.deepcopy(ld.state_dict())
        same(got, epoch)
        assert mid is not None and last is not None and not last["_iterator_finished"]
        return got, mid, last

    ds, ld = loader()
    ds.set_epoch(2)
    _, _, last2 = read(ld, 2)

    ds, ld = loader(last2)
    ds.set_epoch(3)
    first3, mid3, last3 = read(ld, 3)  # epoch 3 from its start
    ds.set_epoch(4)
    same(list(ld), 4)  # and on, as without a resume

    ds, ld = loader(mid3)  # a checkpoint of the resumed epoch resumes as any other
    ds.set_epoch(3)
    same(first3[:3] + list(ld), 3)
    ds, ld = loader(last3)
    ds.set_epoch(4)
    same(list(ld), 4)

    ds, ld = loader(last2)
    ds.set_epoch(2)
    assert list(ld) == []  # the rest of epoch 2: nothing
    ds.set_epoch(3)
    same(list(ld), 3)

    # A state that does not say how many items each worker had yielded (an older ppclient's):
    # without workers that does not matter; with them, whose turn is first is not known.
    def uncounted(state: Any) -> Any:
        if isinstance(state, dict):
            if state.get("finished"):
                return {k: v for k, v in state.items() if k not in ("position", "subshard")}
            return {k: uncounted(v) for k, v in state.items()}
        return state

    ds, ld = loader(uncounted(last2))
    ds.set_epoch(3)
    if workers:
        with pytest.raises(UsageError, match="has the first turn of epoch 3 is not known"):
            list(ld)
    else:
        same(list(ld), 3)


@pytest.mark.processes
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


@pytest.mark.processes
@pytest.mark.parametrize("world, workers, bucket", [(2, 0, 1), (2, 2, 5), (1, 3, 1)])
def test_ranks_and_loader_workers_get_the_servers_batches_in_epoch_order(server, world, workers, bucket):
    srv, cfg = server
    want = batches_of(cfg, 7, bucket)

    def rank_main(rank: int) -> List[Dict[str, Any]]:
        ds = pptorch.ServerDataset(
            srv.address, job=f"t11-{world}-{workers}", rank=rank, world_size=world, epoch=7, bucket_window=bucket,
            **BATCHING,
        )  # fmt: skip
        return list(data.DataLoader(ds, batch_size=None, **from_thread(workers)))

    got, errors = run_ranks(world, rank_main)
    assert not errors, errors
    for rank in range(world):
        assert_same_batches(got[rank], shard(want, rank, world))  # batch j is rank j % world's
    assert len({len(got[rank]) for rank in range(world)}) == 1  # equal steps


@pytest.mark.processes
def test_batches_are_tensors_padded_on_the_workers_without_a_copy(server, monkeypatch):
    srv, cfg = server
    received = record_taken(monkeypatch)
    ds = pptorch.ServerDataset(srv.address, job="t4", epoch=4, **BATCHING)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PyTorch's "non-writable array" warning would fail the test
        batches = list(data.DataLoader(ds, batch_size=None))
    assert_same_batches(batches, batches_of(cfg, 4))
    for b, arrays in zip(batches, received):
        assert isinstance(b["data"], torch.Tensor) and isinstance(b["seq_idx"], torch.Tensor)
        assert isinstance(b["seq_tag"], list)
        for key in ("data", "data:lengths", "classes"):  # each tensor is the received array's memory
            assert b[key].data_ptr() == arrays[key].ctypes.data, key


@pytest.mark.processes
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
    # data, classes; in batches also their lengths, seq_idx and complete_frac
    for opts, pins in (({}, 2 * 37), ({"max_seqs": 4}, 6 * 10)):
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


@pytest.mark.processes
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


def test_collate_padded_pads_tensors_as_the_workers_do():
    batch = pptorch.collate_padded(
        [{"data": torch.ones(2, 3), "seq_tag": "a"}, {"data": torch.ones(4, 3), "seq_tag": "b"}]
    )
    assert batch["data"].shape == (2, 4, 3) and batch["data:lengths"].tolist() == [2, 4]
    assert batch["seq_tag"] == ["a", "b"] and not batch["data"][0, 2:].any()


@pytest.mark.processes
def test_len_is_the_ranks_seqs_and_a_type_error_with_batching(server):
    srv, _ = server
    assert len(data.DataLoader(pptorch.ServerDataset(srv.address), batch_size=None)) == 37  # e.g. for an LR schedule
    assert [len(pptorch.ServerDataset(srv.address, rank=r, world_size=2)) for r in (0, 1)] == [18, 18]
    assert [len(pptorch.ServerDataset(srv.address, rank=r, world_size=2, drop_last=False)) for r in (0, 1)] == [19, 18]
    with pytest.raises(TypeError, match=r"batches is not known before its epoch begins"):
        len(data.DataLoader(pptorch.ServerDataset(srv.address, max_seqs=4), batch_size=None))


def test_cut_settings_without_batch_frames_or_max_seqs_are_refused_in_one_line():
    # (they would be dropped: without a cut of its own the dataset takes the server's, with its settings)
    for kw, named in [
        ({"pad": {"classes": -1}}, "pad"),
        ({"bucket_window": 64, "length_key": "data"}, "bucket_window, length_key"),
    ]:
        with pytest.raises(UsageError, match=f"^{named} without batch_frames, max_seqs or max_duration") as info:
            pptorch.ServerDataset("tcp://127.0.0.1:1", **kw)
        assert "\n" not in str(info.value)
    ds = pptorch.ServerDataset("tcp://127.0.0.1:1", max_seqs=4, pad={"classes": -1}, length_key="data")
    assert ds.client_options["batching"]["pad"] == {"classes": -1}


DURATIONS = """
def batch_duration(seq):
    return seq["data"].shape[0] / 20  # seconds of 50 ms frames
"""


@pytest.mark.processes
def test_max_duration_batches_as_the_server_cuts_them_and_bad_values_are_one_line(tmp_path, server):
    with pytest.raises(UsageError, match=r"\['max_duration'\] must be a finite number of seconds > 0"):
        pptorch.ServerDataset(server[0].address, max_duration=float("nan"))
    with pytest.raises(UsageError, match=r"\['quadratic_duration'\] counts toward max_duration"):
        pptorch.ServerDataset(server[0].address, quadratic_duration=20.0)
    cfg = numpy_config(tmp_path, SCALE_MAPPER, n=29, ordering="random", extra=DURATIONS)
    asked = dict(max_duration=8.0, quadratic_duration=20.0, max_seqs=6, bucket_window=4)
    want = reference_batches(cfg, 2, asked)
    with run_server(cfg, workers=2) as srv:
        ds = pptorch.ServerDataset(srv.address, job="seconds", epoch=2, **asked)
        got = [as_numpy(b) for b in data.DataLoader(ds, batch_size=None)]
    assert_same_batches(got, want)
    assert len(got) < 29 and any(len(b["seq_tag"]) > 1 for b in got)


@pytest.mark.processes
def test_rank_and_world_come_from_the_environment(monkeypatch, server):
    srv, _ = server
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    ds = pptorch.ServerDataset(srv.address)
    assert (ds.rank, ds.world_size) == (1, 3)


def job_clients(srv: Any) -> int:
    """The live clients of the server's job, as its status counts them."""
    with srv.client(timeout=10) as c:
        return c.status()["job"]["clients"]


@pytest.mark.processes
def test_a_state_from_an_epochs_end_without_set_epoch_reads_that_epoch_again(server):
    srv, cfg = server
    ds = pptorch.ServerDataset(srv.address, job="t17")
    loader = stateful.StatefulDataLoader(ds, batch_size=None)
    ds.set_epoch(4)
    assert_same_epoch([as_numpy(s) for s in loader], reference(cfg, 4))
    at_end = copy.deepcopy(loader.state_dict())  # of epoch 4; the constructor's epoch is 1
    ds = pptorch.ServerDataset(srv.address, job="t17")
    loader = stateful.StatefulDataLoader(ds, batch_size=None)
    loader.load_state_dict(at_end)
    for _ in range(2):  # as the uninterrupted loader without set_epoch: epoch 4 again, and again
        assert_same_epoch([as_numpy(s) for s in loader], reference(cfg, 4))
        assert ds.epoch == 4


@pytest.mark.processes
def test_a_dataset_whose_rank_changes_closes_its_client_of_the_old_rank(server, monkeypatch):
    srv, _ = server
    monkeypatch.setenv("WORLD_SIZE", "1")
    ds = pptorch.ServerDataset(srv.address, job="t18")
    it = iter(data.DataLoader(ds, batch_size=None))
    next(it)  # its client reads, as rank 0 of 1
    old = ds._client
    monkeypatch.setenv("RANK", "1")  # e.g. torch.distributed is initialised by now
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds.set_epoch(1)
    new = ds._client_for(0, 1)  # what the next iteration reads with
    assert old is not None and new is not old and old._ctx.closed

    # else it would hold the job (world_size 1) for as long as this process runs
    wait_for(lambda: job_clients(srv) == 0, 10, "the server to hear that the old client closed")
    ds.close()


@pytest.mark.processes
def test_a_stream_that_fails_closes_its_client(server):
    srv, cfg = server
    ds = pptorch.ServerDataset(srv.address, job="t19", epoch=2)
    it = iter(data.DataLoader(ds, batch_size=None))
    next(it)
    again = pptorch.ServerDataset(srv.address, job="t19", epoch=2)
    taken_over = [as_numpy(s) for s in data.DataLoader(again, batch_size=None)]
    assert_same_epoch(taken_over, reference(cfg, 2))  # the same rank asked again: the first one is superseded
    with pytest.raises(Superseded):
        for _ in range(40):
            next(it)
    assert ds._client is None  # closed: no keepalives hold its place in the job
    with pytest.raises(Superseded):
        next(it)  # and the error stays


@pytest.mark.processes
@pytest.mark.parametrize("name", ["DataLoader", "StatefulDataLoader"])
def test_a_loader_reads_on_through_a_server_restart(tmp_path, name):
    """kill -9 of the server mid-epoch and a new one on its address 3 s later: each of the loader's
    two workers asks the new server for its part of the epoch from where it was (both mid-epoch),
    and the loader yields the reference epoch. A state taken after the restart resumes exactly."""
    cfg = slow_config(tmp_path)
    want = reference(cfg, 1)
    cls = data.DataLoader if name == "DataLoader" else stateful.StatefulDataLoader
    with restartable(cfg, tmp_path) as service:
        loader = cls(pptorch.ServerDataset(service.address, epoch=1), batch_size=None, num_workers=2)
        got = [as_numpy(s) for s in collect_with(loader, {6: service.restart_after})]
        service.join()
        assert_same_epoch(got, want)
        starts = [int(k) for k in re.findall(r"reads epoch 1 \(run \d+\) from seq (\d+)", read(service.log(2)))]
        assert len(starts) == 2 and min(starts) > 0, starts  # both readers went on mid-epoch
        if name == "StatefulDataLoader":
            loader = cls(pptorch.ServerDataset(service.address, epoch=2), batch_size=None, num_workers=2)
            it = iter(loader)
            first = [as_numpy(next(it)) for _ in range(5)]
            state = copy.deepcopy(loader.state_dict())
            del it, loader
            resumed = cls(pptorch.ServerDataset(service.address, epoch=2), batch_size=None, num_workers=2)
            resumed.load_state_dict(state)
            assert_same_epoch(first + [as_numpy(s) for s in resumed], reference(cfg, 2))


STUCK_MAPPER = """
import time

def map_seq(seq, *, seq_idx, **kwargs):
    if seq_idx == 2:
        time.sleep(30)  # loader worker 0 waits for this seq when its loader shuts down
    return seq
"""


@pytest.mark.processes
def test_a_loader_worker_terminated_while_it_waits_closes_its_client(tmp_path):
    """A loader that shuts down joins its workers for 5 s, then terminates those still waiting for
    the server. Their clients close first: the job is free at once for another world_size or job,
    not held until the clients' timeout of silence (60 s here)."""
    cfg = numpy_config(tmp_path, STUCK_MAPPER, n=8, extra="buf_size = 1\n")
    with run_server(cfg, workers=2) as srv:
        ds = pptorch.ServerDataset(srv.address, job="t20", world_size=1, rank=0, timeout=60)
        it = iter(data.DataLoader(ds, batch_size=None, num_workers=2))
        assert int(next(it)["seq_idx"]) == 0
        wait_for(lambda: job_clients(srv) == 2, 10, "both loader workers' clients")
        workers = list(it._workers)
        del it  # worker 0 waits for seq 2: it is terminated
        assert all(w.exitcode == 0 for w in workers), [w.exitcode for w in workers]
        wait_for(lambda: job_clients(srv) == 0, 5, "the terminated worker's client to close")
        with srv.client(job="t21", world_size=2, rank=0, timeout=10) as other:
            assert len(other.epoch(1)) == 4  # another job, another world_size: taken at once

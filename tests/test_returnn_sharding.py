"""Contiguous shards against RETURNN's own: a served RETURNN HDFDataset with a laplace order, read
by ranks and DataLoader-worker readers of one job, compared with RETURNN's dataset sharded by
`_num_shards`/`_shard_index` (as `set_sharding` does for its DataLoader workers)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
from conftest import collect, in_threads, run_server, write_config
from returnn.datasets.basic import init_dataset
from returnn.datasets.hdf import SimpleHDFWriter

import ppclient
from ppclient.returnn import ServerDataset

pytestmark = [pytest.mark.processes, pytest.mark.returnn, pytest.mark.usefixtures("in_temporary_cwd")]

NUM_SEQS = 22  # 4 readers: chunks of 6, 6, 5, 5 (rank 0's two readers get the longer ones)

CONFIG = """
dataset = {{"class": "returnn", "dataset": {spec!r}{extra}}}

def map_seq(seq, *, rng, **kwargs):
    seq["data"] = seq["data"] * rng.uniform(0.5, 1.5)
    return seq
"""


def write_hdf(path: str) -> None:
    rng = np.random.RandomState(11)
    writer = SimpleHDFWriter(path, dim=4, ndim=2, extra_type={"classes": (10, 1, "int32")})
    for i in range(NUM_SEQS):
        frames = int(rng.randint(1, 60))
        writer.insert_batch(
            rng.randn(1, frames, 4).astype(np.float32),
            seq_len=[frames],
            seq_tag=[f"s-{i}"],
            extra={"classes": rng.randint(0, 10, size=(1, 3)).astype(np.int32)},
        )
    writer.close()


@pytest.fixture()
def served(tmp_path) -> Tuple[Dict[str, Any], str]:
    path = str(tmp_path / "a.hdf")
    write_hdf(path)
    spec = {"class": "HDFDataset", "files": [path], "seq_ordering": "laplace:.5"}
    return spec, write_config(tmp_path, CONFIG.format(spec=spec, extra=""))


def returnn_shard(spec: Dict[str, Any], epoch: int, shards: int, shard: int) -> List[Tuple[str, float]]:
    """(tag, complete_frac) of each seq of RETURNN's own shard of the epoch."""
    ds = init_dataset(dict(spec, _num_shards=shards, _shard_index=shard))
    ds.init_seq_order(epoch=epoch)
    out = []
    i = 0
    while ds.is_less_than_num_seqs(i):
        ds.load_seqs(i, i + 1)
        out.append((ds.get_tag(i), ds.get_complete_frac(i)))
        i += 1
    return out


def read_job(address: str, epoch: int, ranks: int, readers: int, **kw: Any) -> Dict[Tuple[int, int], List[dict]]:
    """Every reader (rank, loader worker) of one job, reading at once."""
    got: Dict[Tuple[int, int], List[dict]] = {}

    def reader(index: int) -> None:
        rank, w = divmod(index, readers)
        with ppclient.Client(
            address, rank=rank, world_size=ranks, subshard=(w, readers), job="shards", timeout=30, **kw
        ) as c:
            got[rank, w] = collect(c.epoch(epoch))

    in_threads(reader, range(ranks * readers), timeout=90)
    return got


def returnn_ranks(address: str, epoch: int) -> Dict[int, List[Tuple[str, float]]]:
    """(tag, complete_frac) of the seqs ServerDataset gives RETURNN's two ranks ("dataset_distribution":
    "shard"), read at once, with the sharding it chooses by default."""
    got: Dict[int, List[Tuple[str, float]]] = {}

    def rank_main(rank: int) -> None:
        ds = init_dataset(
            {"class": ServerDataset, "address": address, "drop_last": False, "_num_shards": 2, "_shard_index": rank}
        )
        assert isinstance(ds, ServerDataset)
        try:
            ds.init_seq_order(epoch=epoch)
            seqs, i = [], 0
            while ds.is_less_than_num_seqs(i):
                ds.load_seqs(i, i + 1)
                seqs.append((ds.get_tag(i), ds.get_complete_frac(i)))
                i += 1
            got[rank] = seqs
        finally:
            ds.finish_epoch(free_resources=True)

    in_threads(rank_main, (0, 1), timeout=60)
    return got


def test_returnns_dataset_with_two_shards_reads_returnns_own_shards(served):
    """ServerDataset as RETURNN's two ranks gets RETURNN's contiguous shards by default (the server
    serves them), each exactly, with RETURNN's complete_frac; together the epoch once."""
    spec, cfg = served
    with run_server(cfg, workers=2) as srv:
        got = returnn_ranks(srv.address, 3)
    for rank in (0, 1):
        want = returnn_shard(spec, 3, 2, rank)
        assert [t for t, _ in got[rank]] == [t for t, _ in want]
        assert [f for _, f in got[rank]] == pytest.approx([f for _, f in want])
    assert sorted(t for r in (0, 1) for t, _ in got[r]) == sorted(f"s-{i}" for i in range(NUM_SEQS))


def test_two_ranks_of_two_readers_get_returnns_shards_bit_identical_for_1_and_2_workers(served):
    """2 ranks x 2 DataLoader-worker readers, contiguous: reader w of rank r gets RETURNN's shard
    r * 2 + w of 4 (set_sharding's), exactly once over the job, the same bytes with 1 and 2
    workers, and each seq the bytes it has in the strided epoch (it keeps its seq_idx and rng);
    with drop_last every reader the same count."""
    spec, cfg = served
    runs = {}
    for workers in (1, 2):
        with run_server(cfg, workers=workers) as srv:
            runs[workers] = read_job(srv.address, 2, 2, 2, sharding="contiguous", drop_last=False)
            if workers == 2:
                strided = read_job(srv.address, 2, 2, 2, drop_last=False)
                equal = read_job(srv.address, 2, 2, 2, sharding="contiguous")
    for (rank, w), seqs in runs[2].items():
        want = returnn_shard(spec, 2, 4, rank * 2 + w)
        assert [s["seq_tag"] for s in seqs] == [t for t, _ in want], (rank, w)
        assert [s["complete_frac"] for s in seqs] == pytest.approx([f for _, f in want])
    tags = [s["seq_tag"] for seqs in runs[2].values() for s in seqs]
    assert sorted(tags) == sorted(f"s-{i}" for i in range(NUM_SEQS))
    for reader, seqs in equal.items():  # drop_last: every reader NUM_SEQS // 4, the longer chunks' last dropped
        assert [s["seq_tag"] for s in seqs] == [s["seq_tag"] for s in runs[2][reader]][: NUM_SEQS // 4]
    by_tag = {s["seq_tag"]: s for seqs in strided.values() for s in seqs}
    for reader, seqs in runs[2].items():
        assert len(runs[1][reader]) == len(seqs)
        for one, two in zip(runs[1][reader], seqs):
            assert one["seq_tag"] == two["seq_tag"] and one["seq_idx"] == two["seq_idx"]
            assert np.array_equal(one["data"], two["data"]) and np.array_equal(one["classes"], two["classes"])
            assert np.array_equal(two["data"], by_tag[two["seq_tag"]]["data"])
            assert two["seq_idx"] == by_tag[two["seq_tag"]]["seq_idx"]


def test_a_rank_resumes_its_contiguous_shard_exactly_while_the_other_reads(served):
    """Rank 1 stops after 3 seqs and resumes from its state in a new client while rank 0 reads on:
    it gets the rest of RETURNN's shard, the same bytes as without the stop."""
    _, cfg = served
    kw = dict(world_size=2, job="resume", sharding="contiguous", drop_last=False, timeout=30)
    with run_server(cfg, workers=2) as srv:
        whole = read_job(srv.address, 4, 2, 1, sharding="contiguous", drop_last=False)
        got: Dict[int, List[dict]] = {}

        def rank_main(rank: int) -> None:
            with ppclient.Client(srv.address, rank=rank, **kw) as c:
                it = c.epoch(4)
                if rank == 0:
                    got[0] = collect(it)
                    return
                first = [next(it) for _ in range(3)]
                state = it.state_dict()
            with ppclient.Client(srv.address, rank=rank, **kw) as c:
                got[1] = first + collect(c.epoch(state=state))

        in_threads(rank_main, (0, 1), timeout=60)
    for rank in (0, 1):
        want = whole[rank, 0]
        assert [s["seq_tag"] for s in got[rank]] == [s["seq_tag"] for s in want]
        for g, w in zip(got[rank], want):
            assert np.array_equal(g["data"], w["data"]) and g["complete_frac"] == w["complete_frac"]


def test_contiguous_shards_where_the_server_cannot_serve_them(served, tmp_path):
    """A forward-only dataset offers strided shards only: a client asking for contiguous ones gets
    one line saying why, RETURNN's dataset reads strided ones by default; a job that batches is
    refused contiguous shards with one line, and so is a rank asking for other shards than its job's."""
    spec, cfg = served
    forward = write_config(tmp_path, CONFIG.format(spec=spec, extra=', "random_access": False'), name="forward.py")
    with run_server(forward, workers=1) as srv:
        with ppclient.Client(srv.address, sharding="contiguous") as c:
            assert c.info()["shardings"] == ["strided"]
            with pytest.raises(ppclient.Error, match="sharding 'contiguous' is not served here"):
                c.epoch(1)
        got = returnn_ranks(srv.address, 1)
    whole = [t for t, _ in returnn_shard(spec, 1, 1, 0)]
    for rank in (0, 1):
        assert [t for t, _ in got[rank]] == whole[rank::2]  # strided
    batching = {"max_seqs": 2}
    with run_server(cfg, workers=1) as srv:
        with ppclient.Client(srv.address, sharding="contiguous", batching=batching) as c:
            assert c.info()["shardings"] == ["strided", "contiguous"]
            with pytest.raises(ppclient.Error, match="sharding 'contiguous' is for seqs, not batches"):
                c.epoch(1)
        kw: Dict[str, Any] = dict(world_size=2, job="mixed", timeout=30)
        with ppclient.Client(srv.address, rank=0, sharding="contiguous", **kw) as first:
            first.epoch(1)
            with ppclient.Client(srv.address, rank=1, **kw) as other:
                with pytest.raises(ppclient.Error, match="sharding strided, where the job has sharding contiguous"):
                    other.epoch(1)
    with pytest.raises(ppclient.UsageError, match="sharding must be one of 'strided', 'contiguous'"):
        ppclient.Client("tcp://127.0.0.1:5555", sharding="blocks")

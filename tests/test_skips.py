"""Seqs map_seq skips (returns None: a file that does not decode): left out of the epoch, never fatal
until there are more than `max_skipped` of them.

The scheduler alone (a skipped seq's marker takes its position, is counted wherever its result
went, and too many fail the run), the protocol's checks of skip markers, and real services whose
epochs are compared with the reference epoch without the skipped seqs: for 1 and 3 workers, 2
ranks, batched and not, both data paths, and a resume from a state taken after a skip.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
from conftest import (
    DATA_PATHS,
    assert_same_batches,
    assert_same_epoch,
    collect,
    free_port,
    in_threads,
    numpy_config,
    read,
    reference,
    reference_batches,
    run_cli,
    run_server,
    shard,
    wait_for,
)

import ppclient
from ppclient import protocol
from ppclient.batching import Batching
from ppclient.protocol import Batch, Item, ProtocolError
from ppserver.scheduler import Reply, Scheduler, Settings, ToClient
from ppserver.scheduler import events as ev

# A corpus whose seqs of some lengths "do not decode": the mapper skips them (deterministic: it
# looks at the seq only). In epoch 2 of this corpus (n=61, laplace:.20, BATCHING), batch 3 holds
# only such seqs, and batches 1, 11 and 13 hold some.
CORRUPT_MAPPER = """
CORRUPT = (19, 24, 43, 46)
def map_seq(seq, *, rng, **kwargs):
    if seq["data"].shape[0] in CORRUPT:
        return None
    seq["data"] = seq["data"] * rng.uniform(0.5, 1.5)
    return seq
"""
BATCHING = {"max_seqs": 6, "max_frames": 160, "bucket_window": 16, "pad": {"classes": -1}}


def corpus(tmp_path, extra: str = "max_skipped = 0.2\n") -> str:
    return numpy_config(tmp_path, CORRUPT_MAPPER, n=61, ordering="laplace:.20", extra="buf_size = 3\n" + extra)


# ---- the protocol -----------------------------------------------------------------------------
def _check(header: Dict[str, Any], frames: List[Any] = ()) -> Item:  # type: ignore[assignment]
    return protocol.check_item(header, list(frames))


@pytest.mark.unit
def test_a_skip_marker_holds_a_position_and_nothing_else():
    marker = _check({"i": 4, "meta": {"seq_tag": "a"}, "arrays": [], "x": 1, "xt": ["a"]})
    assert marker.skip and marker.seqs == 0 and marker.skipped_tags == ["a"]
    empty = _check(
        {"i": 2, "meta": {"seq_tag": []}, "arrays": [["d", "<f4", [0, 0]]], "n": 0, "x": 3, "xt": ["a"]}, [b""]
    )
    assert empty.padded and not empty.skip and empty.seqs == 0 and empty.skipped == 3
    bad = [
        ({"i": 4, "meta": {}, "arrays": [["d", "<f4", [1]]], "x": 1, "xt": []}, [b"\0" * 4], "holds arrays"),
        ({"i": 4, "meta": {}, "arrays": [], "x": 2, "xt": []}, [], "holds arrays"),  # a seq is one seq
        ({"i": 4, "meta": {}, "arrays": [], "x": 0, "xt": []}, [], "skipped count"),
        ({"i": 4, "meta": {}, "arrays": [], "x": 1, "xt": ["a", "b"]}, [], "skipped tags"),
        ({"i": 4, "meta": {}, "arrays": [], "g": 1, "n": 2, "x": 1, "xt": []}, [], "skipped count"),
        ({"i": 2, "meta": {"seq_tag": []}, "arrays": [], "n": 0}, [], "bad batch size"),  # B = 0 only when skipped
    ]
    for header, frames, why in bad:
        with pytest.raises(ProtocolError, match=why):
            _check(header, frames)
    # as it travels: the header says so, the codec gives it back
    frames = protocol.encode(protocol.Seqs(run=1), [marker, empty])
    decoded = protocol.decode(frames, protocol.Peer.CLIENT, (protocol.Channel.DATA,))
    assert [(i.pos, i.skipped, i.skipped_tags, i.size) for i in decoded.items] == [
        (4, 1, ["a"], None),
        (2, 3, ["a"], 0),
    ]


@pytest.mark.returnn
def test_a_returnn_api_map_seq_skips_a_seq_by_returning_none():
    from ppserver.mappers.returnn import wrap_map_seq

    def fn(td: Any, **kwargs: Any) -> Any:
        return None if td.data["data"].raw_tensor.shape[0] == 1 else td

    map_seq = wrap_map_seq(fn, {"data": {"shape": [None, 2], "dtype": "float32"}})
    short = {"data": np.zeros((1, 2), "f4"), "seq_tag": "a", "seq_idx": 0}
    assert map_seq(short, epoch=1, seq_idx=0, rng=None) is None
    out = map_seq({**short, "data": np.ones((3, 2), "f4")}, epoch=1, seq_idx=0, rng=None)
    assert out is not None and out["data"].shape == (3, 2) and out["seq_tag"] == "a"


# ---- the scheduler alone ------------------------------------------------------------------------
class Sim:
    """A strict scheduler serving one job (its invariants checked after every event)."""

    def __init__(self, world: int = 1, batched: bool = False, direct: bool = False, **kw: Any):
        self.s = Scheduler(Settings(buf_size=4, direct=direct, **kw), strict=True)
        self.now = 0.0
        self.world = world
        self.batching = Batching(max_seqs=2) if batched else None
        self.out: List[Any] = []

    def __call__(self, event_type, *args, **kw) -> List[Any]:
        out = self.s.handle(event_type(self.now, *args, **kw))
        self.s.validate()
        self.out += out
        return out

    def start(self, num: Optional[int], seqs: Optional[int] = None) -> int:
        for rank in range(self.world):
            out = self(
                ev.EpochRequested,
                b"req",
                b"r%d" % rank,
                1,
                job="j",
                rank=rank,
                world_size=self.world,
                batching=self.batching,
                direct="tcp://127.0.0.1:1" if self.s.state.settings.direct else "",
            )
            (reply,) = [i.msg for i in out if isinstance(i, Reply)]
            self.run = reply.run
        self(ev.RunChecked, self.run)
        for rank in range(self.world):
            self(ev.CreditGranted, b"r%d" % rank, self.run, 100)
        self(ev.RunStarted, self.run, 1, num, seqs=seqs)
        self(ev.WorkerJoined, b"w", "host", 1)
        return self.run


def seq(pos: int) -> Item:
    return protocol.seq_to_item({"data": np.full((2,), pos, "f4"), "seq_tag": f"s{pos}", "seq_idx": pos}, pos)


def skipped(pos: int) -> Item:
    return Item(pos, {"seq_tag": f"s{pos}", "seq_idx": pos}, [], [], 0, skipped=1, skipped_tags=[f"s{pos}"])


def to_clients(out: List[Any], kind=protocol.Seqs) -> List[ToClient]:
    return [i for i in out if isinstance(i, ToClient) and isinstance(i.msg, kind)]


@pytest.mark.unit
def test_a_skipped_seq_takes_its_turn_as_a_marker_for_its_rank_and_is_counted():
    sim = Sim(world=2, max_skipped=0.5)
    run = sim.start(6)
    sim(ev.InputsRead, run, [seq(p) for p in range(6)])
    out = sim(ev.ResultsReceived, b"w", run, [seq(0), skipped(1), seq(2)], [])
    got = {c.consumer: [(i.pos, i.skipped) for i in c.items] for c in to_clients(out)}
    assert got == {b"r0": [(0, 0), (2, 0)], b"r1": [(1, 1)]}  # in epoch order, the marker to rank 1
    out = sim(ev.ResultsReceived, b"w", run, [skipped(3), seq(4), skipped(5)], [])
    ends = {c.consumer: c.msg.count for c in to_clients(out, protocol.End)}
    assert ends == {b"r0": 3, b"r1": 3}  # positions: every rank ends after as many
    st = sim.s.status(sim.now)
    assert st.newest is not None and st.newest.seqs_skipped == 3 and st.seqs_skipped_total == 3
    assert st.seqs_delivered_total == 3  # markers hold no seq
    assert sim.s.state.runs == {}  # done


@pytest.mark.unit
def test_a_result_sent_directly_says_what_it_skipped_and_a_late_copy_counts_nothing():
    sim = Sim(batched=True, direct=True, max_skipped=0.5)
    run = sim.start(3, seqs=6)
    batches = [Batch(j, [seq(2 * j), seq(2 * j + 1)]) for j in range(3)]
    sim(ev.InputsRead, run, batches)
    sim(ev.CompletedReceived, b"w", run, [0, 1], [64, 0], [1, 2], [["s1"], ["s2", "s3"]])
    sim(ev.CompletedReceived, b"w", run, [1], [0], [2], [["s2", "s3"]])  # a duplicate: not counted again
    st = sim.s.status(sim.now)
    assert st.newest is not None and st.newest.seqs_skipped == 3
    assert st.seqs_delivered_total == 1  # batch 0 holds one seq, batch 1 none


@pytest.mark.unit
def test_too_many_skipped_seqs_fail_the_run_naming_the_count_and_tags():
    sim = Sim(max_skipped=0.25)
    run = sim.start(8)
    sim(ev.InputsRead, run, [seq(p) for p in range(8)])
    sim(ev.ResultsReceived, b"w", run, [skipped(0), seq(1), skipped(2)], [])  # 2 of 8: not more than 0.25
    assert not to_clients(sim.out, protocol.RunFailed)
    out = sim(ev.ResultsReceived, b"w", run, [skipped(3)], [])
    (failed,) = [c.msg for c in to_clients(out, protocol.RunFailed)]
    assert failed.failure == protocol.FailureKind.MAPPER.value and failed.seq_tag == "s0"
    assert "map_seq skipped 3 seqs of epoch 1" in failed.message
    assert "max_skipped (0.25 of its 8 seqs): 's0', 's2', 's3'" in failed.message
    assert sim.s.state.runs == {}


@pytest.mark.unit
def test_max_skipped_zero_fails_at_the_first_skip():
    sim = Sim(max_skipped=0.0)
    run = sim.start(4)
    sim(ev.InputsRead, run, [seq(p) for p in range(4)])
    out = sim(ev.ResultsReceived, b"w", run, [seq(0), skipped(1)], [])
    (failed,) = [c.msg for c in to_clients(out, protocol.RunFailed)]
    assert failed.seq_tag == "s1" and "skipped 1 seqs" in failed.message


@pytest.mark.unit
def test_an_epoch_counted_by_reading_checks_its_skips_once_its_count_is_known():
    sim = Sim(max_skipped=0.2)
    run = sim.start(None)
    sim(ev.InputsRead, run, [seq(p) for p in range(4)])
    sim(ev.ResultsReceived, b"w", run, [skipped(0), seq(1), seq(2), seq(3)], [])
    assert not to_clients(sim.out, protocol.RunFailed)  # 1 skipped: of how many is not known yet
    out = sim(ev.InputsEnded, run, 4)
    (failed,) = [c.msg for c in to_clients(out, protocol.RunFailed)]
    assert "0.2 of its 4 seqs" in failed.message
    assert not to_clients(sim.out, protocol.End)  # failed before it could end


# ---- real services ---------------------------------------------------------------------------------
def pull(address: str, world: int, epoch: int, **kw: Any) -> Dict[int, Any]:
    """Every rank's epoch (each rank a client in a thread of its own) and its iterator."""
    got: Dict[int, Any] = {}

    def rank_main(rank: int) -> None:
        with ppclient.Client(address, rank=rank, world_size=world, job=f"s{world}", timeout=30, **kw) as c:
            it = c.epoch(epoch)
            got[rank] = (collect(it), it, c.status())

    in_threads(rank_main, range(world))
    return got


@pytest.mark.processes
@pytest.mark.parametrize(
    "workers, world, path, batched",
    [
        (1, 1, "direct", False),
        (3, 2, "direct", False),
        (3, 2, "via-server", False),
        (1, 2, "via-server", True),
        (3, 2, "direct", True),
    ],
)
def test_skipped_seqs_are_left_out_of_the_reference_epoch_for_any_workers_ranks_and_path(
    tmp_path, workers, world, path, batched
):
    cfg = corpus(tmp_path, "max_skipped = 0.2\n" + DATA_PATHS[path])
    positions = reference(cfg, 2, skipped=True)
    log = str(tmp_path / "server.log")
    with run_server(cfg, workers=workers, log_path=log) as srv:
        got = pull(srv.address, world, 2, **({"batching": BATCHING} if batched else {}))
    if batched:
        want = reference_batches(cfg, 2, BATCHING)
        assert len(want[3]["seq_tag"]) == 0 and 0 < len(want[1]["seq_tag"]) < 5  # what the test is about
        for rank in range(world):
            assert_same_batches(got[rank][0], shard(want, rank, world))
        assert len({len(got[rank][0]) for rank in range(world)}) == 1  # equal steps, the empty batch too
        assert got[1][0][1]["data"].shape == (0, 0, 8) and list(got[1][0][1]["seq_tag"]) == []
        end = len(want) // world * world
        cut = Batching.from_dict(BATCHING)
        expect = sum(len(b) - len(w["seq_tag"]) for b, w in zip(_cut(cfg, cut), want[:end]))
    else:
        for rank in range(world):
            mine = shard(positions, rank, world)
            assert_same_epoch(got[rank][0], [s for s in mine if s is not None])
            assert len(got[rank][1]) == len(mine)  # len() and positions count the skipped ones
            assert got[rank][1].skipped == sum(s is None for s in mine)
        end = len(positions) // world * world
        expect = sum(s is None for s in positions[:end])
    assert expect > 0
    assert sum(got[rank][1].skipped for rank in range(world)) == expect
    st = max((got[rank][2] for rank in range(world)), key=lambda s: s["seqs_skipped"])
    assert st["seqs_skipped"] == expect  # counted by the server, wherever the results went
    assert re.search(r"map_seq skipped seqs \(returned None\): (seq |\d+ seqs \()'seq-\d+'", read(log))


def _cut(cfg: str, batching: Batching) -> List[List[int]]:
    """The epoch's batches as positions of its seqs (as the reader cuts epoch 2)."""
    from ppserver.config.settings import load_config
    from ppserver.datasets import make_dataset
    from ppserver.scheduler.cut import cut_epoch

    config = load_config(cfg)
    ds = make_dataset(config.dataset, order_seed=config.seed)
    ds.init_seq_order(2)
    return cut_epoch([ds.get_seq(p)["data"].shape[0] for p in range(ds.num_seqs)], batching)


@pytest.mark.processes
@pytest.mark.parametrize("batched", [False, True])
def test_a_resume_from_a_state_taken_after_a_skip_continues_with_the_same_seqs(tmp_path, batched):
    cfg = corpus(tmp_path)
    kw: Dict[str, Any] = {"batching": BATCHING} if batched else {}
    if batched:
        want = reference_batches(cfg, 2, BATCHING)
        taken = 4  # batches: past batch 3, whose seqs were all skipped, and batch 1
    else:
        positions = reference(cfg, 2, skipped=True)
        taken = next(p for p, s in enumerate(positions) if s is None) + 2  # two positions past the first skip
        want = positions
    with run_server(cfg, workers=2) as srv:
        with srv.client(job="resume", **kw) as c:
            it = c.epoch(2)
            first = [next(it) for _ in range(taken)]
            state = it.state_dict()
            assert it.skipped > 0
        with srv.client(job="resume") as c:
            rest = collect(c.epoch(state=state))
    if batched:
        assert state["position"] == taken
        assert_same_batches(first + rest, want)
    else:
        yielded = len(first)
        assert state["position"] > yielded  # positions count the skipped seqs too
        assert_same_epoch(first + rest, [s for s in want if s is not None])
        assert_same_epoch(rest, [s for s in want[state["position"] :] if s is not None])


@pytest.mark.processes
def test_an_epoch_that_skips_more_than_max_skipped_fails_with_one_clear_error(tmp_path):
    cfg = corpus(tmp_path, "max_skipped = 0.05\n")  # 5 of 61 seqs are corrupt: more than 3.05
    log = str(tmp_path / "server.log")
    with run_server(cfg, workers=3, log_path=log) as srv, srv.client(timeout=30) as c:
        with pytest.raises(ppclient.MapperError) as err:
            collect(c.epoch(2))
        assert c.status()["state"] == "failed"
        assert c.status()["seqs_skipped"] >= 4
    text = str(err.value)
    assert "more than max_skipped (0.05 of its 61 seqs)" in text, text
    assert err.value.seq_tag is not None and repr(err.value.seq_tag) in text
    assert "map_seq skipped" in read(log)


@pytest.mark.processes
def test_status_and_metrics_count_the_skipped_seqs(tmp_path):
    from test_metrics import scrape, value

    cfg = corpus(tmp_path)
    expect = sum(s is None for s in reference(cfg, 2, skipped=True))
    port = free_port()
    with run_server(cfg, workers=1, extra=["--metrics", f"127.0.0.1:{port}"]) as srv, srv.client() as c:
        assert len(collect(c.epoch(2))) == 61 - expect
        text = run_cli("status", srv.address, timeout=30)
        st = json.loads(run_cli("status", srv.address, "--json", timeout=30).stdout)
        wait_for(lambda: value(scrape(port), "ppserver_seqs_skipped_total") == expect, 10, "the skipped count")
    assert text.returncode == 0 and f"skipped {expect} (all epochs: {expect})" in text.stdout, text.stdout
    assert st["seqs_skipped"] == st["seqs_skipped_total"] == expect

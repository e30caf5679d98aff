"""The protocol module alone: every message round-trips; anything else is refused with a reason."""

from __future__ import annotations

import dataclasses
import os
import re

import msgpack
import numpy as np
import pytest

from ppclient import protocol, wire
from ppclient.protocol import Channel, Peer

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sample(cls):
    """An instance with a non-default value in every field it has."""
    values = {}
    for f in dataclasses.fields(cls):
        hint = str(f.type)
        if "List[List[str]]" in hint:
            values[f.name] = [["a"], []]
        elif "List[bytes]" in hint:
            values[f.name] = [b"id-1", b""]
        elif "bytes" in hint:
            values[f.name] = b"id-1"
        elif "List[str]" in hint:
            values[f.name] = ["a", "b"]
        elif "List[int]" in hint:
            values[f.name] = [3, 1]
        elif "List[Dict" in hint:
            values[f.name] = [{"to": "ready", "run": 3, "time": 1.5, "worker": None}]
        elif "Dict" in hint:
            values[f.name] = {"data": {"shape": [None, 8], "dtype": "float32"}}
        elif "bool" in hint:
            values[f.name] = True
        elif "float" in hint:
            values[f.name] = 2.5
        elif "int" in hint:
            values[f.name] = 7
        else:
            values[f.name] = "text"
    return cls(**values)


def receiver_and_channel(cls):
    return cls.receiver[0], (cls.channel,)


@pytest.mark.parametrize("kind", sorted(protocol.MESSAGES))
def test_every_message_round_trips(kind):
    cls = protocol.MESSAGES[kind]
    msg = sample(cls)
    items = [protocol.seq_to_item({"data": np.arange(6, dtype="float32").reshape(3, 2), "seq_tag": "t"}, 4)]
    frames = protocol.encode(msg, items if cls.batch else ())
    decoded = protocol.decode(frames, *receiver_and_channel(cls))
    assert decoded.msg == msg and decoded.bad == []
    if cls.batch:
        seq = protocol.item_to_seq(decoded.items[0])
        assert seq["seq_tag"] == "t" and np.array_equal(seq["data"], np.arange(6, dtype="float32").reshape(3, 2))


def test_unknown_kind_wrong_socket_and_wrong_receiver_are_refused():
    with pytest.raises(protocol.ProtocolError, match="unknown message kind"):
        protocol.decode([wire.pack({"t": "nope"})], Peer.SERVER, (Channel.CONTROL,))
    credit = protocol.encode(protocol.Credit(run=1, total=2))
    with pytest.raises(protocol.ProtocolError, match="does not accept"):
        protocol.decode(credit, Peer.SERVER, (Channel.WORKER,))  # a data-socket message on the worker socket
    with pytest.raises(protocol.ProtocolError, match="does not accept"):
        protocol.decode(credit, Peer.WORKER, (Channel.DATA,))


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("run", -1, "must be >= 0"),
        ("run", True, "must be an int"),
        ("run", "1", "must be an int"),
        ("total", None, "must be an int"),
    ],
)
def test_fields_are_checked(field, value, match):
    header = wire.unpack(protocol.encode(protocol.Credit(run=1, total=2))[0])
    header[field] = value
    with pytest.raises(protocol.ProtocolError, match=match):
        protocol.decode([wire.pack(header)], Peer.SERVER, (Channel.DATA,))
    del header[field]
    with pytest.raises(protocol.ProtocolError, match="without its"):
        protocol.decode([wire.pack(header)], Peer.SERVER, (Channel.DATA,))


def test_nested_values_must_be_plain():
    header = wire.unpack(protocol.encode(protocol.Welcome(templates={}))[0])
    header["templates"] = {"k": b"\x00bytes"}
    with pytest.raises(protocol.ProtocolError, match="plain values"):
        protocol.decode([wire.pack(header)], Peer.WORKER, (Channel.WORKER,))
    header = wire.unpack(protocol.encode(protocol.EpochRequest(epoch=1, consumer=b"c"))[0])
    header["seq_list"] = ["a", 3]
    with pytest.raises(protocol.ProtocolError, match="seq_list"):
        protocol.decode([wire.pack(header)], Peer.SERVER, (Channel.CONTROL,))


def test_version_mismatch_names_both_versions():
    header = wire.unpack(protocol.encode(protocol.InfoRequest())[0])
    header["proto"] = protocol.PROTOCOL + 1
    with pytest.raises(protocol.VersionMismatch) as info:
        protocol.decode([wire.pack(header)], Peer.SERVER, (Channel.CONTROL,))
    assert info.value.theirs == protocol.PROTOCOL + 1 and info.value.msg_kind == "info"
    assert f"speaks {protocol.PROTOCOL + 1}" in str(info.value)


def test_frames_on_a_message_without_items_are_refused():
    with pytest.raises(protocol.ProtocolError, match="carries no frames"):
        protocol.decode(protocol.encode(protocol.Bye()) + [b"x"], Peer.SERVER, (Channel.WORKER,))


def batch(items_headers, frames):
    return [wire.pack({"t": "results", "run": 1, "items": items_headers}), *frames]


GOOD = {"i": 0, "meta": {"seq_tag": "a", "seq_idx": 0, "complete_frac": 0.5}, "arrays": [["x", "<f4", [2]]]}


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"meta": ["seq_tag", "a"]}, "meta is not a map"),
        ({"meta": {"seq_tag": 3}}, "bad meta entry"),
        ({"meta": {"other": 1}}, "bad meta entry"),
        ({"arrays": [[1, "<f4", [2]]]}, "bad or repeated array key"),
        ({"arrays": [["seq_tag", "<f4", [2]]]}, "bad or repeated array key"),
        ({"arrays": [["x", "|O", [2]]]}, "refused dtype"),
        ({"arrays": [["x", "<f4", [-2]]]}, "bad shape"),
        ({"arrays": [["x", "<f4", [3]]]}, "has 8 bytes"),
        ({"i": -1}, "not an int >= 0"),
    ],
)
def test_a_bad_item_is_reported_alone(change, reason):
    bad = {**GOOD, "i": 1, **change}
    decoded = protocol.decode(batch([GOOD, bad], [bytes(8), bytes(8)]), Peer.SERVER, (Channel.WORKER,))
    assert [it.pos for it in decoded.items] == [0]
    assert len(decoded.bad) == 1 and reason in decoded.bad[0].reason
    assert decoded.bad[0].pos == (1 if "i" not in change else None)


def test_frames_that_do_not_match_the_items_make_every_item_bad():
    decoded = protocol.decode(batch([GOOD, {**GOOD, "i": 1}], [bytes(8)]), Peer.SERVER, (Channel.WORKER,))
    assert decoded.items == [] and [b.pos for b in decoded.bad] == [0, 1]


def test_a_batch_too_large_for_one_header_is_split_in_order():
    tag = "t" * (200 << 10)  # 16 items of 200 KiB headers: 3.2 MB, more than one header may have
    items = [protocol.seq_to_item({"data": np.full(3, i, "int16"), "seq_tag": f"{i}{tag}"}, i) for i in range(16)]
    to = [b"c%d" % i for i in range(16)]
    parts = protocol.encode_fitting(protocol.Tasks(run=3, to=to), items)
    assert len(parts) > 1 and all(len(frames[0]) <= wire.MAX_HEADER_BYTES for frames in parts)
    decoded = [protocol.decode(frames, Peer.WORKER, (Channel.WORKER,)) for frames in parts]
    assert [it.pos for d in decoded for it in d.items] == list(range(16))
    assert [t for d in decoded for t in d.msg.to] == to  # `to` is split with its items
    assert all(len(d.msg.to) == len(d.items) and d.msg.run == 3 for d in decoded)
    assert [int(protocol.item_to_seq(it)["data"][0]) for d in decoded for it in d.items] == list(range(16))
    one = protocol.encode_fitting(protocol.Tasks(run=3), items[:2])  # small enough: one message, `to` empty
    assert len(one) == 1 and protocol.decode(one[0], Peer.WORKER, (Channel.WORKER,)).msg.to == []


def test_garbage_headers_are_protocol_errors():
    for frames in ([b"\xc1"], [msgpack.packb([1, 2])], [b""], []):
        with pytest.raises(protocol.ProtocolError):
            protocol.decode(frames, Peer.SERVER, (Channel.CONTROL,))
    with pytest.raises(protocol.ProtocolError, match="exceeds"):
        protocol.decode([b"\x80" + bytes(2000)], Peer.SERVER, (Channel.CONTROL,), max_header_bytes=1000)


def test_docs_describe_every_message_and_field():
    with open(os.path.join(REPO, "docs", "protocol.md")) as f:
        doc = f.read()
    for entry in protocol.describe():
        row = re.search(rf"^\| `{entry['kind']}` \|.*$", doc, re.MULTILINE)
        assert row, f"docs/protocol.md has no row for {entry['kind']!r}"
        for name in entry["fields"]:
            assert f"`{name}`" in row.group(0), f"{entry['kind']}.{name} is not in its row"
    assert f"PROTOCOL = {protocol.PROTOCOL}" in doc


def test_a_dropped_message_is_reported_with_what_can_be_read_of_it():
    """A worker names what it dropped: the kind, run, partition and positions, read past the
    header cap; an item without a readable position names none (every task of the run)."""
    items = [
        protocol.seq_to_item({"data": np.zeros(3, "f4"), "seq_tag": t}, i) for i, t in ((4, "a"), (5, "x" * (2 << 20)))
    ]
    frames = protocol.encode(protocol.Tasks(run=9), items)
    with pytest.raises(protocol.ProtocolError, match="exceeds 1048576") as info:
        protocol.decode(frames, Peer.WORKER, (Channel.WORKER,))
    report = protocol.dropped(frames, str(info.value))
    assert report == protocol.Dropped(what="tasks", run=9, pos=[4, 5], reason=str(info.value))
    stream = protocol.encode(protocol.StreamInputs(run=9, partition=2), items[1:])
    assert protocol.dropped(stream, "r") == protocol.Dropped(
        what="stream_inputs", run=9, partition=2, pos=[5], reason="r"
    )
    header = wire.unpack(protocol.encode(protocol.Tasks(run=9), items[:1])[0])
    header["items"].append({"i": "7"})
    assert protocol.dropped([wire.pack(header)], "r").pos == []
    assert protocol.dropped([b"\xc1"], "junk " * 200) == protocol.Dropped(reason=("junk " * 200)[:500])
    bad = [protocol.BadItem(3, "meta is not a map"), protocol.BadItem(None, "no position")]
    assert protocol.dropped_items(protocol.Tasks(run=2), bad[:1], "r") == protocol.Dropped("tasks", 2, None, [3], "r")
    assert protocol.dropped_items(protocol.Tasks(run=2), bad, "r").pos == []
    frames = protocol.encode(report)
    assert protocol.decode(frames, Peer.SERVER, (Channel.WORKER,)).msg == report


@pytest.mark.parametrize("char", ["x", "\u00e9", "\U0001f600"])
def test_an_oversized_item_header_is_told_exactly(char):
    """The reader's cheap bound never lets an oversized header through nor refuses one that fits."""
    limit = protocol.MAX_ITEM_HEADER_BYTES
    arrays = {f"key{k}": np.zeros((1,) * 8, "f4") for k in range(3)}
    width = len(char.encode())
    for n in (0, 100, limit // width - 300, limit // width - 120, limit // width - 80, limit // width, 2 << 20):
        item = protocol.seq_to_item({**arrays, "seq_tag": char * max(n, 0), "seq_idx": 7}, 12345)
        size = protocol.item_header_bytes(item)
        assert protocol.oversized_header(item) == (size if size > limit else None), (n, size)
    assert protocol.short_tag("s1") == "s1" and protocol.short_tag(None) is None
    assert protocol.short_tag("y" * 10_000) == "y" * protocol.SHORT_TAG + "... (10000 characters)"

"""Shared-memory blocks: the segment's allocator, zero-copy views, release, and two processes (kill -9 included)."""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Set, Tuple

import msgpack
import numpy as np
import pytest
from conftest import held_by_others, wait_child

import ppclient.protocol
from ppclient import shm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The seqs both sides build: exec'd here and prepended to the child scripts.
DATA = """
import numpy as np

def make(seed):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((100, 80)).astype("float32"),
        "n": np.arange(seed, seed + 7, dtype=np.int64),
        "e": np.zeros((0, 5), "f8"),
        "s": np.array(["ab", "cdefg"]),
        "z": np.array(float(seed)),
    }
"""
_ns: Dict[str, Any] = {}
exec(DATA, _ns)
make = _ns["make"]

PRODUCER = (
    DATA
    + """
import json, sys
from ppclient import shm

segment = shm.Segment(1 << 20)

def say(obj):
    sys.stdout.write(json.dumps(obj) + "\\n")
    sys.stdout.flush()

for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "pack":
        seq = make(cmd["seed"])
        block, offsets = shm.pack(segment, list(seq.values()), cmd["owner"].encode())
        specs = [[k, a.dtype.str, list(a.shape), o] for (k, a), o in zip(seq.items(), offsets)]
        say({"descriptor": segment.descriptor.to_dict(), "ref": list(block.ref()), "specs": specs})
    elif cmd["op"] == "used":
        say({"used": segment.used()})
"""
)

CONSUMER = (
    DATA
    + """
import gc, json, sys
from ppclient import shm

held = []

def say(obj):
    sys.stdout.write(json.dumps(obj) + "\\n")
    sys.stdout.flush()

for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "view":
        try:
            arrays = shm.Mapping.open(cmd["descriptor"]).arrays(cmd["ref"], cmd["specs"])
        except shm.ShmUnavailable as exc:
            say({"error": str(exc)})
            continue
        expected = make(cmd["seed"])
        held.append(arrays)
        say({"ok": all(arrays[k].dtype == v.dtype and np.array_equal(arrays[k], v) for k, v in expected.items())})
        del arrays  # only `held` keeps them
    elif cmd["op"] == "drop":
        held.clear()
        gc.collect()
        say({"dropped": True})
"""
)


class Child:
    """A python child speaking JSON lines on stdin/stdout; every wait has a deadline."""

    def __init__(self, script: str, **popen_kw: Any):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [REPO, os.path.join(REPO, "client")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            **popen_kw,
        )
        self._buf = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ask(self, obj: Dict[str, Any], timeout: float = 30.0) -> Dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
        self.proc.stdin.flush()
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no answer to {obj['op']} within {timeout} s")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise AssertionError(f"child exited: {self.stderr()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def stderr(self) -> str:
        self.close()
        assert self.proc.stderr is not None
        return self.proc.stderr.read().decode(errors="replace")[-2000:]

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(timeout=10) == -signal.SIGKILL

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # EOF ends the child's loop
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None and not f.closed:
                f.close()


@pytest.fixture
def children():
    started: List[Child] = []

    def start(script: str, **kw: Any) -> Child:
        started.append(Child(script, **kw))
        return started[-1]

    yield start
    for c in started:
        c.close()
        if c.proc.stderr is not None:
            c.proc.stderr.close()


@pytest.fixture(autouse=True)
def fresh_mappings():
    shm.Mapping.close_all()
    yield
    gc.collect()
    shm.Mapping.close_all()


def specs_of(seq: Dict[str, np.ndarray], offsets: List[int]) -> List[Tuple[str, str, Tuple[int, ...], int]]:
    return [(k, a.dtype.str, a.shape, o) for (k, a), o in zip(seq.items(), offsets)]


def put(segment: shm.Segment, seq: Dict[str, np.ndarray], owner: bytes = b"") -> Tuple[shm.Block, List[Any]]:
    packed = shm.pack(segment, list(seq.values()), owner)
    assert packed is not None
    block, offsets = packed
    return block, specs_of(seq, offsets)


def assert_seq_equal(got: Dict[str, np.ndarray], expected: Dict[str, np.ndarray]) -> None:
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert np.array_equal(got[k], v), k


def memfd_inode(pid: int, fd: int) -> Tuple[int, int]:
    """The segment's (device, inode): an anonymous memfd, not a file of /dev/shm's filesystem."""
    st = os.stat(f"/proc/{pid}/fd/{fd}")
    assert os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:ppshm")
    if os.path.isdir("/dev/shm"):
        assert st.st_dev != os.stat("/dev/shm").st_dev
    return st.st_dev, st.st_ino


def mapped_memfds() -> Set[int]:
    """Inodes of the memfds this process maps."""
    with open("/proc/self/maps") as f:
        return {int(parts[4]) for parts in (line.split() for line in f) if len(parts) > 5 and "memfd:" in parts[5]}


def fd_inodes() -> Set[Tuple[int, int]]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        out.add((st.st_dev, st.st_ino))
    return out


def dev_shm() -> Set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def assert_nothing_new_in_dev_shm(before: Set[str]) -> None:
    """No file appeared in /dev/shm, apart from other programs' (the machine is shared)."""
    new = [name for name in dev_shm() - before if not held_by_others(os.path.join("/dev/shm", name))]
    assert not new, f"new in /dev/shm: {new}"


def assert_gone(inode: Tuple[int, int]) -> None:
    """No mapping and no fd of this process refers to the memfd any more."""
    gc.collect()
    assert inode[1] not in mapped_memfds()
    assert inode not in fd_inodes()


# --- the segment -----------------------------------------------------------------------------


@pytest.mark.unit
def test_probe_and_host_id():
    assert shm.probe() is None
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert f.read().strip() in shm.host_id()
    assert shm.host_id() == shm.host_id()


@pytest.mark.unit
def test_descriptor_travels_as_msgpack():
    with shm.Segment(8192) as segment:
        d = segment.descriptor
        assert d.pid == os.getpid() and d.size == 8192 and d.host == shm.host_id()
        back = shm.Descriptor.from_dict(msgpack.unpackb(msgpack.packb(d.to_dict()), raw=False))
        assert back == d
        assert shm.Mapping.open(msgpack.unpackb(msgpack.packb(d.to_dict()), raw=False)).descriptor == d
    for bad in ({"pid": 1}, {**d.to_dict(), "fd": "3"}, {**d.to_dict(), "x": 1}, [1, 2], None):
        with pytest.raises(shm.ShmUnavailable, match="malformed"):
            shm.Descriptor.from_dict(bad)


@pytest.mark.unit
def test_alloc_is_aligned_and_contiguous():
    with shm.Segment(1 << 16) as segment:
        blocks = [segment.alloc(n) for n in (1, 63, 64, 65, 1000, 0, 7)]
        offset = shm.SEGMENT_HEADER + shm.BLOCK_HEADER
        for b in blocks:
            assert b is not None
            assert b.offset == offset and b.offset % 64 == 0 and b.data.nbytes == b.nbytes
            assert b.data.flags.writeable and b.data.ctypes.data % 64 == 0
            offset += shm.BLOCK_HEADER + -(-b.nbytes // 64) * 64
        assert segment.used() == offset - shm.SEGMENT_HEADER - shm.BLOCK_HEADER
        assert segment.free() == segment.capacity - segment.used()
        assert len({b.seq for b in blocks if b}) == len(blocks)


@pytest.mark.unit
def test_blocks_wrap_to_the_first_gap_that_fits_and_a_full_segment_returns_none():
    with shm.Segment(4096) as segment:  # 4032 bytes of blocks: 63 lines
        assert segment.capacity == 4032
        a, b, c = (segment.alloc(960) for _ in range(3))  # 1024 bytes each with the header
        assert a and b and c and segment.used() == 3072
        assert segment.alloc(960) is None  # 960 left at the end, the start is taken
        a.release()
        d = segment.alloc(960)  # does not fit at the end: goes where a was
        assert d is not None and d.offset == a.offset
        assert segment.used() == 3072
        small = segment.alloc(800)  # fits in the 960 bytes at the end
        assert small is not None and small.offset == c.offset + 1024
        assert segment.alloc(960) is None  # nothing is free anywhere
        b.release()
        c.release()
        assert segment.used() == 1024 + 896  # d and small
        e = segment.alloc(1900)  # 1984 bytes with the header: the room of b and c, together
        assert e is not None and e.offset == d.offset + 1024


@pytest.mark.unit
def test_a_released_block_is_reused_whatever_older_ones_are_held():
    """A consumer that keeps one seq's arrays for long holds only their block."""
    with shm.Segment(4096) as segment:
        a, b, c = (segment.alloc(100) for _ in range(3))
        assert a and b and c
        c.release()
        b.release()
        assert segment.used() == 192  # a alone
        blocks = [segment.alloc(100) for _ in range(20)]  # 192 bytes each: the rest of the segment
        assert all(blocks) and segment.alloc(100) is None
        for blk in blocks:
            assert blk is not None
            blk.release()
        assert segment.used() == 192
        again = [segment.alloc(100) for _ in range(20)]
        assert all(again)  # a is still held: the rest is used again
        a.release()
        for blk in again:
            assert blk is not None
            blk.release()
        assert segment.used() == 0
        first = segment.alloc(100)
        assert first is not None and first.offset == a.offset  # an empty segment starts over


@pytest.mark.unit
def test_a_block_larger_than_the_segment_returns_none():
    with shm.Segment(4096) as segment:
        assert segment.alloc(4096) is None
        assert shm.pack(segment, [np.zeros(5000, np.uint8)]) is None
        assert segment.alloc(segment.capacity - shm.BLOCK_HEADER) is not None


@pytest.mark.unit
def test_release_owner():
    with shm.Segment(1 << 16) as segment:
        blocks = [segment.alloc(100, owner) for owner in (b"gone", b"alive", b"gone", b"gone")]
        assert all(blocks)
        assert segment.release_owner(b"gone") == 3
        assert segment.used() == 192  # "alive"'s alone
        assert segment.release_owner(b"gone") == 0
        assert blocks[1] is not None
        blocks[1].release()
        assert segment.used() == 0
        long_owner = b"x" * 100  # longer than the tag in shared memory: still matched in full
        assert segment.alloc(8, long_owner) and segment.alloc(8, long_owner[:-1] + b"y")
        assert segment.release_owner(long_owner) == 1


@pytest.mark.unit
def test_a_consumer_that_closed_gets_back_only_the_blocks_it_never_took():
    """Blocks a consumer made arrays of are marked taken: freeing the untaken ones of a consumer
    that closed (still in its socket, or on the way) leaves those arrays intact; a taken block
    cannot be made arrays of twice."""
    with shm.Segment(1 << 20) as segment:
        mapping = shm.Mapping.open(segment.descriptor)
        taken, specs = put(segment, make(1), b"closed")
        unread = [put(segment, make(2), b"closed")[0] for _ in range(2)]
        put(segment, make(3), b"other")
        got = mapping.arrays(taken.ref(), specs)
        with pytest.raises(shm.ShmUnavailable, match="taken"):
            mapping.arrays(taken.ref(), specs)
        size = segment.used() // 4
        assert segment.release_owner(b"closed", taken=False) == 2
        assert segment.used() == 2 * size  # the taken block and the other consumer's
        for block in unread:
            with pytest.raises(shm.ShmUnavailable, match="stale"):
                mapping.arrays(block.ref(), specs)
        put(segment, make(4), b"closed")  # the freed room is used again...
        assert_seq_equal(got, make(1))  # ...and the taken block's arrays are untouched
        del got
        assert segment.used() == 2 * size  # dropped: released by the consumer, as always
        assert segment.release_owner(b"other", taken=False) == 1
        assert segment.release_owner(b"closed") == 1  # its process exited: every block goes
        assert segment.used() == 0


@pytest.mark.unit
def test_closed_segment():
    segment = shm.Segment(4096)
    block = segment.alloc(10)
    assert block is not None
    segment.close()  # block.data still maps the segment: unmapped when it goes
    segment.close()
    with pytest.raises(ValueError, match="closed"):
        segment.alloc(1)
    assert segment.release_owner(b"") == 0
    block.release()
    for bad in (0, 4095, "4096", True):
        with pytest.raises(ValueError):
            shm.Segment(bad)


# --- views -----------------------------------------------------------------------------------

DTYPES = [
    "?",
    "i1",
    "u1",
    "<i2",
    ">i4",
    "u4",
    "i8",
    "<u8",
    "f2",
    "f4",
    ">f8",
    "c8",
    "c16",
    "U7",
    "S5",
    "M8[ns]",
    "m8[s]",
]
SHAPES = [(), (0,), (3,), (2, 3, 4), (1, 0, 5), (7, 1)]


def sample(dtype: str, shape: Tuple[int, ...], seed: int) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 120, size=shape)
    dt = np.dtype(dtype)
    if dt.kind == "U" or dt.kind == "S":
        return raw.astype(dt)
    if dt.kind in "mM":
        return raw.astype(np.int64).astype(dt)
    return raw.astype(dt)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_dtypes_and_shapes(dtype):
    with shm.Segment(1 << 16) as segment:
        seq = {f"a{i}": sample(dtype, shape, i) for i, shape in enumerate(SHAPES)}
        seq["strided"] = sample(dtype, (6, 8), 99)[::2, 1::3]
        seq["fortran"] = np.asfortranarray(sample(dtype, (3, 5), 98))
        block, specs = put(segment, seq)
        assert all(off % 64 == 0 for _, _, _, off in specs)
        got = shm.Mapping.open(segment.descriptor).arrays(block.ref(), specs)
        assert_seq_equal(got, seq)
        del got
        assert segment.used() == 0


@pytest.mark.unit
def test_zero_byte_arrays_and_blocks():
    with shm.Segment(4096) as segment:
        seq = {"e": np.zeros((0, 3), "f4"), "f": np.zeros(0, "U3")}
        block, specs = put(segment, seq)
        assert block.nbytes == 0 and segment.used() == shm.BLOCK_HEADER
        got = shm.Mapping.open(segment.descriptor).arrays(block.ref(), specs)
        assert_seq_equal(got, seq)
        del got
        assert segment.used() == 0
        empty = segment.alloc(0)
        assert empty is not None
        assert shm.Mapping.open(segment.descriptor).arrays(empty.ref(), []) == {}
        assert segment.used() == 0  # no arrays: released at once


@pytest.mark.unit
def test_views_are_writable_shared_memory():
    with shm.Segment(1 << 16) as segment:
        seq = make(3)
        block, specs = put(segment, seq)
        got = shm.Mapping.open(segment.descriptor).arrays(block.ref(), specs)
        x = got["x"]
        assert not x.flags.owndata and x.flags.writeable and x.ctypes.data % 64 == 0
        x[0, 0] = 12345.0
        assert block.data[: x.nbytes].view("f4")[0] == 12345.0  # the producer sees the consumer's write
        block.data[: x.nbytes].view("f4")[1] = -1.0
        assert x[0, 1] == -1.0


@pytest.mark.unit
def test_dropping_every_array_releases_the_block():
    with shm.Segment(1 << 16) as segment:
        mapping = shm.Mapping.open(segment.descriptor)
        block, specs = put(segment, make(1))
        got = mapping.arrays(block.ref(), specs)
        x_row = got["x"][3]  # a view keeps the block, whichever array it came from
        tail = got["n"].reshape(7, 1).T
        del got
        gc.collect()
        assert segment.used() > 0
        del x_row
        assert segment.used() > 0
        del tail
        assert segment.used() == 0  # released at once by reference counting
        again, specs2 = put(segment, make(2))
        assert again.offset == block.offset  # the producer reuses the memory
        assert_seq_equal(mapping.arrays(again.ref(), specs2), make(2))


@pytest.mark.unit
def test_explicit_release():
    with shm.Segment(1 << 16) as segment:
        mapping = shm.Mapping.open(segment.descriptor)
        first, specs = put(segment, make(1))
        second, _ = put(segment, make(1))
        a = mapping.arrays(first.ref(), specs)
        b = mapping.arrays(second.ref(), specs)
        shm.release(a)
        shm.release(a)  # twice is fine
        shm.release(b["x"][2:])  # any view of any array names its block
        assert segment.used() == 0
        assert a["x"].shape == (100, 80)  # still referenced: the memory stays mapped
        c = mapping.arrays(put(segment, make(4))[0].ref(), specs)
        shm.release([c["n"]])
        assert segment.used() == 0
        shm.release(np.zeros(3))  # not a block's array: nothing happens


@pytest.mark.unit
def test_stale_and_bad_refs():
    with shm.Segment(1 << 16) as segment:
        mapping = shm.Mapping.open(segment.descriptor)
        block, specs = put(segment, make(1))
        ref = block.ref()
        block.release()
        with pytest.raises(shm.ShmUnavailable, match="stale"):
            mapping.arrays(ref, specs)
        assert segment.used() == 0  # an empty segment starts over at its start
        block2, _ = put(segment, make(2))
        assert block2.offset == ref.offset
        with pytest.raises(shm.ShmUnavailable, match="stale"):
            mapping.arrays(ref, specs)  # same place, another seq
        for bad_ref in ((block2.offset + 8, 10, block2.seq), (64, 10, 1), (block2.offset, 1 << 20, block2.seq)):
            with pytest.raises(shm.ShmUnavailable, match="outside"):
                mapping.arrays(bad_ref, specs)
        assert segment.used() > 0
        block2.release()
        bad_specs = [
            [("x", "f4", (100, 81), 0)],
            [("x", "O", (1,), 0)],
            [("x", "f4", (-1,), 0)],
            [("x", "no such", (1,), 0)],
            [("x", 4, (1,), 0)],
            [("x", "f4", (1,), -64)],
        ]
        for bad in bad_specs:
            block3, _ = put(segment, make(3))
            with pytest.raises(ValueError):
                mapping.arrays(block3.ref(), bad)
            assert segment.used() == 0  # a block that cannot be used is released


@pytest.mark.unit
def test_open_refuses_what_is_not_the_segment(tmp_path):
    segment = shm.Segment(8192)
    d = segment.descriptor
    with pytest.raises(shm.ShmUnavailable, match="token mismatch"):
        shm.Mapping.open(shm.Descriptor(d.host, d.pid, d.fd, d.size, d.token ^ 1))
    with pytest.raises(shm.ShmUnavailable, match="another host"):
        shm.Mapping.open(shm.Descriptor("elsewhere/x/1", d.pid, d.fd, d.size, d.token))
    with pytest.raises(shm.ShmUnavailable, match="is not"):
        shm.Mapping.open(shm.Descriptor(d.host, d.pid, d.fd, d.size * 2, d.token))
    with open(tmp_path / "f", "wb+") as f:
        f.write(b"\0" * d.size)
        f.flush()
        with pytest.raises(shm.ShmUnavailable, match="not a segment"):
            shm.Mapping.open(shm.Descriptor(d.host, d.pid, f.fileno(), d.size, d.token))
    r, w = os.pipe()
    try:
        with pytest.raises(shm.ShmUnavailable, match="is not"):
            shm.Mapping.open(shm.Descriptor(d.host, d.pid, r, d.size, d.token))
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(shm.ShmUnavailable, match="does not exist"):
        shm.Mapping.open(shm.Descriptor(d.host, d.pid, 99999, d.size, d.token))
    segment.close()
    with pytest.raises(shm.ShmUnavailable, match="does not exist"):
        shm.Mapping.open(d)  # closed by the producer
    other = shm.Segment(8192)  # most likely on the same fd: the descriptor is stale
    try:
        with pytest.raises(shm.ShmUnavailable, match="token mismatch" if other.descriptor.fd == d.fd else "not exist"):
            shm.Mapping.open(d)
    finally:
        other.close()


@pytest.mark.unit
def test_a_mapping_is_shared_by_its_users_and_tells_when_its_producer_is_gone():
    segment = shm.Segment(1 << 16)
    a = shm.Mapping.open(segment.descriptor)
    b = shm.Mapping.open(segment.descriptor)  # a second client of this process: the same mapping
    assert a is b and not a.producer_gone()
    block, specs = put(segment, make(1))
    a.close()  # one user leaves: the other one keeps reading
    assert_seq_equal(b.arrays(block.ref(), specs), make(1))
    segment.close()  # the producer is gone (as after a kill): no block will come any more
    assert b.producer_gone()
    b.close()
    with pytest.raises(shm.ShmUnavailable, match="closed"):
        b.arrays(block.ref(), specs)


@pytest.mark.unit
def test_discard_frees_a_block_whose_message_was_not_used():
    with shm.Segment(1 << 16) as segment:
        mapping = shm.Mapping.open(segment.descriptor)
        block, _ = put(segment, make(1))
        frames = ppclient.protocol.encode_batch(
            ppclient.protocol.DirectSeqs(run=1), [{"i": 7, "meta": [], "arrays": [], "b": [*block.ref(), []]}], []
        )
        assert ppclient.protocol.block_refs(frames) == [(7, list(block.ref()))]
        assert ppclient.protocol.block_refs([b"\xc1"]) == []
        wrong = [(block.offset + 8, 1, block.seq), (block.offset, block.nbytes, block.seq + 1), ("x",), (1 << 40, 0, 1)]
        for junk in wrong:
            mapping.discard(junk)  # not this block, or no block at all: nothing happens
        assert segment.used() > 0
        mapping.discard(block.ref())
        assert segment.used() == 0
        again, _ = put(segment, make(2))
        mapping.discard(block.ref())  # a stale reference does not free the block now in its place
        assert segment.used() > 0
        again.release()


@pytest.mark.unit
def test_a_segment_is_made_only_with_memory_to_spare(monkeypatch):
    """A segment must fit four times into the memory available, and committing it stops while
    RESERVE is still free (a memfd's pages would otherwise come from the OOM killer)."""
    fds_before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(shm.memfd, "_available_memory", lambda: 3 << 20)
    with pytest.raises(shm.ShmUnavailable, match=r"more than 1/4 of the memory available \(3 MiB\)"):
        shm.Segment(1 << 20)
    looks = iter([shm.RESERVE + 100 * shm.COMMIT_STEP, shm.RESERVE + shm.COMMIT_STEP // 2])
    monkeypatch.setattr(shm.memfd, "_available_memory", lambda: next(looks))  # others take memory meanwhile
    with pytest.raises(shm.ShmUnavailable, match="memory ran short while committing"):
        shm.Segment(2 * shm.COMMIT_STEP)
    assert len(os.listdir("/proc/self/fd")) == fds_before  # nothing left open
    monkeypatch.setattr(shm.memfd, "_available_memory", lambda: None)  # unknown: no bound
    shm.Segment(1 << 20).close()


@pytest.mark.unit
def test_mappings_are_cached_and_bounded():
    segments = [shm.Segment(4096) for _ in range(shm.MAX_MAPPINGS + 2)]
    try:
        first = shm.Mapping.open(segments[0].descriptor)
        assert shm.Mapping.open(segments[0].descriptor.to_dict()) is first
        for r in segments[1:]:
            shm.Mapping.open(r.descriptor)
        assert shm.Mapping.open(segments[0].descriptor) is not first  # evicted, mapped again
        first.close()  # opened twice: one user is left, for whom it stays mapped
        with pytest.raises(shm.ShmUnavailable, match="stale"):
            first.arrays((128, 0, 1), [])
        first.close()
        with pytest.raises(shm.ShmUnavailable, match="closed"):
            first.arrays((128, 0, 1), [])
    finally:
        for r in segments:
            r.close()


@pytest.mark.unit
def test_close_unmaps_once_the_arrays_are_gone():
    before = dev_shm()
    segment = shm.Segment(1 << 16)
    inode = memfd_inode(os.getpid(), segment.descriptor.fd)
    block, specs = put(segment, make(1))
    got = shm.Mapping.open(segment.descriptor).arrays(block.ref(), specs)
    del block
    segment.close()
    shm.Mapping.close_all()
    assert_seq_equal(got, make(1))  # still mapped by the arrays
    assert inode[1] in mapped_memfds()
    del got
    assert_gone(inode)
    assert_nothing_new_in_dev_shm(before)


# --- two processes -----------------------------------------------------------------------------


@pytest.mark.processes
def test_producer_in_a_child(children):
    before = dev_shm()
    producer = children(PRODUCER)
    msg = producer.ask({"op": "pack", "seed": 5, "owner": "me"})
    assert msg["descriptor"]["pid"] == producer.pid
    mapping = shm.Mapping.open(msg["descriptor"])
    got = mapping.arrays(msg["ref"], msg["specs"])
    assert_seq_equal(got, make(5))
    assert producer.ask({"op": "used"})["used"] > 0
    del got
    assert producer.ask({"op": "used"})["used"] == 0  # the release is seen across processes
    again = producer.ask({"op": "pack", "seed": 6, "owner": "me"})
    assert again["ref"][0] == msg["ref"][0]  # and the memory reused
    assert_seq_equal(shm.Mapping.open(again["descriptor"]).arrays(again["ref"], again["specs"]), make(6))
    assert shm.Mapping.open(again["descriptor"]) is mapping
    inode = memfd_inode(producer.pid, msg["descriptor"]["fd"])
    producer.close()
    assert producer.proc.returncode == 0, producer.stderr()
    shm.Mapping.close_all()
    assert_gone(inode)
    assert_nothing_new_in_dev_shm(before)


@pytest.mark.processes
def test_consumer_in_a_child(children):
    with shm.Segment(1 << 20) as segment:
        consumer = children(CONSUMER)
        for seed in (1, 2):
            block, specs = put(segment, make(seed), b"child")
            answer = consumer.ask(
                {
                    "op": "view",
                    "seed": seed,
                    "descriptor": segment.descriptor.to_dict(),
                    "ref": block.ref(),
                    "specs": specs,
                }
            )
            assert answer == {"ok": True}
        del block
        assert segment.used() > 0
        assert consumer.ask({"op": "drop"}) == {"dropped": True}
        assert segment.used() == 0
        consumer.close()
        assert consumer.proc.returncode == 0, consumer.stderr()


@pytest.mark.processes
def test_kill9_of_the_producer_leaves_the_consumer_valid_data(children):
    before = dev_shm()
    producer = children(PRODUCER)
    msg = producer.ask({"op": "pack", "seed": 7, "owner": "me"})
    inode = memfd_inode(producer.pid, msg["descriptor"]["fd"])
    got = shm.Mapping.open(msg["descriptor"]).arrays(msg["ref"], msg["specs"])
    producer.kill9()
    assert_seq_equal(got, make(7))  # the mapping keeps the memory
    got["x"][:] = 1.0  # and it stays writable
    assert float(got["x"].sum()) == 8000.0
    shm.Mapping.close_all()
    with pytest.raises(shm.ShmUnavailable, match="does not exist"):
        shm.Mapping.open(msg["descriptor"])
    assert inode[1] in mapped_memfds()
    del got
    assert_gone(inode)  # both sides gone: nothing maps the memfd, nothing holds it
    assert_nothing_new_in_dev_shm(before)


@pytest.mark.processes
def test_kill9_of_the_consumer_leaves_the_producer_running(children):
    before = dev_shm()
    segment = shm.Segment(1 << 20)
    inode = memfd_inode(os.getpid(), segment.descriptor.fd)
    consumer = children(CONSUMER)
    block, specs = put(segment, make(1), b"child")
    view = {"op": "view", "seed": 1, "descriptor": segment.descriptor.to_dict(), "ref": block.ref(), "specs": specs}
    assert consumer.ask(view) == {"ok": True}
    mine, _ = put(segment, make(2), b"other")
    consumer.kill9()
    used = segment.used()
    assert used > 0  # the dead consumer's block is still in use: the producer cannot know
    extra = segment.alloc(1000, b"other")  # but it keeps allocating
    assert extra is not None
    assert segment.release_owner(b"child") == 1
    assert segment.used() == sum(shm.BLOCK_HEADER + -(-b.nbytes // 64) * 64 for b in (mine, extra))
    mine.release()
    extra.release()
    assert segment.used() == 0
    del block, mine, extra
    segment.close()
    assert_gone(inode)
    assert_nothing_new_in_dev_shm(before)


@pytest.mark.processes
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the consumer as another user")
def test_another_user_may_not_open_the_segment(children):
    with shm.Segment(8192) as segment:
        block, specs = put(segment, {"n": np.arange(3)})
        consumer = children(CONSUMER, user=65534, cwd="/")
        answer = consumer.ask(
            {"op": "view", "seed": 0, "descriptor": segment.descriptor.to_dict(), "ref": block.ref(), "specs": specs}
        )
        assert "no permission" in answer.get("error", ""), answer


@pytest.mark.processes
def test_a_forked_child_neither_allocates_nor_releases(children):
    with shm.Segment(1 << 16) as segment:
        block, specs = put(segment, make(1))
        got = shm.Mapping.open(segment.descriptor).arrays(block.ref(), specs)
        used = segment.used()
        pid = os.fork()
        if pid == 0:  # the child: its copies of the segment and the arrays must not touch the parent's blocks
            code = 1
            try:
                try:
                    segment.alloc(10)
                except ValueError:
                    code = 0
                del got
                gc.collect()
            finally:
                os._exit(code)
        assert wait_child(pid, 30) == 0
        assert segment.used() == used  # the child's copy of the arrays died: the parent's block is still in use
        assert_seq_equal(got, make(1))
        del got
        assert segment.used() == 0


@pytest.mark.unit
def test_a_block_good_seqs_of_a_message_use_is_not_given_back_with_a_bad_one():
    """The seqs of one message share a block: a bad item gives it back only if no good one uses it."""
    from ppclient import protocol, wire

    with shm.Segment(1 << 16) as segment:
        items = [protocol.seq_to_item({"data": np.full(3, i, np.float32), "seq_tag": f"s{i}"}, i) for i in range(2)]
        placed, block = protocol.to_block(items, segment)
        assert block is not None and len({tuple(it.block[:3]) for it in placed}) == 1  # type: ignore[index]
        header = wire.unpack(protocol.encode(protocol.DirectSeqs(run=1), placed)[0])
        header["items"][1]["meta"] = ["not a map"]
        frames = [wire.pack(header)]
        decoded = protocol.decode(frames, protocol.Peer.CLIENT, (protocol.Channel.DIRECT,))
        assert [it.pos for it in decoded.items] == [0] and [b.pos for b in decoded.bad] == [1]
        assert protocol.unused_blocks(frames, decoded.items) == []  # seq 0 still needs it
        header["items"][0]["meta"] = ["not a map"]
        frames = [wire.pack(header)]
        decoded = protocol.decode(frames, protocol.Peer.CLIENT, (protocol.Channel.DIRECT,))
        assert decoded.items == [] and protocol.unused_blocks(frames, decoded.items) == [list(block.ref())]

"""Placement as pure decisions (scheduler/placement.py): `choose` takes plain views of the
workers, the charges of the seq at the head of the queue and the limits of a message, and says
where it goes and how many go with it, or why it waits; `choose_owner` says which worker a stream
partition without an owner goes to. Each case is a row: the workers, the charges, the decision."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import FrozenSet, List, Optional, Tuple

import pytest

from ppserver.scheduler.placement import Decision, Limits, Send, Wait, choose, choose_owner, joins, may_send
from ppserver.scheduler.settings import Settings
from ppserver.scheduler.workers import ISOLATING, NORMAL, InputPath, Isolation

pytestmark = pytest.mark.unit

LIMITS = Limits(chunk=2, dispatch_bytes=1000)
MSG = 1000.0  # a message's input bytes when they travel in it (LIMITS.dispatch_bytes)


@dataclass(frozen=True)
class View:
    """A worker as placement sees it: its credit, the tasks it holds, whether it retires or isolates,
    the stream partitions it runs and when it joined."""

    wid: bytes
    capacity: int = 4
    held: int = 0
    retiring: bool = False
    isolation: Isolation = NORMAL
    inputs: InputPath = field(default_factory=InputPath.message)
    streams: int = 0
    joined: float = 0.0

    @property
    def partitions(self) -> FrozenSet[Tuple[int, int]]:
        return frozenset((1, p) for p in range(self.streams))

    @property
    def tasks(self) -> FrozenSet[Tuple[int, int]]:
        return frozenset((1, pos) for pos in range(self.held))

    def free(self) -> int:
        return self.capacity - self.held


def w(name: str, held: int = 0, **kw) -> View:
    return View(name.encode(), held=held, **kw)


CASES = [
    # (what, workers, deaths, avoid, decision)
    ("a seq goes to the most free credit", [w("a", 3), w("b", 1), w("c", 2)], 0, None, Send(b"b", 2, MSG)),
    ("of equals, the first", [w("a", 1), w("b", 1)], 0, None, Send(b"a", 2, MSG)),
    ("up to a chunk", [w("a", 0)], 0, None, Send(b"a", 2, MSG)),
    ("never beyond the free credit", [w("a", 3)], 0, None, Send(b"a", 1, MSG)),
    ("no credit free anywhere", [w("a", 4), w("b", 4)], 0, None, Wait.NO_ROOM),
    ("no workers", [], 0, None, Wait.NO_ROOM),
    ("a retiring worker gets nothing", [w("a", 0, retiring=True), w("b", 3)], 0, None, Send(b"b", 1, MSG)),
    ("only retiring workers", [w("a", 0, retiring=True)], 0, None, Wait.NO_ROOM),
    ("one that isolates gets nothing", [w("a", 1, isolation=ISOLATING), w("b", 3)], 0, None, Send(b"b", 1, MSG)),
    ("a suspect goes alone to an idle worker", [w("a", 1), w("b", 0)], 1, None, Send(b"b", 1, MSG, isolate=True)),
    ("a suspect waits for an idle worker", [w("a", 1), w("b", 2)], 2, None, Wait.NO_ROOM),
    ("a suspect not to a retiring one", [w("a", 0, retiring=True), w("b", 1)], 1, None, Wait.NO_ROOM),
    ("a suspect to the first idle one", [w("a", 0), w("b", 0)], 1, None, Send(b"a", 1, MSG, isolate=True)),
    ("a suspect avoids its idle worker", [w("a", 0), w("b", 0)], 1, b"a", Send(b"b", 1, MSG, isolate=True)),
    ("a suspect that avoids the only idle one", [w("a", 0), w("b", 1)], 1, b"a", Wait.OTHERS_FIRST),
    ("a seq avoids the worker it let down", [w("a", 0), w("b", 3)], 0, b"a", Send(b"b", 1, MSG)),
    ("only the worker it let down has room", [w("a", 0), w("b", 4)], 0, b"a", Wait.OTHERS_FIRST),
    ("nor that one", [w("a", 4), w("b", 4)], 0, b"a", Wait.NO_ROOM),
    ("alone, it goes back to it", [w("a", 0)], 0, b"a", Send(b"a", 2, MSG)),
    ("alone, a suspect too", [w("a", 0)], 1, b"a", Send(b"a", 1, MSG, isolate=True)),
]


@pytest.mark.parametrize("what, workers, deaths, avoid, decision", CASES, ids=[c[0] for c in CASES])
def test_choose(what: str, workers: List[View], deaths: int, avoid: Optional[bytes], decision: Decision):
    before = copy.deepcopy(workers)
    assert choose(workers, LIMITS, deaths, avoid) == decision
    assert workers == before  # a decision only: nothing moved


@pytest.mark.parametrize(
    "inputs, max_bytes",
    [(InputPath.message(), MSG), (InputPath.shared_memory(300), 300.0), (InputPath.by_address(), math.inf)],
)
def test_a_messages_bytes_are_what_its_workers_input_path_takes(inputs: InputPath, max_bytes: float):
    assert choose([View(b"a", inputs=inputs)], LIMITS) == Send(b"a", 2, max_bytes)
    assert choose([View(b"a", inputs=inputs)], LIMITS, deaths=1) == Send(b"a", 1, max_bytes, isolate=True)


@pytest.mark.parametrize(
    "buf_size, max_dispatch_batch, chunk", [(8, 16, 4), (64, 16, 16), (1, 16, 1), (3, 16, 1), (8, 0, 1)]
)
def test_a_chunk_is_half_a_workers_credit_within_max_dispatch_batch(buf_size: int, max_dispatch_batch: int, chunk: int):
    settings = Settings(buf_size=buf_size, max_dispatch_batch=max_dispatch_batch, dispatch_bytes=77)
    assert Limits.of(settings) == Limits(chunk, 77)


def test_a_charged_seq_behind_the_head_rides_along_unless_it_needs_its_own_decision():
    send = Send(b"a", 4, MSG)
    assert joins(send, deaths=0, avoid=None) and joins(send, deaths=0, avoid=b"b")
    assert not joins(send, deaths=1, avoid=None)  # a suspect goes alone
    assert not joins(send, deaths=0, avoid=b"a")  # it let this worker down


def test_a_worker_may_take_a_task_when_it_has_credit_and_neither_retires_nor_isolates():
    assert may_send([w("a", 4), w("b", 3)])
    assert not may_send([w("a", 4), w("b", 0, retiring=True), w("c", 0, isolation=ISOLATING)])
    assert not may_send([])


def s(name: str, streams: int = 0, joined: float = 0.0, **kw) -> View:
    return View(name.encode(), streams=streams, joined=joined, **kw)


OWNER_CASES = [
    # (what, workers, avoid, owner)
    ("the fewest streams", [s("a", 2), s("b", 1), s("c", 3)], None, b"b"),
    ("of equals, the earliest joined", [s("a", 1, joined=5.0), s("b", 1, joined=2.0)], None, b"b"),
    ("of equals joined together, the first", [s("a", 1), s("b", 1)], None, b"a"),
    ("a retiring worker gets none", [s("a", 0, retiring=True), s("b", 4)], None, b"b"),
    ("only retiring workers", [s("a", 0, retiring=True)], None, None),
    ("no workers", [], None, None),
    ("not the worker it let down", [s("a", 0), s("b", 5)], b"a", b"b"),
    ("of the others, the fewest streams", [s("a", 0), s("b", 5), s("c", 2)], b"a", b"c"),
    ("back to it if no other may take it", [s("a", 3), s("b", 0, retiring=True)], b"a", b"a"),
    ("nor if it retires", [s("a", 0, retiring=True)], b"a", None),
    (
        "a credit-full or isolating worker may run a stream",
        [s("a", 1, held=4, isolation=ISOLATING), s("b", 2)],
        None,
        b"a",
    ),
]


@pytest.mark.parametrize("what, workers, avoid, owner", OWNER_CASES, ids=[c[0] for c in OWNER_CASES])
def test_choose_owner(what: str, workers: List[View], avoid: Optional[bytes], owner: Optional[bytes]):
    before = copy.deepcopy(workers)
    assert choose_owner(workers, avoid) == owner
    assert workers == before  # a decision only: nothing moved

"""What a worker runs: map_seq tasks one by one, map_seq_stream partitions as generators.

Both keep per-run state: a RunOpen from the server opens a run (its epoch, whether tags are
checked), a RunClose drops everything of it, and messages of runs not open are dropped.
Outputs are checked against the templates before they leave (apply.py), against
max_message_bytes and against the size an item's header may have (its seq_tag, meta entries
and array specs), so the server never has to disconnect a worker for an oversized result or
drop an undecodable one: such a seq fails as a MapperError naming it. Results are batched so
that a message stays within both limits.
"""

from __future__ import annotations

import logging
import traceback
import typing
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

from ppclient import protocol
from ppclient.protocol import Item

from .apply import MappingError, apply_map_seq, run_stream, writable
from .config import Config
from .direct import Routes
from .mapper_api import Mappers, missing_returnn_api_hint
from .mapper_clock import MapperClock

log = logging.getLogger("ppserver.worker")

FLUSH_BYTES = 512 * 1024  # large seqs gain nothing from batching; small ones gain a lot
MAX_FAILURE_TEXT = 16 * 1024  # characters of a failure's seq_tag, message and traceback that are sent

Send = Callable[..., None]


@dataclass
class OpenRun:
    epoch: int
    check_tags: bool


def check_size(item: Item, limit: int) -> None:
    """An output the server would refuse (it disconnects senders of oversized messages)."""
    if item.nbytes > limit:
        biggest = max(zip(item.frames, item.arrays), key=lambda fa: protocol.wire.nbytes(fa[0]))[1][0]
        raise MappingError(
            f"output is {item.nbytes} bytes (array {biggest!r} the largest), more than max_message_bytes ({limit})",
            item.seq_tag,
        )


def check_header(item: Item) -> int:
    """The size of an output's item header; an output whose header could not travel is refused."""
    size = protocol.item_header_bytes(item)
    if size > protocol.MAX_ITEM_HEADER_BYTES:
        raise MappingError(
            f"output header (seq_tag, meta entries and array specs) is {size} bytes, more than "
            f"{protocol.MAX_ITEM_HEADER_BYTES}"
        )
    return size


@typing.overload
def _clip(text: str) -> str: ...
@typing.overload
def _clip(text: Optional[str]) -> Optional[str]: ...
def _clip(text: Optional[str]) -> Optional[str]:
    """A failure's text as it is sent: its message's header must stay small."""
    if text is None or len(text) <= MAX_FAILURE_TEXT:
        return text
    return f"{text[:MAX_FAILURE_TEXT]}... ({len(text) - MAX_FAILURE_TEXT} more characters)"


def _failure_text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, MappingError) else f"{type(exc).__name__}: {exc}"


class MapSeqRunner:
    """Runs tasks one by one; results leave in batches, each straight to its consumer when the
    task names one the worker reaches (with a `completed` to the server), else to the server."""

    def __init__(
        self,
        cfg: Config,
        send: Send,
        templates: Callable[[], Dict[str, Any]],
        mappers: Callable[[], Mappers],
        routes: Optional[Routes] = None,
    ):
        self.cfg = cfg
        self.send = send
        self.templates = templates
        self.mappers = mappers
        self.routes = routes
        self.tasks: Deque[Tuple[int, Item, bytes]] = deque()
        self.results: List[Tuple[Item, bytes]] = []
        self.results_run = -1
        self.results_bytes = 0
        self.results_header_bytes = 0
        self.flush_every = max(1, min(cfg.buf_size // 2, 16))
        self.done = 0
        self.messages_in = self.messages_out = 0
        self.clock = MapperClock()

    def add(self, run: int, items: List[Item], to: Optional[List[bytes]] = None) -> None:
        if to and len(to) == len(items):
            self.tasks.extend((run, item, dest) for item, dest in zip(items, to))
        else:
            self.tasks.extend((run, item, b"") for item in items)
        self.messages_in += 1

    def drop_run(self, run: int) -> None:
        self.tasks = deque(t for t in self.tasks if t[0] != run)
        if self.results_run == run:
            if self.results:
                log.info("dropped %d results (%d bytes) of closed run %d", len(self.results), self.results_bytes, run)
            self.results, self.results_bytes, self.results_header_bytes = [], 0, 0

    def clear(self) -> None:
        self.tasks.clear()
        self.results, self.results_bytes, self.results_header_bytes = [], 0, 0

    def flush(self) -> None:
        if not self.results:
            return
        run = self.results_run
        relayed: List[Item] = []
        direct: Dict[bytes, List[Item]] = {}
        for item, dest in self.results:
            if dest and self.routes is not None:
                direct.setdefault(dest, []).append(item)
            else:
                relayed.append(item)
        done: List[Item] = []
        for dest, items in direct.items():
            assert self.routes is not None
            if self.routes.send(dest, run, items):
                done.extend(items)
            else:
                relayed.extend(items)
        if done:
            self.send(protocol.Completed(run=run, pos=[i.pos for i in done], nbytes=[i.nbytes for i in done]))
        if relayed:
            self.send(protocol.Results(run=run), relayed)
        self.messages_out += 1
        self.results, self.results_bytes, self.results_header_bytes = [], 0, 0

    def step(self, runs: Dict[int, OpenRun]) -> None:
        run_id, item, dest = self.tasks.popleft()
        run = runs.get(run_id)
        if run is None:
            return
        if self.results and self.results_run != run_id:
            self.flush()
        seq = writable(protocol.item_to_seq(item))
        try:
            map_seq = self.mappers().map_seq
            assert map_seq is not None
            self.clock.start()
            out = apply_map_seq(
                map_seq,
                seq,
                epoch=run.epoch,
                seed=self.cfg.seed,
                templates=self.templates(),
                expected_tag=seq.get("seq_tag") if run.check_tags else None,
            )
            self.clock.stop()
            result = protocol.seq_to_item(out, item.pos)
            header_bytes = check_header(result)
            check_size(result, self.cfg.max_message_bytes)
        except Exception as exc:
            # the seq as it was dealt (a mapper may have changed the tag of its dict, or made it huge)
            tag = item.seq_tag if item.seq_tag is not None else exc.seq_tag if isinstance(exc, MappingError) else None
            text = _failure_text(exc) + missing_returnn_api_hint(self.cfg, "map_seq", exc)
            tag, message = _clip(tag), _clip(text)
            log.error("mapper failed on seq %r: %s", tag, message)
            self.flush()
            self.send(
                protocol.TaskFailed(
                    run=run_id, pos=item.pos, seq_tag=tag, message=message, traceback=_clip(traceback.format_exc())
                )
            )
            self.drop_run(run_id)
            return
        # bytes that travel in the message (not in shared memory) cut batches, and so do headers
        nbytes = 0 if dest and self.routes is not None and self.routes.shared(dest) else result.nbytes
        if (
            self.results_bytes + nbytes > self.cfg.max_message_bytes
            or self.results_header_bytes + header_bytes > protocol.MAX_ITEM_HEADER_BYTES
        ):
            self.flush()
        self.results.append((result, dest))
        self.results_run = run_id
        self.results_bytes += nbytes
        self.results_header_bytes += header_bytes
        self.done += 1
        # Results travel in batches, but never more than half the credit, so the server
        # refills this worker's queue before it runs dry.
        if not self.tasks or len(self.results) >= self.flush_every or self.results_bytes >= FLUSH_BYTES:
            self.flush()


class Interrupted(BaseException):
    """Raised inside a stream's input iterator when its partition is closed (a BaseException, so
    that a mapper's `except Exception` does not take it for a failure of its own)."""


class _Partition:
    def __init__(self, run: int, msg: protocol.StreamOpen, epoch: int):
        self.run = run
        self.index = msg.partition
        self.incarnation = msg.incarnation
        self.epoch = epoch
        self.skip = msg.skip
        self.out_credit = msg.credit
        self.inputs: Deque[Dict[str, Any]] = deque()
        self.eof = False
        self.gen: Optional[Iterator[Dict[str, Any]]] = None
        self.emitted = 0
        self.last_tag: Optional[str] = None
        self.closed = False

    def runnable(self) -> bool:
        return (self.out_credit > 0 or self.emitted < self.skip) and (bool(self.inputs) or self.eof or self.gen is None)


class StreamRunner:
    """Partitions as generators whose input iterator pulls inputs from the server while it waits."""

    def __init__(
        self,
        cfg: Config,
        send: Send,
        templates: Callable[[], Dict[str, Any]],
        mappers: Callable[[], Mappers],
        wait_for_input: Callable[[], None],
    ):
        self.cfg = cfg
        self.send = send
        self.templates = templates
        self.mappers = mappers
        self.wait_for_input = wait_for_input
        self.parts: Dict[Tuple[int, int], _Partition] = {}
        self.rr = 0
        self.done = 0
        self.clock = MapperClock()  # the worker adds the time its streams wait for inputs to `paused`

    def open(self, msg: protocol.StreamOpen, runs: Dict[int, OpenRun]) -> None:
        run = runs.get(msg.run)
        if run is not None:
            self.parts[(msg.run, msg.partition)] = _Partition(msg.run, msg, run.epoch)

    def close(self, run: int, partition: Optional[int] = None) -> None:
        for key in [k for k in self.parts if k[0] == run and (partition is None or k[1] == partition)]:
            self.parts.pop(key).closed = True

    def clear(self) -> None:
        for part in self.parts.values():
            part.closed = True
        self.parts.clear()

    def on_message(self, msg: protocol.Message, items: List[Item]) -> None:
        part = self.parts.get((getattr(msg, "run", -1), getattr(msg, "partition", -1)))
        if part is None:
            return
        if isinstance(msg, protocol.StreamInputs):
            part.inputs.extend(writable(protocol.item_to_seq(item)) for item in items)
        elif isinstance(msg, protocol.StreamEnd):
            part.eof = True
        elif isinstance(msg, protocol.StreamCredit):
            part.out_credit += msg.n

    def runnable(self) -> Optional[_Partition]:
        if not self.parts:
            return None
        keys = sorted(self.parts)
        for k in range(len(keys)):
            part = self.parts[keys[(self.rr + k) % len(keys)]]
            if part.runnable():
                self.rr = (self.rr + k + 1) % len(keys)
                return part
        return None

    def _inputs(self, part: _Partition) -> Iterator[Dict[str, Any]]:
        while True:
            if part.closed:
                raise Interrupted()
            if part.inputs:
                seq = part.inputs.popleft()
                part.last_tag = seq.get("seq_tag")
                self.send(protocol.StreamAck(run=part.run, partition=part.index, incarnation=part.incarnation, n=1))
                yield seq
            elif part.eof:
                return
            else:
                self.wait_for_input()

    def step(self, part: _Partition) -> None:
        """Advance one partition by one output."""
        try:
            if part.gen is None:
                mappers = self.mappers()
                assert mappers.map_seq_stream is not None
                part.gen = run_stream(
                    mappers.map_seq_stream,
                    self._inputs(part),
                    epoch=part.epoch,
                    seed=self.cfg.seed,
                    partition=part.index,
                    templates=self.templates(),
                    rng=mappers.stream_rng(part.epoch, part.index),
                )
            self.clock.start()
            seq = next(part.gen)
            self.clock.stop()
            if part.closed:
                return
            item = protocol.seq_to_item(seq, part.emitted)
            check_size(item, self.cfg.max_message_bytes)
            check_header(item)
        except StopIteration:
            if not part.closed:
                self.send(protocol.StreamDone(run=part.run, partition=part.index, incarnation=part.incarnation))
                self.parts.pop((part.run, part.index), None)
            return
        except Interrupted:
            return
        except Exception as exc:
            if part.closed:
                return
            self.parts.pop((part.run, part.index), None)
            tag = exc.seq_tag if isinstance(exc, MappingError) and exc.seq_tag else part.last_tag
            text = _failure_text(exc) + missing_returnn_api_hint(self.cfg, "map_seq_stream", exc)
            tag, message = _clip(tag), _clip(text)
            log.error("stream mapper failed in partition %d (last input %r): %s", part.index, tag, message)
            self.send(
                protocol.StreamFailed(
                    run=part.run,
                    partition=part.index,
                    incarnation=part.incarnation,
                    seq_tag=tag,
                    message=message,
                    traceback=_clip(traceback.format_exc()),
                )
            )
            return
        part.emitted += 1
        if part.emitted <= part.skip:
            return  # delivered already, before this partition moved here
        self.send(protocol.StreamOutputs(run=part.run, partition=part.index, incarnation=part.incarnation), [item])
        part.out_credit -= 1
        self.done += 1

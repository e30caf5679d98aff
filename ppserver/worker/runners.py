"""What a worker runs: map_seq tasks one by one, map_seq_stream partitions as generators.

Both keep per-run state: a RunOpen from the server opens a run (its epoch, whether tags are
checked), a RunClose drops everything of it, and messages of runs not open are dropped.
Outputs are checked against the templates before they leave (apply.py), against
max_message_bytes and against the size an item's header may have (its seq_tag, meta entries
and array specs), so the server never has to disconnect a worker for an oversized result or
drop an undecodable one: such a seq fails as a MapperError naming it. Results are batched so
that a message stays within both limits.

A batch (the seqs of a task that name one) is mapped seq by seq, each with its own rng and meta
entries, then padded into one array per key (collate.py), written where it travels: into a
block of the shared-memory segment for a consumer on this host, so padding is the only copy
between the mapper's output and the trainer.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
import typing
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple, Union

import numpy

from ppclient import collate, protocol, shm
from ppclient.protocol import Item
from ppserver.config.settings import Config
from ppserver.mappers.api import Mappers, missing_returnn_api_hint
from ppserver.mappers.apply import MappingError, apply_map_seq, run_stream, writable
from ppserver.worker.clock import MapperClock
from ppserver.worker.routes import Routes

log = logging.getLogger("ppserver.worker")

FLUSH_BYTES = 512 * 1024  # large seqs gain nothing from batching; small ones gain a lot
PROBE_PAUSE_S = 0.002  # after saying which seq of a suspect batch it maps: the word leaves before a crash
MAX_FAILURE_TEXT = 16 * 1024  # characters of a failure's seq_tag, message and traceback that are sent

Send = Callable[..., None]


@dataclass
class OpenRun:
    epoch: int
    check_tags: bool
    pad: Dict[str, Any] = field(default_factory=dict)


@dataclass
class BatchTask:
    """The seqs of batch `pos`, in order; `probe`: say which one is mapped before each."""

    pos: int
    items: List[Item]
    probe: bool = False

    @property
    def seq_tag(self) -> Optional[str]:
        return self.items[0].seq_tag if self.items else None


Task = Union[Item, BatchTask]


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
    return str(exc) if isinstance(exc, (MappingError, collate.BatchError)) else f"{type(exc).__name__}: {exc}"


def _culprit(exc: BaseException, task: BatchTask) -> Optional[Item]:
    """The seq of a batch a padding failure names (the batch's first seq if none is named)."""
    tag = getattr(exc, "seq_tag", None)
    for item in task.items:
        if item.seq_tag == tag:
            return item
    return task.items[0] if task.items else None


def _unplaced(item: Item, block: Optional[shm.Block]) -> Item:
    """A padded batch laid out in a block that will not be sent: its arrays copied out, the block
    given back (it goes through the server instead)."""
    if item.block is None or block is None:
        return item
    import dataclasses

    arrays = [
        shm.view(block, off, numpy.dtype(dtype), shape).copy()
        for (_, dtype, shape), off in zip(item.arrays, item.block[3])
    ]
    block.release()
    return dataclasses.replace(item, frames=arrays, block=None)


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
        self.tasks: Deque[Tuple[int, Task, bytes]] = deque()
        self.partial: Dict[Tuple[int, int], BatchTask] = {}  # batches whose seqs have not all come
        self.results: List[Tuple[Item, bytes, Optional[shm.Block]]] = []  # and the block a padded batch lies in
        self.results_run = -1
        self.results_bytes = 0
        self.results_header_bytes = 0
        self.flush_every = max(1, min(cfg.buf_size // 2, 16))
        self.done = 0
        self.messages_in = self.messages_out = 0
        self.clock = MapperClock()

    def add(self, run: int, items: List[Item], to: Optional[List[bytes]] = None, probe: bool = False) -> None:
        """Tasks of a message: its seqs, and a batch (its seqs may come in several messages) once
        all its seqs are here."""
        dests = to if to and len(to) == len(items) else [b""] * len(items)
        for item, dest in zip(items, dests):
            if item.batch is None:
                self.tasks.append((run, item, dest))
                continue
            key = (run, item.batch)
            task = self.partial.get(key)
            if task is None:
                task = self.partial[key] = BatchTask(item.batch, [], probe)
            task.items.append(item)
            if len(task.items) >= (item.size or 1):
                del self.partial[key]
                self.tasks.append((run, task, dest))
        self.messages_in += 1

    def drop_run(self, run: int) -> None:
        self.tasks = deque(t for t in self.tasks if t[0] != run)
        for key in [k for k in self.partial if k[0] == run]:
            del self.partial[key]
        if self.results_run == run:
            if self.results:
                log.info("dropped %d results (%d bytes) of closed run %d", len(self.results), self.results_bytes, run)
            self._drop_results()

    def clear(self) -> None:
        self.tasks.clear()
        self.partial.clear()
        self._drop_results()

    def _drop_results(self) -> None:
        for _, _, block in self.results:
            if block is not None:
                block.release()
        self.results, self.results_bytes, self.results_header_bytes = [], 0, 0

    def flush(self) -> None:
        if not self.results:
            return
        run = self.results_run
        relayed: List[Item] = []
        direct: Dict[bytes, List[Tuple[Item, Optional[shm.Block]]]] = {}
        for item, dest, block in self.results:
            if dest and self.routes is not None:
                direct.setdefault(dest, []).append((item, block))
            else:
                relayed.append(item)
        done: List[Item] = []
        for dest, placed in direct.items():
            assert self.routes is not None
            if self.routes.send(dest, run, [item for item, _ in placed]):
                done.extend(item for item, _ in placed)
            else:
                relayed.extend(_unplaced(item, block) for item, block in placed)
        if done:
            self.send(protocol.Completed(run=run, pos=[i.pos for i in done], nbytes=[i.nbytes for i in done]))
        if relayed:
            self.send(protocol.Results(run=run), relayed)
        self.messages_out += 1
        self.results, self.results_bytes, self.results_header_bytes = [], 0, 0

    def step(self, runs: Dict[int, OpenRun]) -> None:
        run_id, task, dest = self.tasks.popleft()
        run = runs.get(run_id)
        if run is None:
            return
        if self.results and self.results_run != run_id:
            self.flush()
        if isinstance(task, BatchTask):
            self._step_batch(run_id, run, task, dest)
            return
        item = task
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
        self._add_result(run_id, result, dest, header_bytes)
        self.done += 1

    def _add_result(
        self, run_id: int, result: Item, dest: bytes, header_bytes: int, block: Optional[shm.Block] = None
    ) -> None:
        # bytes that travel in the message (not in shared memory) cut batches, and so do headers
        shared = block is not None or (dest and self.routes is not None and self.routes.shared(dest))
        nbytes = 0 if shared else result.nbytes
        if (
            self.results_bytes + nbytes > self.cfg.max_message_bytes
            or self.results_header_bytes + header_bytes > protocol.MAX_ITEM_HEADER_BYTES
        ):
            self.flush()
        self.results.append((result, dest, block))
        self.results_run = run_id
        self.results_bytes += nbytes
        self.results_header_bytes += header_bytes
        # Results travel in batches, but never more than half the credit, so the server
        # refills this worker's queue before it runs dry.
        if not self.tasks or len(self.results) >= self.flush_every or self.results_bytes >= FLUSH_BYTES:
            self.flush()

    def _step_batch(self, run_id: int, run: OpenRun, task: BatchTask, dest: bytes) -> None:
        """Map a batch's seqs one by one, then pad them into one result where it travels; a seq that
        fails fails the batch, naming the seq."""
        outs: List[Dict[str, Any]] = []
        item: Optional[Item] = None
        block: Optional[shm.Block] = None
        try:
            map_seq = self.mappers().map_seq
            assert map_seq is not None
            templates = self.templates()
            for item in task.items:
                seq = writable(protocol.item_to_seq(item))
                if task.probe:
                    self.send(protocol.Mapping(run=run_id, pos=task.pos, seq_tag=_clip(item.seq_tag)))
                    time.sleep(PROBE_PAUSE_S)
                self.clock.start()
                out = apply_map_seq(
                    map_seq,
                    seq,
                    epoch=run.epoch,
                    seed=self.cfg.seed,
                    templates=templates,
                    expected_tag=seq.get("seq_tag") if run.check_tags else None,
                )
                self.clock.stop()
                outs.append(out)
            item = None  # what fails from here fails the batch as a whole
            result, block = self._padded(task.pos, outs, run.pad, dest)
            header_bytes = check_header(result)
            check_size(result, self.cfg.max_message_bytes)
        except Exception as exc:
            if block is not None:
                block.release()
            bad = item if item is not None else _culprit(exc, task)
            tag = (
                bad.seq_tag
                if bad is not None and bad.seq_tag is not None
                else exc.seq_tag
                if isinstance(exc, (MappingError, collate.BatchError))
                else None
            )
            text = _failure_text(exc) + missing_returnn_api_hint(self.cfg, "map_seq", exc)
            tag, message = _clip(tag), _clip(f"batch {task.pos}: {text}")
            log.error("mapper failed on seq %r of batch %d: %s", tag, task.pos, message)
            self.flush()
            self.send(
                protocol.TaskFailed(
                    run=run_id, pos=task.pos, seq_tag=tag, message=message, traceback=_clip(traceback.format_exc())
                )
            )
            self.drop_run(run_id)
            return
        self._add_result(run_id, result, dest, header_bytes, block)
        self.done += len(outs)

    def _padded(
        self, pos: int, outs: List[Dict[str, Any]], pad: Dict[str, Any], dest: bytes
    ) -> Tuple[Item, Optional[shm.Block]]:
        """The batch's outputs padded into one result: into a block of the consumer's shared memory
        when it is on this host (and the segment has room), else into arrays of their own."""
        columns = collate.layout(outs)
        specs = collate.arrays_of(columns)
        offsets, size = shm.layout([math.prod(shape) * dtype.itemsize for _, dtype, shape in specs])
        block = self.routes.block_for(dest, size) if dest and self.routes is not None else None
        if block is not None:
            arrays = {key: shm.view(block, off, dtype, shape) for (key, dtype, shape), off in zip(specs, offsets)}
        else:
            arrays = {key: numpy.empty(shape, dtype) for key, dtype, shape in specs}
        collate.fill(outs, columns, arrays, lambda key: pad.get(key, 0))
        described = [[key, dtype.str, list(shape)] for key, dtype, shape in specs]
        nbytes = sum(a.nbytes for a in arrays.values())
        meta = collate.meta_of(outs)
        if block is None:
            return Item(pos, meta, described, list(arrays.values()), nbytes, size=len(outs)), None
        ref = block.ref()
        return Item(
            pos, meta, described, [], nbytes, block=[ref.offset, ref.nbytes, ref.seq, offsets], size=len(outs)
        ), block


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

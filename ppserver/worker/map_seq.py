"""The map_seq runner: tasks one by one, a seq or a batch each.

A batch (the seqs of a task that name one) is mapped seq by seq, each with its own rng and meta
entries, then padded into one array per key (collate.py), written where it travels: into a
block of the shared-memory segment for a consumer on this host, so padding is the only copy
between the mapper's output and the trainer. The heartbeats say how many seqs of the batch are
mapped (`under_way`), so a slow batch is not taken for a stuck one.

Results leave in batches, each straight to its consumer when the task names one the worker
reaches (with a `completed` to the server), else to the server; a message stays within
max_message_bytes and the header cap (outputs.py). A failure fails the task's run here, and the
server hears of it with the seq it names.

A seq map_seq skips (returns None) leaves as a marker that takes its position and holds nothing;
a batch is padded without its skipped seqs (a batch whose seqs were all skipped is an empty one,
B = 0, so that every rank still takes a step for it). Both say how many seqs were skipped and
name a few, so the server counts them wherever the result went.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple, Union

import numpy

from ppclient import collate, protocol, shm
from ppclient.protocol import BadItem, Item
from ppserver.config.mappers import failure_hint
from ppserver.mappers.apply import STRING, MappingError, apply_map_seq, writable
from ppserver.worker.outputs import Means, OpenRun, Runner, check_header, check_size, clip, failure_text
from ppserver.worker.routes import Routes

log = logging.getLogger("ppserver.worker")

FLUSH_BYTES = 512 * 1024  # large seqs gain nothing from batching; small ones gain a lot
PROBE_PAUSE_S = 0.002  # after saying which seq of a suspect batch it maps: the word leaves before a crash


@dataclass
class BatchTask:
    """The seqs of batch `pos`, in order; `probe`: say which one is mapped before each."""

    pos: int
    items: List[Item]
    probe: bool = False


Task = Union[Item, BatchTask]
Consumer = Optional[bytes]  # where a task's result goes directly; None: to the server


class MapSeqRunner(Runner):
    """Runs tasks one by one; results leave in batches, each straight to its consumer when the
    task names one the worker reaches (with a `completed` to the server), else to the server."""

    def __init__(self, means: Means, routes: Optional[Routes] = None):
        super().__init__(means)
        self.routes = routes
        self.tasks: Deque[Tuple[int, Task, Consumer]] = deque()
        self.partial: Dict[Tuple[int, int], BatchTask] = {}  # batches whose seqs have not all come
        # lost batches (a seq did not check or could not be read): how many of their seqs are still
        # to come in later messages of the same send, to drop (a redo comes after them)
        self.discard: Dict[Tuple[int, int], int] = {}
        # results not sent yet (all of run `results_run`), with the block a padded batch lies in
        self.results: List[Tuple[Item, Consumer, Optional[shm.Block]]] = []
        self.results_run: Optional[int] = None
        self.results_bytes = 0
        self.results_header_bytes = 0
        self.flush_every = max(1, min(self.cfg.buf_size // 2, 16))
        self.messages_in = self.messages_out = 0
        # [run, pos, seqs mapped] of the batch being mapped (its heartbeats carry it; read there)
        self.under_way: Optional[List[int]] = None

    def add(
        self,
        run: int,
        items: List[Item],
        to: Optional[List[bytes]] = None,
        probe: bool = False,
        lost: Sequence[BadItem] = (),
    ) -> None:
        """Tasks of a message: its seqs, and a batch (its seqs may come in several messages) once
        all its seqs are here. `to`: the message's consumers (b"": to the server). A batch one of
        whose seqs is `lost` (did not check, or could not be read) runs not at all: its seqs here,
        before and after are dropped (the server redoes it whole, after the rest of this send)."""
        dests: List[Consumer] = [d or None for d in to] if to and len(to) == len(items) else [None] * len(items)
        if lost:
            self._lose(run, items, lost)
        for item, dest in zip(items, dests):
            if item.batch is None:
                self.tasks.append((run, item, dest))
                continue
            key = (run, item.batch)
            left = self.discard.get(key)
            if left is not None:
                if left <= 1:
                    del self.discard[key]
                else:
                    self.discard[key] = left - 1
                continue
            task = self.partial.get(key)
            if task is None:
                task = self.partial[key] = BatchTask(item.batch, [], probe)
            task.items.append(item)
            if len(task.items) >= (item.size or 1):
                del self.partial[key]
                self.tasks.append((run, task, dest))
        self.messages_in += 1

    def _lose(self, run: int, items: List[Item], lost: Sequence[BadItem]) -> None:
        """Mark the batches of `lost` seqs to be dropped: the seqs of each that came already, and as
        many as are still to come (its size less the lost ones and those that came before)."""
        gone: Dict[Tuple[int, int], int] = {}  # (batch, size): seqs lost
        for bad in lost:
            if bad.pos is not None and bad.size is not None:
                gone[(bad.pos, bad.size)] = gone.get((bad.pos, bad.size), 0) + 1
        for (batch, size), n_lost in gone.items():
            key = (run, batch)
            if key in self.discard:
                continue  # lost already: its later seqs are being dropped
            before = self.partial.pop(key, None)
            left = size - n_lost - (len(before.items) if before is not None else 0)
            if left > 0:
                self.discard[key] = left  # this message's seqs of it are counted among them

    def drop_run(self, run: int) -> None:
        self.tasks = deque(t for t in self.tasks if t[0] != run)
        for key in [k for k in self.partial if k[0] == run]:
            del self.partial[key]
        for key in [k for k in self.discard if k[0] == run]:
            del self.discard[key]
        if self.results_run == run:
            if self.results:
                log.info("dropped %d results (%d bytes) of closed run %d", len(self.results), self.results_bytes, run)
            self._drop_results()

    def clear(self) -> None:
        self.under_way = None
        self.tasks.clear()
        self.partial.clear()
        self.discard.clear()
        self._drop_results()

    def _drop_results(self) -> None:
        for _, _, block in self.results:
            if block is not None:
                block.release()
        self.results, self.results_bytes, self.results_header_bytes = [], 0, 0

    def flush(self) -> None:
        run = self.results_run
        if not self.results or run is None:
            return
        relayed: List[Item] = []
        direct: Dict[bytes, List[Tuple[Item, Optional[shm.Block]]]] = {}
        for item, dest, block in self.results:
            if dest is not None and self.routes is not None:
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
            skips = any(i.skipped for i in done)
            self.send(
                protocol.Completed(
                    run=run,
                    pos=[i.pos for i in done],
                    nbytes=[i.nbytes for i in done],
                    skipped=[i.skipped for i in done] if skips else [],
                    skipped_tags=[i.skipped_tags for i in done] if skips else [],
                )
            )
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
        try:
            out = self._map(run, item, self.templates())
            result = protocol.seq_to_item(out, item.pos) if out is not None else _skip(item)
            header_bytes = check_header(result)
            check_size(result, self.cfg.max_message_bytes)
        except Exception as exc:
            # the seq as it was dealt (a mapper may have changed the tag of its dict, or made it huge)
            tag = item.seq_tag if item.seq_tag is not None else exc.seq_tag if isinstance(exc, MappingError) else None
            self._failed(run_id, item.pos, tag, self._failure(exc))
            return
        self._add_result(run_id, result, dest, header_bytes)
        self.done += 1

    def _map(self, run: OpenRun, item: Item, templates: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """One seq through the config's map_seq (its rng, its meta entries put back), checked; None:
        the mapper skipped it."""
        map_seq = self.mappers().map_seq
        assert map_seq is not None
        seq = writable(protocol.item_to_seq(item))
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
        return out

    def _failure(self, exc: BaseException) -> str:
        return failure_text(exc) + failure_hint(self.cfg, "map_seq", exc)

    def _failed(self, run_id: int, pos: int, tag: Optional[str], text: str) -> None:
        """A task failed (call while handling the exception): its run is over here; the server hears
        of it after the results before it."""
        tag, message = clip(tag), clip(text)
        tb = clip(traceback.format_exc())
        log.error("mapper failed on seq %r: %s\n%s", tag, message, tb.rstrip())
        self.flush()
        self.send(protocol.TaskFailed(run=run_id, pos=pos, seq_tag=tag, message=message, traceback=tb))
        self.drop_run(run_id)

    def _add_result(
        self, run_id: int, result: Item, dest: Consumer, header_bytes: int, block: Optional[shm.Block] = None
    ) -> None:
        # bytes that travel in the message (not in shared memory) cut batches, and so do headers
        shared = block is not None or (dest is not None and self.routes is not None and self.routes.shared(dest))
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

    def _step_batch(self, run_id: int, run: OpenRun, task: BatchTask, dest: Consumer) -> None:
        """Map a batch's seqs one by one, then pad them into one result where it travels (without
        the seqs the mapper skipped); a seq that fails fails the batch, naming the seq."""
        outs: List[Dict[str, Any]] = []
        skipped: List[Item] = []
        item: Optional[Item] = None
        block: Optional[shm.Block] = None
        try:
            templates = self.templates()
            for item in task.items:
                if task.probe:
                    self.send(protocol.Mapping(run=run_id, pos=task.pos, seq_tag=clip(item.seq_tag)))
                    time.sleep(PROBE_PAUSE_S)
                self.under_way = [run_id, task.pos, len(outs) + len(skipped)]
                out = self._map(run, item, templates)
                if out is None:
                    skipped.append(item)
                else:
                    outs.append(out)
            self.under_way = None
            item = None  # what fails from here fails the batch as a whole
            if outs:
                result, block = self._padded(task.pos, outs, run.pad, dest)
            else:
                result = _empty(task.pos, templates)
            if skipped:
                result.skipped, result.skipped_tags = len(skipped), _tags(skipped)
            header_bytes = check_header(result)
            check_size(result, self.cfg.max_message_bytes)
        except Exception as exc:
            self.under_way = None
            if block is not None:
                block.release()
            bad = item if item is not None else _culprit(exc, task)
            tag = bad.seq_tag if bad is not None else None
            if tag is None and isinstance(exc, (MappingError, collate.BatchError)):
                tag = exc.seq_tag
            self._failed(run_id, task.pos, tag, f"batch {task.pos}: {self._failure(exc)}")
            return
        self._add_result(run_id, result, dest, header_bytes, block)
        self.done += len(task.items)

    def _padded(
        self, pos: int, outs: List[Dict[str, Any]], pad: Dict[str, Any], dest: Consumer
    ) -> Tuple[Item, Optional[shm.Block]]:
        """The batch's outputs padded into one result: into a block of the consumer's shared memory
        when it is on this host (and the segment has room), else into arrays of their own."""
        columns = collate.layout(outs)
        specs = collate.arrays_of(columns)
        offsets, size = shm.layout([math.prod(shape) * dtype.itemsize for _, dtype, shape in specs])
        block = self.routes.block_for(dest, size) if dest is not None and self.routes is not None else None
        if block is not None:
            arrays = {key: shm.view(block, off, dtype, shape) for (key, dtype, shape), off in zip(specs, offsets)}
        else:
            arrays = {key: numpy.empty(shape, dtype) for key, dtype, shape in specs}
        collate.fill(outs, columns, arrays, pad)
        described = [[key, dtype.str, list(shape)] for key, dtype, shape in specs]
        nbytes = sum(a.nbytes for a in arrays.values())
        meta = collate.meta_of(outs)
        if block is None:
            return Item(pos, meta, described, list(arrays.values()), nbytes, size=len(outs)), None
        ref = block.ref()
        placed = [ref.offset, ref.nbytes, ref.seq, offsets]
        return Item(pos, meta, described, [], nbytes, block=placed, size=len(outs)), block


def _tags(items: Sequence[Item]) -> List[str]:
    """The tags a result names of its skipped seqs (the first few, shortened)."""
    return [protocol.short_tag(i.seq_tag) or "" for i in items[: protocol.MAX_SKIPPED_TAGS]]


def _skip(item: Item) -> Item:
    """The result of a seq the mapper skipped: its position and meta entries, no arrays."""
    meta: Dict[str, Any] = {k: item.meta[k] for k in ("seq_tag", "seq_idx") if k in item.meta}
    return Item(item.pos, meta, [], [], 0, skipped=1, skipped_tags=_tags([item]))


def _empty(pos: int, templates: Dict[str, Any]) -> Item:
    """A batch whose seqs were all skipped: B = 0, each key's array [0, 0, ...] (its fixed axes as
    the output templates give them) with its empty lengths, as padding would make it."""
    described: List[List[Any]] = []
    frames: List[Any] = []
    for key, tpl in templates.items():
        shape = [0 if d is None else int(d) for d in tpl["shape"]]
        dtype = numpy.dtype("<U1") if tpl["dtype"] == STRING else numpy.dtype(tpl["dtype"])
        arrays = [(key, numpy.empty([0, *shape], dtype))]
        if shape:
            arrays.append((key + collate.LENGTHS, numpy.empty([0], numpy.int64)))
        for name, array in arrays:
            described.append([name, array.dtype.str, list(array.shape)])
            frames.append(array)
    return Item(pos, {"seq_tag": [], "seq_idx": []}, described, frames, 0, size=0)


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
    arrays = [
        shm.view(block, off, numpy.dtype(dtype), shape).copy()
        for (_, dtype, shape), off in zip(item.arrays, item.block[3])
    ]
    block.release()
    return dataclasses.replace(item, frames=arrays, block=None)

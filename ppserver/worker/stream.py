"""The map_seq_stream runner: each stream partition a generator, advanced one output at a time.

A partition's mapper pulls its inputs through an iterator that takes messages from the server
while it waits for the next one; outputs go to the server within the partition's credit, each
checked first (outputs.py). An output the partition delivered before it moved here (`skip`) is
made again but not sent. A failure ends the partition here, and the server hears of it with the
last input's seq tag.
"""

from __future__ import annotations

import logging
import traceback
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

from ppclient import protocol
from ppclient.protocol import Item
from ppserver.config.mappers import failure_hint
from ppserver.mappers.apply import MappingError, run_stream, writable
from ppserver.worker.outputs import Means, OpenRun, Runner, check_header, check_size, clip, failure_text

log = logging.getLogger("ppserver.worker")


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


class StreamRunner(Runner):
    """Partitions as generators whose input iterator pulls inputs from the server while it waits.
    The worker adds the time its streams wait for inputs to the clock's `paused`."""

    def __init__(self, means: Means, wait_for_input: Callable[[], None]):
        super().__init__(means)
        self.wait_for_input = wait_for_input
        self.parts: Dict[Tuple[int, int], _Partition] = {}
        self.rr = 0

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
            text = failure_text(exc) + failure_hint(self.cfg, "map_seq_stream", exc)
            tag, message, tb = clip(tag), clip(text), clip(traceback.format_exc())
            log.error(
                "stream mapper failed in partition %d (last input %r): %s\n%s", part.index, tag, message, tb.rstrip()
            )
            self.send(
                protocol.StreamFailed(
                    run=part.run,
                    partition=part.index,
                    incarnation=part.incarnation,
                    seq_tag=tag,
                    message=message,
                    traceback=tb,
                )
            )
            return
        part.emitted += 1
        if part.emitted <= part.skip:
            return  # delivered already, before this partition moved here
        self.send(protocol.StreamOutputs(run=part.run, partition=part.index, incarnation=part.incarnation), [item])
        part.out_credit -= 1
        self.done += 1

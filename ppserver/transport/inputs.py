"""How the server sends each worker its inputs: in the messages, in blocks of a shared-memory
segment of the worker's, or by address in the server's own memory (cma.py).

A worker on the server's host is offered a segment (and reading the server's memory) when it
registers; it says in `shm_mapped` what works, and from then on its inputs take the cheapest
way it has. A way that fails later (`inputs_lost`) is given up for the messages. The scheduler
hears of each change as ev.InputsShared, with the worker's InputPath (`path`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Set, Tuple

import numpy

from ppclient import protocol, shm
from ppclient.protocol import Item
from ppclient.throttle import Throttled
from ppserver.scheduler.workers import InputPath, InputWay
from ppserver.transport import cma

log = logging.getLogger("ppserver.server")


class WorkerInputs:
    """The per-worker input transport: the segments offered and mapped, the workers reading the
    server's memory, and sending a message with inputs the way its worker takes them."""

    def __init__(self, shm_mb: int, stream: bool, send: Callable[[List[Any]], bool]):
        self.shm_mb = shm_mb
        self.stream = stream
        self.send_frames = send  # to the worker socket; False if not sent
        self.host_id = shm.usable_host_id(log, "inputs of local workers go") if shm_mb > 0 else ""
        self.segments: Dict[bytes, shm.Segment] = {}  # segments offered, mapped or not yet
        self.in_blocks: Set[bytes] = set()  # workers that mapped theirs
        # Workers on this host that read their inputs in this process's memory: they are told only
        # where each array lies. The token lets a worker check that reading works.
        self.cma_token = numpy.frombuffer(os.urandom(32), numpy.uint8).copy()
        self.by_address: Set[bytes] = set()
        self.segments_full = Throttled(log, "inputs went over the socket", interval=10.0)

    def way(self, wid: bytes) -> InputWay:
        """How the worker's tasks get their inputs (a stream's inputs go in blocks where the worker
        mapped its segment, else in the messages)."""
        if wid in self.by_address:
            return InputWay.ADDRESS
        return InputWay.SHARED_MEMORY if wid in self.in_blocks else InputWay.MESSAGE

    def path(self, wid: bytes) -> InputPath:
        """The way for the scheduler (ev.InputsShared), which bounds a task message's input bytes
        by it: in blocks, a quarter of the segment (such blocks fit it well)."""
        way = self.way(wid)
        if way is InputWay.SHARED_MEMORY:
            return InputPath.shared_memory(self.segments[wid].capacity // 4)
        return InputPath.by_address() if way is InputWay.ADDRESS else InputPath.message()

    # ---- a worker's registration and what it says -------------------------------------------
    def offer(self, wid: bytes, host_id: str) -> Tuple[Optional[Dict[str, Any]], Optional[Dict[str, Any]]]:
        """What a worker that registers is offered: (its segment's descriptor, reading this process's
        memory); (None, None) on another host. An earlier registration's segment goes."""
        self.forget(wid)
        if not self.host_id or host_id != self.host_id:
            return None, None
        cma_offer = cma.offer(self.cma_token) if cma.available() is None else None
        try:
            segment = self.segments[wid] = shm.Segment(self.shm_mb << 20)
        except (OSError, shm.ShmUnavailable) as exc:
            log.warning("no shared memory for worker %s: %s", wid.decode(errors="replace"), exc)
            return None, cma_offer
        return segment.descriptor.to_dict(), cma_offer

    def mapped(self, wid: bytes, msg: protocol.ShmMapped) -> InputPath:
        """How the worker gets its inputs once it tried what it was offered; its segment is kept
        only where it is of use."""
        name = wid.decode(errors="replace")
        if msg.cma:
            self.by_address.add(wid)
            log.info("worker %s reads its inputs in the server's memory", name)
            if not self.stream:
                self._drop_segment(wid)  # tasks name their inputs by address: the segment would sit unused
        if wid in self.segments:
            if msg.ok:
                self.in_blocks.add(wid)
            else:
                log.warning("worker %s gets its inputs over the socket: %s", name, msg.reason)
                self._drop_segment(wid)
        return self.path(wid)

    def fall_back(self, wid: bytes) -> bool:
        """The worker could not read inputs it was sent by address or in a block. The server keeps
        every input a worker may still read, so that way failed: from now on (the redone ones
        included) they travel in the messages. False if they did already."""
        if self.way(wid) is InputWay.MESSAGE:
            return False
        log.warning("worker %s gets its inputs over the socket from now on", wid.decode(errors="replace"))
        self.forget(wid)
        return True

    def forget(self, wid: bytes) -> None:
        self.by_address.discard(wid)
        self._drop_segment(wid)

    def keep_only(self, workers: Collection[bytes]) -> None:
        """Workers that left: their segments go (once they unmap them)."""
        for wid in [w for w in self.segments if w not in workers]:
            self._drop_segment(wid)
        if self.by_address:
            self.by_address.intersection_update(workers)

    def close(self) -> None:
        for wid in list(self.segments):
            self._drop_segment(wid)

    def _drop_segment(self, wid: bytes) -> None:
        self.in_blocks.discard(wid)
        segment = self.segments.pop(wid, None)
        if segment is not None:
            segment.close()

    # ---- sending ----------------------------------------------------------------------------
    def send(self, ident: bytes, wid: bytes, msg: protocol.Message, items: Sequence[Item]) -> None:
        """A message with inputs, the worker's way: by address (the scheduler keeps each input until
        its result is settled), in a block of its segment per message (a receiver's lease covers
        one message), or in the message; one message unless headers are huge (encoded once: each
        costs about a microsecond per seq)."""
        way = self.way(wid)
        if way is InputWay.ADDRESS and type(msg) is protocol.Tasks:
            items = protocol.to_spans(items) or items
        elif wid in self.in_blocks:
            for part_msg, part in protocol.split_fitting(msg, items, placed=True):
                self._send_in_block(ident, wid, part_msg, part)
            return
        for frames in protocol.encode_fitting(msg, items):
            self.send_frames([ident, *frames])

    def _send_in_block(self, ident: bytes, wid: bytes, msg: protocol.Message, items: List[Item]) -> None:
        """Inputs in a block of the worker's segment (or, if it is full, in the message); a block of
        a message that was not sent is given back."""
        segment = self.segments[wid]
        items, block = protocol.to_block(items, segment)  # the worker frees it when done
        if block is None:
            self.segments_full.hit(
                lambda: (
                    f"worker {wid.decode(errors='replace')}'s shared-memory segment is full "
                    f"({segment.used() / 2**20:.1f} of {segment.capacity / 2**20:.1f} MiB in use)"
                ),
                len(items),
            )
        if not self.send_frames([ident, *protocol.encode(msg, items)]) and block is not None:
            block.release()

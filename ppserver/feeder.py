"""The feeder thread: reads one epoch from the dataset and hands encoded seqs to the server loop.

Batches go through a small bounded deque (no serialisation inside the process); a one-byte
message on an inproc socket wakes the loop's poller. The deque holds at most two batches,
so the thread runs only as far ahead as the loop takes seqs (the loop takes them only when
workers have credit). While the queue is full, the thread gathers the next batch, so one
hand-over carries several seqs when the loop is busy. It checks its quit flag between
steps, so a superseded epoch stops within one timeout.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from typing import Any, Deque, List, Optional, Tuple

import zmq

from ppclient import wire

log = logging.getLogger("ppserver.feeder")

WAIT_S = 0.0005  # while the deque is full; polling keeps the loop free of lock hand-offs
MAX_BATCH = 16
MAX_BATCH_BYTES = 1 << 20
QUEUE_BATCHES = 2

# What the loop takes from Feeder.out: ("in", items) | ("fed", count) | ("error", message, traceback)
Event = Tuple[Any, ...]


class Feeder(threading.Thread):
    def __init__(self, *, ctx: zmq.Context, wake_endpoint: str, dataset, lock: threading.Lock, run: int,
                 num_seqs: int):
        super().__init__(name=f"feeder run {run}", daemon=True)
        self.ctx = ctx
        self.wake_endpoint = wake_endpoint
        self.dataset = dataset
        self.lock = lock
        self.run_id = run
        self.num_seqs = num_seqs
        self.quit = threading.Event()
        self.out: Deque[Event] = deque()  # appended here, popped by the loop (deque ops are atomic)
        self._wake: Optional[zmq.Socket] = None

    def stop(self) -> None:
        self.quit.set()

    def take(self) -> Optional[Event]:
        """The next event for the loop, or None if there is none yet."""
        try:
            return self.out.popleft()
        except IndexError:
            return None

    def run(self) -> None:
        self._wake = self.ctx.socket(zmq.PUSH)
        self._wake.sndhwm = 1
        self._wake.linger = 0
        self._wake.connect(self.wake_endpoint)
        batch: List[Any] = []
        nbytes = 0
        try:
            for pos in range(self.num_seqs):
                if self.quit.is_set():
                    return
                with self.lock:
                    if self.quit.is_set():
                        return
                    seq = self.dataset.get_seq(pos)
                item = wire.seq_to_item(seq, i=pos)
                batch.append(item)
                nbytes += sum(map(wire.nbytes, item[1]))
                full = len(batch) >= MAX_BATCH or nbytes >= MAX_BATCH_BYTES
                if self._put(("in", batch), block=full):
                    batch, nbytes = [], 0
                elif self.quit.is_set():
                    return
            if batch and not self._put(("in", batch), block=True):
                return
            self._put(("fed", self.num_seqs), block=True)
        except Exception as exc:
            log.error("reading the dataset failed in run %d: %s", self.run_id, exc)
            self._put(("error", f"dataset failed: {type(exc).__name__}: {exc}", traceback.format_exc()), block=True)
        finally:
            self._wake.close(linger=0)

    def _put(self, event: Event, *, block: bool) -> bool:
        while not self.quit.is_set():
            if len(self.out) >= QUEUE_BATCHES:
                if not block:
                    return False
                time.sleep(WAIT_S)
                continue
            self.out.append(event)
            try:
                self._wake.send(b"", flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # a wake-up is already pending
            return True
        return False

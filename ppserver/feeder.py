"""The feeder thread: reads one epoch from the dataset and hands encoded seqs to the server loop.

It sends over an inproc PUSH socket whose high-water mark is tiny, so the thread runs only
as far ahead as the server loop pulls (the loop pulls only when workers have credit). It
checks its quit flag between sends, so a superseded epoch stops within one send timeout.
"""

from __future__ import annotations

import logging
import threading
import traceback
from typing import Any, Dict, List, Tuple

import zmq

from ppclient import wire

log = logging.getLogger("ppserver.feeder")

SEND_TIMEO_MS = 10
MAX_BATCH = 16
MAX_BATCH_BYTES = 1 << 20


class Feeder(threading.Thread):
    def __init__(self, *, ctx: zmq.Context, endpoint: str, dataset, lock: threading.Lock, run: int, num_seqs: int):
        super().__init__(name=f"feeder run {run}", daemon=True)
        self.ctx = ctx
        self.endpoint = endpoint
        self.dataset = dataset
        self.lock = lock
        self.run_id = run
        self.num_seqs = num_seqs
        self.quit = threading.Event()

    def stop(self) -> None:
        self.quit.set()

    def run(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.sndhwm = 2
        sock.linger = 0
        sock.sndtimeo = SEND_TIMEO_MS
        sock.connect(self.endpoint)
        batch: List[Tuple[Dict[str, Any], List[Any]]] = []
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
                # Adaptive batching: send as soon as the loop has room; while it is busy,
                # gather seqs so one message carries several (fewer wake-ups per seq).
                if len(batch) >= MAX_BATCH or nbytes >= MAX_BATCH_BYTES or sock.poll(0, zmq.POLLOUT):
                    if not self._send(sock, wire.pack_batch({"t": "in", "run": self.run_id}, batch)):
                        return
                    batch, nbytes = [], 0
            if batch and not self._send(sock, wire.pack_batch({"t": "in", "run": self.run_id}, batch)):
                return
            self._send(sock, [wire.pack({"t": "fed", "run": self.run_id, "count": self.num_seqs})])
        except Exception as exc:
            log.error("reading the dataset failed in run %d: %s", self.run_id, exc)
            message = f"dataset failed: {type(exc).__name__}: {exc}"
            self._send(sock, [wire.pack({"t": "feed_error", "run": self.run_id, "message": message,
                                         "traceback": traceback.format_exc()})])
        finally:
            sock.close(linger=0)

    def _send(self, sock, frames) -> bool:
        while not self.quit.is_set():
            try:
                sock.send_multipart(frames, copy=False)
                return True
            except zmq.Again:
                continue
        return False

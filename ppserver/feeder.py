"""The feeder thread: reads one epoch from the dataset and hands encoded seqs to the server loop.

It sends over an inproc PUSH socket whose high-water mark is tiny, so the thread runs only
as far ahead as the server loop pulls (the loop pulls only when workers have credit). It
checks its quit flag between sends, so a superseded epoch stops within one send timeout.
"""

from __future__ import annotations

import logging
import threading
import traceback

import zmq

from ppclient import wire

log = logging.getLogger("ppserver.feeder")

SEND_TIMEOUT_MS = 10


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
        sock.sndtimeo = SEND_TIMEOUT_MS
        sock.connect(self.endpoint)
        try:
            for pos in range(self.num_seqs):
                if self.quit.is_set():
                    return
                with self.lock:
                    if self.quit.is_set():
                        return
                    seq = self.dataset.get_seq(pos)
                frames = wire.seq_to_frames({"t": "in", "run": self.run_id, "i": pos}, seq)
                if not self._send(sock, frames):
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

"""Requests on the control socket: info, status, epoch and worker discovery; client credit.

Every request is checked by the protocol module before it gets here; this module decides
the answer. An epoch request that checks is answered at once (EpochAccepted) and handed
to the reader, which validates it against the dataset and sets the epoch up; the client
learns the outcome on its data socket (Started or RunFailed). So no request ever waits for
the dataset, and a request the dataset refuses leaves the running epoch alone.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Dict, List, Optional

from ppclient import protocol

from . import reader as rd
from .config import Config
from .scheduler import Instruction, Scheduler
from .scheduler import events as ev


class Control:
    def __init__(
        self,
        cfg: Config,
        sched: Scheduler,
        reader: rd.Reader,
        *,
        info: Dict[str, Any],
        status: Callable[[], Dict[str, Any]],
        worker_address: Callable[[], str],
    ):
        self.cfg = cfg
        self.sched = sched
        self.reader = reader
        self.info = info
        self.status = status
        self.worker_address = worker_address
        # Run ids start at a random point, so a restarted server never reuses an id a client
        # may still hold data for.
        self.next_run = random.getrandbits(40)

    def handle(self, ident: bytes, msg: protocol.Message) -> tuple[Optional[protocol.Message], List[Instruction]]:
        """The reply (None for a credit, which has none) and the scheduler's instructions."""
        now = time.monotonic()
        if isinstance(msg, protocol.Credit):
            return None, self.sched.handle(ev.CreditGranted(now, ident, msg.run, msg.total))
        if isinstance(msg, protocol.InfoRequest):
            return protocol.InfoReply(**self.info), []
        if isinstance(msg, protocol.StatusRequest):
            return protocol.StatusReply(status=self.status()), []
        if isinstance(msg, protocol.DiscoverRequest):
            return protocol.DiscoverReply(worker_endpoint=self.worker_address()), []
        if isinstance(msg, protocol.EpochRequest):
            return self._epoch(now, msg)
        return protocol.ErrorReply(error=f"{msg.kind!r} is not a request"), []

    def _epoch(self, now: float, msg: protocol.EpochRequest) -> tuple[protocol.Message, List[Instruction]]:
        if not 0 < len(msg.consumer) <= 255:
            return protocol.ErrorReply(error="consumer must be 1 to 255 bytes"), []
        if self.cfg.is_stream and (msg.seq_list is not None or msg.seq_order is not None):
            return protocol.ErrorReply(error="map_seq_stream is set: seq_list and seq_order are not supported"), []
        if msg.seq_list is not None and msg.seq_order is not None:
            return protocol.ErrorReply(error="give at most one of seq_list and seq_order"), []
        self.next_run += 1
        run = self.next_run
        out = self.sched.handle(ev.RunRequested(now, run, msg.epoch, msg.consumer))
        self.reader.send(rd.Prepare(run, msg.epoch, msg.seq_list, msg.seq_order))
        return protocol.EpochAccepted(run=run), out

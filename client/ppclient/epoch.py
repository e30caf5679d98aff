"""An epoch as the trainer reads it: this rank's seqs (or batches) in order, credit granted to the
server as they are taken, and the waits that tell a slow epoch from a dead or restarted server.

A seq the server's mapper skipped (returned None) comes as a marker that holds its position: the
iterator passes over it (a position of the shard is taken, nothing is yielded), so positions,
resume states and `len()` count it; a batch comes without its skipped seqs (B = 0 when all were).

The client grants the server credit for `window` seqs and tops it up as the trainer takes them,
so the server never sends more than the trainer takes. While a run is live the server sends a
keepalive every heartbeat interval, which tells a slow epoch (an Error naming what it waits for)
from a dead server (ServerUnavailable); a wait for other readers of the job whose clients live
(room in their windows) is neither, and lasts as long as they do.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Sequence, Union

import zmq

from . import collate, protocol, resume
from .errors import DatasetError, Error, MapperError, ServerUnavailable, Superseded
from .inbox import Inbox
from .protocol import Batch, Item
from .shards import lane_of

log = logging.getLogger("ppclient")

WINDOW = 32  # the default window: seqs the server may send ahead of the trainer
BATCH_WINDOW = 8  # ... and batches, when the job batches

KEEPALIVE_MISSES = 2  # the server is alive if something came within this many of its heartbeat intervals
MISSING_AFTER = 2.0  # heartbeat intervals a client waits for its next direct seq before saying it is missing
PROBE_WAIT_S = 1.0  # how long a client that hears nothing of its run waits for the answer to `info`
PROBE_EVERY_S = 1.0  # and how often it asks again while the silence lasts


@dataclass(frozen=True)
class Session:
    """What an epoch needs of its client, and all it gets: who reads, where the server is, how
    long a wait may last, the inbox of its runs, and the three things it asks of the client. The
    client makes one for each epoch it starts (Client.epoch), with the values of that moment; the
    iterator reaches the client through nothing else."""

    reader: resume.Reader  # job, rank, world size, subshard: the lanes and what a state names
    address: str  # the server's, for messages and errors
    timeout: float  # the longest wait for the server, in s
    window: Optional[int]  # the client's window (None: the default for the cut)
    direct: bool  # results come straight from the workers (map_seq), not through the server
    inbox: Inbox  # the messages of the live runs: next(run, deadline), open(run), drop(run)
    probe: Callable[[float], Optional[protocol.InfoReply]]  # `info`, waiting up to s: who answers
    # ask for the epoch again (epoch, start, seq_list, seq_order, fingerprint, batching), after a restart
    ask: Callable[
        [int, int, Optional[List[str]], Optional[List[int]], Optional[str], Optional[Dict[str, Any]]],
        protocol.EpochAccepted,
    ]
    check_process: Callable[[], None]  # UsageError in a forked child of the client's process


class EpochIterator(Iterator[Dict[str, Any]]):
    """This rank's seqs (or batches) of one epoch in order. Raises MapperError, Superseded or
    ServerUnavailable, never hangs; once it has raised, every later next() raises the same error.

    A server that stops sending anything (not even keepalives) is asked `info` now and then;
    when a restarted one (another instance, the same config fingerprint) answers at the address
    within the timeout, the iterator asks it for the epoch again from its position, as a resume
    state would, and goes on: the rest of the epoch is the same as it would have been."""

    def __init__(
        self,
        session: Session,
        sock: zmq.Socket,
        accepted: protocol.EpochAccepted,
        epoch: int,
        start: int = 0,
        seq_list: Optional[List[str]] = None,
        seq_order: Optional[List[int]] = None,
        batching: Optional[Dict[str, Any]] = None,
    ):
        """`batching`: the cut asked for ({}: none; None: the server's default)."""
        self._session = session
        self._sock = sock
        self.run = accepted.run
        self.epoch = epoch
        self.start = start  # index in the shard of the first seq (or batch) this iterator yields
        reader = session.reader
        self.rank = reader.rank
        self.world_size = reader.world_size
        self.num_seqs: Optional[int] = None  # seqs (batches, when the job batches) it yields in all
        self.batching: Optional[Dict[str, Any]] = None  # the job's cut, once started (None: seq by seq)
        self.fingerprint = accepted.fingerprint
        self._instance = accepted.instance  # the server process that serves the run
        self._seq_list, self._seq_order = seq_list, seq_order
        self.reconnects = 0  # times the epoch was asked for again from a restarted server
        self._consumed = 0  # positions taken (yielded, or passed over: seqs the mapper skipped)
        self.skipped = 0  # seqs the mapper skipped among them (a batch's too)
        self._base = 0  # seqs yielded before the current run began (the server counts from there)
        self._granted = 0  # credit granted to the current run so far (cumulative)
        window = session.window
        if window is None:  # the default: fewer positions when they are batches (each holds many seqs);
            # with the server's default cut (None), the smaller one until Started says (_on)
            window = WINDOW if batching == {} else BATCH_WINDOW
        self._window = window
        self._told = 0  # seqs taken, as the server last heard it
        self._done = False
        self._end: Optional[int] = None  # seqs the current run has for this iterator, once End came
        self._error: Optional[Error] = None
        self._direct = session.direct
        lanes = reader.world_size * reader.subshards
        lane = lane_of(reader.rank, reader.world_size, reader.subshard, reader.subshards, reader.sharding)
        self._reorder = Reorder(lane + start * lanes, lanes, self._direct)
        self._awaited = -1  # direct results: the position waited for since _ask_at's count began
        self._ask_at = 0.0  # when to say it is missing
        self._mapped = 0  # the run's seqs of batches under way mapped, as the last keepalive said
        self._server = Silence()
        self._started = False
        self._sized = False  # num_seqs was set by the first run to start

    def __len__(self) -> int:
        """Seqs (batches, when the job batches) this iterator yields in all (from its start), if the
        server knows it in advance."""
        if self.num_seqs is None:
            what = "batches" if self.batching else "seqs"
            raise TypeError(f"the number of {what} of this epoch is not known in advance")
        return self.num_seqs

    @property
    def position(self) -> int:
        """Index in this rank's shard of the next seq or batch (start + those yielded so far)."""
        return self.start + self._consumed

    @property
    def duplicates(self) -> int:
        """Seqs that came twice (a worker died after sending one) and were dropped."""
        return self._reorder.duplicates

    def state_dict(self) -> Dict[str, Any]:
        """Where this iterator is: small and msgpack-able. `client.epoch(state=...)` resumes from it,
        delivering exactly what this iterator would have delivered next."""
        return {
            **self._session.reader.names(),
            "epoch": self.epoch,
            "position": self.position,
            "fingerprint": self.fingerprint,
            "seq_selection": resume.seq_selection(self._seq_list, self._seq_order),
            "batching": self.batching,
        }

    def __iter__(self) -> EpochIterator:
        return self

    def _grant(self, n: int) -> None:
        """Grants are cumulative (total so far), so one lost on a reset connection is repaired by the next."""
        self._granted += n
        self._told = self._consumed
        credit = protocol.Credit(run=self.run, total=self._granted, consumed=self._consumed - self._base)
        self._sock.send_multipart([protocol.DELIMITER, *protocol.encode(credit)])

    def _top_up(self, held: int = 0, end: bool = False) -> None:
        """Credit for `window` seqs beyond those taken (and the `held` ones received meanwhile),
        granted half a window at a time, with the number taken (also `end`: at the end)."""
        window, taken = self._window, self._consumed - self._told
        due = self._consumed - self._base + held + window - self._granted
        if due * 2 >= window or taken * 2 >= window or (end and taken):
            self._grant(max(due, 0))

    def _stop(self, error: Error) -> None:
        """Another epoch of the client superseded this one, or the client closed: an unfinished
        iterator raises `error` from now on, and the seqs that arrived are let go (never yielded
        now: their shared-memory blocks go)."""
        if self._error is None and not self._finished():
            self._error = error
        self._reorder.clear()

    def _raise(self, error: Error) -> NoReturn:
        self._error = error
        self._session.inbox.drop(self.run)
        self._reorder.clear()
        raise error

    def _wait_started(self) -> None:
        self._server.heard(time.monotonic())
        self._grant(self._window)
        while not self._started:
            self._receive("started")
        self._top_up()  # (a job that turned out not to batch: the rest of its window of seqs)

    def _finished(self) -> bool:
        return self._done and (self._end is None or self._consumed - self._base >= self._end)

    def __next__(self) -> Dict[str, Any]:
        if self._error is not None:
            raise self._error
        self._session.check_process()
        while True:
            expected = self._reorder.expected(self._consumed)
            while expected not in self._reorder.buffer:
                if self._finished():
                    self._top_up(end=True)
                    self._session.inbox.drop(self.run)
                    raise StopIteration
                self._receive("progress")
            item = self._reorder.buffer.pop(expected)
            if isinstance(item, Item) and item.skip:  # a skipped seq: its position is taken, nothing yielded
                self._consumed += 1
                self.skipped += 1
                self._top_up(end=self._finished())
                continue
            seq = self._build(item)
            self._consumed += 1
            if isinstance(item, Item):
                self.skipped += item.skipped
            self._top_up(end=self._finished())  # (at the end, tells the server how many were taken)
            return seq

    def _build(self, item: Union[Item, Batch]) -> Dict[str, Any]:
        """What the trainer gets: a seq, a padded batch, or the seqs of a batch padded here."""
        if isinstance(item, Item):
            return protocol.item_to_seq(item)
        pad = self.batching.get("pad", {}) if self.batching else {}
        try:
            return collate.pad([protocol.item_to_seq(i) for i in item.items], pad)
        except collate.BatchError as exc:  # the mapper's outputs do not fit together (it names the seqs)
            self._raise(MapperError(f"epoch {self.epoch}, batch {item.pos}: {exc}", seq_tag=exc.seq_tag))

    def _receive(self, what: str) -> None:
        """Take the next message of this run (`what`: "started" or "progress"); raise when none
        comes within the timeout. Keepalives that say the run waits for other readers whose
        clients live extend it (a paused reader fails no one), and so do those that say workers
        mapped more seqs of batches under way (a slow batch is progress, a stuck mapper is not). Waiting
        for a seq sent directly, say every 2 heartbeat intervals that it is missing (it may be lost).
        When nothing at all comes for 2 heartbeat intervals, ask who serves the address: a
        restarted server is asked for the epoch again from here (and this returns)."""
        timeout, server = self._session.timeout, self._server
        began = time.monotonic()
        deadline = began + timeout
        ask = deadline
        if self._direct and what == "progress":
            expected = self._reorder.expected(self._consumed)
            if self._awaited != expected:  # the wait for this seq begins now, not at every message
                self._awaited, self._ask_at = expected, began + MISSING_AFTER * server.interval
            ask = self._ask_at
        while True:
            try:
                decoded = self._session.inbox.next(self.run, min(deadline, ask, max(server.probe_at, began)))
            except Error as exc:
                self._raise(exc)
            if decoded is None:
                now = time.monotonic()
                if now >= deadline:
                    self._raise(server.timed_out(what, timeout, began, self.epoch, self._session.address))
                if now >= server.probe_at and self._restarted(deadline):
                    self._resume_run()
                    return
                if now >= ask:
                    self._missing()
                    ask = self._ask_at = now + MISSING_AFTER * server.interval
                continue
            msg = decoded.msg
            server.heard(time.monotonic())
            if isinstance(msg, protocol.Keepalive):
                server.keepalive(msg)
                mapped, self._mapped = msg.mapped > self._mapped, max(self._mapped, msg.mapped)
                if (msg.waits_on_readers or mapped) and what != "started":
                    deadline = server.at + timeout
                continue
            self._on(msg, decoded)
            return

    def _restarted(self, deadline: float) -> bool:
        """Nothing came for a while: ask `info` whose server answers at the address. True: another
        instance of the same config (a restart); another config is an error naming both."""
        session = self._session
        self._server.probes += 1
        try:
            info = session.probe(max(0.05, min(PROBE_WAIT_S, deadline - time.monotonic())))
        except Error as exc:
            self._raise(exc)
        self._server.probe_at = time.monotonic() + PROBE_EVERY_S
        if info is None:
            return False
        self._server.answered += 1
        if info.fingerprint != self.fingerprint:
            self._raise(
                Error(
                    f"the server at {session.address} restarted with another config: its fingerprint is "
                    f"{info.fingerprint!r}, epoch {self.epoch} was read with {self.fingerprint!r} (the config, "
                    "its values, the modules it uses, its data files or ppserver differ), so the rest of the epoch "
                    "would not be the same"
                )
            )
        return info.instance != self._instance

    def _resume_run(self) -> None:
        """Ask the restarted server for the epoch from this iterator's position, as a resume state
        would; what arrived of the old run and was not yielded yet is dropped (it comes again)."""
        session = self._session
        log.warning(
            "the server at %s restarted: asking for epoch %d again from seq %d of this shard",
            session.address,
            self.epoch,
            self.position,
        )
        session.inbox.drop(self.run)
        self._reorder.clear(self._reorder.expected(self._consumed))
        try:
            accepted = session.ask(
                self.epoch, self.position, self._seq_list, self._seq_order, self.fingerprint, self.batching or {}
            )
        except Error as exc:
            self._raise(exc)
        self.run, self._instance = accepted.run, accepted.instance
        session.inbox.open(self.run)
        self._base = self._consumed
        self._granted = self._told = 0
        self._done, self._end, self._started = False, None, False
        self._awaited = -1
        self._mapped = 0
        self.reconnects += 1
        self._wait_started()

    def _on(self, msg: protocol.Message, decoded: protocol.Decoded) -> None:
        if isinstance(msg, protocol.Started):
            if self.fingerprint and msg.fingerprint != self.fingerprint:
                self._raise(
                    Error(f"epoch {self.epoch} started with fingerprint {msg.fingerprint!r}, not {self.fingerprint!r}")
                )
            if not self._sized:  # the first run that started (an earlier one's server may have died before)
                self.num_seqs, self._sized = msg.num_seqs, True
            elif self.num_seqs is not None and msg.num_seqs != self.num_seqs - self._base:
                self._raise(
                    Error(
                        f"epoch {self.epoch}: the restarted server has {msg.num_seqs} seqs left for this iterator, "
                        f"not {self.num_seqs - self._base}"
                    )
                )
            self._started = True
            self.fingerprint = msg.fingerprint
            self.batching = msg.batching
            if self._session.window is None:
                self._window = BATCH_WINDOW if self.batching else WINDOW
        elif isinstance(msg, (protocol.Seqs, protocol.DirectSeqs)):
            if decoded.bad:
                self._raise(Error(f"epoch {self.epoch}: malformed seq from the server: {decoded.bad[0].reason}"))
            try:
                self._reorder.take(decoded.items, self._reorder.expected(self._consumed), self.epoch)
            except Error as exc:
                self._raise(exc)
        elif isinstance(msg, protocol.End):
            self._done = True
            self._end = msg.count
            arrived = self._consumed - self._base + len(self._reorder.buffer)
            if msg.count < arrived or (not self._direct and msg.count != arrived):
                self._raise(
                    Error(f"epoch {self.epoch} ended after {msg.count} seqs but {arrived} arrived (messages were lost)")
                )
            if self.num_seqs is not None and msg.count != self.num_seqs - self._base:
                self._raise(Error(f"epoch {self.epoch} ended after {msg.count} of {self.num_seqs - self._base} seqs"))
        elif isinstance(msg, protocol.RunFailed):
            self._done = True
            self._raise(self._failure(msg))
        elif isinstance(msg, protocol.Superseded):
            self._done = True
            self._raise(
                Superseded(f"epoch {self.epoch} was superseded by epoch {msg.epoch}, requested by another client")
            )

    def _failure(self, msg: protocol.RunFailed) -> Error:
        if msg.failure == protocol.FailureKind.MAPPER.value:
            return MapperError(msg.message, seq_tag=msg.seq_tag, remote_traceback=msg.traceback)
        if msg.failure == protocol.FailureKind.DATASET.value:
            return DatasetError(
                f"epoch {self.epoch} failed on the server: {msg.message}", remote_traceback=msg.traceback
            )
        if msg.failure == protocol.FailureKind.REQUEST.value:
            return Error(f"cannot start epoch {self.epoch}: {msg.message}")
        return Error(f"epoch {self.epoch} failed on the server: {msg.message}")

    def _missing(self) -> None:
        missing = protocol.Missing(run=self.run, pos=self._reorder.expected(self._consumed))
        try:
            self._sock.send_multipart([protocol.DELIMITER, *protocol.encode(missing)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass


class Reorder:
    """Seqs (or batches) by position until they are yielded, in order: direct results may come
    out of order, twice, or before the server's End; through the server they come in order.
    This reader's positions are `first`, then every `lanes`-th."""

    def __init__(self, first: int, lanes: int, direct: bool):
        self.first, self.lanes, self.direct = first, lanes, direct
        self.buffer: Dict[int, Union[Item, Batch]] = {}
        self.partial: Dict[int, List[Item]] = {}  # seqs of batches the server cut but did not pad, not all here yet
        self.arrived = first  # without direct results: the position the next message must have
        self.duplicates = 0  # seqs that came twice (a worker died after sending one) and were dropped

    def expected(self, consumed: int) -> int:
        """The position of the next seq to yield, after `consumed` of them."""
        return self.first + consumed * self.lanes

    def clear(self, arrived: Optional[int] = None) -> None:
        """Let go of what arrived (a new run: the next message from position `arrived` on)."""
        self.buffer.clear()
        if arrived is not None:
            self.partial.clear()
            self.arrived = arrived

    def take(self, items: List[Item], expected: int, epoch: int) -> None:
        """Into the buffer; duplicates and seqs already yielded are dropped. An Error if, without
        direct results, a seq is not the next one (messages were lost)."""
        for item in self._whole(items):
            pos = item.pos
            if not self.direct:
                if pos != self.arrived:
                    raise Error(
                        f"epoch {epoch}: expected the seq at position {self.arrived} but got {pos} "
                        "(messages were lost, e.g. on a reset connection)"
                    )
                self.arrived += self.lanes
            elif pos < expected or (pos - self.first) % self.lanes or pos in self.buffer:
                self.duplicates += 1
                continue
            self.buffer[pos] = item

    def _whole(self, items: List[Item]) -> Sequence[Union[Item, Batch]]:
        """The items, with the seqs of a batch the server cut but did not pad as one Batch once
        they are all here (they may come in several messages)."""
        if not any(item.batch is not None for item in items):
            return items
        out: List[Union[Item, Batch]] = []
        for item in items:
            if item.batch is None:
                out.append(item)
                continue
            seqs = self.partial.setdefault(item.batch, [])
            seqs.append(item)
            if len(seqs) >= (item.size or 1):
                out.append(Batch(item.batch, self.partial.pop(item.batch)))
        return out


class Silence:
    """What an iterator heard from its server, and when: a silence of KEEPALIVE_MISSES heartbeat
    intervals means the server is gone, or restarted (asked `info` from `probe_at` on)."""

    def __init__(self) -> None:
        self.at = 0.0  # when the last keepalive (or anything) came from the server
        self.probe_at = 0.0  # when to ask who serves the address, if nothing comes until then
        self.probes = 0  # `info` requests of the current silence, and how many were answered
        self.answered = 0
        self.interval = 1.0
        self.waiting_for = ""
        self.workers = 0

    def heard(self, now: float) -> None:
        """Something came from the server: it lives, and the next silence begins now."""
        self.at = now
        self.probe_at = now + KEEPALIVE_MISSES * self.interval + 0.25
        self.probes = self.answered = 0

    def keepalive(self, msg: protocol.Keepalive) -> None:
        self.interval, self.workers, self.waiting_for = msg.interval, msg.workers, msg.waiting_for
        self.probe_at = self.at + KEEPALIVE_MISSES * self.interval + 0.25

    def timed_out(self, what: str, timeout: float, began: float, epoch: int, address: str) -> Error:
        """Why a wait for `what` that began at `began` ended: alive means keepalives kept coming
        while we waited; else the server is gone."""
        silent = time.monotonic() - self.at
        if self.at < began or silent > KEEPALIVE_MISSES * self.interval + 0.25:
            if not self.probes:
                tried = ""
            elif self.answered:
                tried = f"; the server answers (asked {self.probes} times) but sends nothing of this epoch"
            else:
                tried = f"; tried {self.probes} times to reach a server there again, none answered"
            return ServerUnavailable(f"no data from {address} for {silent:.1f} s (epoch {epoch}){tried}")
        waiting = f"; waiting for {self.waiting_for}" if self.waiting_for else ""
        if what == "started":
            return Error(
                f"epoch {epoch} did not start within {timeout:g} s although the server at {address} is alive{waiting}"
            )
        return Error(
            f"epoch {epoch} made no progress for {timeout:g} s although the server at {address} "
            f"is alive ({self.workers} workers{waiting})"
        )

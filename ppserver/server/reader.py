"""The reader thread: the only code that calls the dataset once the server serves.

The I/O thread hands it commands (prepare a run's epoch, read these positions, read these
again for a stream partition, stop a run) and never waits for it; the reader hands back
scheduler events through a deque and wakes the I/O loop through a pipe (no ZeroMQ socket,
so a reader stuck inside the dataset cannot keep the server from shutting down).

A dataset holds one epoch's state at a time. Runs of the epoch it is set to are read side
by side (a job's run and a rank's solo run, say); a run of another epoch is set up once
every run of the current one has stopped reading. Preparing checks the request against the
dataset first (unknown seq tags, positions out of range) without touching the current
epoch, so a refused request disturbs nothing; RunChecked tells the scheduler it may now
let the requesting ranks leave their old runs.

A run that batches (map_seq) has batches for positions: the reader cuts its epoch (cut.py),
up front where the dataset knows every seq's length (`epoch_lengths`), else as it reads, and
hands each batch over as a Batch of its seqs once they are all read.

Every seq is handed over as soon as it is read (the loop batches what it finds waiting),
so a read that hangs never holds back the seqs read before it. The pipe is written once per
WAKE_EVERY seqs and whenever the reader stops: a wake-up hands the GIL to the loop, and once
per seq the two threads would spend more time passing it back and forth than reading.
While the reader reads, the loop polls at least every READING_POLL_MS.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from ppclient.batching import Batching
from ppclient.protocol import MAX_ITEM_HEADER_BYTES, Batch, Item, oversized_header, seq_to_item, short_tag
from ppserver.datasets.cut import Cutter, cut_epoch
from ppserver.scheduler import events as ev

log = logging.getLogger("ppserver.reader")

MAX_BATCH = 16  # seqs the loop takes from the reader as one event
WAKE_EVERY = 8  # seqs handed over per wake-up of the loop, at most
READING_POLL_MS = 10  # the loop's poll timeout while the reader reads
IDLE_WAIT_S = 0.1
BUSY_REPORT_S = 1.0  # how long a dataset call must take before status and keepalives mention it
DATASET_CALLS = ("get_seq", "init_seq_order", "check_epoch_args", "is_less_than_num_seqs", "epoch_lengths")

EpochArgs = Tuple[int, Optional[Tuple[str, ...]], Optional[Tuple[int, ...]]]


@dataclass(frozen=True)
class Prepare:
    run: int
    epoch: int
    seq_list: Optional[List[str]] = None
    seq_order: Optional[List[int]] = None
    batching: Optional[Batching] = None

    @property
    def args(self) -> EpochArgs:
        return (
            self.epoch,
            None if self.seq_list is None else tuple(self.seq_list),
            None if self.seq_order is None else tuple(self.seq_order),
        )


@dataclass(frozen=True)
class Read:
    run: int
    positions: List[int] = field(default_factory=list)


@dataclass(frozen=True)
class Replay:
    run: int
    partition: int
    ticket: int
    positions: List[int] = field(default_factory=list)


@dataclass(frozen=True)
class Stop:
    run: int


class InputRefused(Exception):
    """A seq read from the dataset that no worker could take: its run fails naming it."""


def input_item(seq: Any, pos: int) -> Item:
    """A seq as an input to send. One whose header (its seq_tag, meta entries and array specs)
    could not travel in a message is refused here: a worker would have to drop it."""
    item = seq_to_item(seq, pos)
    size = oversized_header(item)
    if size is not None:
        tag = short_tag(item.seq_tag)
        raise InputRefused(
            f"seq {tag if tag is not None else f'#{pos}'!r} (position {pos}) cannot be sent to a worker: its header "
            f"(seq_tag, meta entries and array specs) is {size} bytes, more than {MAX_ITEM_HEADER_BYTES}"
        )
    return item


class Mailbox:
    """Commands from the I/O thread to the reader. A put wakes the reader only when it waits:
    while it reads, it looks at the deque between seqs, and waking a thread costs a system call
    (on a virtual machine, often more than reading a small seq)."""

    def __init__(self) -> None:
        self._items: Deque[Any] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._waiting = False

    def put(self, item: Any) -> None:
        self._items.append(item)
        if self._waiting:  # read after the append: a reader about to wait sees the item first
            with self._cond:
                self._cond.notify()

    def empty(self) -> bool:
        return not self._items

    def get(self, timeout: float) -> Any:
        """The next command; raises IndexError if none came within `timeout`."""
        items = self._items
        if not items:
            with self._cond:
                self._waiting = True
                try:
                    if not items:
                        self._cond.wait(timeout)
                finally:
                    self._waiting = False
        return items.popleft()


class _Cut:
    """A batched run's batches: cut up front (`lengths` known), or as its seqs are read."""

    def __init__(self, batching: Batching, lengths: Optional[Any], length: Callable[[Dict[str, Any]], int]):
        self.batches: List[List[int]] = [] if lengths is None else cut_epoch(lengths, batching)
        self.cutter: Optional[Cutter] = None if lengths is not None else Cutter(batching)
        self.length = length  # of a read seq, for the cut
        self.next_seq = 0  # the next seq to read, cutting as it goes
        self.read: Dict[int, Item] = {}  # seqs read whose batch was neither handed over nor dropped
        self.low = 0  # the first batch whose read seqs may still be in `read`
        self.ended = lengths is not None  # every batch is known

    @property
    def up_front(self) -> bool:
        return self.cutter is None


class Reader(threading.Thread):
    def __init__(
        self,
        dataset: Any,
        batch_length: Optional[Callable[[Dict[str, Any]], Any]] = None,
        length_key: Optional[str] = None,
    ):
        super().__init__(name="reader", daemon=True)
        self.dataset = dataset
        self.batch_length = batch_length  # the config's: a read seq's length for the cut
        self.length_key = length_key  # the inputs' key whose first axis is a seq's length, by default
        self.commands = Mailbox()
        # appended here, popped by the loop (deque ops are atomic): events, and (run, item) for each input
        self.out: Deque[Any] = deque()
        self.woken = False  # a wake-up byte is in the pipe and the loop has not taken events since
        self.unannounced = 0  # seqs handed over since the last wake-up
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.quit = threading.Event()
        self.busy: Optional[Tuple[str, Any, float]] = None  # the dataset call under way, its argument, since when
        # time inside each dataset call and how many returned (written here only; status and metrics read them)
        self.seconds: Dict[str, float] = dict.fromkeys(DATASET_CALLS, 0.0)
        self.calls: Dict[str, int] = dict.fromkeys(DATASET_CALLS, 0)
        self.epoch_args: Optional[EpochArgs] = None  # what the dataset is set up for
        self.runs: Dict[int, Deque[int]] = {}  # runs of that epoch and the positions they asked for
        self.waiting: Deque[Prepare] = deque()  # runs of another epoch, checked, waiting for these to stop
        self.replays: Deque[Replay] = deque()
        self.ends: Dict[int, int] = {}  # runs whose epoch ended (count learnt by reading) -> the count
        self.cuts: Dict[int, _Cut] = {}  # runs that batch: their batches
        self.rr = 0

    # ---- the I/O thread's side ------------------------------------------------------------
    def send(self, command: Any) -> None:
        self.commands.put(command)

    def take(self, now: float) -> Optional[ev.Event]:
        """The next event; inputs of one run read one after the other come as one (up to MAX_BATCH)."""
        out = self.out
        try:
            first = out.popleft()
        except IndexError:
            return None
        if isinstance(first, ev.Event):
            return first
        run, item = first
        items = [item]
        while len(items) < MAX_BATCH and out and type(out[0]) is tuple and out[0][0] == run:
            items.append(out.popleft()[1])
        return ev.InputsRead(now, run, items)

    def drain_wakeups(self) -> None:
        """Call before take(): a hand-over after this writes a new wake-up. The pipe is emptied
        first: a hand-over in between finds `woken` still set, and take() sees it."""
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        self.woken = False

    @property
    def reading(self) -> bool:
        """Reading inputs the loop may not have been woken for: it should look in every few ms."""
        return self.unannounced > 0 or any(self.runs.values())

    def describe_busy(self, now: float) -> str:
        busy = self.busy
        if busy is None or now - busy[2] < BUSY_REPORT_S:
            return ""
        what, arg, since = busy
        return f"in {what}({arg}) for {now - since:.1f} s"

    def stop(self, timeout: float) -> bool:
        """Ask the thread to end; True if it did within `timeout` (it may be stuck in the dataset)."""
        self.quit.set()
        self.commands.put(None)
        self.join(timeout)
        alive = self.is_alive()
        if not alive:
            os.close(self.wake_r)
            os.close(self.wake_w)
        return not alive

    # ---- the reader's side ----------------------------------------------------------------
    def _emit(self, event: ev.Event) -> None:
        self.out.append(event)
        self._wake()

    def _wake(self) -> None:
        self.unannounced = 0
        if self.woken:
            return  # the loop will see this event with the ones it was woken for
        self.woken = True
        try:
            os.write(self.wake_w, b"x")
        except BlockingIOError:
            pass  # wake-ups are pending already

    def _call(self, what: str, arg: Any, fn: Any, *args: Any) -> Any:
        since = time.monotonic()
        self.busy = (what, arg, since)
        try:
            return fn(*args)
        finally:
            self.busy = None
            self.seconds[what] += time.monotonic() - since
            self.calls[what] += 1

    def run(self) -> None:
        while not self.quit.is_set():
            try:
                self._step()
            except Exception:  # a bug here must not end the thread silently
                log.exception("reader step failed")
                for run in list(self.runs):
                    self._emit(
                        ev.ReadFailed(time.monotonic(), run, "internal error in the reader", traceback.format_exc())
                    )
                self.runs.clear()

    def _step(self) -> None:
        if not self.commands.empty() or (not self.replays and not self._can_read()):
            try:
                command = self.commands.get(timeout=IDLE_WAIT_S)
            except IndexError:
                return
            if command is not None:
                self._apply(command)
            return
        if self.replays:
            self._replay(self.replays.popleft())
        else:
            self._read_next()

    def _apply(self, command: Any) -> None:
        if isinstance(command, Prepare):
            self._prepare(command)
        elif isinstance(command, Read):
            if command.run in self.runs:
                end = self.ends.get(command.run)
                self.runs[command.run].extend(p for p in command.positions if end is None or p < end)
        elif isinstance(command, Replay):
            if command.run in self.runs:
                self.replays.append(command)
        elif isinstance(command, Stop):
            self._stop_run(command.run)

    def _stop_run(self, run: int) -> None:
        self.runs.pop(run, None)
        self.ends.pop(run, None)
        self.cuts.pop(run, None)
        self.waiting = deque(p for p in self.waiting if p.run != run)
        self.replays = deque(r for r in self.replays if r.run != run)
        while self.waiting and (not self.runs or self.waiting[0].args == self.epoch_args):
            self._start(self.waiting.popleft())

    def _can_read(self) -> bool:
        return any(self.runs.values())

    def _prepare(self, cmd: Prepare) -> None:
        check = getattr(self.dataset, "check_epoch_args", None)
        if check is not None:
            try:
                self._call("check_epoch_args", f"epoch={cmd.epoch}", check, cmd.epoch, cmd.seq_list, cmd.seq_order)
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                self._emit(ev.RunRejected(time.monotonic(), cmd.run, _message(exc)))
                return
            except Exception as exc:  # a bug in the dataset: this run fails, nothing else does
                log.exception("the dataset failed to check the request for epoch %d", cmd.epoch)
                self._emit(
                    ev.ReadFailed(
                        time.monotonic(),
                        cmd.run,
                        f"the dataset failed to check the request: {_message(exc)}",
                        traceback.format_exc(),
                    )
                )
                return
        self._emit(ev.RunChecked(time.monotonic(), cmd.run))
        if cmd.args == self.epoch_args or not self.runs:
            self._start(cmd)
        else:
            self.waiting.append(cmd)  # the dataset holds another epoch until its runs stop reading

    def _start(self, cmd: Prepare) -> None:
        if cmd.args != self.epoch_args:
            self.epoch_args = None
            try:
                self._call(
                    "init_seq_order",
                    f"epoch={cmd.epoch}",
                    self.dataset.init_seq_order,
                    cmd.epoch,
                    cmd.seq_list,
                    cmd.seq_order,
                )
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                self._emit(ev.RunRejected(time.monotonic(), cmd.run, _message(exc)))
                return
            except Exception as exc:
                log.exception("the dataset failed to set up epoch %d", cmd.epoch)
                self._emit(
                    ev.ReadFailed(
                        time.monotonic(),
                        cmd.run,
                        f"the dataset failed to set up epoch {cmd.epoch}: {_message(exc)}",
                        traceback.format_exc(),
                    )
                )
                return
            self.epoch_args = cmd.args
        num_seqs = self.dataset.num_seqs
        count = None if num_seqs is None else int(num_seqs)
        if cmd.batching is not None:
            try:
                cut = self._cut(cmd.batching)
            except Exception as exc:
                log.exception("cutting epoch %d into batches failed", cmd.epoch)
                self._emit(
                    ev.ReadFailed(
                        time.monotonic(),
                        cmd.run,
                        f"cutting epoch {cmd.epoch} failed: {_message(exc)}",
                        traceback.format_exc(),
                    )
                )
                return
            self.cuts[cmd.run] = cut
            count = len(cut.batches) if cut.up_front else None
        self.runs[cmd.run] = deque()
        self._emit(ev.RunStarted(time.monotonic(), cmd.run, cmd.epoch, count, check_tags=cmd.seq_list is not None))

    def _cut(self, batching: Batching) -> _Cut:
        """The epoch's batches: up front when the dataset knows the lengths (and no config function
        decides them), else as the seqs are read."""
        key = batching.length_key or self.length_key
        lengths = None
        known = getattr(self.dataset, "epoch_lengths", None)
        if self.batch_length is None and known is not None and key is not None:
            lengths = self._call("epoch_lengths", key, known, key)
        return _Cut(batching, lengths, self._length_of(key))

    def _length_of(self, key: Optional[str]) -> Callable[[Dict[str, Any]], int]:
        fn = self.batch_length
        if fn is not None:
            return lambda seq: _checked_length(fn(seq), "batch_length(seq)")

        def length(seq: Dict[str, Any]) -> int:
            array = seq.get(key) if key is not None else None
            if array is None:
                raise KeyError(f"the seq has no array {key!r}, the batching's length_key")
            return int(array.shape[0]) if getattr(array, "ndim", 0) else 1

        return length

    def _read_one(self, pos: int) -> Item:
        return input_item(self._call("get_seq", pos, self.dataset.get_seq, pos), pos)

    def _refused(self, run: int, exc: InputRefused) -> None:
        """A seq no worker could take fails its run at once (a DatasetError in the client)."""
        log.error("run %d: %s", run, exc)
        self._emit(ev.ReadFailed(time.monotonic(), run, str(exc)))
        self.runs.pop(run, None)

    def _read_next(self) -> None:
        """Read the runs' positions in turn until a command waits (the hot loop: kept lean)."""
        runs = [r for r, q in self.runs.items() if q]
        run = runs[self.rr % len(runs)]
        self.rr += 1
        if run in self.cuts:
            self._read_batch(run)
            return
        positions = self.runs[run]
        get_seq, commands, out, monotonic = self.dataset.get_seq, self.commands, self.out, time.monotonic
        seconds, calls = self.seconds, self.calls
        counted = self.dataset.num_seqs is not None
        try:
            while positions:
                pos = positions[0]
                if not counted and not self._call(
                    "is_less_than_num_seqs", pos, self.dataset.is_less_than_num_seqs, pos
                ):
                    positions.clear()  # the epoch ends here
                    self.ends[run] = pos
                    self._emit(ev.InputsEnded(monotonic(), run, pos))
                    break
                since = monotonic()
                self.busy = ("get_seq", pos, since)
                seq = get_seq(pos)
                self.busy = None
                seconds["get_seq"] += monotonic() - since
                calls["get_seq"] += 1
                item = input_item(seq, pos)
                positions.popleft()
                out.append((run, item))
                self.unannounced += 1
                if self.unannounced >= WAKE_EVERY:
                    self._wake()
                if not commands.empty() or len(runs) > 1:
                    break
        except InputRefused as exc:
            self._refused(run, exc)
            return
        except Exception as exc:
            self.busy = None
            log.exception("reading the dataset failed in run %d", run)
            self._emit(ev.ReadFailed(monotonic(), run, f"dataset failed: {_message(exc)}", traceback.format_exc()))
            self.runs.pop(run, None)
            return
        if self.unannounced and not any(self.runs.values()):
            self._wake()

    def _read_batch(self, run: int) -> None:
        """Read the next batch asked for of a batched run and hand it over."""
        positions, cut = self.runs[run], self.cuts[run]
        index = positions[0]
        try:
            while index >= len(cut.batches) and not cut.ended:
                if not self._cut_next(run, cut):
                    return  # a command waits: go on later
            if index >= len(cut.batches):  # the epoch has fewer batches
                positions.clear()
                self.ends[run] = len(cut.batches)
                self._emit(ev.InputsEnded(time.monotonic(), run, len(cut.batches)))
                return
            items = self._read_seqs(cut, cut.batches[index])
        except InputRefused as exc:
            self.busy = None
            self._refused(run, exc)
            return
        except Exception as exc:
            self.busy = None
            log.exception("reading the dataset failed in run %d", run)
            self._emit(ev.ReadFailed(time.monotonic(), run, f"dataset failed: {_message(exc)}", traceback.format_exc()))
            self.runs.pop(run, None)
            return
        for low in range(cut.low, index):  # batches passed over (no one wants them): their seqs go
            for pos in cut.batches[low]:
                cut.read.pop(pos, None)
        cut.low = index + 1
        for item in items:
            item.batch, item.size = index, len(items)
        positions.popleft()
        self.out.append((run, Batch(index, items)))
        self._wake()

    def _read_seqs(self, cut: _Cut, positions: List[int]) -> List[Item]:
        """A batch's seqs: read as the cut went along, or read now (a batch cut up front; the
        hot loop of batching: kept lean)."""
        read, get_seq, monotonic = cut.read, self.dataset.get_seq, time.monotonic
        items = []
        since = monotonic()
        for pos in positions:
            item = read.pop(pos, None)
            if item is None:
                self.busy = ("get_seq", pos, since)
                item = input_item(get_seq(pos), pos)
                self.calls["get_seq"] += 1
            items.append(item)
        self.busy = None
        self.seconds["get_seq"] += monotonic() - since
        return items

    def _cut_next(self, run: int, cut: _Cut) -> bool:
        """Read one more seq and cut; False if a command waits (the batch is finished later)."""
        pos = cut.next_seq
        num_seqs = self.dataset.num_seqs
        there = (
            pos < num_seqs
            if num_seqs is not None
            else self._call("is_less_than_num_seqs", pos, self.dataset.is_less_than_num_seqs, pos)
        )
        assert cut.cutter is not None
        if not there:
            cut.batches += cut.cutter.finish()
            cut.ended = True
            return True
        seq = self._call("get_seq", pos, self.dataset.get_seq, pos)
        length = cut.length(seq)
        cut.read[pos] = input_item(seq, pos)
        cut.next_seq += 1
        cut.batches += cut.cutter.add(pos, length)
        return self.commands.empty()

    def _replay(self, cmd: Replay) -> None:
        try:
            items = [self._read_one(pos) for pos in cmd.positions]
        except InputRefused as exc:
            self._refused(cmd.run, exc)
            return
        except Exception as exc:
            log.error("re-reading inputs for stream partition %d failed: %s", cmd.partition, exc)
            self._emit(
                ev.ReadFailed(
                    time.monotonic(),
                    cmd.run,
                    f"dataset failed while replaying partition {cmd.partition}: {_message(exc)}",
                    traceback.format_exc(),
                )
            )
            self.runs.pop(cmd.run, None)
            return
        self._emit(ev.ReplayRead(time.monotonic(), cmd.run, cmd.partition, cmd.ticket, items))


def _checked_length(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        try:
            import numpy

            if isinstance(value, numpy.integer) and value >= 0:
                return int(value)
        except ImportError:
            pass
        raise ValueError(f"{what} must return an int >= 0, got {value!r:.60}")
    return value


def _message(exc: BaseException) -> str:
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, (ValueError, KeyError, IndexError)) else str(text)

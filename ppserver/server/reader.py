"""The reader thread: the only code that calls the dataset once the server serves.

The I/O thread hands it the scheduler's reading instructions as they are (Prepare a run's
epoch, Read these positions, Replay these for a stream partition, StopReading a run) and
never waits for it; the reader hands back scheduler events (handover.py).

A dataset holds one epoch's state at a time. Runs of the epoch it is set to are read side
by side (a job's run and a rank's solo run, say); a run of another epoch is set up once
every run of the current one has stopped reading. Preparing checks the request against the
dataset first (unknown seq tags, positions out of range) without touching the current
epoch, so a refused request disturbs nothing; RunChecked tells the scheduler it may now
let the requesting ranks leave their old runs.

A run that batches (map_seq) has batches for positions: the reader cuts its epoch (cutting.py),
up front where the dataset knows every seq's length (`epoch_lengths`) and, for max_duration,
duration (`epoch_durations`), else as it reads (keeping lengths, reading a batch's seqs again
when it is due), and hands each batch over as a Batch of its seqs, each carrying the batch's
complete_frac.

Every seq is handed over as soon as it is read (the loop batches what it finds waiting),
so a read that hangs never holds back the seqs read before it. While the reader reads, the
loop polls at least every READING_POLL_MS.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from ppclient.batching import Batching
from ppclient.protocol import MAX_ITEM_HEADER_BYTES, Batch, Item, oversized_header, seq_to_item, short_tag
from ppserver.scheduler import Instruction, Prepare, Read, Replay, StopReading
from ppserver.scheduler import events as ev
from ppserver.server.cutting import BatchedRun, checked_durations, seq_duration, seq_length
from ppserver.server.handover import Mailbox, Outbox
from ppserver.server.shards import Contiguous

log = logging.getLogger("ppserver.reader")

READING_POLL_MS = 10  # the loop's poll timeout while the reader reads
IDLE_WAIT_S = 0.1
BUSY_REPORT_S = 1.0  # how long a dataset call must take before status and keepalives mention it
DATASET_CALLS = (
    "get_seq",
    "init_seq_order",
    "check_epoch_args",
    "is_less_than_num_seqs",
    "epoch_lengths",
    "epoch_durations",
)
REFUSALS = (ValueError, KeyError, IndexError, TypeError)  # what a dataset raises for a request it refuses

CONTIGUOUS_NEEDS = (
    "sharding 'contiguous' needs a dataset that reads any position and knows its count up front "
    "(this one reads forward only, or learns its count by reading): use sharding 'strided'"
)

EpochArgs = Tuple[int, Optional[Tuple[str, ...]], Optional[Tuple[int, ...]]]


def epoch_args(cmd: Prepare) -> EpochArgs:
    """What a run asks the dataset to be set up for: runs that ask the same are read side by side."""
    seq_list = None if cmd.seq_list is None else tuple(cmd.seq_list)
    return cmd.epoch, seq_list, None if cmd.seq_order is None else tuple(cmd.seq_order)


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


class Reader(threading.Thread):
    def __init__(
        self,
        dataset: Any,
        batch_length: Optional[Callable[[Dict[str, Any]], Any]] = None,
        length_key: Optional[str] = None,
        batch_duration: Optional[Callable[[Dict[str, Any]], Any]] = None,
    ):
        super().__init__(name="reader", daemon=True)
        self.dataset = dataset
        self.batch_length = batch_length  # the config's: a read seq's length for the cut
        self.length_key = length_key  # the inputs' key whose first axis is a seq's length, by default
        self.batch_duration = batch_duration  # the config's: a read seq's duration for the cut
        self.commands = Mailbox()
        self.outbox = Outbox()
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
        self.batched: Dict[int, BatchedRun] = {}  # runs that batch: their batches
        self.contiguous: Dict[int, Contiguous] = {}  # runs of contiguous shards: their positions (shards.py)
        self.rr = 0
        self._apply: Dict[type, Callable[[Any], None]] = {
            Prepare: self._prepare,
            Read: self._read,
            Replay: self._replay_later,
            StopReading: lambda cmd: self._stop_run(cmd.run),
        }

    # ---- the I/O thread's side ------------------------------------------------------------
    def send(self, instruction: Instruction) -> None:
        """One of the scheduler's reading instructions: Prepare, Read, Replay or StopReading."""
        self.commands.put(instruction)

    @property
    def reading(self) -> bool:
        """Reading inputs the loop may not have been woken for: it should look in every few ms."""
        return self.outbox.unannounced > 0 or any(self.runs.values())

    def describe_busy(self, now: float) -> Optional[str]:
        """The dataset call under way in words, once it has taken BUSY_REPORT_S (None before)."""
        busy = self.busy
        if busy is None or now - busy[2] < BUSY_REPORT_S:
            return None
        what, arg, since = busy
        return f"in {what}({arg}) for {now - since:.1f} s"

    def stop(self, timeout: float) -> bool:
        """Ask the thread to end; True if it did within `timeout` (it may be stuck in the dataset)."""
        self.quit.set()
        self.commands.put(None)
        self.join(timeout)
        alive = self.is_alive()
        if not alive:
            self.outbox.close()
        return not alive

    # ---- the reader's side ----------------------------------------------------------------
    def _emit(self, event: ev.Event) -> None:
        self.outbox.emit(event)

    def _call(self, what: str, arg: Any, fn: Any, *args: Any) -> Any:
        since = time.monotonic()
        self.busy = (what, arg, since)
        try:
            return fn(*args)
        finally:
            self.busy = None
            self.seconds[what] += time.monotonic() - since
            self.calls[what] += 1

    def _failed(self, run: int, what: str, exc: BaseException) -> None:
        """A dataset call (or a bug here) failed: the run fails with a DatasetError, nothing else does."""
        self.busy = None
        log.exception("run %d: %s", run, what)
        self._emit(ev.ReadFailed(time.monotonic(), run, f"{what}: {_message(exc)}", traceback.format_exc()))
        self.runs.pop(run, None)

    def _refused(self, run: int, exc: InputRefused) -> None:
        """A seq no worker could take fails its run at once (a DatasetError in the client)."""
        self.busy = None
        log.error("run %d: %s", run, exc)
        self._emit(ev.ReadFailed(time.monotonic(), run, str(exc)))
        self.runs.pop(run, None)

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
        if not self.commands.empty() or (not self.replays and not any(self.runs.values())):
            try:
                command = self.commands.get(timeout=IDLE_WAIT_S)
            except IndexError:
                return
            if command is not None:
                self._apply[type(command)](command)
            return
        if self.replays:
            self._replay(self.replays.popleft())
        else:
            self._read_next()

    def _read(self, cmd: Read) -> None:
        if cmd.run in self.runs:
            end = self.ends.get(cmd.run)
            self.runs[cmd.run].extend(p for p in cmd.positions if end is None or p < end)

    def _replay_later(self, cmd: Replay) -> None:
        if cmd.run in self.runs:
            self.replays.append(cmd)

    def _stop_run(self, run: int) -> None:
        self.runs.pop(run, None)
        self.ends.pop(run, None)
        self.batched.pop(run, None)
        self.contiguous.pop(run, None)
        self.waiting = deque(p for p in self.waiting if p.run != run)
        self.replays = deque(r for r in self.replays if r.run != run)
        while self.waiting and (not self.runs or epoch_args(self.waiting[0]) == self.epoch_args):
            self._start(self.waiting.popleft())

    # ---- a run's epoch --------------------------------------------------------------------
    def _epoch_call(self, cmd: Prepare, what: str, failure: str, fn: Callable) -> bool:
        """check_epoch_args or init_seq_order for the run's epoch: the dataset refusing the request
        rejects the run (its client gets a UsageError), any other failure fails it."""
        try:
            self._call(what, f"epoch={cmd.epoch}", fn, cmd.epoch, cmd.seq_list, cmd.seq_order)
        except REFUSALS as exc:
            self._emit(ev.RunRejected(time.monotonic(), cmd.run, _message(exc)))
            return False
        except Exception as exc:
            self._failed(cmd.run, failure, exc)
            return False
        return True

    def _prepare(self, cmd: Prepare) -> None:
        check = getattr(self.dataset, "check_epoch_args", None)
        if check is not None and not self._epoch_call(
            cmd, "check_epoch_args", "the dataset failed to check the request", check
        ):
            return
        if cmd.contiguous is not None and not getattr(self.dataset, "random_access", True):
            self._emit(ev.RunRejected(time.monotonic(), cmd.run, CONTIGUOUS_NEEDS))
            return
        self._emit(ev.RunChecked(time.monotonic(), cmd.run))
        if epoch_args(cmd) == self.epoch_args or not self.runs:
            self._start(cmd)
        else:
            self.waiting.append(cmd)  # the dataset holds another epoch until its runs stop reading

    def _start(self, cmd: Prepare) -> None:
        args = epoch_args(cmd)
        if args != self.epoch_args:
            self.epoch_args = None
            failure = f"the dataset failed to set up epoch {cmd.epoch}"
            if not self._epoch_call(cmd, "init_seq_order", failure, self.dataset.init_seq_order):
                return
            self.epoch_args = args
        num_seqs = self.dataset.num_seqs
        count = seqs = None if num_seqs is None else int(num_seqs)
        if cmd.contiguous is not None:
            if count is None:
                self._failed(cmd.run, "contiguous shards", ValueError(CONTIGUOUS_NEEDS))
                return
            self.contiguous[cmd.run] = Contiguous(count, cmd.contiguous)
        if cmd.batching is not None:
            try:
                batched = self._batched(cmd.batching)
            except Exception as exc:
                self._failed(cmd.run, f"cutting epoch {cmd.epoch} failed", exc)
                return
            self.batched[cmd.run] = batched
            count = len(batched.batches) if batched.up_front else None
        self.runs[cmd.run] = deque()
        self._emit(
            ev.RunStarted(time.monotonic(), cmd.run, cmd.epoch, count, check_tags=cmd.seq_list is not None, seqs=seqs)
        )

    def _batched(self, batching: Batching) -> BatchedRun:
        """The epoch's batches: up front when the dataset knows the measures the cut uses (and no
        config function decides them), else as the seqs are read."""
        key = batching.length_key or self.length_key
        lengths = durations = None
        known = getattr(self.dataset, "epoch_lengths", None)
        if self.batch_length is None and known is not None and key is not None:
            lengths = self._call("epoch_lengths", key, known, key)
        if batching.max_duration is not None and self.batch_duration is None:
            epoch_durations = getattr(self.dataset, "epoch_durations", None)
            if epoch_durations is not None:
                durations = self._call("epoch_durations", "", epoch_durations)
            if durations is None:
                raise ValueError("the dataset gives no seq durations for max_duration (its seq_durations() is None)")
            durations = checked_durations(durations, self.dataset.num_seqs)
        return BatchedRun(
            batching,
            lengths,
            seq_length(self.batch_length, key),
            durations,
            seq_duration(self.batch_duration, durations),
        )

    # ---- reading --------------------------------------------------------------------------
    def _read_next(self) -> None:
        """Read the runs' positions in turn until a command waits (the hot loop: kept lean)."""
        runs = [r for r, q in self.runs.items() if q]
        run = runs[self.rr % len(runs)]
        self.rr += 1
        try:
            if run in self.batched:
                self._read_batch(run)
            else:
                self._read_seqs(run, len(runs) > 1)
        except InputRefused as exc:
            self._refused(run, exc)
            return
        except Exception as exc:
            self._failed(run, "dataset failed", exc)
            return
        if self.outbox.unannounced and not any(self.runs.values()):
            self.outbox.wake()

    def _read_seqs(self, run: int, others: bool) -> None:
        """Read the run's positions until a command waits or (`others`) another run gets its turn."""
        positions = self.runs[run]
        get_seq, commands, outbox, monotonic = self.dataset.get_seq, self.commands, self.outbox, time.monotonic
        seconds, calls = self.seconds, self.calls
        counted = self.dataset.num_seqs is not None
        shards = self.contiguous.get(run)
        while positions:
            pos = positions[0]
            if not counted and not self._call("is_less_than_num_seqs", pos, self.dataset.is_less_than_num_seqs, pos):
                positions.clear()  # the epoch ends here
                self.ends[run] = pos
                self._emit(ev.InputsEnded(monotonic(), run, pos))
                return
            since = monotonic()
            self.busy = ("get_seq", pos, since)
            seq = get_seq(pos) if shards is None else shards.served(pos, get_seq(shards.epoch_pos(pos)))
            self.busy = None
            seconds["get_seq"] += monotonic() - since
            calls["get_seq"] += 1
            item = input_item(seq, pos)
            positions.popleft()
            outbox.put(run, item)
            if not commands.empty() or others:
                return

    def _read_batch(self, run: int) -> None:
        """Read the next batch asked for of a batched run and hand it over."""
        positions, batched = self.runs[run], self.batched[run]
        index = positions[0]
        while index >= len(batched.batches) and not batched.ended:
            if not self._cut_next(batched):
                return  # a command waits: go on later
        if index >= len(batched.batches):  # the epoch has fewer batches
            positions.clear()
            self.ends[run] = len(batched.batches)
            self._emit(ev.InputsEnded(time.monotonic(), run, len(batched.batches), seqs=batched.next_seq))
            return
        items = self._batch_seqs(batched, batched.batches[index])
        batched.passed(index)
        frac = self._reach_frac(batched, index, items)
        for item in items:
            item.batch, item.size = index, len(items)
            if frac is not None:
                item.meta["complete_frac"] = frac
        positions.popleft()
        self.outbox.put(run, Batch(index, items))
        self.outbox.wake()

    def _batch_seqs(self, batched: BatchedRun, positions: List[int]) -> List[Item]:
        """A batch's seqs: read as the cut went along, or read now (a batch cut up front; the
        hot loop of batching: kept lean)."""
        read, get_seq, monotonic = batched.read, self.dataset.get_seq, time.monotonic
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

    def _reach_frac(self, batched: BatchedRun, index: int, items: List[Item]) -> Any:
        """Batch `index`'s complete_frac: that of the furthest seq of the epoch in it or a batch
        before it (cutting.py), so a sorted window never sends it back. That seq is in the batch,
        or it was the previous batch's; a run that skips batches (a rank's solo run) reads it."""
        pos = batched.reach[index]
        for item in items:
            if item.pos == pos:
                frac = item.meta.get("complete_frac")
                break
        else:
            if batched.frac is not None and batched.frac[0] == pos:
                frac = batched.frac[1]
            else:
                frac = self._call("get_seq", pos, self.dataset.get_seq, pos).get("complete_frac")
        batched.frac = (pos, frac)
        return frac

    def _cut_next(self, batched: BatchedRun) -> bool:
        """Read one more seq and cut; False if a command waits (the batch is finished later)."""
        pos = batched.next_seq
        num_seqs = self.dataset.num_seqs
        there = (
            pos < num_seqs
            if num_seqs is not None
            else self._call("is_less_than_num_seqs", pos, self.dataset.is_less_than_num_seqs, pos)
        )
        if not there:
            batched.finish()
            return True
        seq = self._call("get_seq", pos, self.dataset.get_seq, pos)
        length, duration = batched.length(seq), batched.duration(pos, seq)
        batched.add(pos, input_item(seq, pos), length, duration)
        return self.commands.empty()

    def _replay(self, cmd: Replay) -> None:
        try:
            items = [input_item(self._call("get_seq", pos, self.dataset.get_seq, pos), pos) for pos in cmd.positions]
        except InputRefused as exc:
            self._refused(cmd.run, exc)
            return
        except Exception as exc:
            self._failed(cmd.run, f"dataset failed while replaying partition {cmd.partition}", exc)
            return
        self._emit(ev.ReplayRead(time.monotonic(), cmd.run, cmd.partition, cmd.ticket, items))


def _message(exc: BaseException) -> str:
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, (ValueError, KeyError, IndexError)) else str(text)

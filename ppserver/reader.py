"""The reader thread: the only code that calls the dataset once the server serves.

The I/O thread hands it commands (prepare an epoch, read up to a position, read some
positions again, stop a run) and never waits for it; the reader hands back scheduler
events through a deque and wakes the I/O loop through a pipe (no ZeroMQ socket, so a
reader stuck inside the dataset cannot keep the server from shutting down). Every seq is
handed over as soon as it is read (the loop batches what it finds waiting), so a read that
hangs never holds back the seqs read before it. The pipe is written once per WAKE_EVERY
seqs and whenever the reader stops (its window is read, or it waits for a command): a
wake-up hands the GIL to the loop, and once per seq the two threads would spend more time
passing it back and forth than reading. While the reader is reading, the loop polls at
least every READING_POLL_MS, so a seq never waits longer than that for it.

Preparing an epoch checks the request against the dataset first (unknown seq tags, bad
seq_order), so a rejected request never disturbs the run being read; only a request that
checks replaces that run, and if setting it up then fails, the replaced run fails too
(the dataset holds one epoch's state at a time).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, List, Optional, Tuple

from ppclient.protocol import Item, seq_to_item

from .scheduler import events as ev

log = logging.getLogger("ppserver.reader")

MAX_BATCH = 16  # seqs the loop takes from the reader as one event
WAKE_EVERY = 8  # seqs handed over per wake-up of the loop, at most
READING_POLL_MS = 10  # the loop's poll timeout while the reader reads
IDLE_WAIT_S = 0.1
BUSY_REPORT_S = 1.0  # how long a dataset call must take before status and keepalives mention it


@dataclass(frozen=True)
class Prepare:
    run: int
    epoch: int
    seq_list: Optional[List[str]] = None
    seq_order: Optional[List[int]] = None


@dataclass(frozen=True)
class ReadUpTo:
    run: int
    upto: int


@dataclass(frozen=True)
class Replay:
    run: int
    partition: int
    ticket: int
    positions: List[int] = field(default_factory=list)


@dataclass(frozen=True)
class Stop:
    run: int


class Reader(threading.Thread):
    def __init__(self, dataset: Any):
        super().__init__(name="reader", daemon=True)
        self.dataset = dataset
        self.commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # appended here, popped by the loop (deque ops are atomic): events, and (run, item) for each input
        self.out: Deque[Any] = deque()
        self.woken = False  # a wake-up byte is in the pipe and the loop has not taken events since
        self.unannounced = 0  # seqs handed over since the last wake-up
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.quit = threading.Event()
        self.busy: Optional[Tuple[str, Any, float]] = None  # the dataset call under way, its argument, since when
        self.run_id: Optional[int] = None  # the run being read
        self.num_seqs = 0
        self.next_pos = 0
        self.upto = 0
        self.ended = False
        self.replays: Deque[Replay] = deque()

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
        """Call before take(): a hand-over after this writes a new wake-up."""
        self.woken = False
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    @property
    def reading(self) -> bool:
        """Reading inputs the loop may not have been woken for: it should look in every few ms."""
        return self.unannounced > 0 or (self.run_id is not None and self.next_pos < min(self.upto, self.num_seqs))

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
        self.busy = (what, arg, time.monotonic())
        try:
            return fn(*args)
        finally:
            self.busy = None

    def run(self) -> None:
        while not self.quit.is_set():
            try:
                self._step()
            except Exception:  # a bug here must not end the thread silently
                log.exception("reader step failed")
                if self.run_id is not None:
                    self._emit(
                        ev.ReadFailed(
                            time.monotonic(), self.run_id, "internal error in the reader", traceback.format_exc()
                        )
                    )
                    self.run_id = None

    def _step(self) -> None:
        if not self.commands.empty() or (not self.replays and not self._can_read()):
            try:
                command = self.commands.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
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
        elif isinstance(command, ReadUpTo):
            if command.run == self.run_id:
                self.upto = max(self.upto, command.upto)
        elif isinstance(command, Replay):
            if command.run == self.run_id:
                self.replays.append(command)
        elif isinstance(command, Stop):
            if command.run == self.run_id:
                self._drop_run()

    def _drop_run(self) -> None:
        self.run_id = None
        self.replays.clear()

    def _can_read(self) -> bool:
        if self.run_id is None:
            return False
        return self.next_pos < min(self.upto, self.num_seqs) or (self.next_pos >= self.num_seqs and not self.ended)

    def _prepare(self, cmd: Prepare) -> None:
        now = time.monotonic
        check = getattr(self.dataset, "check_epoch_args", None)
        if check is not None:
            try:
                self._call("check_epoch_args", f"epoch={cmd.epoch}", check, cmd.epoch, cmd.seq_list, cmd.seq_order)
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                self._emit(ev.RunRejected(now(), cmd.run, _message(exc)))
                return
        replaced = self.run_id
        self._drop_run()
        try:
            self._call(
                "init_seq_order",
                f"epoch={cmd.epoch}",
                self.dataset.init_seq_order,
                cmd.epoch,
                cmd.seq_list,
                cmd.seq_order,
            )
            num_seqs = int(self.dataset.num_seqs)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            self._emit(ev.RunRejected(now(), cmd.run, _message(exc)))
            self._fail_replaced(replaced, cmd.epoch, exc)
            return
        except Exception as exc:
            log.exception("the dataset failed to set up epoch %d", cmd.epoch)
            self._emit(
                ev.ReadFailed(
                    now(),
                    cmd.run,
                    f"the dataset failed to set up epoch {cmd.epoch}: {_message(exc)}",
                    traceback.format_exc(),
                )
            )
            self._fail_replaced(replaced, cmd.epoch, exc)
            return
        self.run_id = cmd.run
        self.num_seqs = num_seqs
        self.next_pos = 0
        self.upto = 0
        self.ended = False
        self._emit(ev.RunStarted(now(), cmd.run, cmd.epoch, num_seqs, check_tags=cmd.seq_list is not None))

    def _fail_replaced(self, replaced: Optional[int], epoch: int, exc: BaseException) -> None:
        if replaced is not None:
            self._emit(
                ev.ReadFailed(
                    time.monotonic(),
                    replaced,
                    f"the dataset lost this epoch's state while failing to set up epoch {epoch}: {_message(exc)}",
                )
            )

    def _read_one(self, pos: int) -> Item:
        return seq_to_item(self._call("get_seq", pos, self.dataset.get_seq, pos), pos)

    def _read_next(self) -> None:
        """Read on until the window is read or a command waits (the hot loop: kept lean)."""
        run = self.run_id
        assert run is not None
        limit = min(self.upto, self.num_seqs)
        get_seq, commands, out, monotonic = self.dataset.get_seq, self.commands, self.out, time.monotonic
        pos = self.next_pos
        try:
            while pos < limit:
                self.busy = ("get_seq", pos, monotonic())
                item = seq_to_item(get_seq(pos), pos)
                self.busy = None
                pos += 1
                self.next_pos = pos
                out.append((run, item))
                self.unannounced += 1
                if self.unannounced >= WAKE_EVERY:
                    self._wake()
                if not commands.empty():
                    break
        except Exception as exc:
            self.busy = None
            log.error("reading the dataset failed in run %d: %s", run, exc)
            self._emit(ev.ReadFailed(monotonic(), run, f"dataset failed: {_message(exc)}", traceback.format_exc()))
            self._drop_run()
            return
        if self.unannounced:
            self._wake()
        if self.next_pos >= self.num_seqs and not self.ended:
            self.ended = True
            self._emit(ev.InputsEnded(time.monotonic(), run, self.num_seqs))

    def _replay(self, cmd: Replay) -> None:
        try:
            items = [self._read_one(pos) for pos in cmd.positions]
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
            self._drop_run()
            return
        self._emit(ev.ReplayRead(time.monotonic(), cmd.run, cmd.partition, cmd.ticket, items))


def _message(exc: BaseException) -> str:
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, (ValueError, KeyError, IndexError)) else str(text)

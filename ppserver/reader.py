"""The reader thread: the only code that calls the dataset once the server serves.

The I/O thread hands it commands (prepare an epoch, read up to a position, read some
positions again, stop a run) and never waits for it; the reader hands back scheduler
events through a deque and wakes the I/O loop through a pipe (no ZeroMQ socket, so a
reader stuck inside the dataset cannot keep the server from shutting down). Every seq is
handed over as soon as it is read (the loop batches what it finds waiting), so a read that
hangs never holds back the seqs read before it.

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
        self.out: Deque[ev.Event] = deque()  # appended here, popped by the loop (deque ops are atomic)
        self.woken = False  # a wake-up byte is in the pipe and the loop has not taken events since
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.quit = threading.Event()
        self.busy: Optional[Tuple[str, float]] = None  # the dataset call under way and since when
        self.run_id: Optional[int] = None  # the run being read
        self.num_seqs = 0
        self.next_pos = 0
        self.upto = 0
        self.ended = False
        self.replays: Deque[Replay] = deque()

    # ---- the I/O thread's side ------------------------------------------------------------
    def send(self, command: Any) -> None:
        self.commands.put(command)

    def take(self) -> Optional[ev.Event]:
        """The next event; consecutive InputsRead of one run come as one (up to MAX_BATCH seqs)."""
        try:
            event = self.out.popleft()
        except IndexError:
            return None
        if not isinstance(event, ev.InputsRead):
            return event
        items = list(event.items)
        while (
            len(items) < MAX_BATCH
            and self.out
            and isinstance(self.out[0], ev.InputsRead)
            and self.out[0].run == event.run
        ):
            more = self.out.popleft()
            assert isinstance(more, ev.InputsRead)
            items.extend(more.items)
        return ev.InputsRead(event.now, event.run, items)

    def drain_wakeups(self) -> None:
        """Call before take(): a hand-over after this writes a new wake-up."""
        self.woken = False
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def describe_busy(self, now: float) -> str:
        busy = self.busy
        if busy is None or now - busy[1] < BUSY_REPORT_S:
            return ""
        return f"in {busy[0]} for {now - busy[1]:.1f} s"

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
        if self.woken:
            return  # the loop will see this event with the ones it was woken for
        self.woken = True
        try:
            os.write(self.wake_w, b"x")
        except BlockingIOError:
            pass  # wake-ups are pending already

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        self.busy = (what, time.monotonic())
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
                self._call(f"checking the request for epoch {cmd.epoch}", check, cmd.epoch, cmd.seq_list, cmd.seq_order)
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                self._emit(ev.RunRejected(now(), cmd.run, _message(exc)))
                return
        replaced = self.run_id
        self._drop_run()
        try:
            self._call(
                f"init_seq_order(epoch={cmd.epoch})",
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
        return seq_to_item(self._call(f"get_seq({pos})", self.dataset.get_seq, pos), pos)

    def _read_next(self) -> None:
        run = self.run_id
        assert run is not None
        if self.next_pos < min(self.upto, self.num_seqs):
            try:
                item = self._read_one(self.next_pos)
            except Exception as exc:
                log.error("reading the dataset failed in run %d: %s", run, exc)
                self._emit(
                    ev.ReadFailed(time.monotonic(), run, f"dataset failed: {_message(exc)}", traceback.format_exc())
                )
                self._drop_run()
                return
            self.next_pos += 1
            self._emit(ev.InputsRead(time.monotonic(), run, [item]))
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

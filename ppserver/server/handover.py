"""What passes between the I/O loop and the reader thread, neither waiting for the other.

Commands go to the reader through a Mailbox; events and read inputs come back through an
Outbox, a deque plus a pipe that wakes the loop (no ZeroMQ socket, so a reader stuck inside
the dataset cannot keep the server from shutting down). The pipe is written once per
WAKE_EVERY inputs and whenever the reader has an event or stops reading: a wake-up hands the
GIL to the loop, and once per seq the two threads would spend more time passing it back and
forth than reading.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import Any, Deque, Optional

from ppserver.scheduler import events as ev

MAX_BATCH = 16  # inputs the loop takes from the reader as one event
WAKE_EVERY = 8  # inputs handed over per wake-up of the loop, at most


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


class Outbox:
    """Events and inputs from the reader to the I/O thread (deque operations are atomic)."""

    def __init__(self) -> None:
        self.out: Deque[Any] = deque()  # events, and (run, input) for each input
        self.woken = False  # a wake-up byte is in the pipe and the loop has not taken events since
        self.unannounced = 0  # inputs handed over since the last wake-up
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    # ---- the reader's side ------------------------------------------------------------------
    def emit(self, event: ev.Event) -> None:
        self.out.append(event)
        self.wake()

    def put(self, run: int, item: Any) -> None:
        """An input (an Item, or a Batch of them); the loop is woken every WAKE_EVERY."""
        self.out.append((run, item))
        self.unannounced += 1
        if self.unannounced >= WAKE_EVERY:
            self.wake()

    def wake(self) -> None:
        self.unannounced = 0
        if self.woken:
            return  # the loop will see this with what it was woken for
        self.woken = True
        try:
            os.write(self.wake_w, b"x")
        except BlockingIOError:
            pass  # wake-ups are pending already

    # ---- the I/O thread's side --------------------------------------------------------------
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

    def close(self) -> None:
        os.close(self.wake_r)
        os.close(self.wake_w)

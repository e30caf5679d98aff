"""Log lines about events that can come at any rate (a peer's doing, a full segment): counted, logged
at most once per interval."""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Union


class Throttled:
    """Counts events and logs at most one line per `interval` seconds about them, with the count so far."""

    def __init__(self, log: logging.Logger, what: str, interval: float = 1.0):
        self.log = log
        self.what = what
        self.interval = interval
        self.count = 0
        self.logged_at = -interval

    def hit(self, detail: Union[str, Callable[[], str]], n: int = 1, now: Optional[float] = None) -> None:
        """Count `n` events; `detail` may be a function, called only when a line is logged. `now`:
        the time, for a caller that is given it (else the clock's)."""
        self.count += n
        if now is None:
            now = time.monotonic()
        if now - self.logged_at >= self.interval:
            self.logged_at = now
            total = f" ({self.count} so far)" if self.count > 1 else ""
            self.log.warning("%s: %s%s", self.what, detail() if callable(detail) else detail, total)

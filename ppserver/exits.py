"""How a process ended, in words: shared by the process pool that reaps workers and the
scheduler that reports a local worker's exit (a pure function)."""

from __future__ import annotations

import signal


def describe_exit(returncode: int) -> str:
    """`signal SIGKILL` for a process a signal ended (a negative return code), else `code N`."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"code {returncode}"

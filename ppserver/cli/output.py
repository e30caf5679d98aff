"""What a command prints and how it exits: stdout keeps nothing but `serve`'s `ready ADDRESS` line
(the log and anything else go to stderr), a bad config or argument is one line and exit code 2."""

from __future__ import annotations

import os
import sys
from typing import TextIO

EXIT_CONFIG = 2


def stdout_to_stderr() -> None:
    """From here on, everything this process and its children write to stdout goes to stderr
    (the log): prints of the config and of the dataset (RETURNN's among them), of the threads
    that read it and of the processes they start. stdout carries nothing a supervisor would
    have to parse around or drain."""
    sys.stdout.flush()
    try:
        os.dup2(2, 1)  # C code and child processes writing to descriptor 1
    except OSError:
        return  # no stderr to send it to: leave stdout as it is
    sys.stdout = sys.stderr  # Python code: unbuffered, in order with the log lines


def ready_stream() -> TextIO:
    """The real stdout, kept for the one `ready ADDRESS` line (call before stdout_to_stderr)."""
    try:
        return os.fdopen(os.dup(1), "w", buffering=1)  # os.dup: not inherited by child processes
    except OSError:
        return sys.stdout  # stdout is closed: printing `ready` fails as it did before


def fail_config(command: str, exc: Exception) -> int:
    """Exit 2 with one line, also for a ConfigError (e.g. a dataset's own) whose message spans lines."""
    message = " ".join(str(exc).split())
    print(f"ppserver {command}: error: {message}", file=sys.stderr)
    return EXIT_CONFIG

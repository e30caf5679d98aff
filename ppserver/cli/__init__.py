"""The `ppserver` command: serve, worker, status, keygen, demo.

`parser` defines the command line, `output` what a command prints and how it exits, and each
subcommand has a module of its own whose `run(args)` it is. `wait_ready` reads a started
server's `ready ADDRESS` line (for scripts that start one).
"""

from __future__ import annotations

from typing import List, Optional

from ppserver.cli import demo, keygen, serve, status, worker
from ppserver.cli.parser import parser
from ppserver.cli.serve import wait_ready

__all__ = ["main", "wait_ready"]

COMMANDS = {"serve": serve.run, "worker": worker.run, "status": status.run, "keygen": keygen.run, "demo": demo.run}


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    return COMMANDS[args.command](args)

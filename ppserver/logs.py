"""Log lines of every ppserver process (the server, a worker host's supervisor): one format on
stderr, the level from PPSERVER_LOG_LEVEL, the process's name and pid on each line."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(name: str = "ppserver") -> None:
    logging.basicConfig(
        level=os.environ.get("PPSERVER_LOG_LEVEL", "INFO"),
        stream=sys.stderr,
        format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(message)s",
    )

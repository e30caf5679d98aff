"""The scheduler's settings and the failure of a run.

The settings are plain values: the server builds them from the config (server/loop.py), and
the scheduler imports no config. The four that are config settings repeat the config's
defaults (tests/test_config.py checks that they agree), for tests that build a scheduler alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ppclient.protocol import FailureKind


@dataclass(frozen=True)
class Settings:
    # the config's settings, with the config's defaults (ppserver/config/table.py)
    buf_size: int = 1  # tasks in flight per worker; inputs and outputs in flight per stream partition
    max_seq_retries: int = 3
    max_skipped: float = 0.01  # of an epoch's seqs map_seq may skip before the run fails
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    stream: bool = False
    partitions: int = 1
    preserves_num_seqs: bool = True  # stream mode: every input gives exactly one output
    fingerprint: str = ""  # the config's, handed to clients for their resume states
    instance: str = ""  # this server process's id: a client that lost it tells a restart from a pause
    direct: bool = True  # map_seq results may go from workers to their consumers directly
    read_slack: int = 16  # inputs read beyond the workers' credit, so no worker waits for the reader
    read_step: int = 12  # the reader is asked for this many seqs at a time (each request wakes it)
    max_dispatch_batch: int = 16  # tasks per message
    dispatch_bytes: int = 512 * 1024  # input bytes per message (large seqs gain nothing from batching)
    max_delivery_batch: int = 64  # seqs per message to a client
    story_length: int = 100_000  # moves kept for Scheduler.story (story.py)


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    message: str
    seq_tag: Optional[str] = None
    traceback: str = ""

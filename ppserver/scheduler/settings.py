"""The scheduler's settings (from the config: server/loop.py builds them) and the failure of a run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ppclient.protocol import FailureKind
from ppserver.config.table import default


@dataclass(frozen=True)
class Settings:
    # the config's settings (their defaults are the config's: ppserver/config/table.py)
    buf_size: int = default("buf_size")  # tasks in flight per worker; inputs and outputs in flight per stream partition
    max_seq_retries: int = default("max_seq_retries")
    heartbeat_interval: float = default("heartbeat_interval")
    heartbeat_timeout: float = default("heartbeat_timeout")
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
    story_length: int = default("story_length")  # moves kept for Scheduler.story (story.py)


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    message: str
    seq_tag: Optional[str] = None
    traceback: str = ""

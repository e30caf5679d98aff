"""What both runners share: what they map with, a run as the worker knows it, the checks an output
passes before it leaves, and the text of a failure as it is sent.

Outputs are checked against max_message_bytes and against the size an item's header may have
(its seq_tag, meta entries and array specs), so the server never has to disconnect a worker for
an oversized result or drop an undecodable one: such a seq fails as a MapperError naming it.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import numpy

from ppclient import collate, protocol
from ppclient.protocol import Item
from ppserver.config.mappers import Mappers
from ppserver.config.settings import Config
from ppserver.mappers.apply import MappingError
from ppserver.worker.clock import MapperClock

MAX_FAILURE_TEXT = 16 * 1024  # characters of a failure's seq_tag, message and traceback that are sent

Send = Callable[..., None]


@dataclass(frozen=True)
class Means:
    """What a runner maps with: the config, sending to the server, and the input templates and
    mappers as the server last sent them (the worker rebuilds the mappers when they change)."""

    cfg: Config
    send: Send
    templates: Callable[[], Dict[str, Any]]
    mappers: Callable[[], Mappers]


class Runner:
    """A runner's means, the time its mapper takes and the seqs it mapped."""

    def __init__(self, means: Means):
        self.cfg = means.cfg
        self.send = means.send
        self.templates = means.templates
        self.mappers = means.mappers
        self.clock = MapperClock()
        self.done = 0


@dataclass
class OpenRun:
    """A run the server opened here (run_open): its epoch, whether seq tags are checked, a batch's padding."""

    epoch: int
    check_tags: bool
    pad: Dict[str, Any] = field(default_factory=dict)


def check_size(item: Item, limit: int) -> None:
    """An output the server would refuse (it disconnects senders of oversized messages)."""
    if item.nbytes > limit:
        if item.frames:
            sizes = [protocol.wire.nbytes(f) for f in item.frames]
        else:  # laid out in a shared-memory block already (a padded batch)
            sizes = [math.prod(shape) * numpy.dtype(dtype).itemsize for _, dtype, shape in item.arrays]
        biggest = item.arrays[max(range(len(sizes)), key=sizes.__getitem__)][0]
        raise MappingError(
            f"output is {item.nbytes} bytes (array {biggest!r} the largest), more than max_message_bytes ({limit})",
            item.seq_tag,
        )


def check_header(item: Item) -> int:
    """The size of an output's item header; an output whose header could not travel is refused."""
    size = protocol.item_header_bytes(item)
    if size > protocol.MAX_ITEM_HEADER_BYTES:
        raise MappingError(
            f"output header (seq_tag, meta entries and array specs) is {size} bytes, more than "
            f"{protocol.MAX_ITEM_HEADER_BYTES}"
        )
    return size


@typing.overload
def clip(text: str) -> str: ...
@typing.overload
def clip(text: Optional[str]) -> Optional[str]: ...
def clip(text: Optional[str]) -> Optional[str]:
    """A failure's text as it is sent: its message's header must stay small."""
    if text is None or len(text) <= MAX_FAILURE_TEXT:
        return text
    return f"{text[:MAX_FAILURE_TEXT]}... ({len(text) - MAX_FAILURE_TEXT} more characters)"


def failure_text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, (MappingError, collate.BatchError)) else f"{type(exc).__name__}: {exc}"

"""The scheduler's story: a bounded log of the moves it made, each with the stimulus that caused it.

A seq's or batch's state moves (seqstates.py), a stream partition's owner changes (streams.py), a
run's state moves (runs.py), and workers join and leave (core.py); each move is appended here
with the stimulus id of the event being handled and its time. `Scheduler.story(*keys)` picks
the entries of some positions, batches, partitions, runs or workers, as Dask's `story()` does,
so a stalled epoch can be explained by the server itself (`ppserver status --story`).

Appending is on the hot path (a seq moves about five times), so an entry is a plain tuple of
what the mover has at hand (states as enums); it is turned into words only when asked for.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Any, Deque, Dict, List, NamedTuple, Optional, Tuple, Union

# what an entry is about (its first field)
POS = "pos"  # a seq of a map_seq run
BATCH = "batch"  # a batch of a map_seq run that batches
PARTITION = "partition"  # a partition of a map_seq_stream run
RUN = "run"
WORKER = "worker"
SUBJECTS = (POS, BATCH, PARTITION, RUN, WORKER)
DELIVERED = "delivered"  # a seq's or batch's last move: released in epoch order to its rank

# (subject, key, run, from, to, worker, stimulus, time, note)
Raw = Tuple[str, Any, Optional[int], Any, Any, Optional[bytes], str, float, str]
Key = Tuple[str, Any]


class Entry(NamedTuple):
    """One move, in words: `key` of `subject` (a position, a partition, a run id, a worker's name)
    moved `from_` -> `to` at `time` (the scheduler's clock), caused by `stimulus`."""

    subject: str
    key: Union[int, str]
    run: Optional[int]
    from_: str
    to: str
    worker: str
    stimulus: str
    time: float
    note: str

    def to_dict(self) -> Dict[str, Any]:
        d = self._asdict()
        d["from"] = d.pop("from_")
        return d


class Story:
    """The last `length` moves. The scheduler sets `stimulus` and `now` before each event; the
    movers append through `seq`, `move` and `worker`."""

    def __init__(self, length: int):
        self.entries: Deque[Raw] = deque(maxlen=max(0, length))
        self.stimulus = ""
        self.now = 0.0

    def seq(self, subject: str, run: int, pos: int, old: Any, new: Any, wid: Optional[bytes] = None) -> None:
        """A map_seq position (`subject` POS or BATCH) moved from state `old` to `new` (None: not held)."""
        self.entries.append((subject, pos, run, old, new, wid, self.stimulus, self.now, ""))

    def move(
        self,
        subject: str,
        key: Any,
        run: Optional[int],
        old: Any,
        new: Any,
        wid: Optional[bytes] = None,
        note: str = "",
    ) -> None:
        """Any other move (a partition's, a run's, a worker's); `wid`: the worker it concerns."""
        self.entries.append((subject, key, run, old, new, wid, self.stimulus, self.now, note))

    def select(self, keys: List[Key]) -> List[Entry]:
        """The entries about any of `keys` (oldest first). A worker's story also holds the moves of
        the seqs and partitions it mapped; a plain position matches a seq and a batch."""
        wanted = set(keys)
        workers = {k for subject, k in keys if subject == WORKER}
        picked = []
        for raw in self.entries:
            subject, key, wid = raw[0], raw[1], raw[5]
            if (
                (subject, key) in wanted
                or (subject == BATCH and (POS, key) in wanted)
                or (wid is not None and _name(wid) in workers)
            ):
                picked.append(_entry(raw))
        return picked

    def __len__(self) -> int:
        return len(self.entries)


def parse_key(text: Union[int, str]) -> Key:
    """A key as users write it: POS, batch:K, partition:P, run:R, worker:NAME. ValueError names a bad one."""
    if isinstance(text, int):
        return (POS, text)
    subject, sep, rest = text.partition(":")
    if not sep:
        subject, rest = POS, text
    if subject not in SUBJECTS or (subject == WORKER and not rest):
        raise ValueError(f"{text!r} is not POS, batch:K, partition:P, run:R or worker:NAME")
    if subject == WORKER:
        return (WORKER, rest)
    try:
        return (subject, int(rest))
    except ValueError:
        raise ValueError(f"{text!r}: {rest!r} is not a number") from None


def _entry(raw: Raw) -> Entry:
    subject, key, run, old, new, wid, stimulus, now, note = raw
    return Entry(subject, key, run, _word(old), _word(new), "" if wid is None else _name(wid), stimulus, now, note)


def _word(state: Any) -> str:
    if state is None:
        return "-"
    if isinstance(state, enum.Enum):
        return state.name.lower() if isinstance(state.value, int) else str(state.value)
    return str(state)


def _name(wid: Union[bytes, str]) -> str:
    return wid.decode("utf8", "replace") if isinstance(wid, bytes) else wid

"""The scheduler's story: a bounded log of the moves it made, each with the stimulus that caused it.

A seq's or batch's state moves (seqstates.py), a stream partition's state moves (streams.py), a
run's state and the reader's side of it (its ReadState, noted "reader") move and a lane's state
moves (jobs.py: Run and Lane), and a worker joins, isolates, retires and leaves (workers.py);
each mover tells its move here with the stimulus id of the event being handled and its time.
`Scheduler.story(*keys)` picks the entries of some positions, batches, partitions, runs, lanes
(keyed RUN/INDEX) or workers, as Dask's `story()` does, so a stalled epoch can be explained by the server itself
(`ppserver status --story`).

Writing is on the hot path (a seq moves about five times): an entry is written into columns
allocated once (a ring), its states as words made once per state, so a move allocates nothing
and gives the garbage collector nothing to walk. 100,000 entries take some 7 MB.
"""

from __future__ import annotations

import enum
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

# what an entry is about (its first field)
POS = "pos"  # a seq of a map_seq run
BATCH = "batch"  # a batch of a map_seq run that batches
PARTITION = "partition"  # a partition of a map_seq_stream run
RUN = "run"
LANE = "lane"  # a reader's lane of a run, keyed RUN/INDEX
WORKER = "worker"
SUBJECTS = (POS, BATCH, PARTITION, RUN, LANE, WORKER)
DELIVERED = "delivered"  # a seq's or batch's last move: released in epoch order to its rank

# (subject, key, run, from, to, worker, stimulus, time, note)
Raw = Tuple[str, Any, Optional[int], str, str, Optional[bytes], str, float, str]
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
    """The last `length` moves, in a ring of columns (subject, key, run, from, to, worker,
    stimulus, time, note), slot `at` the next to write. It keeps the time and stimulus of the
    event being handled (`SchedulerState.begin` sets them, the state reads them here: one copy);
    the movers write through `move`."""

    def __init__(self, length: int):
        self.length = max(0, length)
        self.cols: List[List[Any]] = [[None] * self.length for _ in range(9)]
        self.at = 0
        self.full = False
        self.words = _Words()
        self.stimulus = ""
        self.now = 0.0
        if not self.length:
            self.move = _nothing  # type: ignore[method-assign]

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
        """`key` of `subject` moved from state `old` to `new` (None: none); `wid`: the worker it concerns."""
        i, c, words = self.at, self.cols, self.words
        c[0][i] = subject
        c[1][i] = key
        c[2][i] = run
        c[3][i] = words[old]
        c[4][i] = words[new]
        c[5][i] = wid
        c[6][i] = self.stimulus
        c[7][i] = self.now
        c[8][i] = note
        i += 1
        if i == self.length:
            i, self.full = 0, True
        self.at = i

    def select(self, keys: List[Key], last: Optional[int] = None) -> Tuple[List[Entry], int]:
        """The entries about any of `keys` (oldest first; the `last` of them if given), and how
        many there are. A worker's story also holds the moves of the seqs and partitions it
        mapped; a plain position matches a seq and a batch."""
        wanted = set(keys)
        workers = {k.encode("utf8", "surrogateescape") for subject, k in keys if subject == WORKER}
        at = self.at
        rows = zip(*(col[at:] + col[:at] if self.full else col[:at] for col in self.cols))
        picked = []
        for raw in rows:
            subject, key, wid = raw[0], raw[1], raw[5]
            if (
                (subject, key) in wanted
                or (subject == BATCH and (POS, key) in wanted)
                or (wid is not None and wid in workers)
            ):
                picked.append(raw)
        tail = picked if last is None else picked[len(picked) - last :] if last > 0 else []
        return [_entry(raw) for raw in tail], len(picked)

    def __len__(self) -> int:
        return self.length if self.full else self.at


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def parse_key(text: Union[int, str]) -> Key:
    """A key as users write it: POS, batch:K, partition:P, run:R, lane:R/I, worker:NAME. ValueError names a bad one."""
    if isinstance(text, int):
        return (POS, text)
    subject, sep, rest = text.partition(":")
    if not sep:
        subject, rest = POS, text
    if subject not in SUBJECTS or (subject == WORKER and not rest):
        raise ValueError(f"{text!r} is not POS, batch:K, partition:P, run:R, lane:R/I or worker:NAME")
    if subject == WORKER:
        return (WORKER, rest)
    run, slash, index = rest.partition("/")
    if (subject == LANE) != bool(slash):
        raise ValueError(f"{text!r}: {rest!r} is not {'RUN/INDEX' if subject == LANE else 'a number'}")
    try:
        if subject == LANE:
            return (LANE, f"{int(run)}/{int(index)}")
        return (subject, int(rest))
    except ValueError:
        raise ValueError(f"{text!r}: {rest!r} is not a number") from None


def _entry(raw: Raw) -> Entry:
    subject, key, run, old, new, wid, stimulus, now, note = raw
    return Entry(subject, key, run, old, new, "" if wid is None else _name(wid), stimulus, now, note)


class _Words(Dict[Any, str]):
    """A state in words: None "-", an enum of numbers its name, of words its value ("running")."""

    def __missing__(self, state: Any) -> str:
        if state is None:
            word = "-"
        elif isinstance(state, enum.Enum):
            word = state.name.lower() if isinstance(state.value, int) else str(state.value)
        else:
            word = str(state)
        self[state] = word
        return word


def _name(wid: Union[bytes, str]) -> str:
    return wid.decode("utf8", "replace") if isinstance(wid, bytes) else wid

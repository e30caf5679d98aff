"""Resume states: what `EpochIterator.state_dict()` holds, and the checks a client makes before it
resumes one, so that a state is resumed only by the reader it was taken of."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import msgpack

from . import batching
from .arguments import int_arg
from .errors import UsageError

STATE_KEYS = ("job", "epoch", "rank", "world_size", "position", "fingerprint", "drop_last", "subshard")


def seq_selection(seq_list: Optional[List[str]], seq_order: Optional[List[int]]) -> Optional[str]:
    """A digest of an epoch's seq_list or seq_order (None: the whole epoch), kept in resume states
    so that a state is resumed only with the same selection."""
    if seq_list is None and seq_order is None:
        return None
    kind, values = ("seq_list", seq_list) if seq_list is not None else ("seq_order", seq_order)
    digest = hashlib.sha256(msgpack.packb([kind, values])).hexdigest()[:32]
    return f"{kind} of {len(values or ())} entries, sha256 {digest}"


@dataclass(frozen=True)
class Reader:
    """Who reads: a client's job and place in it, what a state names and must match."""

    job: str
    rank: int
    world_size: int
    drop_last: bool
    subshard: int
    subshards: int
    sharding: str = "strided"

    def names(self) -> Dict[str, Any]:
        """The reader as a state holds it."""
        return {
            "job": self.job,
            "rank": self.rank,
            "world_size": self.world_size,
            "drop_last": self.drop_last,
            "subshard": [self.subshard, self.subshards],
            "sharding": self.sharding,
        }


def check(
    state: Dict[str, Any],
    reader: Reader,
    asks: Optional[Dict[str, Any]],
    epoch: Optional[int],
    selection: Optional[str],
) -> Tuple[int, int, str, Dict[str, Any]]:
    """(epoch, position, fingerprint, batching) of a state `reader` may resume, asked for with the
    cut `asks` (the client's batching; None: whatever the state's), `epoch` (None: the state's)
    and the seq selection `selection`; else UsageError saying why."""
    if not isinstance(state, dict) or any(k not in state for k in STATE_KEYS):
        raise UsageError(f"state must be a dict from EpochIterator.state_dict() with {', '.join(STATE_KEYS)}")
    for key, value in reader.names().items():
        mine = state.get(key, "strided") if key == "sharding" else state[key]  # (older states: strided)
        theirs = list(mine) if isinstance(mine, (list, tuple)) else mine
        if theirs != value:
            raise UsageError(f"the state is of {key} {mine!r}, this client's is {value!r}")
    if epoch is not None and epoch != state["epoch"]:
        raise UsageError(f"the state is of epoch {state['epoch']}, not {epoch}")
    # (a state of ppclient 0.2.0 has no seq_selection: it cannot be checked)
    if "seq_selection" in state and state["seq_selection"] != selection:
        saved = state["seq_selection"] or "the whole epoch"
        raise UsageError(
            f"the state was taken of {saved}, this request asks for {selection or 'the whole epoch'}: "
            "resume with the seq_list or seq_order the state's epoch was asked for"
        )
    fingerprint = state["fingerprint"]
    if not isinstance(fingerprint, str) or not fingerprint:
        raise UsageError(
            f"the state has no config fingerprint (fingerprint={fingerprint!r}); EpochIterator.state_dict() "
            "always gives one"
        )
    int_arg("the state's position", state["position"], 0)
    # the state's position counts its batches: it resumes with its cut (a state of ppclient 0.2.0
    # was read seq by seq)
    cut = batching.argument(state.get("batching") or False)
    assert cut is not None
    if asks is not None and asks != cut:
        raise UsageError(
            f"the state was taken of an epoch read in {batching.describe(cut)}, "
            f"this client asks for {batching.describe(asks)}"
        )
    return state["epoch"], state["position"], fingerprint, cut

"""The reference epoch: the epoch as the service must deliver it, computed in one process by the
same functions the workers run (mappers/apply.py), with no scheduler, sockets or workers.

It is the oracle of the tests and benchmarks; nothing in the service imports it.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional

from ppserver.config.mappers import mappers_for
from ppserver.mappers.apply import apply_map_seq, run_stream, writable


def _positions(dataset: Any, first: int, step: int) -> Iterator[int]:
    """first, first + step, ... while the epoch has them (also for counts known only by reading)."""
    pos = first
    while dataset.is_less_than_num_seqs(pos):
        yield pos
        pos += step


def reference_epoch(
    cfg,
    dataset,
    epoch: int,
    templates: Dict[str, Dict[str, Any]],
    *,
    seq_list=None,
    seq_order=None,
    skipped: bool = False,
) -> Iterator[Optional[Dict[str, Any]]]:
    """The epoch as the service must deliver it, computed in one process (for checks and benchmarks):
    without the seqs map_seq skipped, or (`skipped`) with None in their places."""
    mappers = mappers_for(cfg, dataset.data_keys())
    dataset.init_seq_order(epoch, seq_list=seq_list, seq_order=seq_order)
    if mappers.map_seq is not None:
        for pos in _positions(dataset, 0, 1):
            seq = writable(dataset.get_seq(pos))
            out = apply_map_seq(
                mappers.map_seq,
                seq,
                epoch=epoch,
                seed=cfg.seed,
                templates=templates,
                expected_tag=seq["seq_tag"] if seq_list is not None else None,
            )
            if out is not None or skipped:
                yield out
        return
    parts = cfg.partitions
    assert mappers.map_seq_stream is not None
    streams = [
        run_stream(
            mappers.map_seq_stream,
            (writable(dataset.get_seq(pos)) for pos in _positions(dataset, p, parts)),
            epoch=epoch,
            seed=cfg.seed,
            partition=p,
            templates=templates,
            rng=mappers.stream_rng(epoch, p),
        )
        for p in range(parts)
    ]
    yield from interleave(streams)


def interleave(streams) -> Iterator[Dict[str, Any]]:
    """Round-robin over the partition streams, skipping exhausted ones (the delivery order)."""
    live = list(streams)
    done = [False] * len(live)
    i = 0
    while not all(done):
        if not done[i]:
            try:
                yield next(live[i])
            except StopIteration:
                done[i] = True
        i = (i + 1) % len(live)

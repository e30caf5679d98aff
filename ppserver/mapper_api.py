"""The mappers of a config as the runners call them: seq dicts in, seq dicts out.

With ``mapper_api = "dict"`` (the default) they are the config's own functions; with
``"returnn"`` they are wrapped to take and return RETURNN TensorDicts (returnn_mappers.py),
which needs the input templates the server sends. The rng of a stream partition follows
the API: ppserver's own seeding, or PostprocessingDataset's for RETURNN mappers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import numpy

from .apply import partition_rng
from .config import Config


@dataclass(frozen=True)
class Mappers:
    map_seq: Optional[Callable]
    map_seq_stream: Optional[Callable]
    api: str
    seed: int
    partitions: int

    def stream_rng(self, epoch: int, partition: int) -> numpy.random.RandomState:
        if self.api == "returnn":
            from .returnn_mappers import stream_seed

            return numpy.random.RandomState(stream_seed(self.seed, epoch, partition, self.partitions))
        return partition_rng(self.seed, epoch, partition)


def mappers_for(cfg: Config, in_templates: Dict[str, Any]) -> Mappers:
    map_seq, map_seq_stream = cfg.map_seq, cfg.map_seq_stream
    if cfg.mapper_api == "returnn":
        from .returnn_mappers import dict_mappers

        map_seq, map_seq_stream = dict_mappers(map_seq, map_seq_stream, in_templates)
    return Mappers(map_seq, map_seq_stream, cfg.mapper_api, cfg.seed, cfg.partitions)

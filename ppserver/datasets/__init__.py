"""Datasets: the one a server opens and the epoch orders it serves (the server's reader thread
is their only caller), and how an epoch is cut into batches.

    from ppserver.datasets import Dataset, NumpyDataset, save_npz
"""

from ppserver.datasets.base import (
    META_KEYS,
    SEQ_ORDERINGS,
    Dataset,
    DemoDataset,
    NumpyDataset,
    UnknownSeqTagError,
    describe_arrays,
    epoch_random_seed,
    load_npz,
    make_dataset,
    save_npz,
)

__all__ = [
    "META_KEYS",
    "SEQ_ORDERINGS",
    "UnknownSeqTagError",
    "Dataset",
    "NumpyDataset",
    "DemoDataset",
    "save_npz",
    "load_npz",
    "make_dataset",
    "epoch_random_seed",
    "describe_arrays",
]

"""Datasets: the one a server opens and the epoch orders it serves (the server's reader thread
is their only caller), and how an epoch is cut into batches.

    from ppserver.datasets import Dataset, NumpyDataset, save_npz

The modules: `base` (the Dataset class), `orderings` (RETURNN's epoch orders), `arrays`
(NumpyDataset and its npz files), `demo` (DemoDataset), `factory` (a dataset from its config
entry), `hdf` and `returnn` (loaded when a config names them), `cut` (batches), and the audio
corpora: `speech` (their base), `audiofiles` (the bytes of a region), `nemo`, `lhotse_cuts` and
`hf` (loaded when a config names them). docs/datasets.md describes the Dataset interface.
"""

from ppclient.wire import META_KEYS
from ppserver.datasets.arrays import NumpyDataset, load_npz, save_npz
from ppserver.datasets.base import Dataset, UnknownSeqTagError, describe_arrays
from ppserver.datasets.demo import DemoDataset
from ppserver.datasets.factory import make_dataset
from ppserver.datasets.orderings import SEQ_ORDERINGS, epoch_random_seed

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

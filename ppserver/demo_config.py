"""The demo's config: synthetic speech-like data through SpecAugment-style masking."""

from ppserver.mappers.builtin import spec_augment

dataset = {"class": "DemoDataset", "num_seqs": 400, "seed": 1, "seq_ordering": "laplace:.50"}
map_seq = spec_augment
buf_size = 4
num_workers = 2
seed = 42

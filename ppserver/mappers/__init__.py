"""Mappers: the built-in ones and their composition (what a config uses), and how a worker
runs a config's mappers (seeding, meta entries, validation, RETURNN's TensorDict API).

    from ppserver.mappers import spec_augment, Sequential
"""

from ppserver.mappers.builtin import double, spec_augment
from ppserver.mappers.compose import LaplaceOrdering, Sequential

__all__ = ["double", "spec_augment", "LaplaceOrdering", "Sequential"]

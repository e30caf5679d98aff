"""Mappers: the built-in ones and their composition (what a config uses), and how a worker
runs a config's mappers (seeding, meta entries, validation, the outputs they declare,
RETURNN's TensorDict API).

    from ppserver.mappers import spec_augment, Sequential
    from ppserver.mappers import decode, speed_perturb, fbank, tokenize   # speech: pip install 'ppserver[speech]'
"""

from ppserver.mappers.builtin import double, spec_augment
from ppserver.mappers.compose import LaplaceOrdering, Sequential
from ppserver.mappers.speech import decode, fbank, speed_perturb, tokenize

__all__ = ["double", "spec_augment", "LaplaceOrdering", "Sequential", "decode", "speed_perturb", "fbank", "tokenize"]

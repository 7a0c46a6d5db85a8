"""fasttrain.rng: a run's seed sets every generator a checkpoint holds."""

import random

import numpy as np
import torch

from fasttrain.config import make_config
from fasttrain.rng import get_rng_state, seed_torch


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def test_a_runs_seed_sets_every_generator_a_checkpoint_holds():
    # Python's and NumPy's global generators were left as the process found them: two runs of one
    # --deterministic command wrote checkpoints differing in their rng/*/python and rng/*/numpy entries.
    states = []
    for draws in (1, 7):  # whatever the process drew before
        random.random(), np.random.rand(draws), torch.rand(draws)
        seed_torch(make_config(seed=5, device="cpu"), torch.device("cpu"))
        states.append({k: _plain(v) for k, v in get_rng_state().items() if k != "cuda"})
    assert states[0] == states[1]

"""Every random-number generator's state, in a form torch.load(weights_only=True) accepts.

Python's `random`, NumPy's global generator, torch's CPU generator and (when present) every CUDA
generator. Data augmentation does not need to be here: its randomness is derived from
(seed, epoch, record position), and the loaders' own state_dict holds the position.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def get_rng_state() -> dict:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore get_rng_state()'s result, wherever torch.load(map_location=...) put its tensors."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(int(v) for v in internal.tolist()), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())  # generator states are CPU byte tensors only
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])

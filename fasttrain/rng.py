"""Every random-number generator's state, in a form torch.load(weights_only=True) accepts; and
seed_torch, a run's seeding of torch's generator and its choice of (deterministic) algorithms.

Python's `random`, NumPy's global generator, torch's CPU generator and (when present) every CUDA
generator. Data augmentation does not need to be here: its randomness is derived from
(seed, epoch, record position), and the loaders' own state_dict holds the position.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from fasttrain.config import Config


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


def seed_torch(cfg: Config, device: torch.device) -> None:
    """torch's generator from the seed (model initialisation), Python's and NumPy's global ones too
    (nothing in a run draws from them, but checkpoints hold their states: two runs of one command wrote
    different files), and the algorithm choices: deterministic ones with cfg.deterministic, else cuDNN's
    benchmark search on CUDA."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    if cfg.deterministic:
        if device.type == "cuda":
            # Deterministic cuBLAS needs a fixed workspace, or PyTorch refuses the first matmul; read
            # when cuBLAS makes its first handle, which no step has done yet.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    elif device.type == "cuda":
        # Static shapes: cuDNN's algorithm search pays for itself after a few steps.
        torch.backends.cudnn.benchmark = True

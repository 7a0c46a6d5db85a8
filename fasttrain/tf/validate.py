"""Counters read from a TF checkpoint (global_step, the zero-debias local_step), checked before use.

    step = read_count(ckpt, "global_step", ckpt.shapes())

A counter is a scalar holding a whole number 0 <= n < 2**63 (the int64 TF counts in; float32 in the
Inception seed's global_step and in local_step, where every value that large is whole). Anything
else (a vector, NaN, -7, 1e30) is one CheckpointError naming the checkpoint and the variable, where it
was a TypeError or ValueError traceback, or a negative step written on into the next checkpoint.
"""

from __future__ import annotations

import math

import numpy as np

from fasttrain.checkpoint import CheckpointError

_LIMIT = 2**63


def read_count(ckpt, name: str, shapes: dict) -> int:
    """The whole, non-negative scalar `name` of `ckpt` (shapes: ckpt.shapes(), which the caller caches)."""
    where = f"TensorFlow checkpoint {ckpt.prefix}: variable {name}"
    shape = shapes[name][0]
    if shape != ():
        raise CheckpointError(f"{where} has shape {shape}; a step counter is a scalar")
    value = np.asarray(ckpt.get(name)).item()  # Python int, float or bool: exact for int64
    if isinstance(value, float):
        if not math.isfinite(value) or value != math.floor(value):
            raise CheckpointError(f"{where} is {value}, not a whole number of steps")
    value = int(value)
    if not 0 <= value < _LIMIT:
        raise CheckpointError(f"{where} is {value}, outside [0, 2**63): not a step count")
    return value

"""One TensorFlow variable of a name map (`TFVariable`: its name and layout), and the conversions between
TF's and torch's layouts of its array. Below the name maps: every family module returns these, and
fasttrain.tf.names (which dispatches to the families) re-exports them.

Layouts: "conv" is TF's HWIO against torch's OIHW, "dense" TF's (in, out) against torch's (out, in),
"vector" the same on both sides, and "ones" an entry TF does not have (slim's batch norm has no gamma).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Layout = Literal["conv", "dense", "vector", "ones"]


@dataclass(frozen=True)
class TFVariable:
    """One TensorFlow variable: its full name (no ':0') and how its layout differs from torch's."""

    name: str
    layout: Layout


def to_torch(value: np.ndarray, layout: Layout) -> np.ndarray:
    """A TF variable's array in torch's layout (conv HWIO -> OIHW, dense (in, out) -> (out, in))."""
    if layout == "conv":
        return np.ascontiguousarray(value.transpose(3, 2, 0, 1))
    if layout == "dense":
        return np.ascontiguousarray(value.T)
    return value


def to_tf(value: np.ndarray, layout: Layout) -> np.ndarray:
    """A torch entry's array in TF's layout (the inverse of to_torch)."""
    if layout == "conv":
        return np.ascontiguousarray(value.transpose(2, 3, 1, 0))
    if layout == "dense":
        return np.ascontiguousarray(value.T)
    return value

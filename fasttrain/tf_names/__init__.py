"""Name maps between fasttrain's state_dict keys and the seeds' TensorFlow variable names.

    vmap = variable_map("resnet50_v2", model)
    vmap["conv1.weight"]  -> TFVariable("resnet/conv2d/kernel", "conv")

One map per architecture family, each in its own module:
    resnet_v2     the ResNet seed's tf.layers names under `resnet/` (conv2d_N/kernel,
                  batch_normalization_N/{gamma,beta,moving_mean,moving_variance}, dense/{kernel,bias})
    resnet_v15    TF official ResNet (2018, v1.5) names
    inception_v3  the Inception seed's slim names (no top scope: conv0/weights, conv0/BatchNorm/beta, ...)

A map covers every floating-point entry of the model's state_dict (parameters and BN running
statistics; not num_batches_tracked). Layouts: "conv" is TF's HWIO against torch's OIHW, "dense"
TF's (in, out) against torch's (out, in), "vector" the same on both sides, and "ones" an entry TF
does not have (slim's batch norm has no gamma): an import fills it with 1, an export leaves it out.
Optimizer slots, EMA shadows and global_step are named from these variable names by fasttrain.tf_import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from torch import nn

Layout = Literal["conv", "dense", "vector", "ones"]


@dataclass(frozen=True)
class TFVariable:
    """One TensorFlow variable: its full name (no ':0') and how its layout differs from torch's."""

    name: str
    layout: Layout


def variable_map(model_name: str, model: nn.Module) -> dict[str, TFVariable]:
    """torch state_dict key -> TFVariable for `model` (an instance of model `model_name`), in the
    model's state_dict order. ValueError for an architecture without a map."""
    if model_name.endswith("_v2"):
        from fasttrain.tf_names import resnet_v2 as family
    elif model_name == "inception_v3":
        from fasttrain.tf_names import inception_v3 as family
    elif model_name.startswith("resnet"):
        from fasttrain.tf_names import resnet_v15 as family
    else:
        raise ValueError(f"no TensorFlow name map for model {model_name!r}")
    return family.variable_map(model)


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

"""Name maps between fasttrain's state_dict keys and the seeds' TensorFlow variable names.

    vmap = variable_map("resnet50_v2", model)
    vmap["conv1.weight"]  -> TFVariable("resnet/conv2d/kernel", "conv")

One map per architecture family, each in its own module (the TFVariable they return, and the layout
conversions, in fasttrain/tf/names/variable.py):
    resnet_v2     the ResNet seed's tf.layers names under `resnet/` (conv2d_N/kernel,
                  batch_normalization_N/{gamma,beta,moving_mean,moving_variance}, dense/{kernel,bias})
    resnet_v15    TF official ResNet (2018, v1.5) names
    inception_v3  the Inception seed's slim names (no top scope: conv0/weights, conv0/BatchNorm/beta, ...)

A map covers every floating-point entry of the model's state_dict (parameters and BN running
statistics; not num_batches_tracked). Layouts: "conv" is TF's HWIO against torch's OIHW, "dense"
TF's (in, out) against torch's (out, in), "vector" the same on both sides, and "ones" an entry TF
does not have (slim's batch norm has no gamma): an import fills it with 1, an export leaves it out.
Optimizer slots, EMA shadows and global_step are named from these variable names by fasttrain.tf.state
(and fasttrain.tf.export).
"""

from __future__ import annotations

from torch import nn

from fasttrain.tf.names import inception_v3, resnet_v2, resnet_v15
from fasttrain.tf.names.variable import Layout, TFVariable, to_tf, to_torch

# The package's public names; each family module imports TFVariable from fasttrain.tf.names.variable.
__all__ = ["Layout", "TFVariable", "to_tf", "to_torch", "variable_map"]


def variable_map(model_name: str, model: nn.Module) -> dict[str, TFVariable]:
    """torch state_dict key -> TFVariable for `model` (an instance of model `model_name`), in the
    model's state_dict order. ValueError for an architecture without a map."""
    if model_name.endswith("_v2"):
        family = resnet_v2
    elif model_name == "inception_v3":
        family = inception_v3
    elif model_name.startswith("resnet"):
        family = resnet_v15
    else:
        raise ValueError(f"no TensorFlow name map for model {model_name!r}")
    return family.variable_map(model)

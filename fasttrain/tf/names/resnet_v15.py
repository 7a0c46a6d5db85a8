"""TF official ResNet (2018, v1.5: resnet_version=1 with the stride on the 3x3) names for fasttrain's ResNet.

tensorflow/models official/resnet/resnet_model.py (2018) builds the network inside
`tf.variable_scope('resnet_model')` with tf.layers, which name each layer by kind and creation count:
`conv2d`, `conv2d_1`, ...; `batch_normalization`, `batch_normalization_1`, ...; `dense`. Creation order:

    initial conv (conv2d) and, v1 only, its batch norm (batch_normalization)
    per block (_building_block_v1 / _bottleneck_block_v1): the projection conv and its batch norm first
        when the block has one, then conv1, bn1, conv2, bn2 (, conv3, bn3)
    dense (the classifier, with bias)

Variables: conv `kernel` (HWIO), batch norm `gamma`, `beta`, `moving_mean`, `moving_variance`, dense
`kernel` (in, out) and `bias`; so fasttrain's `layer1.0.downsample.0.weight` of ResNet-50 is
`resnet_model/conv2d_1/kernel`. Numerics are the same (v1.5, BN eps 1e-5, decay 0.997).

Not mapped: TF official gives the first block of *every* stage a projection shortcut, also stage 1
of ResNet-18/34, where fasttrain's (torchvision's) block has none because the shape does not change.
For ResNet-50 and deeper the two networks have the same variables; a TF official ResNet-18/34
checkpoint does not fit (its extra stage-1 projection shifts the numbering: the import names the first
variable whose shape differs). fasttrain's own ResNet-18/34 still get these names, which is what
`to-tf` writes and `from-tf` reads back.
"""

from __future__ import annotations

from torch import nn

from fasttrain.tf.names.variable import TFVariable

SCOPE = "resnet_model"
_BN = {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean", "running_var": "moving_variance"}


def _numbered(kind: str, index: int) -> str:
    return f"{SCOPE}/{kind}" if index == 0 else f"{SCOPE}/{kind}_{index}"


def variable_map(model: nn.Module) -> dict[str, TFVariable]:
    """state_dict key -> TFVariable for a fasttrain ResNet (fasttrain.models.resnet.ResNet)."""
    modules = []  # (module name, module) in TF's creation order
    modules += [("conv1", model.conv1), ("bn1", model.bn1)]
    for stage in range(1, 5):
        for i, block in enumerate(getattr(model, f"layer{stage}")):
            prefix = f"layer{stage}.{i}"
            if block.downsample is not None:
                modules += [(f"{prefix}.downsample.0", block.downsample[0])]
                modules += [(f"{prefix}.downsample.1", block.downsample[1])]
            for n in (1, 2, 3):
                if hasattr(block, f"conv{n}"):
                    modules += [(f"{prefix}.conv{n}", getattr(block, f"conv{n}"))]
                    modules += [(f"{prefix}.bn{n}", getattr(block, f"bn{n}"))]
    out: dict[str, TFVariable] = {}
    convs = bns = 0
    for name, module in modules:
        if isinstance(module, nn.Conv2d):
            out[f"{name}.weight"] = TFVariable(f"{_numbered('conv2d', convs)}/kernel", "conv")
            convs += 1
        else:
            scope = _numbered("batch_normalization", bns)
            for key, tf_name in _BN.items():
                out[f"{name}.{key}"] = TFVariable(f"{scope}/{tf_name}", "vector")
            bns += 1
    out["fc.weight"] = TFVariable(f"{SCOPE}/dense/kernel", "dense")
    out["fc.bias"] = TFVariable(f"{SCOPE}/dense/bias", "vector")
    order = [k for k, v in model.state_dict().items() if v.is_floating_point()]
    if sorted(order) != sorted(out):
        raise ValueError(f"the TF official ResNet map does not cover this model ({type(model).__name__})")
    return {k: out[k] for k in order}

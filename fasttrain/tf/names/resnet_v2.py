"""The ResNet seed's TensorFlow variable names for fasttrain's ResNetV2 (fasttrain/models/resnet_v2.py).

The seed builds its model with tf.layers under variable_scope("resnet") (imagenet_main.py model_fn), so
each layer is named by its kind and creation count: the N-th convolution created is `conv2d_N` (the first
plain `conv2d`), the N-th batch norm `batch_normalization_N`, the one dense layer `dense`:

    resnet/conv2d[_N]/kernel                     (kh, kw, cin, cout)   <- <conv>.weight (cout, cin, kh, kw)
    resnet/batch_normalization[_N]/gamma, beta, moving_mean, moving_variance
                                                 (C,)                  <- <bn>.weight, bias, running_mean,
                                                                          running_var
    resnet/dense/kernel (in, out), resnet/dense/bias (out,)            <- fc.weight (out, in), fc.bias

Creation order (resnet_model.py): the stem conv; per block bn1, the projection conv (first block of a
stage), conv1, bn2, conv2 (, bn3, conv3); the final BN; dense. ResNetV2 registers its modules in that
order, so the N-th Conv2d / BatchNorm2d in `model.modules()` is TF's N-th; the map is checked against
TF's own name and shape lists for every size (tests/test_tf_names_resnet_v2.py).
"""

from __future__ import annotations

from torch import nn

from fasttrain.models.resnet_v2 import ResNetV2
from fasttrain.tf.names.variable import TFVariable

SCOPE = "resnet"
_BN_VARIABLES = (
    ("weight", "gamma"),
    ("bias", "beta"),
    ("running_mean", "moving_mean"),
    ("running_var", "moving_variance"),
)


def _layer_name(kind: str, index: int) -> str:
    # tf.layers' unique naming: the first layer of a kind has no suffix, then _1, _2, ...
    return f"{SCOPE}/{kind}" if index == 0 else f"{SCOPE}/{kind}_{index}"


def variable_map(model: nn.Module) -> dict[str, TFVariable]:
    """state_dict key -> TFVariable for every floating entry of a ResNetV2, in state_dict order."""
    if not isinstance(model, ResNetV2):
        raise ValueError(f"the ResNet seed's names map a ResNetV2, not a {type(model).__name__}")
    names: dict[str, TFVariable] = {}
    convs = bns = 0
    for prefix, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            names[f"{prefix}.weight"] = TFVariable(f"{_layer_name('conv2d', convs)}/kernel", "conv")
            convs += 1
        elif isinstance(module, nn.BatchNorm2d):
            layer = _layer_name("batch_normalization", bns)
            for torch_name, tf_name in _BN_VARIABLES:
                names[f"{prefix}.{torch_name}"] = TFVariable(f"{layer}/{tf_name}", "vector")
            bns += 1
        elif isinstance(module, nn.Linear):
            names[f"{prefix}.weight"] = TFVariable(f"{SCOPE}/dense/kernel", "dense")
            names[f"{prefix}.bias"] = TFVariable(f"{SCOPE}/dense/bias", "vector")
    floating = [key for key, value in model.state_dict().items() if value.is_floating_point()]
    missing = sorted(set(floating) - set(names))
    if missing:  # a module kind this map does not know: a bug here, not a user error
        raise AssertionError(f"no TensorFlow name for {missing}")
    return {key: names[key] for key in floating}

"""Models: one dispatch point (`create_model`) and the helpers the trainer needs around a model.

    model = create_model("resnet50", 1000)            # or resnet18/34/101/152, inception_v3,
                                                      # resnet18/34/50/101/152/200_v2 (the ResNet seed's)
    classifier_names(model)  -> ["fc"]                # ["fc", "AuxLogits.fc"] for inception_v3
    reset_classifier(model)                           # fine_tune: re-initialise only those layers
    param_groups(model, weight_decay=1e-4, no_decay_bn_bias=True)   # torch.optim param groups

A classifier name is a state_dict key prefix: the layer's keys are f"{name}.weight" and
f"{name}.bias", so `key.startswith(name + ".")` selects them.

Forward: ResNets return logits (N, num_classes); Inception v3 returns (logits, aux_logits) in train
mode with aux_logits=True and logits alone otherwise. Inputs are (N, 3, H, W), NCHW or channels_last
(or (N, 4, H, W) with the fourth channel zero: fasttrain.models.stem);
after `model.to(memory_format=torch.channels_last)` every activation stays NHWC.
"""

from __future__ import annotations

import torch
from torch import nn

from fasttrain.errors import SettingError
from fasttrain.models.inception_v3 import Inception3
from fasttrain.models.resnet import DEPTHS, ResNet
from fasttrain.models.resnet_v2 import DEPTHS as V2_DEPTHS
from fasttrain.models.resnet_v2 import ResNetV2

MODEL_NAMES = (
    tuple(f"resnet{d}" for d in DEPTHS) + tuple(f"resnet{d}_v2" for d in V2_DEPTHS) + ("inception_v3",)
)

__all__ = ["MODEL_NAMES", "classifier_names", "create_model", "param_groups", "reset_classifier"]


def create_model(
    name: str,
    num_classes: int,
    *,
    base_channels: int = 64,
    zero_init_residual: bool = True,
    bn_momentum: float | None = None,
    bn_eps: float | None = None,
    dropout_keep: float = 0.8,
    aux_logits: bool = True,
    inception_bn_gamma: bool = True,
) -> nn.Module:
    """The named architecture, initialised from torch's global generator (seed it first).

    base_channels applies to ResNets and zero_init_residual to v1.5 ResNets (Inception v3 has no
    residual blocks, a pre-activation v2 block no BN at its end); dropout_keep, aux_logits and
    inception_bn_gamma to Inception v3 (False: the seed's slim batch norm, beta only, which the trainer
    builds by default; True: torchvision's, with gamma). bn_momentum and bn_eps None take the
    architecture's seed values: ResNet momentum 0.003 (TF decay 0.997), eps 1e-5; Inception momentum
    0.0003 (decay 0.9997), eps 0.001. bn_momentum is torch's: running = (1 - momentum) * running +
    momentum * batch.
    """
    if name not in MODEL_NAMES:
        raise SettingError(
            f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}", settings=("model",)
        )
    if num_classes < 1:
        raise SettingError(f"num_classes must be positive, got {num_classes}", settings=("num_classes",))
    if bn_momentum is not None and not 0.0 <= bn_momentum <= 1.0:
        raise SettingError(
            f"bn_momentum is torch's (1 - TF decay) and must be in [0, 1], got {bn_momentum}",
            settings=("bn_momentum",),
        )
    if bn_eps is not None and bn_eps <= 0.0:
        raise SettingError(f"bn_eps must be positive, got {bn_eps}", settings=("bn_eps",))
    bn = {k: v for k, v in (("bn_momentum", bn_momentum), ("bn_eps", bn_eps)) if v is not None}
    if name == "inception_v3":
        if base_channels != 64:
            raise SettingError(
                f"base_channels={base_channels} applies to ResNets only; leave it at 64 for inception_v3",
                settings=("base_channels",),
            )
        if not 0.0 < dropout_keep <= 1.0:
            raise SettingError(f"dropout_keep must be in (0, 1], got {dropout_keep}")
        return Inception3(
            num_classes, aux_logits=aux_logits, dropout_keep=dropout_keep, bn_gamma=inception_bn_gamma, **bn
        )
    if base_channels < 1:
        raise SettingError(
            f"base_channels must be positive, got {base_channels}", settings=("base_channels",)
        )
    if name.endswith("_v2"):  # the ResNet seed's pre-activation net: no last BN to zero-initialise
        return ResNetV2(
            int(name[len("resnet") : -len("_v2")]), num_classes, base_channels=base_channels, **bn
        )
    return ResNet(
        int(name[len("resnet") :]),
        num_classes,
        base_channels=base_channels,
        zero_init_residual=zero_init_residual,
        **bn,
    )


def classifier_names(model: nn.Module) -> list[str]:
    """Names (state_dict key prefixes of the unwrapped model) of the layer(s) fine_tune resets."""
    return list(_unwrap(model).classifier_names)


def reset_classifier(model: nn.Module) -> None:
    """Re-initialise only the classifier layer(s), with the architecture's own initialisation."""
    with torch.no_grad():
        _unwrap(model).reset_classifier()


def param_groups(
    model: nn.Module, weight_decay: float, no_decay_bn_bias: bool, no_decay_bn: bool = False
) -> list[dict]:
    """torch.optim parameter groups: [{'params': [...], 'weight_decay': wd}, ...].

    Both False: one group with every parameter. no_decay_bn_bias: a group with the conv and fc
    weights at weight_decay, then a group with every BN gamma/beta and every bias at 0 (slim's
    regularizers, the Inception seed). no_decay_bn: the same with only BN's gamma/beta at 0, biases
    decayed (TF official ResNet's `exclude_batch_norm`: every trainable variable but batch_normalization
    ones). Within a group parameters keep model.parameters() order (registration order); empty groups
    are left out, and so are parameters with requires_grad=False (as TF's apply_gradients never sees a
    non-trainable variable).
    """
    params = [p for p in model.parameters() if p.requires_grad]  # frozen ones are no optimizer's
    if not (no_decay_bn_bias or no_decay_bn):
        return [{"params": params, "weight_decay": weight_decay}]
    exempt: set[int] = set()
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if isinstance(module, nn.modules.batchnorm._NormBase) or (no_decay_bn_bias and pname == "bias"):
                exempt.add(id(p))
    groups = [
        {"params": [p for p in params if id(p) not in exempt], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) in exempt], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP (.module) and torch.compile (._orig_mod) wrap the model; the names live on the inner one.
    while not hasattr(model, "classifier_names"):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            raise TypeError(f"{type(model).__name__} is not a fasttrain model (no classifier_names)")
        model = inner
    return model

"""fasttrain/tf/names/resnet_v2.py: our ResNetV2 state_dict named as the ResNet seed's TF variables.

Reference: tests/data/tf-resnet-v2/variables.json, every global variable (name, shape, trainable) of the
seed's graph as TensorFlow 2.21 built it from resnet_model.py ported to tf.compat.v1 (1001 classes, base
width 64; tests/data/make_tf_resnet_v2.py), and TF's count of trainable parameters per size.
"""

import json

import pytest
import torch

from fasttrain.models import create_model
from fasttrain.tf.names import to_tf, variable_map

with open("tests/data/tf-resnet-v2/variables.json") as _f:
    TF_VARIABLES = json.load(_f)
SIZES = [18, 34, 50, 101, 152, 200]


def _meta_model(size: int) -> torch.nn.Module:
    with torch.device("meta"):  # names and shapes only: no values, no arithmetic
        return create_model(f"resnet{size}_v2", 1001)


@pytest.mark.parametrize("size", SIZES)
def test_names_and_shapes_are_tensorflows(size):
    model = _meta_model(size)
    vmap = variable_map(f"resnet{size}_v2", model)
    state = model.state_dict()
    ours = [[var.name, list(to_tf_shape(state[key].shape, var.layout))] for key, var in vmap.items()]
    theirs = [[name, shape] for name, shape, _ in TF_VARIABLES[str(size)]["variables"]]
    assert ours == theirs  # same names, same shapes, same (creation) order
    trainable = {name for name, _, is_trainable in TF_VARIABLES[str(size)]["variables"] if is_trainable}
    assert {var.name for key, var in vmap.items() if key in dict(model.named_parameters())} == trainable


@pytest.mark.parametrize("size", SIZES)
def test_parameter_count_is_tensorflows(size):
    count = sum(p.numel() for p in _meta_model(size).parameters())
    assert count == TF_VARIABLES[str(size)]["trainable_parameters"]


def to_tf_shape(shape: torch.Size, layout: str) -> tuple[int, ...]:
    # to_tf on an array of that shape (meta tensors have no values; a zero-stride view costs nothing).
    return to_tf(torch.zeros(()).expand(*shape).numpy(), layout).shape


def test_every_floating_entry_in_state_dict_order():
    model = create_model("resnet18_v2", 5, base_channels=2)
    vmap = variable_map("resnet18_v2", model)
    floating = [k for k, v in model.state_dict().items() if v.is_floating_point()]
    assert list(vmap) == floating
    assert len({var.name for var in vmap.values()}) == len(vmap)
    assert vmap["conv1.weight"].name == "resnet/conv2d/kernel"
    assert vmap["layer1.0.bn1.weight"].name == "resnet/batch_normalization/gamma"
    assert vmap["layer1.0.shortcut.weight"].name == "resnet/conv2d_1/kernel"  # before conv1, as TF made it
    assert vmap["fc.weight"].layout == "dense" and vmap["final_bn.running_var"].layout == "vector"


def test_another_architecture_is_refused():
    with pytest.raises(ValueError, match="ResNetV2"):
        variable_map("resnet18_v2", create_model("resnet18", 5, base_channels=2))

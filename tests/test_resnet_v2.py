"""fasttrain/models/resnet_v2.py against TensorFlow: the ResNet seed's imagenet_resnet_v2.

References: tests/data/tf-resnet-v2/, written by TensorFlow 2.21 running the seed's resnet_model.py
ported to tf.compat.v1 (tests/data/make_tf_resnet_v2.py): reduced models' weights and TF's logits for
three photos in eval and training mode, and TF's SAME max-pool at each padding parity. The weights are
read from the generator's .npz (the same values as its V2 checkpoint, model.ckpt-0, next to it); the
initialisers are checked against their defining distributions.
"""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from fasttrain.models import classifier_names, create_model, reset_classifier
from fasttrain.models.resnet_v2 import ResNetV2, tf_same_max_pool
from fasttrain.tf.checkpoint import open_checkpoint
from fasttrain.tf.names import variable_map
from fasttrain.tf.state import model_state

DATA = "tests/data/tf-resnet-v2/"
MEANS = (123.68, 116.78, 103.94)  # vgg_preprocessing's channel means on the 0-255 scale
REDUCED = [("resnet50_v2_w2", "resnet50_v2", 2), ("resnet18_v2_w4", "resnet18_v2", 4)]


def network_input(channels_last: bool) -> torch.Tensor:
    """The generator's input: x = u8 / 255 - means / 255 in float32 (its `network_input`), NCHW."""
    u8 = np.load(DATA + "images.npz")["images"]  # (3, 224, 224, 3) uint8
    x = u8.astype(np.float32) / np.float32(255) - np.array(MEANS, np.float32) / np.float32(255)
    x = torch.from_numpy(x).permute(0, 3, 1, 2)
    return x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def tf_model(tag: str, name: str, base: int) -> tuple[nn.Module, np.lib.npyio.NpzFile]:
    """Our model holding the values of the V2 checkpoint TF wrote (DATA + tag + "/model.ckpt-0"),
    imported as a user's is: fasttrain.tf.checkpoint reads it, fasttrain.tf.state maps the names and
    layouts; and the fixture's .npz, which holds TF's logits (and the same values, for the check below)."""
    fixture = np.load(DATA + tag + ".npz")
    model = create_model(name, 1001, base_channels=base)
    ckpt = open_checkpoint(DATA + tag + "/model.ckpt-0")
    model.load_state_dict(model_state(ckpt, name, model))
    return model, fixture


# Eval mode, measured max |diff| 2.3e-6 (ResNet-50 w2, logits up to 1.14) and 3e-7 (ResNet-18 w4): every
# layer is a float32 affine map + ReLU whose sums run in another order than TF's (oneDNN/ATen vs Eigen),
# ~sqrt(n) * 6e-8 relative each, n <= 3*3*256, over 50 layers: below 1e-5 of the logits' scale. 2e-5 is
# an order above that and four orders below a wrong padding, pool or BN (differences of 0.01-1).
EVAL_ATOL = 2e-5
# Training mode, measured 5.1e-5: each BN divides by a batch std over as few as 3 * 7 * 7 values of a
# 2-channel-wide layer, and E[(x - mean)^2] of nearly constant channels loses digits to cancellation, so
# the same rounding is amplified ~10x; 5e-4 is 10x the measured.
TRAIN_ATOL = 5e-4


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("tag, name, base", REDUCED, ids=[r[0] for r in REDUCED])
def test_logits_equal_tensorflows(tag, name, base, channels_last):
    model, fixture = tf_model(tag, name, base)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    x = network_input(channels_last)
    with torch.no_grad():
        eval_logits = model.eval()(x).numpy()
        train_logits = copy.deepcopy(model).train()(x).numpy()
    np.testing.assert_allclose(eval_logits, fixture["logits_eval"], rtol=0, atol=EVAL_ATOL)
    np.testing.assert_allclose(train_logits, fixture["logits_train"], rtol=0, atol=TRAIN_ATOL)
    # Not vacuous: the images give different logits, and train mode differs from eval mode.
    assert np.abs(fixture["logits_eval"][0] - fixture["logits_eval"][1]).max() > 0.05
    assert np.abs(fixture["logits_eval"] - fixture["logits_train"]).max() > 0.05


@pytest.mark.parametrize("size", ["16x16", "15x15", "8x7", "2x1"])
def test_max_pool_is_tensorflows_same_padding(size):
    # Even sizes: TF pads one cell at the end only, odd sizes one at each end; never a winning pad.
    fixture = np.load(DATA + "maxpool.npz")
    x = torch.from_numpy(fixture[f"x_{size}"]).permute(0, 3, 1, 2)
    ours = tf_same_max_pool(x).permute(0, 2, 3, 1).numpy()
    np.testing.assert_array_equal(ours, fixture[f"y_{size}"])  # a max is exact
    # torch's symmetric padding 1 differs at even sizes (the reason for the emulation).
    if size == "16x16":
        symmetric = torch.nn.functional.max_pool2d(x, 3, 2, padding=1).permute(0, 2, 3, 1).numpy()
        assert not np.array_equal(symmetric, fixture[f"y_{size}"])


def test_channels_last_end_to_end_and_shapes():
    model = create_model("resnet50_v2", 10, base_channels=2).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    seen = []
    hooks = [
        m.register_forward_hook(lambda m, i, o: seen.append(o))
        for m in model.modules()
        if isinstance(m, nn.Conv2d)
    ]
    out = model(x)
    for h in hooks:
        h.remove()
    assert out.shape == (2, 10)
    assert all(o.is_contiguous(memory_format=torch.channels_last) for o in seen)
    out.sum().backward()  # the in-place ReLUs and adds leave autograd a consistent graph


def test_architecture_follows_the_seed():
    with torch.device("meta"):  # structure only: no arithmetic
        model = create_model("resnet18_v2", 1001)
        bottleneck = create_model("resnet50_v2", 1001).layer2[0]
    assert isinstance(model, ResNetV2) and model.fc.out_features == 1001
    # A projection on the first block of every stage, ResNet-18 included, reading 1x1 with the stride.
    for stage, stride in zip((model.layer1, model.layer2, model.layer3, model.layer4), (1, 2, 2, 2)):
        assert stage[0].shortcut.kernel_size == (1, 1) and stage[0].shortcut.stride == (stride, stride)
        assert stage[0].conv1.stride == (stride, stride)  # the stride on the first 3x3
        assert all(block.shortcut is None for block in stage[1:])
    assert bottleneck.conv1.stride == (1, 1) and bottleneck.conv2.stride == (2, 2)
    # No BN after the stem conv; BN before every conv in a block, one final BN.
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bns) == 2 * 8 + 1
    assert all(bn.momentum == pytest.approx(0.003) and bn.eps == 1.001e-5 for bn in bns)


def test_bn_epsilon_floor_applies_to_any_given_epsilon():
    # TF 1.4's fused batch norm ran max(eps, 1.001e-5): the seed's 1e-5 became 1.001e-5.
    small = create_model("resnet18_v2", 5, base_channels=4, bn_eps=1e-5, bn_momentum=0.1)
    large = create_model("resnet18_v2", 5, base_channels=4, bn_eps=1e-3)
    assert {m.eps for m in small.modules() if isinstance(m, nn.BatchNorm2d)} == {1.001e-5}
    assert {m.momentum for m in small.modules() if isinstance(m, nn.BatchNorm2d)} == {0.1}
    assert {m.eps for m in large.modules() if isinstance(m, nn.BatchNorm2d)} == {1e-3}


def test_initialisation_is_tf_1_4s():
    torch.manual_seed(0)
    model = create_model("resnet50_v2", 1001, base_channels=16)  # 1/16 of the draws, the same rules
    # TF 1.4's variance_scaling: truncated normal at 2 sigma of sigma = sqrt(1 / fan_in). The truncated
    # draw's std is sigma * 0.8796 (TF >= 1.12 would divide sigma by 0.8796 to give sigma itself).
    for conv in (model.conv1, model.layer3[2].conv2, model.layer4[0].shortcut):
        w = conv.weight.detach().double()
        sigma = math.sqrt(1.0 / (w.shape[1] * w.shape[2] * w.shape[3]))
        assert w.abs().max() <= 2 * sigma
        assert w.std().item() == pytest.approx(0.87962566 * sigma, rel=0.05)
    bound = math.sqrt(6.0 / (512 + 1001))  # Glorot uniform, 8 * 16 * 4 = 512 features
    assert model.fc.weight.abs().max() <= bound and model.fc.weight.abs().max() > 0.99 * bound
    assert not model.fc.bias.any()
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(bool((bn.weight == 1).all()) and not bn.bias.any() for bn in bns)
    # Deterministic under the seed.
    torch.manual_seed(0)
    again = create_model("resnet50_v2", 1001, base_channels=16)
    assert torch.equal(again.layer4[2].conv3.weight, model.layer4[2].conv3.weight)


def test_fine_tune_resets_only_the_classifier():
    model = create_model("resnet18_v2", 7, base_channels=4)
    assert classifier_names(model) == ["fc"]
    before = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        model.fc.bias.fill_(1.0)
    reset_classifier(model)
    after = model.state_dict()
    assert not after["fc.bias"].any() and not torch.equal(after["fc.weight"], before["fc.weight"])
    assert all(torch.equal(after[k], before[k]) for k in before if not k.startswith("fc."))


@pytest.mark.parametrize("tag, name, base", REDUCED, ids=[r[0] for r in REDUCED])
def test_tf_checkpoint_holds_the_maps_names_and_the_fixture_values(tag, name, base):
    # TF's own V2 checkpoint (read by fasttrain.tf.checkpoint) holds exactly our map's names, and the
    # values the generator also saved in the .npz beside TF's logits.
    ckpt = open_checkpoint(DATA + tag)  # the directory: its `checkpoint` file names ckpt-0
    model, fixture = tf_model(tag, name, base)
    names = {var.name for var in variable_map(name, model).values()}
    assert set(ckpt.shapes()) == names | {"global_step"}
    for var_name in names:
        np.testing.assert_array_equal(ckpt.get(var_name), fixture[var_name])

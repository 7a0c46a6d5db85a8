"""fasttrain's Inception v3 against the Inception seed's slim code, layer kind by layer kind.

References: float64 transcriptions of slim/ops.py batch_norm (tf.nn.moments' biased variance, TF's
zero-debiased assign_moving_average) and the layer table of slim/inception_model.py. The whole
network against TensorFlow's own logits is tests/test_tf_names_inception_v3.py.
"""

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fasttrain.config import make_config
from fasttrain.models import create_model
from fasttrain.models.inception_v3 import BasicConv2d, Inception3, SlimBatchNorm, _avg_pool_3x3
from fasttrain.run import build_model

DECAY, EPS = 0.9997, 0.001
SMALL = 1.0 / 32  # depth multiplier of the small models here


def _reference_bn_train(x, beta, moving_mean, moving_var, t):
    """slim batch_norm, training: (y, new moving_mean, new moving_var) in float64.

    TF's float32 constants are kept as TF makes them: o = float32(1 - decay), a = float32(1 - o),
    a^t rounded to float32 (the correctly rounded powf)."""
    x = x.double()
    mean = x.mean(dim=(0, 2, 3))
    var = ((x - mean[None, :, None, None]) ** 2).mean(dim=(0, 2, 3))  # biased, as tf.nn.moments
    y = (x - mean[None, :, None, None]) / torch.sqrt(var + EPS)[None, :, None, None]
    y = y + beta.double()[None, :, None, None]
    o = float(np.float32(1.0 - DECAY))
    a = float(np.float32(1.0) - np.float32(o))

    def debias(n):
        return 1.0 - float(np.float32(a**n))

    def update(moving, value):
        biased = moving.double() * debias(t)
        biased = biased - (biased - value) * o
        return biased / debias(t + 1)

    return y, update(moving_mean, mean), update(moving_var, var)


@pytest.mark.parametrize("t", [0, 1, 6, 100_000])
def test_slim_batch_norm_training_is_slims_with_zero_debiased_moving_statistics(t):
    torch.manual_seed(t)
    bn = SlimBatchNorm(5, eps=EPS, momentum=1 - DECAY).train()
    with torch.no_grad():
        bn.bias.normal_()
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.num_batches_tracked.fill_(t)
    x = 3.0 + 2.0 * torch.randn(3, 5, 4, 4)
    expected = _reference_bn_train(x, bn.bias.detach(), bn.running_mean.clone(), bn.running_var.clone(), t)
    y = bn(x)
    # float32 against float64: the outputs are O(3); the batch statistics accumulate 48 terms.
    torch.testing.assert_close(y.double(), expected[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(bn.running_mean.double(), expected[1], rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(bn.running_var.double(), expected[2], rtol=2e-6, atol=1e-6)
    assert int(bn.num_batches_tracked) == t + 1


def test_the_first_update_takes_the_batchs_biased_variance_not_torchs_unbiased():
    # Zero-debiasing makes the first update (local_step 0) the batch's statistics themselves; the
    # variance is tf.nn.moments' (divided by N*H*W = 2, not 1): torch's BatchNorm would store 2x.
    # "Themselves" up to TF's own float32 rounding: it divides o * v by 1 - float32(1 - o), and
    # float32(1 - o) is off by up to 3e-8 of o = 3e-4, so the stored value is v * (1 + 3.3e-5).
    bn = SlimBatchNorm(1).train()
    bn(torch.tensor([0.0, 2.0]).reshape(2, 1, 1, 1))
    assert bn.running_mean.item() == pytest.approx(1.0, rel=1e-4)
    assert bn.running_var.item() == pytest.approx(1.0, rel=1e-4)


def test_slim_batch_norm_eval_uses_the_moving_statistics_and_beta_only():
    bn = SlimBatchNorm(2).eval()
    with torch.no_grad():
        bn.bias.copy_(torch.tensor([0.5, -1.0]))
        bn.running_mean.copy_(torch.tensor([1.0, 2.0]))
        bn.running_var.copy_(torch.tensor([4.0, 0.25]))
    x = torch.randn(2, 2, 3, 3)
    expected = (x - bn.running_mean[None, :, None, None]) / torch.sqrt(bn.running_var + EPS)[
        None, :, None, None
    ]
    torch.testing.assert_close(bn(x), expected + bn.bias[None, :, None, None])
    assert [n for n, _ in bn.named_parameters()] == ["bias"]


class _BatchNormWeights(TorchDispatchMode):
    """Records the weight argument of every aten native_batch_norm call (the forward)."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith("native_batch_norm."):
            self.weights.append(args[1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("training", [True, False])
def test_slim_batch_norm_hands_batch_norm_a_weight_of_ones(training):
    # torch's CUDA backward for channels_last input returns an empty bias gradient when batch_norm
    # has no weight (Normalization.cuh allocates grad_bias only beside a weight): every Inception
    # v3 step stopped on an H200 with "NativeBatchNormBackward0 returned an invalid gradient at
    # index 2 - got [0]". The CPU kernels do not have that bug, so this checks what the CUDA one
    # would be handed; the beta gradient is checked against slim's (the sum of dy) as well.
    bn = SlimBatchNorm(3).train(training)
    x = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last).requires_grad_()
    dy = torch.randn(2, 3, 4, 4)
    with _BatchNormWeights() as seen:
        (bn(x) * dy).sum().backward()
    assert seen.weights
    assert all(isinstance(w, torch.Tensor) and torch.equal(w, torch.ones(3)) for w in seen.weights)
    torch.testing.assert_close(bn.bias.grad, dy.sum(dim=(0, 2, 3)))
    assert [n for n, _ in bn.named_parameters()] == ["bias"] and "weight" not in bn.state_dict()


def test_the_seed_model_has_beta_only_and_tfs_parameter_count():
    with torch.device("meta"):
        seed, gamma = Inception3(1000, bn_gamma=False), Inception3(1000, bn_gamma=True)
    assert not any(n.endswith("bn.weight") for n, _ in seed.named_parameters())
    assert sum(p.numel() for p in seed.parameters()) == 27_143_152  # TF slim's Inception v3, 1000 classes
    assert sum(p.numel() for p in gamma.parameters()) == 27_161_264  # torchvision's
    assert all(isinstance(m.bn, SlimBatchNorm) for m in seed.modules() if isinstance(m, BasicConv2d))
    assert all(isinstance(m.bn, nn.BatchNorm2d) for m in gamma.modules() if isinstance(m, BasicConv2d))


def test_the_trainer_builds_the_seed_network_unless_gamma_is_asked_for():
    cfg = make_config(recipe="inception_v3")
    assert cfg.inception_bn_gamma is False
    model = build_model(cfg)
    bns = [m.bn for m in model.modules() if isinstance(m, BasicConv2d)]
    assert len(bns) == 96 and all(isinstance(b, SlimBatchNorm) for b in bns)
    assert all(b.momentum == pytest.approx(0.0003) and b.eps == 0.001 for b in bns)
    with torch.device("meta"):
        gamma = create_model("inception_v3", 1001, inception_bn_gamma=True)
    assert isinstance(gamma.Conv2d_1a_3x3.bn, nn.BatchNorm2d)


def test_widths_are_the_seeds_and_the_depth_multiplier_scales_them():
    with torch.device("meta"):
        full = Inception3(1001, bn_gamma=False)
        small = Inception3(11, bn_gamma=False, depth_multiplier=SMALL)
    # slim/inception_model.py's comments: 35x35x256, x288, x288, 17x17x768 (x5), 8x8x1280, x2048 (x2)
    widths = [
        full.get_submodule(f"Mixed_{b}").out_channels for b in ("5b", "5c", "5d", "6a", "6e", "7a", "7c")
    ]
    assert widths == [256, 288, 288, 768, 768, 1280, 2048]
    assert full.fc.in_features == 2048 and full.AuxLogits.fc.in_features == 768
    # max(1, int(c / 32)): 32 -> 1, 64 -> 2, 192 -> 6; the block widths follow from the branches.
    assert small.Conv2d_1a_3x3.conv.out_channels == 1 and small.Conv2d_4a_3x3.conv.out_channels == 6
    assert (
        small.Mixed_5b.out_channels == 2 + 2 + 3 + 1 and small.fc.in_features == small.Mixed_7c.out_channels
    )


def test_padding_is_slims_valid_and_same():
    # slim: the stem is VALID except conv2 (SAME); in the blocks every stride-1 conv is SAME (odd
    # kernels: pad k // 2 each side) and every stride-2 conv VALID; the aux head's 5x5 is VALID.
    with torch.device("meta"):
        model = Inception3(1001, bn_gamma=False)
    valid = {"Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_3b_1x1", "Conv2d_4a_3x3", "AuxLogits.conv1"}
    for name, m in model.named_modules():
        if isinstance(m, BasicConv2d):
            kernel, stride, padding = m.conv.kernel_size, m.conv.stride, m.conv.padding
            same = tuple(k // 2 for k in kernel)
            want = (0, 0) if name in valid or stride == (2, 2) else same
            assert padding == want, name
    assert model.AuxLogits.conv1.conv.kernel_size == (5, 5) and model.AuxLogits.conv1.init_std == 0.01


def test_block_average_pools_leave_the_padding_out_as_tfs_same_avg_pool():
    out = _avg_pool_3x3(torch.ones(1, 1, 4, 4))
    torch.testing.assert_close(out, torch.ones(1, 1, 4, 4))  # counting the padding: 4/9 at corners


def test_endpoint_sizes_at_299_are_slims():
    model = Inception3(11, bn_gamma=False, depth_multiplier=SMALL).eval()
    sizes = {}
    names = ["Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3", "maxpool1", "Conv2d_3b_1x1", "Conv2d_4a_3x3"]
    names += ["maxpool2", "Mixed_5d", "Mixed_6a", "Mixed_6e", "Mixed_7a", "Mixed_7c", "AuxLogits.conv1"]
    for name in names:
        model.get_submodule(name).register_forward_hook(
            lambda m, i, o, n=name: sizes.__setitem__(n, o.shape[-1])
        )
    model.train()(torch.randn(2, 3, 299, 299))
    # slim/inception_model.py's comments: 149, 147, 147, 73, 73, 71, 35, 35, 17, 17, 8, 8; aux 1x1
    assert [sizes[n] for n in names] == [149, 147, 147, 73, 73, 71, 35, 35, 17, 17, 8, 8, 1]


def test_dropout_keeps_0_8_in_training_only_before_the_logits_layer():
    model = Inception3(11, bn_gamma=False, depth_multiplier=SMALL)
    assert model.dropout.p == pytest.approx(0.2)
    seen = []
    model.fc.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    x = torch.randn(2, 3, 299, 299)
    model.train()(x)
    assert (seen[-1] == 0).float().mean() > 0.05  # some of the 64 features dropped, the rest / 0.8
    model.eval()(x)
    assert (seen[-1] == 0).float().mean() < (seen[-2] == 0).float().mean()


def test_a_training_forward_reads_nothing_back_to_the_host():
    # On the meta device any .item() / bool(tensor) / CPU tensor mixed in fails: CUDA-graph safe.
    with torch.device("meta"):
        model = Inception3(11, bn_gamma=False, depth_multiplier=SMALL).train()
        logits, aux = model(torch.empty(2, 3, 299, 299))
    assert logits.shape == aux.shape == (2, 11)


def test_channels_last_training_matches_nchw_outputs_and_statistics():
    torch.manual_seed(0)
    a = Inception3(11, bn_gamma=False, depth_multiplier=SMALL).train()
    b = Inception3(11, bn_gamma=False, depth_multiplier=SMALL)
    b.load_state_dict(a.state_dict())
    b = b.to(memory_format=torch.channels_last).train()
    x = torch.randn(2, 3, 299, 299)
    torch.manual_seed(1)  # the same dropout mask for both
    out_a = a(x)
    torch.manual_seed(1)
    out_b = b(x.contiguous(memory_format=torch.channels_last))
    # float32, different summation orders of NCHW and NHWC convolutions: ~1e-6 of O(1) values.
    for u, v in zip(out_a, out_b):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-4)
    # The moving statistics of the last blocks, measured: up to 1e-5 apart with 2 intra-op threads and
    # 5e-5 (3e-4 of values ~0.15) with 1 (oneDNN's blocking, so the summation order, follows the thread
    # count, and ~15 layers compound it): 1e-3 relative + 1e-4 is twice that, and a layout bug (a wrong
    # permute or pool padding) moves them by O(0.1).
    for (name, u), v in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(u, v, rtol=1e-3, atol=1e-4, msg=name)

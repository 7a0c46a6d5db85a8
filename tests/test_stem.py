"""--pad_stem: the first convolution given its images with a fourth, zero channel (fasttrain.models.stem).

References: the convolution of the 3-channel input in float64 (F.conv2d, an independent computation),
the 3-channel model's own output and gradients, and the 3-channel step's training. The padded input is
the 3-channel one with zeros added, so every product the fourth channel adds is an exact zero and only
the order of the sums can differ: the bounds are fp32 rounding of sums of at most 4 x 7 x 7 = 196
products (conv1) or of a batch's gradients, far below what a wrong pad (the zero channel in front,
a non-zero fourth channel, the weight of another channel) changes.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from fasttrain.config import make_config
from fasttrain.data.normalize import normalize_images, pad_channels
from fasttrain.models import create_model
from fasttrain.models.stem import StemConv2d
from fasttrain.optim import FusedMomentum
from fasttrain.precision import Precision, resolve_precision
from fasttrain.schedule import LRSchedule
from fasttrain.step import TrainStep, classification_loss, model_input

CPU = torch.device("cpu")


def _conv(kernel, stride, padding, seed=0):
    torch.manual_seed(seed)
    return StemConv2d(3, 16, kernel, stride=stride, padding=padding, bias=False)


@pytest.mark.parametrize("kernel, stride, padding", [(7, 2, 3), (3, 2, 0)])  # ResNets', Inception's
@pytest.mark.parametrize("channels_last", [False, True])
def test_four_channels_convolve_like_three(kernel, stride, padding, channels_last):
    conv = _conv(kernel, stride, padding)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    conv = conv.to(memory_format=layout)
    x3 = torch.randn(2, 3, 33, 33, generator=torch.Generator().manual_seed(1)).to(memory_format=layout)
    x4 = pad_channels(x3, 4, channels_last)
    assert x4.shape[1] == 4 and bool((x4[:, 3] == 0).all())
    reference = F.conv2d(x3.double(), conv.weight.double(), stride=stride, padding=padding)
    grad_out = torch.randn(reference.shape, generator=torch.Generator().manual_seed(2))
    grads = []
    for x in (x3, x4):
        conv.zero_grad()
        y = conv(x)
        torch.testing.assert_close(y.double(), reference, rtol=1e-5, atol=1e-5)
        y.backward(grad_out)
        assert conv.weight.grad.shape == (16, 3, kernel, kernel)  # the parameter stays 3-channel
        grads.append(conv.weight.grad.clone())
    # The weight gradient against float64: sum over the batch and the output map of x * grad_out.
    expected = torch.nn.grad.conv2d_weight(
        x3.double(), conv.weight.shape, grad_out.double(), stride=stride, padding=padding
    )
    for grad in grads:
        torch.testing.assert_close(grad.double(), expected, rtol=1e-5, atol=1e-4)


def test_other_channel_counts_are_refused():
    conv = _conv(7, 2, 3)
    with pytest.raises(ValueError, match="takes 3 channels, or 4 with the last one zero; got 5"):
        conv(torch.zeros(1, 5, 16, 16))


@pytest.mark.parametrize("preprocess", ["resnet", "inception", "vgg"])
def test_normalize_pads_a_zero_fourth_channel(preprocess):
    images = torch.randint(
        0, 256, (3, 9, 7, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    for dtype in (torch.float32, torch.bfloat16):
        three = normalize_images(images, preprocess, dtype)
        four = normalize_images(images, preprocess, dtype, channels=4)
        assert four.shape == (3, 4, 9, 7) and four.dtype == dtype
        assert four.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(four[:, :3], three)  # bit for bit
        assert bool((four[:, 3] == 0).all())
    nchw = normalize_images(images, preprocess, channels_last=False, channels=4)
    assert nchw.is_contiguous() and bool((nchw[:, 3] == 0).all())
    assert torch.equal(nchw[:, :3], normalize_images(images, preprocess, channels_last=False))


def test_float_batches_are_padded_too():
    # DALI's float NHWC batches: the permute, then the zero channel.
    images = torch.randn(2, 8, 8, 3, generator=torch.Generator().manual_seed(0))
    policy = Precision("fp32", channels_last=True, cuda_graph=False, stem_channels=4)
    x = model_input(images, "resnet", policy)
    assert x.shape == (2, 4, 8, 8) and x.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(x[:, :3], images.permute(0, 3, 1, 2)) and bool((x[:, 3] == 0).all())


@pytest.mark.parametrize(
    "name, size, kwargs",
    [
        ("resnet18", 32, {"base_channels": 8}),
        ("resnet18_v2", 32, {"base_channels": 8}),
        ("inception_v3", 75, {"aux_logits": False}),
    ],
)
def test_each_model_takes_its_images_padded(name, size, kwargs):
    torch.manual_seed(0)
    model = create_model(name, 5, **kwargs).train()
    stem = model.Conv2d_1a_3x3.conv if name == "inception_v3" else model.conv1
    assert isinstance(stem, StemConv2d) and stem.weight.shape[1] == 3
    padded = copy.deepcopy(model)
    images = torch.randint(
        0, 256, (2, size, size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    outs = []
    for m, channels in ((model, 3), (padded, 4)):
        torch.manual_seed(2)  # Inception's dropout: the same mask
        out = m(normalize_images(images, "inception", channels=channels))
        logits = out[0] if isinstance(out, tuple) else out
        logits.square().sum().backward()
        outs.append(logits)
    # BatchNorm in train mode normalises by the batch's statistics: a rounding difference in the stem
    # stays a rounding difference (relative 1e-5 of fp32 sums through the net's depth).
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    for (key, a), b in zip(model.named_parameters(), padded.parameters()):
        assert a.grad.shape == b.grad.shape
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-4, msg=key)


def _train(stem_channels, steps=4):
    torch.manual_seed(0)
    model = create_model("resnet18", 5, base_channels=8)
    cfg = make_config(initial_learning_rate=0.05, learning_rate_decay_factor=1.0)
    opt = FusedMomentum(
        model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, ema_decay=None, impl="torch"
    )
    step = TrainStep(
        model,
        optimizer=opt,
        precision=Precision("fp32", channels_last=True, cuda_graph=False, stem_channels=stem_channels),
        device=CPU,
        schedule=LRSchedule(cfg, steps_per_epoch=100, global_batch=8, device=CPU),
        loss_fn=lambda out, y: classification_loss(out, y),
        preprocess="resnet",
    )
    gen = torch.Generator().manual_seed(3)
    seen = []
    model.conv1.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    for _ in range(steps):
        images = torch.randint(0, 256, (8, 32, 32, 3), dtype=torch.uint8, generator=gen)
        step([(images, torch.randint(0, 5, (8,), generator=gen))])
    return model, seen


def test_the_padded_step_trains_like_the_three_channel_one():
    three, seen3 = _train(3)
    four, seen4 = _train(4)
    assert set(seen3) == {3} and set(seen4) == {4}  # the step fed the stem 4 channels
    # 4 steps of a BN-heavy tiny net amplify last-bit differences (test_step.py measured 1e-7 after one
    # step, 1e-4 after six on this net): 1e-4 absolute still fails for any wrong pad (1e-1 and more).
    for (key, a), b in zip(three.state_dict().items(), four.state_dict().values()):
        if a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=key)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_a_cuda_policy_leaves_three_channels_unless_asked(monkeypatch, precision):
    # The 4-channel stem was bf16's default on CUDA; in the whole step on an H200 it gained nothing
    # (bench/results/2026-11-28-h200-third-run), so it is off unless --pad_stem asks for it. The
    # policy is resolved for a Hopper GPU without one: it reads the capability only.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    assert resolve_precision(make_config(precision=precision), cuda).stem_channels == 3
    assert resolve_precision(make_config(precision=precision, pad_stem=True), cuda).stem_channels == 4
    assert resolve_precision(make_config(precision=precision, pad_stem=False), cuda).stem_channels == 3


def test_the_cpu_policy_leaves_three_channels_unless_asked():
    assert resolve_precision(make_config(), CPU).stem_channels == 3
    assert resolve_precision(make_config(pad_stem=True), CPU).stem_channels == 4


@pytest.mark.gpu
def test_on_the_gpu_the_padded_stem_in_bf16_matches_float32():
    # cuDNN picks other kernels for 4 channels than for 3 (the point of it): both are checked against
    # the same convolution in float32 without TF32. bf16 keeps 8 bits of mantissa, so the inputs' and
    # weights' rounding alone moves each output by about 2^-8 of the sum of |x * w| it is made of:
    # the bound is 2% of the output's scale, far below what a wrong weight channel or a non-zero
    # fourth channel would move it (the size of the output itself).
    if not torch.cuda.is_bf16_supported(including_emulation=False):  # cuDNN: bf16 from sm_80
        pytest.skip("this GPU has no bf16 convolutions (fasttrain picks fp16 there, the stem unpadded)")
    cuda = torch.device("cuda")
    conv = _conv(7, 2, 3).to(cuda, memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(4)
    x3 = torch.randn(32, 3, 224, 224, generator=gen).to(cuda, memory_format=torch.channels_last)
    grad_out = torch.randn(32, 16, 112, 112, generator=gen).to(cuda, memory_format=torch.channels_last)
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = False, True
    try:
        conv.zero_grad()
        reference = conv(x3)
        reference.backward(grad_out)
        reference_grad = conv.weight.grad.clone()
        for x in (x3, pad_channels(x3, 4)):
            conv.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = conv(x.bfloat16())
            y.float().backward(grad_out)
            scale = reference.abs().max().item()
            assert (y.float() - reference).abs().max().item() <= 2e-2 * scale, x.shape[1]
            worst = (conv.weight.grad - reference_grad).abs().max().item()
            assert worst <= 2e-2 * reference_grad.abs().max().item(), x.shape[1]
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = flags

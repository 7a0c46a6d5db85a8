"""The selfcheck's optimizer and training-step checks, after the tests that prove the same on the CPU
in CI and on a GPU with `-m gpu`: tests/test_optim.py and test_chunked.py (the chunked and Triton
paths against the readable torch reference), tests/test_step.py (the eager step against torch SGD,
graph replay against eager, the fp16 overflow skip, no host sync in a replayed step).
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.nn.functional as F

from fasttrain.selfcheck.common import Context, Skip, batches, deterministic, needs_cuda, sync, train_step

# The test suite's tolerances (tests/test_rmsprop_tf.py, test_step.py): the paths compute in fp32 and
# differ only in rounding order; semantic slips move values by >= 1e-3.
ATOL, RTOL = 2e-6, 1e-6


# --- the optimizer: fast paths vs the readable reference ----------------------------------------


def _optimizer_run(kind: str, impl: str, device: torch.device, sizes, steps: int = 6):
    """`steps` updates (the 4th skipped by found_inf) of params of `sizes`; returns the optimizer."""
    from fasttrain.optim import FusedMomentum, FusedRMSPropTF

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(device)) for n in sizes]
    groups = [{"params": params[::2], "weight_decay": 4e-5}, {"params": params[1::2], "weight_decay": 0.0}]
    lr = torch.tensor(0.1, device=device)
    if kind == "rmsprop":
        opt = FusedRMSPropTF(groups, lr=lr, decay=0.9, momentum=0.9, eps=1.0, ema_decay=0.999, impl=impl)
    else:
        opt = FusedMomentum(groups, lr=lr, momentum=0.9, nesterov=True, ema_decay=0.999, impl=impl)
    scale = torch.tensor(0.37 / 1024, device=device)  # a loss scale's unscale and a non-power-of-two
    for i in range(steps):
        lr.fill_(0.1 * 0.8**i)
        for p in params:
            p.grad.copy_(torch.randn(p.shape, generator=gen).to(device) * 1024)
        skip = i == 3
        if skip:
            before = [b.clone() for b in _buffers(opt)]
            for p in params:
                p.grad.fill_(float("inf"))
        opt.step(grad_scale=scale, found_inf=torch.tensor(float(skip), device=device))
        if skip:
            for name, b, a in zip(_names(opt), before, _buffers(opt)):
                assert torch.equal(b, a), f"{kind} {opt.impl}: the skipped step changed {name}"
    return opt


def _names(opt) -> list[str]:
    return ["weights", *opt._buffers.keys(), "applied_steps"]


def _buffers(opt) -> list[torch.Tensor]:
    return [opt.flat.params, *opt._buffers.values(), opt.applied_steps]


def _compare_optimizers(impl: str, device: torch.device, sizes) -> str:
    worst = 0.0
    for kind in ("rmsprop", "momentum"):
        fast = _optimizer_run(kind, impl, device, sizes)
        reference = _optimizer_run(kind, "torch", device, sizes)
        assert fast.impl == impl, f"asked for {impl}, the optimizer dispatched to {fast.impl}"
        for name, a, b in zip(_names(fast), _buffers(fast), _buffers(reference)):
            torch.testing.assert_close(
                a, b, atol=ATOL, rtol=RTOL, msg=lambda m, n=name, k=kind: f"{k} {n}: {m}"
            )
            if a.is_floating_point():
                worst = max(worst, float((a - b).abs().max()))
    return (
        f"RMSProp-TF and Nesterov momentum + EMA, {sum(sizes)} params in {len(sizes)} tensors, 6 steps "
        f"with a skipped overflow step: every buffer within {ATOL:g}+{RTOL:g}x of the reference "
        f"(max diff {worst:.1e}), the skip bit-identical"
    )


def check_optimizer_chunked(ctx: Context) -> str:
    return _compare_optimizers("chunked", ctx.device, (1, 127, 1000, 40_003))


def check_optimizer_triton(ctx: Context) -> str:
    from fasttrain.kernels.common import HAVE_TRITON

    if not HAVE_TRITON:
        raise Skip("triton is not installed: the chunked torch path is used")
    if ctx.cuda:
        if torch.cuda.get_device_capability(ctx.device) < (7, 0):
            raise Skip("Triton does not support this GPU (sm < 70): the chunked torch path is used")
        return "compiled: " + _compare_optimizers("triton", ctx.device, (1, 127, 1000, 1_000_003))
    # On the CPU the kernels run in Triton's interpreter (NumPy): a few hundred elements, so seconds.
    with _env("TRITON_INTERPRET", "1"):
        return "interpreter (CPU): " + _compare_optimizers("triton", ctx.device, (1, 127, 300))


@contextlib.contextmanager
def _env(key: str, value: str):
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[key]
        else:
            os.environ[key] = old


# --- the training step ---------------------------------------------------------------------------


def _small_resnet(device, channels_last=False, seed=0, name="resnet18"):
    from fasttrain.models import create_model

    torch.manual_seed(seed)
    model = create_model(name, 5, base_channels=8 if device.type == "cpu" else 16).to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def check_eager_step(ctx: Context) -> str:
    # As tests/test_step.py: each step starts both sides from the same weights and momentum, so the
    # comparison is one step deep (a BN-heavy net amplifies last-bit rounding over free steps).
    from fasttrain.data.normalize import normalize_images
    from fasttrain.precision import Precision

    with deterministic():
        model = _small_resnet(ctx.device)
        reference = copy.deepcopy(model)
        step = train_step(model, Precision("fp32", channels_last=False, cuda_graph=False), ctx.device)
        sgd = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        tol = dict(rtol=2e-6, atol=1e-7) if not ctx.cuda else dict(rtol=1e-5, atol=1e-6)
        for images, labels in batches(4, ctx.device):
            step([(images, labels)])
            sgd.zero_grad()
            x = normalize_images(images, "resnet", torch.float32, False)
            F.cross_entropy(reference(x), labels, label_smoothing=0.1).backward()
            sgd.step()
            ours = step.optimizer.state_dict()["state"]
            for i, ((name, a), b) in enumerate(zip(model.named_parameters(), reference.parameters())):
                torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"{n}: {m}")
                momentum = sgd.state[b]["momentum_buffer"]
                torch.testing.assert_close(ours[i]["momentum_buffer"], momentum, **tol)
                b.data.copy_(a)
                momentum.copy_(ours[i]["momentum_buffer"])
    impl = step.optimizer.impl
    return f"ResNet-18 (tiny), 4 steps, optimizer {impl}: weights and momentum = torch.optim.SGD"


def _run_graphed(
    ctx: Context, graph: bool, steps: int, precision: str = "fp32", name: str = "resnet18", compile_mode=None
):
    from fasttrain.precision import Precision

    model = _small_resnet(ctx.device, channels_last=True, name=name)
    policy = Precision(precision, channels_last=True, cuda_graph=graph)
    step = train_step(model, policy, ctx.device, compile_mode=compile_mode)
    for batch in batches(steps, ctx.device, seed=1):
        step([batch])
    sync(ctx.device)
    return model, step


def check_graph_replay(ctx: Context) -> str:
    needs_cuda(ctx, "CUDA-graph capture and replay")
    for name in ("resnet18", "resnet18_v2"):  # v1.5 and the ResNet seed's pre-activation v2
        with deterministic():
            eager, _ = _run_graphed(ctx, graph=False, steps=10, name=name)
            graphed, step = _run_graphed(ctx, graph=True, steps=10, name=name)
        assert step.graph is not None, f"the {name} step was not captured"
        for (key, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
            if a.is_floating_point():
                torch.testing.assert_close(
                    a, b, rtol=1e-6, atol=1e-6, msg=lambda m, k=key, n=name: f"{n} {k}: {m}"
                )
    return (
        "ResNet-18 and ResNet-18 v2 (tiny), fp32 channels_last, 10 steps (3 eager warm-up, 1 capture, "
        "6 replays) = eager"
    )


def check_compiled_graph(ctx: Context) -> str:
    needs_cuda(ctx, "the compiled model inside the whole-step CUDA graph")
    from fasttrain.compile import why_not_compiled

    if why := why_not_compiled(ctx.device):
        raise Skip(why)
    with deterministic():
        eager, eager_step = _run_graphed(ctx, graph=False, steps=8, precision="bf16", compile_mode="default")
        graphed, step = _run_graphed(ctx, graph=True, steps=8, precision="bf16", compile_mode="default")
    assert step.graph is not None and step.compiled.active, "the compiled step was not captured"
    assert eager_step.compiled.active, "inductor did not compile the model here (it runs eagerly)"
    for (key, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
    return (
        f"ResNet-18 (tiny), bf16 channels_last, {len(step.compiled.regions)} regions compiled by inductor: "
        "8 steps in the CUDA graph (3 warm-up, 1 capture, 4 replays) = the same compiled step eagerly"
    )


def check_padded_stem(ctx: Context) -> str:
    """cuDNN's first convolution on 4 channels, the fourth zero (--pad_stem; fasttrain.models.stem),
    and on 3, each in the GPU's half precision against float32 without TF32 (tests/test_stem.py)."""
    needs_cuda(ctx, "cuDNN's convolution on a padded 4-channel input")
    from fasttrain.data.normalize import pad_channels
    from fasttrain.models.stem import StemConv2d
    from fasttrain.precision import default_precision

    # The GPU's half precision as fasttrain picks it (bf16 from sm_80; is_bf16_supported() would also
    # count bf16 emulated on older GPUs, where cuDNN has no bf16 convolutions).
    dtype = torch.bfloat16 if default_precision(ctx.device) == "bf16" else torch.float16
    torch.manual_seed(0)
    conv = StemConv2d(3, 64, 7, stride=2, padding=3, bias=False)
    conv = conv.to(ctx.device, memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(1)
    x3 = torch.randn(32, 3, 224, 224, generator=gen).to(ctx.device, memory_format=torch.channels_last)
    grad_out = torch.randn(32, 64, 112, 112, generator=gen).to(ctx.device, memory_format=torch.channels_last)
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = False, True
    try:
        reference = conv(x3)
        reference.backward(grad_out)
        reference_grad, conv.weight.grad = conv.weight.grad, None
        for x in (x3, pad_channels(x3, 4)):
            with torch.autocast("cuda", dtype=dtype):
                y = conv(x.to(dtype))
            y.float().backward(grad_out)
            # Half precision's rounding of inputs and weights alone: about 2^-8 of the output's scale.
            worst = (y.float() - reference).abs().max().item() / reference.abs().max().item()
            assert worst <= 2e-2, f"{x.shape[1]} channels: output off by {worst:.1e} of its scale"
            worst = (conv.weight.grad - reference_grad).abs().max().item() / reference_grad.abs().max().item()
            assert worst <= 2e-2, f"{x.shape[1]} channels: weight gradient off by {worst:.1e} of its scale"
            conv.weight.grad = None
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = flags
    name = str(dtype).rsplit(".", 1)[-1]
    return (
        f"ResNet's conv1 (batch 32, 224 px, channels_last) in {name} on 3 channels and on 4 (the fourth "
        "zero, --pad_stem): output and weight gradient within 2% of float32's scale"
    )


def check_bn_kernels(ctx: Context) -> str:
    """--bn_kernels triton: BatchNorm + residual add + ReLU in fasttrain's Triton kernels at ResNet-50's
    layer1 size in bf16, against torch's BatchNorm in float64 (tests/test_bn_kernels.py)."""
    needs_cuda(ctx, "this check of the Triton BatchNorm kernels")
    from fasttrain.kernels.batch_norm import bn_act
    from fasttrain.kernels.common import why_triton_cannot_run

    reason = why_triton_cannot_run(ctx.device)
    if reason:
        raise Skip(reason)
    gen = torch.Generator().manual_seed(0)
    shape, c = (32, 256, 56, 56), 256

    def tensor(*size):
        return torch.randn(*size, generator=gen).to(ctx.device)

    x, res, dy = (
        tensor(*shape).to(torch.bfloat16).contiguous(memory_format=torch.channels_last) for _ in range(3)
    )
    w, b = tensor(c), tensor(c)
    rm, rv = torch.zeros(c, device=ctx.device), torch.ones(c, device=ctx.device)
    leaves = [t.clone().requires_grad_() for t in (x, w, b, res)]
    y = bn_act(*leaves[:3], rm, rv, momentum=0.1, eps=1e-5, residual=leaves[3])
    got = [y, *torch.autograd.grad(y, leaves, dy)]
    ref_leaves = [t.double().requires_grad_() for t in (x, w, b, res)]
    ref_rm, ref_rv = torch.zeros_like(rm, dtype=torch.float64), torch.ones_like(rv, dtype=torch.float64)
    z = F.batch_norm(ref_leaves[0], ref_rm, ref_rv, ref_leaves[1], ref_leaves[2], True, 0.1, 1e-5)
    z = z + ref_leaves[3]
    # The ReLU's mask is the kernels' where it differs from float64's within rounding of 0 (a few of
    # the 25.7M inputs fall there; one moves its channel's gradient sums by a whole dy).
    mask = y.detach() > 0
    flipped = mask != (z > 0)
    near_zero = z.detach()[flipped].abs().max().item() if flipped.any() else 0.0
    assert near_zero <= 1e-5 * z.abs().max().item(), f"{int(flipped.sum())} ReLU masks differ away from 0"
    want = [torch.relu(z), *torch.autograd.grad(z, ref_leaves, dy.double() * mask)]
    # bf16 outputs (y, dx, dresidual) rounded to nearest: within 2^-9 of each value (2^-7 allowed), and
    # 2^-12 of the scale near 0; the fp32 gradient sums of 100,352 terms: 1e-4 of their scale.
    for name, a, e in zip(("y", "dx", "dweight", "dbias", "dresidual"), got, want):
        scale = e.abs().max().item()
        if a.dtype == torch.bfloat16:
            bad = ((a.double() - e).abs() > 2**-7 * e.abs() + 2**-12 * scale).sum().item()
            assert not bad, f"{name}: {bad} values off by more than 2^-7 of themselves"
        else:
            worst = (a.double() - e).abs().max().item() / scale
            assert worst <= 1e-4, f"{name} off by {worst:.1e} of its scale"
    for name, a, e in (("running_mean", rm, ref_rm), ("running_var", rv, ref_rv)):
        worst = (a.double() - e).abs().max().item() / e.abs().max().item()
        assert worst <= 1e-4, f"{name} off by {worst:.1e} of its scale"
    return (
        "BatchNorm + add + ReLU (batch 32, 256 x 56 x 56, bf16, channels_last) in the Triton kernels = "
        "torch's in float64: output, all 4 gradients and the running statistics"
    )


def check_fp16_overflow(ctx: Context) -> str:
    needs_cuda(ctx, "fp16 loss scaling under graph replay")
    model, step = _run_graphed(ctx, graph=True, steps=5, precision="fp16")
    skipped = step.scaler.skipped_steps.item()  # note: host read, outside the replayed step
    before = [p.detach().clone() for p in model.parameters()]
    step.scaler.scale.fill_(3e38)  # the scaled loss overflows: inf/NaN gradients everywhere
    step([batches(1, ctx.device, seed=7)[0]])
    sync(ctx.device)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), (
        "an overflow step changed weights"
    )
    assert step.scaler.skipped_steps.item() == skipped + 1, "the overflow step was not counted as skipped"
    scale = step.scaler.scale.item()  # note: host read, outside the replayed step
    assert abs(scale / 1.5e38 - 1) < 1e-6, f"loss scale {scale:.3g} after the overflow, not halved to 1.5e38"
    step.scaler.scale.fill_(1024.0)
    step([batches(1, ctx.device, seed=8)[0]])
    sync(ctx.device)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters())), (
        "the next step did not train"
    )
    return (
        "scale forced to 3e38 in a replayed fp16 step: weights unchanged, skip counted, scale halved; "
        "the next step trains"
    )


def check_no_host_sync(ctx: Context) -> str:
    needs_cuda(ctx, "torch.cuda.set_sync_debug_mode")
    _, step = _run_graphed(ctx, graph=True, steps=5)
    batch = batches(1, ctx.device, seed=9)[0]
    torch.cuda.set_sync_debug_mode("error")
    try:
        step([batch])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return "a replayed step ran under torch.cuda.set_sync_debug_mode('error')"

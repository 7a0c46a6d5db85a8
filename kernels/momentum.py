"""TensorFlow's MomentumOptimizer (= torch.optim.SGD, dampening 0) + L2 weight decay + EMA in one pass.

Per element, in float32 (g may be stored as fp32, fp16 or bf16; w, acc, ema are fp32):

    g   = g * grad_scale + weight_decay * w      # grad_scale folds 1/loss_scale and 1/world_size;
                                                 # the decay term is the gradient of TF's L2 loss
    acc = momentum * acc + g                     # acc starts at zeros
    w   = w - lr * acc                           # plain
    w   = w - lr * (g + momentum * acc)          # nesterov (TF use_nesterov=True, torch nesterov=True)
    ema = ema - ema_weight * (ema - w)           # ema_weight = 1 - d, see common.ema_one_minus_decay

This is torch.optim.SGD(momentum, dampening=0, weight_decay, nesterov) exactly: torch's first step
sets acc = g, which equals momentum * 0 + g.

Skip: when `found_inf` (0-d tensor) is nonzero, no element is read or written: every buffer stays
bit-identical. lr, grad_scale and found_inf may be 0-d device tensors read by the kernel, so a launch
needs no host sync and can be captured in a CUDA graph.

Memory traffic: reads w, g, acc, ema and writes w, acc, ema: 28 B/param with fp32 state (20 B without
EMA), the floor for this update.
"""

import torch

from .common import (
    check_args,
    check_triton_launch,
    f32,
    launches,
    lazy_jit,
    split_scalar,
    tl,
)


@lazy_jit
def _momentum_kernel(
    w_ptr, g_ptr, acc_ptr, ema_ptr,
    lr_ptr, lr_value, scale_ptr, scale_value, found_inf_ptr, ema_weight_ptr,
    momentum, weight_decay, numel,
    LR_FROM_PTR: tl.constexpr, SCALE_FROM_PTR: tl.constexpr, NESTEROV: tl.constexpr,
    CHECK_INF: tl.constexpr, HAS_EMA: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    # int64 offsets: a flat buffer may exceed 2^31 elements.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    limit = numel
    if CHECK_INF:
        # Skip by masking everything out: no loads, no stores, bit-identical buffers.
        limit = tl.where(tl.load(found_inf_ptr) == 0, numel, 0)
    mask = offsets < limit
    if LR_FROM_PTR:
        lr = tl.load(lr_ptr).to(tl.float32)
    else:
        lr = lr_value
    if SCALE_FROM_PTR:
        scale = tl.load(scale_ptr).to(tl.float32)
    else:
        scale = scale_value

    w = tl.load(w_ptr + offsets, mask=mask)
    g = tl.load(g_ptr + offsets, mask=mask).to(tl.float32)
    acc = tl.load(acc_ptr + offsets, mask=mask)

    g = g * scale + weight_decay * w
    acc = momentum * acc + g
    if NESTEROV:
        w = w - lr * (g + momentum * acc)
    else:
        w = w - lr * acc

    tl.store(w_ptr + offsets, w, mask=mask)
    tl.store(acc_ptr + offsets, acc, mask=mask)
    if HAS_EMA:
        ema_weight = tl.load(ema_weight_ptr)
        ema = tl.load(ema_ptr + offsets, mask=mask)
        tl.store(ema_ptr + offsets, ema - ema_weight * (ema - w), mask=mask)


def momentum_update(
    w: torch.Tensor,
    g: torch.Tensor,
    acc: torch.Tensor,
    ema: torch.Tensor | None,
    *,
    lr,
    momentum: float,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    grad_scale=None,
    found_inf: torch.Tensor | None = None,
    ema_weight: torch.Tensor | None = None,
) -> None:
    """One Triton launch: update w, acc (and ema) in place. All buffers are 1-D, contiguous, of
    equal length, on one device; lr and grad_scale are floats or 1-element tensors; found_inf is a
    1-element float tensor or None; ema_weight (`1 - d`) a 1-element fp32 tensor when ema is given.

    Runs as the custom op `torch.ops.fasttrain.momentum_update`, whose fake implementation lets it
    trace on the meta device, under FakeTensorMode and under torch.compile."""
    check_args("momentum", w, found_inf, ema_weight, g=g, acc=acc, ema=ema)
    lr_tensor, lr_value = split_scalar("lr", lr, w)
    scale_tensor, scale_value = split_scalar("grad_scale", 1.0 if grad_scale is None else grad_scale, w)
    _momentum_op(
        w, g, acc, ema, lr_tensor, lr_value, scale_tensor, scale_value, found_inf, ema_weight,
        float(momentum), bool(nesterov), float(weight_decay),
    )  # fmt: skip


@torch.library.custom_op("fasttrain::momentum_update", mutates_args=("w", "acc", "ema"))
def _momentum_op(
    w: torch.Tensor,
    g: torch.Tensor,
    acc: torch.Tensor,
    ema: torch.Tensor | None,
    lr: torch.Tensor | None,
    lr_value: float,
    grad_scale: torch.Tensor | None,
    grad_scale_value: float,
    found_inf: torch.Tensor | None,
    ema_weight: torch.Tensor | None,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
) -> None:
    check_triton_launch("momentum_update", w)
    for lo, hi, grid, options in launches(w.numel()):
        part = slice(lo, hi)
        _momentum_kernel[grid](
            w[part], g[part], acc[part], (w if ema is None else ema)[part],
            w if lr is None else lr, lr_value, w if grad_scale is None else grad_scale, grad_scale_value,
            w if found_inf is None else found_inf, w if ema_weight is None else ema_weight,
            momentum, weight_decay, hi - lo,
            LR_FROM_PTR=lr is not None, SCALE_FROM_PTR=grad_scale is not None, NESTEROV=nesterov,
            CHECK_INF=found_inf is not None, HAS_EMA=ema is not None,
            **options,
        )  # fmt: skip


@_momentum_op.register_fake
def _momentum_fake(*args) -> None:
    # In-place on its arguments, no outputs: tracing needs nothing but the signature.
    return None


def momentum_update_reference(
    w: torch.Tensor,
    g: torch.Tensor,
    acc: torch.Tensor,
    ema: torch.Tensor | None,
    *,
    lr,
    momentum: float,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    grad_scale=None,
    found_inf: torch.Tensor | None = None,
    ema_weight: torch.Tensor | None = None,
) -> None:
    """The specification: same arguments and semantics as `momentum_update`, in torch ops
    (several passes; runs anywhere, no host sync)."""
    check_args("momentum", w, found_inf, ema_weight, g=g, acc=acc, ema=ema)
    # Float hyperparameters are rounded to fp32 first, as the kernel receives them.
    g = g.to(torch.float32) * (1.0 if grad_scale is None else grad_scale) + f32(weight_decay) * w
    new_acc = f32(momentum) * acc + g
    step = g + f32(momentum) * new_acc if nesterov else new_acc
    new_w = w - lr * step
    updates = [(w, new_w), (acc, new_acc)]
    if ema is not None:
        updates.append((ema, ema - ema_weight * (ema - new_w)))
    for buffer, new in updates:
        # torch.where keeps the old bits exactly when found_inf is set.
        buffer.copy_(new if found_inf is None else torch.where(found_inf == 0, new, buffer))

"""TensorFlow's RMSProp (tf.compat.v1.train.RMSPropOptimizer) + L2 weight decay + EMA in one pass.

Per element, in float32 (g may be stored as fp32, fp16 or bf16; w, ms, mom, ema are fp32):

    g   = g * grad_scale + weight_decay * w      # grad_scale folds 1/loss_scale and 1/world_size;
                                                 # the decay term is the gradient of TF's L2 loss
    ms  = ms + (1 - decay) * (g * g - ms)        # TF's ApplyRMSProp form of decay*ms + (1-decay)*g^2;
                                                 # ms starts at ONES
    mom = momentum * mom + (g * lr) / sqrt(ms + eps)   # eps inside the sqrt, lr inside the momentum
    w   = w - mom
    ema = ema - ema_weight * (ema - w)           # ema_weight = 1 - d, see common.ema_one_minus_decay

How it differs from torch.optim.RMSprop: ms starts at 1 (torch: 0), eps is inside the sqrt (torch:
added to sqrt(ms)), lr scales the momentum input (torch: applied to the buffer), so an LR change
blends in gradually instead of rescaling the whole pending update. With eps = 1.0 these differ a lot.

Skip: when `found_inf` (0-d tensor) is nonzero, no element is read or written: every buffer stays
bit-identical. lr, grad_scale and found_inf may be 0-d device tensors read by the kernel, so a launch
needs no host sync and can be captured in a CUDA graph.

Memory traffic: reads w, g, ms, mom, ema and writes w, ms, mom, ema: 36 B/param with fp32 state
(32 B with a 16-bit gradient, 28 B without EMA), the floor for this update.
"""

import torch

from .common import (
    check_args,
    check_triton_launch,
    f32,
    interpreter_enabled,
    launches,
    lazy_jit,
    split_scalar,
    tl,
)


@lazy_jit
def _rmsprop_tf_kernel(
    w_ptr, g_ptr, ms_ptr, mom_ptr, ema_ptr,
    lr_ptr, lr_value, scale_ptr, scale_value, found_inf_ptr, ema_weight_ptr,
    decay, momentum, eps, weight_decay, numel,
    LR_FROM_PTR: tl.constexpr, SCALE_FROM_PTR: tl.constexpr,
    CHECK_INF: tl.constexpr, HAS_EMA: tl.constexpr, IEEE_PTX: tl.constexpr, BLOCK_SIZE: tl.constexpr,
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
    ms = tl.load(ms_ptr + offsets, mask=mask)
    mom = tl.load(mom_ptr + offsets, mask=mask)

    g = g * scale + weight_decay * w
    ms = ms + (1.0 - decay) * (g * g - ms)
    # Round-to-nearest sqrt and division, as torch and TensorFlow compute them (the fast
    # approximate forms would cost nothing here but break agreement with the reference). Compiled
    # for an NVIDIA GPU they are written as the PTX instructions themselves: Triton <= 3.5 lowers
    # sqrt_rn and div_rn through libdevice with flush-to-zero (sqrt.rn.ftz.f32), which turns
    # subnormal results to 0 where torch's CUDA kernels keep them. The interpreter runs the tl forms.
    if IEEE_PTX:
        root = tl.inline_asm_elementwise(
            "sqrt.rn.f32 $0, $1;", "=r,r", [ms + eps], dtype=tl.float32, is_pure=True, pack=1
        )
        update = tl.inline_asm_elementwise(
            "div.rn.f32 $0, $1, $2;", "=r,r,r", [g * lr, root], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        update = tl.div_rn(g * lr, tl.sqrt_rn(ms + eps))
    mom = momentum * mom + update
    w = w - mom

    tl.store(w_ptr + offsets, w, mask=mask)
    tl.store(ms_ptr + offsets, ms, mask=mask)
    tl.store(mom_ptr + offsets, mom, mask=mask)
    if HAS_EMA:
        ema_weight = tl.load(ema_weight_ptr)
        ema = tl.load(ema_ptr + offsets, mask=mask)
        tl.store(ema_ptr + offsets, ema - ema_weight * (ema - w), mask=mask)


def rmsprop_tf_update(
    w: torch.Tensor,
    g: torch.Tensor,
    ms: torch.Tensor,
    mom: torch.Tensor,
    ema: torch.Tensor | None,
    *,
    lr,
    decay: float,
    momentum: float,
    eps: float,
    weight_decay: float = 0.0,
    grad_scale=None,
    found_inf: torch.Tensor | None = None,
    ema_weight: torch.Tensor | None = None,
) -> None:
    """One Triton launch: update w, ms, mom (and ema) in place. All buffers are 1-D, contiguous,
    of equal length, on one device; lr and grad_scale are floats or 1-element tensors; found_inf is
    a 1-element float tensor or None; ema_weight (`1 - d`) a 1-element fp32 tensor when ema is given.

    Runs as the custom op `torch.ops.fasttrain.rmsprop_tf_update`, whose fake implementation lets
    it trace on the meta device, under FakeTensorMode and under torch.compile."""
    check_args("rmsprop_tf", w, found_inf, ema_weight, g=g, ms=ms, mom=mom, ema=ema)
    lr_tensor, lr_value = split_scalar("lr", lr, w)
    scale_tensor, scale_value = split_scalar("grad_scale", 1.0 if grad_scale is None else grad_scale, w)
    _rmsprop_tf_op(
        w, g, ms, mom, ema, lr_tensor, lr_value, scale_tensor, scale_value, found_inf, ema_weight,
        float(decay), float(momentum), float(eps), float(weight_decay),
    )  # fmt: skip


@torch.library.custom_op("fasttrain::rmsprop_tf_update", mutates_args=("w", "ms", "mom", "ema"))
def _rmsprop_tf_op(
    w: torch.Tensor,
    g: torch.Tensor,
    ms: torch.Tensor,
    mom: torch.Tensor,
    ema: torch.Tensor | None,
    lr: torch.Tensor | None,
    lr_value: float,
    grad_scale: torch.Tensor | None,
    grad_scale_value: float,
    found_inf: torch.Tensor | None,
    ema_weight: torch.Tensor | None,
    decay: float,
    momentum: float,
    eps: float,
    weight_decay: float,
) -> None:
    check_triton_launch("rmsprop_tf_update", w)
    ieee_ptx = not interpreter_enabled() and torch.version.hip is None  # PTX: NVIDIA GPUs only
    for lo, hi, grid, options in launches(w.numel()):
        part = slice(lo, hi)
        _rmsprop_tf_kernel[grid](
            w[part], g[part], ms[part], mom[part], (w if ema is None else ema)[part],
            w if lr is None else lr, lr_value, w if grad_scale is None else grad_scale, grad_scale_value,
            w if found_inf is None else found_inf, w if ema_weight is None else ema_weight,
            decay, momentum, eps, weight_decay, hi - lo,
            LR_FROM_PTR=lr is not None, SCALE_FROM_PTR=grad_scale is not None,
            CHECK_INF=found_inf is not None, HAS_EMA=ema is not None,
            IEEE_PTX=ieee_ptx, **options,
        )  # fmt: skip


@_rmsprop_tf_op.register_fake
def _rmsprop_tf_fake(*args) -> None:
    # In-place on its arguments, no outputs: tracing needs nothing but the signature.
    return None


def rmsprop_tf_update_reference(
    w: torch.Tensor,
    g: torch.Tensor,
    ms: torch.Tensor,
    mom: torch.Tensor,
    ema: torch.Tensor | None,
    *,
    lr,
    decay: float,
    momentum: float,
    eps: float,
    weight_decay: float = 0.0,
    grad_scale=None,
    found_inf: torch.Tensor | None = None,
    ema_weight: torch.Tensor | None = None,
) -> None:
    """The specification: same arguments and semantics as `rmsprop_tf_update`, in torch ops
    (several passes; runs anywhere, no host sync)."""
    check_args("rmsprop_tf", w, found_inf, ema_weight, g=g, ms=ms, mom=mom, ema=ema)
    # Float hyperparameters are rounded to fp32 first, as the kernel receives them.
    g = g.to(torch.float32) * (1.0 if grad_scale is None else grad_scale) + f32(weight_decay) * w
    new_ms = ms + (1.0 - f32(decay)) * (g * g - ms)
    new_mom = f32(momentum) * mom + (g * lr) / torch.sqrt(new_ms + f32(eps))
    new_w = w - new_mom
    updates = [(w, new_w), (ms, new_ms), (mom, new_mom)]
    if ema is not None:
        updates.append((ema, ema - ema_weight * (ema - new_w)))
    for buffer, new in updates:
        # torch.where keeps the old bits exactly when found_inf is set.
        buffer.copy_(new if found_inf is None else torch.where(found_inf == 0, new, buffer))

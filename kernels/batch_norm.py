"""Training BatchNorm (+ residual add) (+ ReLU) on channels_last activations, in 4 Triton passes.

What one call computes, for x of shape (N, C, H, W) in channels_last (viewed as M = N*H*W rows of C
contiguous channels), per channel c, in float32 for x in fp32, fp16 or bf16 (float64 for float64):

    mean  = sum_m x / M                      var = sum_m (x - mean)^2 / M       (biased, as BN normalises)
    a     = weight * rsqrt(var + eps)                                          (weight 1, bias 0 when None)
    z     = (x - mean) * a + bias (+ residual)   y = relu(z) or z              (y stored in x's dtype)
    running_mean = (1 - momentum) * running_mean + momentum * mean
    running_var  = (1 - momentum) * running_var  + momentum * var * M / (M - 1)

which is nn.BatchNorm2d in training mode (then `out += residual`, then ReLU), the block tail of ResNet
v1.5 and the BN + ReLU of the ResNet seed's v2. Backward, with g = dL/dy masked by the ReLU (z > 0):

    dbias   = sum_m g                        dweight = sum_m g * xhat,   xhat = (x - mean) * rsqrt(var + eps)
    dx      = weight * rsqrt(var + eps) * (g - dbias / M - xhat * dweight / M)
    dresidual = g

Passes over the activations (each a read or a write of one (M, C) tensor), the point of the kernels:

    forward:  statistics (read x) | apply (read x [, residual], write y)           3, or 4 with residual
    backward: sums (read dy, x [, y]; write g as dresidual) | dx (read dy or g, x; write dx)
                                                                                    5, or 7 with residual

8 without the residual (11 with), against 8 + the ReLU's 3 + the add's 3 for the same work in separate
eager kernels. Without a residual the ReLU mask is recomputed from x (z > 0, the same expression the
forward evaluated, compiled without FMA contraction in both kernels so that it rounds alike) instead of
read from y; with one, the mask is y > 0, as torch's ReLU backward reads it.

Statistics in one read, without E[x^2] - E[x]^2's cancellation: in each program every row slot of
its tile keeps a running (count, mean, M2) by Welford's update as the tiles go by; the slots, then
the programs' partials (in a small kernel per channel block), are merged by Chan et al.'s formula.

Runs on CUDA devices of compute capability >= 7.0 and, under TRITON_INTERPRET=1, on CPU tensors (how
CI tests it). NaN and inf pass through as in torch's ops (relu(NaN) is NaN), so the step's overflow
check still sees them. First derivatives only: a create_graph backward is refused. Float64 (the
tests' exact comparisons) computes in float64, but on a GPU Triton passes eps and momentum as float32
(about 1e-9 of the results); the interpreter keeps them double. `bn_act` is the entry point;
fasttrain/models/bn_act.py decides when it is used (--bn_kernels triton). Not measured on a GPU yet:
the launch geometry (batch_norm_layout.py) is a first guess.
"""

from __future__ import annotations

import torch

from .batch_norm_backward import _grad_sums_kernel, _grad_x_kernel
from .batch_norm_layout import _acc_dtype, _format, _Layout, _programs, _rows
from .common import check_triton_launch, lazy_jit, tl


@lazy_jit
def _stats_kernel(
    x_ptr, part_ptr, M, C, rows_per_prog,
    ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Program (p, cb): mean and M2 of rows [p * rows_per_prog, ...) for channel block cb, in
    part[p, 0, c] and part[p, 1, c] (the count follows from p). Each of the tile's BLOCK_M row slots
    keeps its own running count, mean and M2 (Welford's update, elementwise: no reduction across
    threads inside the loop); the slots are merged once at the end (Chan's pairwise formula)."""
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    start = pid_m.to(tl.int64) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, M)
    n = tl.zeros([BLOCK_M, 1], dtype=ACC)
    mean = tl.zeros([BLOCK_M, BLOCK_C], dtype=ACC)
    m2 = tl.zeros([BLOCK_M, BLOCK_C], dtype=ACC)
    for r in range(0, rows_per_prog, BLOCK_M):
        rows = start + r + tl.arange(0, BLOCK_M)
        rmask = rows < end
        x = tl.load(
            x_ptr + rows[:, None] * C + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0
        )
        x = x.to(ACC)
        valid = rmask[:, None].to(ACC)
        n = n + valid
        step = valid / tl.maximum(n, 1.0)  # 1/n for a row this tile has, 0 for one it has not
        delta = x - mean
        mean = mean + delta * step
        m2 = m2 + delta * (x - mean) * valid
    total = tl.maximum(tl.sum(n, axis=0), 1.0)  # (1,)
    pmean = tl.sum(n * mean, axis=0) / total
    dev = mean - pmean[None, :]
    pm2 = tl.sum(m2 + n * dev * dev, axis=0)
    base = part_ptr + pid_m.to(tl.int64) * 2 * C
    tl.store(base + cols, pmean, mask=cmask)
    tl.store(base + C + cols, pm2, mask=cmask)


@lazy_jit
def _merge_kernel(
    part_ptr, mean_ptr, invstd_ptr, rmean_ptr, rvar_ptr, var_ptr,
    P, M, C, rows_per_prog, momentum, eps,
    UPDATE_RUNNING: tl.constexpr, WRITE_VAR: tl.constexpr, ACC: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Per channel: merge the P partials BLOCK_P at a time (exact pairwise formulas), then mean,
    rsqrt(var + eps), the running statistics and (WRITE_VAR) the biased batch variance."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    n = tl.zeros([BLOCK_C], dtype=ACC)
    mean = tl.zeros([BLOCK_C], dtype=ACC)
    m2 = tl.zeros([BLOCK_C], dtype=ACC)
    for p0 in range(0, P, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        pmask = ps < P
        mask = pmask[:, None] & cmask[None, :]
        offs = ps.to(tl.int64)[:, None] * 2 * C + cols[None, :]
        pmean = tl.load(part_ptr + offs, mask=mask, other=0.0)
        pm2 = tl.load(part_ptr + offs + C, mask=mask, other=0.0)
        rows_left = M - ps.to(tl.int64) * rows_per_prog
        pn = tl.where(pmask, tl.minimum(rows_left, rows_per_prog), 0).to(ACC)
        nb = tl.sum(pn, axis=0)
        bmean = tl.sum(pn[:, None] * pmean, axis=0) / tl.maximum(nb, 1.0)
        dev = tl.where(mask, pmean - bmean[None, :], 0.0)
        bm2 = tl.sum(pm2 + pn[:, None] * dev * dev, axis=0)
        total = n + nb
        frac = nb / tl.maximum(total, 1.0)
        delta = bmean - mean
        mean = mean + delta * frac
        m2 = m2 + bm2 + delta * delta * n * frac
        n = total
    var = m2 / M
    if ACC == tl.float32:  # correctly rounded, as torch's 1 / sqrt (fp32 `/` and sqrt are approximate)
        invstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    else:  # float64's are IEEE
        invstd = 1.0 / tl.sqrt(var + eps)
    tl.store(mean_ptr + cols, mean, mask=cmask)
    tl.store(invstd_ptr + cols, invstd, mask=cmask)
    if WRITE_VAR:
        tl.store(var_ptr + cols, var, mask=cmask)
    if UPDATE_RUNNING:
        rmean = tl.load(rmean_ptr + cols, mask=cmask, other=0.0)
        rvar = tl.load(rvar_ptr + cols, mask=cmask, other=0.0)
        unbiased = m2 / (M - 1)
        tl.store(rmean_ptr + cols, (1.0 - momentum) * rmean + momentum * mean, mask=cmask)
        tl.store(rvar_ptr + cols, (1.0 - momentum) * rvar + momentum * unbiased, mask=cmask)


@lazy_jit
def _apply_kernel(
    x_ptr, res_ptr, y_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr, M, C,
    HAS_RES: tl.constexpr, RELU: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = (rows < M)[:, None] & cmask[None, :]
    offs = rows[:, None] * C + cols[None, :]
    mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0)
    a = tl.load(invstd_ptr + cols, mask=cmask, other=0.0)
    shift = tl.zeros([BLOCK_C], dtype=ACC)
    if HAS_W:
        a = a * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ACC)
    if HAS_B:
        shift = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(ACC)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(ACC)
    z = (x - mean[None, :]) * a[None, :] + shift[None, :]
    if HAS_RES:
        z = z + tl.load(res_ptr + offs, mask=mask, other=0.0).to(ACC)
    if RELU:
        z = tl.maximum(z, 0.0, propagate_nan=tl.PropagateNan.ALL)  # relu(NaN) = NaN, as torch's
    tl.store(y_ptr + offs, z.to(y_ptr.dtype.element_ty), mask=mask)


def _wb(weight, bias, stand_in):
    """The weight and bias pointers; `stand_in` for one that is None (never read then)."""
    return (stand_in if weight is None else weight), (stand_in if bias is None else bias)


def _has_wb(weight, bias) -> dict:
    return dict(HAS_W=weight is not None, HAS_B=bias is not None)


class _BNAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual, running_mean, running_var, momentum, eps, relu, batch_stats):
        # The kernels index channels_last rows; other layouts are copied in, and the outputs and the
        # gradients are handed back in the layout their tensor came in (a copy each: --bn_kernels is
        # for channels_last models, config_checks refuses it beside --no-channels_last).
        ctx.x_format = _format(x)
        ctx.res_format = None if residual is None else _format(residual)
        x = _rows(x)
        k = ctx.layout = _Layout(x)  # the backward launches at the same tiles
        M, C = k.M, k.C
        mean = torch.empty(C, **k.vector) if batch_stats is None else batch_stats[0]
        invstd = torch.empty(C, **k.vector)
        P, rows_per_prog = _programs(_stats_kernel, k, (x, invstd, M, C, k.tile_meta["BLOCK_M"]), k.tile_meta)
        part = torch.empty((P, 2, C), **k.vector)
        _stats_kernel[(P, k.cblocks)](x, part, M, C, rows_per_prog, **k.tile_meta)
        update = running_mean is not None
        merge_grid, merge_meta = k.merge(P)
        _merge_kernel[merge_grid](
            # Without running statistics their pointers are never read or written; `part` stands in
            # (not `mean`: the interpreter writes every tensor argument back, an alias of an output too).
            part, mean, invstd, running_mean if update else part, running_var if update else part,
            part if batch_stats is None else batch_stats[1], P, M, C, rows_per_prog, float(momentum),
            float(eps), UPDATE_RUNNING=update, WRITE_VAR=batch_stats is not None, **merge_meta,
        )  # fmt: skip
        res = None if residual is None else _rows(residual)
        y = torch.empty_like(x)
        wb = _wb(weight, bias, mean)
        _apply_kernel[k.tiles](
            x, x if res is None else res, y, mean, invstd, *wb, M, C,
            HAS_RES=res is not None, RELU=relu, **_has_wb(weight, bias), **k.tile_meta,
        )  # fmt: skip
        ctx.save_for_backward(x, y if res is not None else None, mean, invstd, weight, bias)
        ctx.relu, ctx.has_res = relu, res is not None
        return y.contiguous(memory_format=ctx.x_format)

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():  # create_graph=True: the kernels have no derivative of their own
            raise RuntimeError(
                "bn_act (--bn_kernels=triton) has no second derivative: use --bn_kernels=torch for "
                "double backward (create_graph=True)"
            )
        x, y, mean, invstd, weight, bias = ctx.saved_tensors
        dy = _rows(dy)
        k = ctx.layout
        g = torch.empty_like(x) if ctx.has_res else None  # the masked gradient, = dresidual
        wb, has_wb = _wb(weight, bias, mean), _has_wb(weight, bias)
        tensors = (dy, x, x if y is None else y, dy if g is None else g)
        vectors = (mean, invstd, *wb, k.M, k.C)  # after `part`, before rows_per_prog
        meta = dict(HAS_RES=ctx.has_res, RELU=ctx.relu, **has_wb, **k.tile_meta)
        stand_ins = (*tensors, invstd, *vectors, k.tile_meta["BLOCK_M"])  # for part, rows_per_prog
        P, rows_per_prog = _programs(_grad_sums_kernel, k, stand_ins, meta)
        part = torch.empty((P, 2, k.C), **k.vector)
        _grad_sums_kernel[(P, k.cblocks)](*tensors, part, *vectors, rows_per_prog, **meta)
        sums = part.sum(0) if P > 1 else part[0]
        dx = torch.empty_like(x)
        _grad_x_kernel[k.tiles](
            dy if g is None else g, x, dx, sums, mean, invstd, *wb, k.M, k.C,
            MASK_RELU=ctx.relu and not ctx.has_res, **has_wb, **k.tile_meta,
        )  # fmt: skip
        dweight = sums[1].clone() if weight is not None and ctx.needs_input_grad[1] else None
        dbias = sums[0].clone() if bias is not None and ctx.needs_input_grad[2] else None
        dx = dx.contiguous(memory_format=ctx.x_format)
        g = None if g is None else g.contiguous(memory_format=ctx.res_format)
        return dx, dweight, dbias, g, None, None, None, None, None, None


def bn_act(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    *,
    momentum: float,
    eps: float,
    residual: torch.Tensor | None = None,
    relu: bool = True,
    batch_stats: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Training-mode BatchNorm of x (N, C, H, W) with batch statistics, then `+ residual` (same shape
    and dtype as x) when given, then ReLU when `relu`. The running statistics (both given or both None)
    are updated in place as nn.BatchNorm2d updates them; `batch_stats` (mean, var), when given, receive
    the batch's mean and biased variance instead, for a module that keeps its own kind of average
    (Inception's slim batch norm; the mean buffer is kept for the backward: leave it unchanged). weight
    and bias are each a (C,) tensor or None (scale 1, shift 0). Every vector is float32 (float64 for a
    float64 x) and contiguous. Differentiable in x, weight, bias and residual. Equations in the module
    docstring."""
    check_triton_launch("bn_act", x, instead="--bn_kernels=torch")
    if x.dim() != 4:
        raise ValueError(f"bn_act: x must be (N, C, H, W), got shape {tuple(x.shape)}.")
    N, C, H, W = x.shape
    if N * H * W < 2:
        raise ValueError(f"bn_act: training needs more than one value per channel, got {tuple(x.shape)}.")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"bn_act: residual {tuple(residual.shape)} {residual.dtype} does not match x "
            f"{tuple(x.shape)} {x.dtype}."
        )
    vectors = {"weight": weight, "bias": bias, "running_mean": running_mean, "running_var": running_var}
    if batch_stats is not None:
        vectors.update(batch_mean=batch_stats[0], batch_var=batch_stats[1])
    for name, t in vectors.items():
        if t is None:
            continue
        if t.shape != (C,) or t.dtype != _acc_dtype(x) or not t.is_contiguous() or t.device != x.device:
            want = f"a contiguous {_acc_dtype(x)} ({C},) tensor on {x.device}"
            got = f"{tuple(t.shape)} {t.dtype} with strides {t.stride()} on {t.device}"
            raise ValueError(f"bn_act: {name} must be {want}, got {got}.")
    if (running_mean is None) != (running_var is None):
        raise ValueError("bn_act: running_mean and running_var come in a pair.")
    return _BNAct.apply(
        x, weight, bias, residual, running_mean, running_var, momentum, eps, relu, batch_stats
    )

"""The backward kernels of kernels/batch_norm.py (its docstring has the equations and the passes):

    _grad_sums_kernel  per program, the channel sums of g and g * xhat, where g is dL/dy masked by the
                       ReLU (recomputed from x, or read from y when a residual was added); with a
                       residual g is also written: it is the residual's gradient
    _grad_x_kernel     dx = a * (g - sum g / M - xhat * sum(g * xhat) / M), a = weight * invstd

Launched by batch_norm._BNAct.backward, with its geometry. Each kernel (here and in batch_norm.py)
spells out the same per-channel preamble (mean, a = weight * invstd, the bias): kernels built by
common.lazy_jit cannot call a shared @triton.jit helper (it would be frozen in one interpreter mode).
"""

from .common import lazy_jit, tl


@lazy_jit
def _grad_sums_kernel(
    dy_ptr, x_ptr, y_ptr, g_ptr, part_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr, M, C, rows_per_prog,
    HAS_RES: tl.constexpr, RELU: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """part[p, 0, c] = sum g, part[p, 1, c] = sum g * xhat over the program's rows; with a residual,
    g (the masked gradient, = dresidual) is also written."""
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0)
    invstd = tl.load(invstd_ptr + cols, mask=cmask, other=0.0)
    a = invstd
    shift = tl.zeros([BLOCK_C], dtype=ACC)
    if HAS_W:
        a = a * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ACC)
    if HAS_B:
        shift = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(ACC)
    start = pid_m.to(tl.int64) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, M)
    # Elementwise accumulators per row slot, summed across the slots once at the end.
    sum_g = tl.zeros([BLOCK_M, BLOCK_C], dtype=ACC)
    sum_gx = tl.zeros([BLOCK_M, BLOCK_C], dtype=ACC)
    for r in range(0, rows_per_prog, BLOCK_M):
        rows = start + r + tl.arange(0, BLOCK_M)
        mask = (rows < end)[:, None] & cmask[None, :]
        offs = rows[:, None] * C + cols[None, :]
        g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(ACC)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(ACC)
        if RELU:
            if HAS_RES:
                keep = tl.load(y_ptr + offs, mask=mask, other=0.0).to(ACC) > 0.0
            else:
                keep = (x - mean[None, :]) * a[None, :] + shift[None, :] > 0.0
            g = tl.where(keep, g, 0.0)
        if HAS_RES:
            tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), mask=mask)
        sum_g += g
        sum_gx += g * ((x - mean[None, :]) * invstd[None, :])
    base = part_ptr + pid_m.to(tl.int64) * 2 * C
    tl.store(base + cols, tl.sum(sum_g, axis=0), mask=cmask)
    tl.store(base + C + cols, tl.sum(sum_gx, axis=0), mask=cmask)


@lazy_jit
def _grad_x_kernel(
    g_ptr, x_ptr, dx_ptr, sums_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr, M, C,
    MASK_RELU: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """dx from g (masked here from dy when MASK_RELU, else already masked) and the channel sums."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = (rows < M)[:, None] & cmask[None, :]
    offs = rows[:, None] * C + cols[None, :]
    mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0)
    invstd = tl.load(invstd_ptr + cols, mask=cmask, other=0.0)
    a = invstd
    shift = tl.zeros([BLOCK_C], dtype=ACC)
    if HAS_W:
        a = a * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ACC)
    if HAS_B:
        shift = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(ACC)
    mean_g = tl.load(sums_ptr + cols, mask=cmask, other=0.0) / M
    mean_gx = tl.load(sums_ptr + C + cols, mask=cmask, other=0.0) / M
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(ACC)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(ACC)
    if MASK_RELU:
        g = tl.where((x - mean[None, :]) * a[None, :] + shift[None, :] > 0.0, g, 0.0)
    xhat = (x - mean[None, :]) * invstd[None, :]
    dx = a[None, :] * (g - mean_g[None, :] - xhat * mean_gx[None, :])
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)

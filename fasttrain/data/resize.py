"""TensorFlow 1.x `tf.image.resize_images` (align_corners=False), transcribed for NumPy images.

The seeds resize with TF1's kernels, which are not what Pillow, OpenCV or torch compute: no half-pixel
offset, no antialiasing when shrinking. For an output of size (S_h, S_w) from an input of (H, W), per
axis (float32, as TF: `scale = float(H) / float(S_h)`):

    bilinear  src = y * scale; y0 = floor(src); y1 = min(ceil(src), H - 1); t = src - y0
              top = tl + (tr - tl) * tx;  bottom = bl + (br - bl) * tx;  out = top + (bottom - top) * ty
    nearest   out = in[min(floor(y * scale), H - 1)]
    bicubic   Keys cubic with a = -0.75 at src = y * scale; taps floor(src) - 1 .. floor(src) + 2 clamped
              to the image; weights from a 1025-entry table indexed by lrintf(frac * 1024); columns
              interpolated vertically first, then the four column values horizontally
    area      out = sum over input cells of value * overlap(cell, [y * scale, (y + 1) * scale)) per
              axis, times 1 / (scale_h * scale_w); cells past the edge are clamped to it

Every kernel reads uint8 or float32 (H, W, C) arrays of any strides (a crop is a view, a left-right flip
a view with a negative stride), multiplies each input value by `in_scale` (1/255 reproduces
`convert_image_dtype`, which the Inception seed applies before resizing) and writes float32 into `out`
(S_h, S_w, C). The arithmetic is float32 in TF's order of operations, so the outputs equal TF's up to
the compiler's choices (tests/test_tf_images.py compares them with TensorFlow's own).

The kernels are compiled by numba on first use (about 1 s each, then cached on disk).
"""

from __future__ import annotations

import math

import numba
import numpy as np

_F32 = np.float32
METHODS = ("bilinear", "nearest", "bicubic", "area")
_JIT = dict(nogil=True, cache=True)


@numba.njit(**_JIT)
def _scale(in_size, out_size):
    return _F32(in_size) / _F32(out_size)


@numba.njit(**_JIT)
def _bilinear(src, in_scale, out, full_h, full_w, oy, ox):
    """Rows oy.. and columns ox.. of the (full_h, full_w) resize (ResNet eval keeps only a window)."""
    in_h, in_w, channels = src.shape
    out_h, out_w = out.shape[0], out.shape[1]
    sy, sx = _scale(in_h, full_h), _scale(in_w, full_w)
    x0 = np.empty(out_w, np.int64)
    x1 = np.empty(out_w, np.int64)
    tx = np.empty(out_w, np.float32)
    for x in range(out_w):
        s = _F32(x + ox) * sx
        f = math.floor(s)
        x0[x] = max(int(f), 0)
        x1[x] = min(int(math.ceil(s)), in_w - 1)
        tx[x] = s - _F32(f)
    for y in range(out_h):
        s = _F32(y + oy) * sy
        f = math.floor(s)
        y0, y1 = max(int(f), 0), min(int(math.ceil(s)), in_h - 1)
        ty = s - _F32(f)
        for x in range(out_w):
            for c in range(channels):
                tl = _F32(src[y0, x0[x], c]) * in_scale
                tr = _F32(src[y0, x1[x], c]) * in_scale
                bl = _F32(src[y1, x0[x], c]) * in_scale
                br = _F32(src[y1, x1[x], c]) * in_scale
                top = tl + (tr - tl) * tx[x]
                bottom = bl + (br - bl) * tx[x]
                out[y, x, c] = top + (bottom - top) * ty


@numba.njit(**_JIT)
def _nearest(src, in_scale, out):
    in_h, in_w, channels = src.shape
    out_h, out_w = out.shape[0], out.shape[1]
    sy, sx = _scale(in_h, out_h), _scale(in_w, out_w)
    for y in range(out_h):
        iy = min(int(math.floor(_F32(y) * sy)), in_h - 1)
        for x in range(out_w):
            ix = min(int(math.floor(_F32(x) * sx)), in_w - 1)
            for c in range(channels):
                out[y, x, c] = _F32(src[iy, ix, c]) * in_scale


_TABLE_SIZE = 1024


@numba.njit(**_JIT)
def _cubic_table():
    """TF's coefficient table for a = -0.75: [i, 0] for |d| in [0, 1), [i, 1] for |d| in [1, 2)."""
    a = _F32(-0.75)
    table = np.empty((_TABLE_SIZE + 1, 2), np.float32)
    for i in range(_TABLE_SIZE + 1):
        x = _F32(i * 1.0 / _TABLE_SIZE)
        table[i, 0] = ((a + _F32(2)) * x - (a + _F32(3))) * x * x + _F32(1)
        x = _F32(x + 1.0)
        table[i, 1] = ((a * x - _F32(5) * a) * x + _F32(8) * a) * x - _F32(4) * a
    return table


@numba.njit(**_JIT)
def _cubic_taps(out_size, in_size, scale, table):
    """(out_size, 4) clamped source indices and (out_size, 4) weights along one axis."""
    index = np.empty((out_size, 4), np.int64)
    weight = np.empty((out_size, 4), np.float32)
    for o in range(out_size):
        s = _F32(o) * scale
        base = int(math.floor(s))
        offset = int(np.rint(np.float32(s - _F32(base)) * _F32(_TABLE_SIZE)))  # lrintf
        weight[o, 0] = table[offset, 1]
        weight[o, 1] = table[offset, 0]
        weight[o, 2] = table[_TABLE_SIZE - offset, 0]
        weight[o, 3] = table[_TABLE_SIZE - offset, 1]
        for k in range(4):
            index[o, k] = min(in_size - 1, max(0, base - 1 + k))
    return index, weight


@numba.njit(**_JIT)
def _bicubic(src, in_scale, out):
    in_h, in_w, channels = src.shape
    out_h, out_w = out.shape[0], out.shape[1]
    table = _cubic_table()
    xi, xw = _cubic_taps(out_w, in_w, _scale(in_w, out_w), table)
    yi, yw = _cubic_taps(out_h, in_h, _scale(in_h, out_h), table)
    column = np.empty(4, np.float32)
    for y in range(out_h):
        for x in range(out_w):
            for c in range(channels):
                for k in range(4):
                    ix = xi[x, k]
                    column[k] = (
                        (_F32(src[yi[y, 0], ix, c]) * in_scale) * yw[y, 0]
                        + (_F32(src[yi[y, 1], ix, c]) * in_scale) * yw[y, 1]
                        + (_F32(src[yi[y, 2], ix, c]) * in_scale) * yw[y, 2]
                        + (_F32(src[yi[y, 3], ix, c]) * in_scale) * yw[y, 3]
                    )
                out[y, x, c] = (
                    column[0] * xw[x, 0] + column[1] * xw[x, 1] + column[2] * xw[x, 2] + column[3] * xw[x, 3]
                )


@numba.njit(**_JIT)
def _area_cell_scale(i, lo, hi, scale):
    """Overlap of input cell [i, i + 1) with the output cell [lo, hi) (TF's start/end scale rule)."""
    fi = _F32(i)
    if fi < lo:
        return scale if fi + _F32(1) > hi else fi + _F32(1) - lo
    return hi - fi if fi + _F32(1) > hi else _F32(1)


@numba.njit(**_JIT)
def _area(src, in_scale, out):
    in_h, in_w, channels = src.shape
    out_h, out_w = out.shape[0], out.shape[1]
    sy, sx = _scale(in_h, out_h), _scale(in_w, out_w)
    norm = _F32(1.0 / (sy * sx))
    x_start = np.empty(out_w, np.int64)
    x_end = np.empty(out_w, np.int64)
    x_first = np.empty(out_w, np.float32)
    x_last = np.empty(out_w, np.float32)
    for x in range(out_w):
        lo, hi = _F32(x) * sx, _F32(x + 1) * sx
        x_start[x], x_end[x] = int(math.floor(lo)), int(math.ceil(hi))
        x_first[x] = _area_cell_scale(x_start[x], lo, hi, sx)
        x_last[x] = _area_cell_scale(x_end[x] - 1, lo, hi, sx)
    for y in range(out_h):
        lo, hi = _F32(y) * sy, _F32(y + 1) * sy
        y_start, y_end = int(math.floor(lo)), int(math.ceil(hi))
        for x in range(out_w):
            for c in range(channels):
                total = _F32(0)
                for i in range(y_start, y_end):
                    row = min(in_h - 1, max(0, i))
                    ix = min(in_w - 1, max(0, x_start[x]))
                    line = (_F32(src[row, ix, c]) * in_scale) * x_first[x]
                    if x_start[x] + 1 != x_end[x]:
                        for j in range(x_start[x] + 1, x_end[x] - 1):
                            line += _F32(src[row, min(in_w - 1, max(0, j)), c]) * in_scale
                        ix = min(in_w - 1, max(0, x_end[x] - 1))
                        line += (_F32(src[row, ix, c]) * in_scale) * x_last[x]
                    total += line * _area_cell_scale(i, lo, hi, sy)
                out[y, x, c] = total * norm


_KERNELS = {"nearest": _nearest, "bicubic": _bicubic, "area": _area}


def resize(
    image: np.ndarray,
    out: np.ndarray,
    method: str = "bilinear",
    in_scale: float = 1.0,
    full_size: tuple[int, int] | None = None,
    offset: tuple[int, int] = (0, 0),
) -> np.ndarray:
    """TF1 resize_images(image * in_scale, out.shape[:2], method, align_corners=False) into `out`.

    image: (H, W, C) uint8 or float32, any strides; out: (S_h, S_w, C) float32, written and returned.
    full_size / offset (bilinear only): compute just the out-sized window at `offset` (top, left) of
    the resize to full_size, the same pixels as resizing to full_size and slicing.
    """
    if image.shape[0] < 1 or image.shape[1] < 1:
        raise ValueError(f"cannot resize an empty image of shape {image.shape}")
    if method == "bilinear":
        full_h, full_w = full_size or out.shape[:2]
        _bilinear(image, _F32(in_scale), out, full_h, full_w, offset[0], offset[1])
    elif full_size is not None:
        raise ValueError(f"a window of the resize is implemented for bilinear only, not {method}")
    else:
        _KERNELS[method](image, _F32(in_scale), out)
    return out


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel for the input types the pipelines use."""
    out = np.empty((2, 2, 3), np.float32)
    for dtype in (np.uint8, np.float32):
        image = np.zeros((3, 4, 3), dtype)
        for method in METHODS:
            resize(image, out, method)
            resize(image[:, ::-1], out, method)

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

Every kernel reads uint8 or float32 (H, W, 3) arrays of any strides (a crop is a view, a left-right flip
a view with a negative stride), multiplies each input value by `in_scale` (1/255 reproduces
`convert_image_dtype`, which the Inception seed applies before resizing) and writes float32 into `out`
(S_h, S_w, 3). The arithmetic is float32 in TF's order of operations, so the outputs equal TF's up to
the compiler's choices (tests/test_transforms_tf.py compares them with TensorFlow's own).

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
def _lerp_row(buf, start, in_scale, i0, i1, t, conv, dst):
    """dst[k] = TF's horizontal lerp, for flat output element k (x * 3 + c), of the source row whose
    W * 3 values start at buf[start].

    The row is first converted to float32 once (`conv`: a contiguous loop the compiler vectorises),
    then the lerp reads two floats per output element through flat indices: the same float operations
    as TF's per-pixel loop.
    """
    row = buf[start : start + conv.shape[0]]
    for j in range(conv.shape[0]):
        conv[j] = _F32(row[j]) * in_scale
    for k in range(i0.shape[0]):
        left = conv[i0[k]]
        right = conv[i1[k]]
        dst[k] = left + (right - left) * t[k]


@numba.njit(**_JIT)
def _bilinear(buf, row_stride, in_h, in_w, mirror, in_scale, out, flip, full_h, full_w, oy, ox):
    """Rows oy.. and columns ox.. of the (full_h, full_w) resize (ResNet eval keeps only a window).

    The (in_h, in_w, 3) image is row y's in_w * 3 values at buf[y * row_stride:] (`_flat_rows`),
    mirrored left-right when `mirror` (the ResNet seed flips before resizing); `flip` mirrors the output.
    Each source row's horizontal lerp is computed once and kept while the next output row needs it
    (TF computes it per output pixel: the same float operations, about half of them here).
    """
    out_h, out_w = out.shape[0], out.shape[1] // 3
    sy, sx = _scale(in_h, full_h), _scale(in_w, full_w)
    n = out_w * 3
    # Flat source element (column * 3 + channel) of each output element. Unsigned: numba then skips its
    # negative-index fix-up on every load of conv[i0[k]] (measured: the bilinear resize 1.4x as fast).
    i0 = np.empty(n, np.uint32)
    i1 = np.empty(n, np.uint32)
    tx = np.empty(n, np.float32)
    for x in range(out_w):
        s = _F32(x + ox) * sx
        f = math.floor(s)
        a, b, t = max(int(f), 0), min(int(math.ceil(s)), in_w - 1), s - _F32(f)
        if mirror:  # column a of the mirrored image is column in_w - 1 - a of the stored one
            a, b = in_w - 1 - a, in_w - 1 - b
        xo = out_w - 1 - x if flip else x
        for c in range(3):
            i0[3 * xo + c], i1[3 * xo + c], tx[3 * xo + c] = 3 * a + c, 3 * b + c, t
    conv = np.empty(in_w * 3, np.float32)
    top = np.empty(n, np.float32)
    bottom = np.empty(n, np.float32)
    top_row, bottom_row = -1, -1
    for y in range(out_h):
        s = _F32(y + oy) * sy
        f = math.floor(s)
        y0, y1 = max(int(f), 0), min(int(math.ceil(s)), in_h - 1)
        ty = s - _F32(f)
        if y0 == bottom_row and y0 != top_row:  # the previous bottom row is this row's top
            top, bottom = bottom, top
            top_row, bottom_row = bottom_row, top_row
        if y0 != top_row:
            _lerp_row(buf, y0 * row_stride, in_scale, i0, i1, tx, conv, top)
            top_row = y0
        if y1 != bottom_row:
            _lerp_row(buf, y1 * row_stride, in_scale, i0, i1, tx, conv, bottom)
            bottom_row = y1
        row = out[y]
        for k in range(n):
            row[k] = top[k] + (bottom[k] - top[k]) * ty


def _flat_rows(image: np.ndarray) -> tuple[np.ndarray, int, bool]:
    """(buf, row_stride, mirrored): `image` as a 1-D contiguous run of memory whose row y holds
    image's W * 3 values from buf[y * row_stride] on, read right to left when mirrored. No copy for
    a crop of a C-contiguous image or its left-right flip (what the pipelines pass)."""
    mirrored = image.strides[1] < 0
    if mirrored:
        image = image[:, ::-1]
    size = image.itemsize
    height, width = image.shape[:2]
    if (
        image.strides[2] != size
        or image.strides[1] != 3 * size
        or image.strides[0] % size
        or image.strides[0] < 0
    ):
        return np.ascontiguousarray(image).reshape(-1), width * 3, mirrored
    row_stride = image.strides[0] // size
    length = (height - 1) * row_stride + width * 3
    return np.lib.stride_tricks.as_strided(image, (length,), (size,)), row_stride, mirrored


@numba.njit(**_JIT)
def _nearest(src, in_scale, out, flip):
    in_h, in_w = src.shape[0], src.shape[1]
    out_h, out_w = out.shape[0], out.shape[1]
    sy, sx = _scale(in_h, out_h), _scale(in_w, out_w)
    columns = np.empty(out_w, np.int64)
    for x in range(out_w):
        columns[x] = min(int(math.floor(_F32(x) * sx)), in_w - 1)
    if flip:
        columns = columns[::-1].copy()
    for y in range(out_h):
        row = src[min(int(math.floor(_F32(y) * sy)), in_h - 1)]
        for x in range(out_w):
            for c in range(3):
                out[y, x, c] = _F32(row[columns[x], c]) * in_scale


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
def _bicubic(src, in_scale, out, flip):
    """Per output row: the vertical 4-tap sums of every source column any output reads, then the
    horizontal 4-tap sums of those (TF's order: column values first, then across them)."""
    in_h, in_w = src.shape[0], src.shape[1]
    out_h, out_w = out.shape[0], out.shape[1]
    table = _cubic_table()
    xi, xw = _cubic_taps(out_w, in_w, _scale(in_w, out_w), table)
    yi, yw = _cubic_taps(out_h, in_h, _scale(in_h, out_h), table)
    if flip:
        xi, xw = xi[::-1].copy(), xw[::-1].copy()
    needed = np.zeros(in_w, np.bool_)
    for x in range(out_w):
        for k in range(4):
            needed[xi[x, k]] = True
    column = np.empty((in_w, 3), np.float32)
    for y in range(out_h):
        r0, r1, r2, r3 = src[yi[y, 0]], src[yi[y, 1]], src[yi[y, 2]], src[yi[y, 3]]
        w0, w1, w2, w3 = yw[y, 0], yw[y, 1], yw[y, 2], yw[y, 3]
        for j in range(in_w):
            if needed[j]:
                for c in range(3):
                    column[j, c] = (
                        (_F32(r0[j, c]) * in_scale) * w0
                        + (_F32(r1[j, c]) * in_scale) * w1
                        + (_F32(r2[j, c]) * in_scale) * w2
                        + (_F32(r3[j, c]) * in_scale) * w3
                    )
        row = out[y]
        for x in range(out_w):
            a, b, d, e = xi[x, 0], xi[x, 1], xi[x, 2], xi[x, 3]
            v0, v1, v2, v3 = xw[x, 0], xw[x, 1], xw[x, 2], xw[x, 3]
            for c in range(3):
                row[x, c] = column[a, c] * v0 + column[b, c] * v1 + column[d, c] * v2 + column[e, c] * v3


@numba.njit(**_JIT)
def _area_cell_scale(i, lo, hi, scale):
    """Overlap of input cell [i, i + 1) with the output cell [lo, hi) (TF's start/end scale rule)."""
    fi = _F32(i)
    if fi < lo:
        return scale if fi + _F32(1) > hi else fi + _F32(1) - lo
    return hi - fi if fi + _F32(1) > hi else _F32(1)


@numba.njit(**_JIT)
def _area(src, in_scale, out, flip):
    """Per output row: for each source row it overlaps (in order), the weighted sums along x of every
    output column, accumulated with the row's weight (TF's order of additions per output pixel)."""
    in_h, in_w = src.shape[0], src.shape[1]
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
    if flip:
        x_start, x_end = x_start[::-1].copy(), x_end[::-1].copy()
        x_first, x_last = x_first[::-1].copy(), x_last[::-1].copy()
    total = np.empty((out_w, 3), np.float32)
    for y in range(out_h):
        lo, hi = _F32(y) * sy, _F32(y + 1) * sy
        total[:] = 0
        for i in range(int(math.floor(lo)), int(math.ceil(hi))):
            row = src[min(in_h - 1, max(0, i))]
            row_weight = _area_cell_scale(i, lo, hi, sy)
            for x in range(out_w):
                start, end = x_start[x], x_end[x]
                first, last = min(in_w - 1, max(0, start)), min(in_w - 1, max(0, end - 1))
                for c in range(3):
                    line = (_F32(row[first, c]) * in_scale) * x_first[x]
                    if start + 1 != end:
                        for j in range(start + 1, end - 1):
                            line += _F32(row[min(in_w - 1, max(0, j)), c]) * in_scale
                        line += (_F32(row[last, c]) * in_scale) * x_last[x]
                    total[x, c] += line * row_weight
        for x in range(out_w):
            for c in range(3):
                out[y, x, c] = total[x, c] * norm


_KERNELS = {"nearest": _nearest, "bicubic": _bicubic, "area": _area}


def resize(
    image: np.ndarray,
    out: np.ndarray,
    method: str = "bilinear",
    in_scale: float = 1.0,
    flip: bool = False,
    full_size: tuple[int, int] | None = None,
    offset: tuple[int, int] = (0, 0),
) -> np.ndarray:
    """TF1 resize_images(image * in_scale, out.shape[:2], method, align_corners=False) into `out`.

    flip: write the result mirrored left-right (flip_left_right after the resize, at no cost).
    image: (H, W, 3) uint8 or float32, any strides; out: (S_h, S_w, 3) float32, written and returned.
    full_size / offset (bilinear only): compute just the out-sized window at `offset` (top, left) of
    the resize to full_size, the same pixels as resizing to full_size and slicing.
    """
    if image.ndim != 3 or image.shape[2] != 3 or image.shape[0] < 1 or image.shape[1] < 1:
        raise ValueError(f"resize takes a non-empty (H, W, 3) image, got shape {image.shape}")
    if method == "bilinear":
        full_h, full_w = full_size or out.shape[:2]
        buf, row_stride, mirrored = _flat_rows(image)
        height, width = image.shape[:2]
        rows = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
        _bilinear(
            buf, row_stride, height, width, mirrored, _F32(in_scale), rows.reshape(out.shape[0], -1),
            flip, full_h, full_w, *offset,
        )  # fmt: skip
        if rows is not out:
            out[...] = rows
    elif full_size is not None:
        raise ValueError(f"a window of the resize is implemented for bilinear only, not {method}")
    else:
        _KERNELS[method](image, _F32(in_scale), out, flip)
    return out


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel for the input types the pipelines use."""
    out = np.empty((2, 2, 3), np.float32)
    for dtype in (np.uint8, np.float32):
        image = np.zeros((3, 4, 3), dtype)
        for method in METHODS:
            for flip in (False, True):
                resize(image, out, method, flip=flip)
                resize(image[:, ::-1], out, method, flip=flip)

"""The numba kernels of fasttrain.data.resize, TF1's resize_images one method a kernel (bilinear,
nearest, bicubic, area): each reads an image as (H, W * 3) rows (resize._flat_rows) and writes float32
rows, or uint8 rows rounded in its last pass (`_round`). resize.py's docstring states the equations
they compute, in TF's float32 order of operations.

How the kernels save work without changing a float operation: each converts only the source columns
its taps read, once per source row, in a vector loop; bilinear keeps a source row's horizontal lerps
while the next output row reads them; bicubic's vertical sums run over the run of columns read (a
vector loop); area's horizontal sums of a source row are computed once (TF: once per output row it
overlaps). Cost (bench/bench_kernels_cpu.py, one thread, the bench photos, uint8 out for ResNet 224,
float out for Inception 299): ResNet bilinear 0.13 ms; Inception bilinear 0.17, nearest 0.10, bicubic
0.38, area 0.35 ms. The horizontal taps are scalar loads: about 1.2 ns per pixel and source row.

The kernels are compiled by numba on first use (about 1 s each, then cached on disk).
"""

from __future__ import annotations

import math

import numba
import numpy as np

_F32 = np.float32
_JIT = dict(nogil=True, cache=True)


@numba.njit(**_JIT)
def _scale(in_size, out_size):
    return _F32(in_size) / _F32(out_size)


@numba.njit(nogil=True, cache=True, inline="always")
def _round(v, multiplier):
    """v * multiplier to the nearest uint8 level, clamped to [0, 255] (the conversion truncates: floor
    for the clamped, non-negative value); NaN becomes 0."""
    v = min(max(v * multiplier + _F32(0.5), _F32(0)), _F32(255.5))
    return np.uint8(min(np.int32(v), 255))


@numba.njit(**_JIT)
def _emit(row, y, fout, uout, multiplier):
    """Output row y = the float32 `row`, rounded into uout when uout has rows, else copied into fout."""
    if uout.shape[0] > 0:
        dst = uout[y]
        for k in range(row.shape[0]):
            dst[k] = _round(row[k], multiplier)
    else:
        fout[y, :] = row


@numba.njit(**_JIT)
def _convert(line, in_scale, conv):
    """conv = the values of `line` as float32 times in_scale (a vector loop)."""
    for j in range(conv.shape[0]):
        conv[j] = _F32(line[j]) * in_scale


@numba.njit(**_JIT)
def _lerp_row(line, in_scale, ia, ib, tx, conv, dst):
    """dst[3x + c] = TF's horizontal lerp of output pixel x, channel c, from the source row whose
    values (from the first column read) are `line`: left + (right - left) * tx.

    ia / ib are 3 x the taps' columns (from the first column read), unsigned: numba then skips its
    negative-index fix-up on every load of conv (measured: the bilinear resize 1.4x as fast).
    """
    _convert(line, in_scale, conv)
    k = np.uint32(0)
    one, two = np.uint32(1), np.uint32(2)
    for x in range(ia.shape[0]):
        a, b, t = ia[x], ib[x], tx[x]
        left0, left1, left2 = conv[a], conv[a + one], conv[a + two]
        dst[k] = left0 + (conv[b] - left0) * t
        dst[k + one] = left1 + (conv[b + one] - left1) * t
        dst[k + two] = left2 + (conv[b + two] - left2) * t
        k += np.uint32(3)


@numba.njit(**_JIT)
def _bilinear(rows, mirror, in_scale, fout, uout, multiplier, flip, full_h, full_w, oy, ox):
    """Rows oy.. and columns ox.. of the (full_h, full_w) resize (ResNet eval keeps only a window).

    The (in_h, in_w, 3) image is rows (in_h, in_w * 3) (`_flat_rows`),
    mirrored left-right when `mirror` (the ResNet seed flips before resizing); `flip` mirrors the output.
    Each source row's horizontal lerp is computed once and kept while the next output row needs it
    (TF computes it per output pixel: the same float operations, about half of them here); the vertical
    lerp and the rounding store are one loop when uout (rows, S_w * 3) has rows, else fout receives
    the floats.
    """
    in_h, in_w = rows.shape[0], rows.shape[1] // 3
    rounding = uout.shape[0] > 0
    out_h = uout.shape[0] if rounding else fout.shape[0]
    n = uout.shape[1] if rounding else fout.shape[1]
    out_w = n // 3
    sy, sx = _scale(in_h, full_h), _scale(in_w, full_w)
    ia = np.empty(out_w, np.int64)
    ib = np.empty(out_w, np.int64)
    tx = np.empty(out_w, np.float32)
    lo, hi = in_w - 1, 0  # the stored columns read
    for x in range(out_w):
        s = _F32(x + ox) * sx
        f = math.floor(s)
        a, b, t = max(int(f), 0), min(int(math.ceil(s)), in_w - 1), s - _F32(f)
        if mirror:  # column a of the mirrored image is column in_w - 1 - a of the stored one
            a, b = in_w - 1 - a, in_w - 1 - b
        xo = out_w - 1 - x if flip else x
        ia[xo], ib[xo], tx[xo] = a, b, t
        lo, hi = min(lo, a, b), max(hi, a, b)
    ua = np.empty(out_w, np.uint32)
    ub = np.empty(out_w, np.uint32)
    for x in range(out_w):
        ua[x], ub[x] = 3 * (ia[x] - lo), 3 * (ib[x] - lo)
    conv = np.empty(3 * (hi - lo + 1), np.float32)
    upper = np.empty(n, np.float32)
    lower = np.empty(n, np.float32)
    upper_row, lower_row = -1, -1
    for y in range(out_h):
        s = _F32(y + oy) * sy
        f = math.floor(s)
        y0, y1 = max(int(f), 0), min(int(math.ceil(s)), in_h - 1)
        ty = s - _F32(f)
        if y0 != upper_row:
            if y0 == lower_row:  # the previous lower row is this row's upper one
                upper, lower = lower, upper
                upper_row, lower_row = lower_row, upper_row
            else:
                _lerp_row(rows[y0, 3 * lo :], in_scale, ua, ub, tx, conv, upper)
                upper_row = y0
        if y1 != lower_row:
            _lerp_row(rows[y1, 3 * lo :], in_scale, ua, ub, tx, conv, lower)
            lower_row = y1
        if rounding:
            dst = uout[y]
            for k in range(n):
                dst[k] = _round(upper[k] + (lower[k] - upper[k]) * ty, multiplier)
        else:
            row = fout[y]
            for k in range(n):
                row[k] = upper[k] + (lower[k] - upper[k]) * ty


@numba.njit(**_JIT)
def _nearest(rows, mirror, in_scale, fout, uout, multiplier, flip):
    """A gather: output row y is source row min(floor(y * sy), H - 1), its columns likewise. Each
    source row read is converted once (a vector loop); an output row that reads the same source row
    as the one before is a copy of it."""
    in_h, in_w = rows.shape[0], rows.shape[1] // 3
    rounding = uout.shape[0] > 0
    out_h = max(uout.shape[0], fout.shape[0])
    n = max(uout.shape[1], fout.shape[1])
    out_w = n // 3
    sy, sx = _scale(in_h, out_h), _scale(in_w, out_w)
    columns = np.empty(out_w, np.uint32)  # 3 x the stored column of output pixel x
    for x in range(out_w):
        c = min(int(math.floor(_F32(x) * sx)), in_w - 1)
        columns[out_w - 1 - x if flip else x] = 3 * (in_w - 1 - c if mirror else c)
    conv = np.empty(3 * in_w, np.float32)
    row = np.empty(n, np.float32)
    one, two = np.uint32(1), np.uint32(2)
    previous = -1
    for y in range(out_h):
        r = min(int(math.floor(_F32(y) * sy)), in_h - 1)
        if r == previous:
            if rounding:
                uout[y, :] = uout[y - 1]
            else:
                fout[y, :] = fout[y - 1]
            continue
        previous = r
        _convert(rows[r], in_scale, conv)
        dst = row if rounding else fout[y]
        for x in range(out_w):
            a = columns[x]
            dst[3 * x], dst[3 * x + 1], dst[3 * x + 2] = conv[a], conv[a + one], conv[a + two]
        if rounding:  # a separate vector loop: rounding each value as it is gathered is 3x slower
            _emit(row, y, fout, uout, multiplier)


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
def _bicubic(rows, mirror, in_scale, fout, uout, multiplier, flip):
    """Per output row: the vertical 4-tap sums of the run of source columns the output reads, then
    the horizontal 4-tap sums of those (TF's order: column values first, then across them)."""
    in_h, in_w = rows.shape[0], rows.shape[1] // 3
    out_h = max(uout.shape[0], fout.shape[0])
    n = max(uout.shape[1], fout.shape[1])
    out_w = n // 3
    table = _cubic_table()
    xi, xw = _cubic_taps(out_w, in_w, _scale(in_w, out_w), table)
    yi, yw = _cubic_taps(out_h, in_h, _scale(in_h, out_h), table)
    if mirror:
        xi = in_w - 1 - xi
    lo = xi.min()
    taps = np.empty((out_w, 4), np.uint32)  # 3 x (column - lo), in output order
    weights = np.empty((out_w, 4), np.float32)
    for x in range(out_w):
        xo = out_w - 1 - x if flip else x
        for k in range(4):
            taps[xo, k], weights[xo, k] = 3 * (xi[x, k] - lo), xw[x, k]
    count = 3 * (xi.max() - lo + 1)
    column = np.empty(count, np.float32)
    row = np.empty(n, np.float32)
    one = np.uint32(1)
    for y in range(out_h):
        start = 3 * lo
        r0, r1 = rows[yi[y, 0], start : start + count], rows[yi[y, 1], start : start + count]
        r2, r3 = rows[yi[y, 2], start : start + count], rows[yi[y, 3], start : start + count]
        w0, w1, w2, w3 = yw[y, 0], yw[y, 1], yw[y, 2], yw[y, 3]
        for j in range(count):
            column[j] = (
                (_F32(r0[j]) * in_scale) * w0
                + (_F32(r1[j]) * in_scale) * w1
                + (_F32(r2[j]) * in_scale) * w2
                + (_F32(r3[j]) * in_scale) * w3
            )
        for x in range(out_w):
            a, b, d, e = taps[x, 0], taps[x, 1], taps[x, 2], taps[x, 3]
            v0, v1, v2, v3 = weights[x, 0], weights[x, 1], weights[x, 2], weights[x, 3]
            row[3 * x] = column[a] * v0 + column[b] * v1 + column[d] * v2 + column[e] * v3
            a, b, d, e = a + one, b + one, d + one, e + one
            row[3 * x + 1] = column[a] * v0 + column[b] * v1 + column[d] * v2 + column[e] * v3
            a, b, d, e = a + one, b + one, d + one, e + one
            row[3 * x + 2] = column[a] * v0 + column[b] * v1 + column[d] * v2 + column[e] * v3
        _emit(row, y, fout, uout, multiplier)


@numba.njit(**_JIT)
def _area_cell_scale(i, lo, hi, scale):
    """Overlap of input cell [i, i + 1) with the output cell [lo, hi) (TF's start/end scale rule)."""
    fi = _F32(i)
    if fi < lo:
        return scale if fi + _F32(1) > hi else fi + _F32(1) - lo
    return hi - fi if fi + _F32(1) > hi else _F32(1)


@numba.njit(**_JIT)
def _area_taps(out_w, in_w, sx, mirror, flip):
    """Per output pixel (in output order) the terms of TF's horizontal sum, in TF's order: the first
    cell times its overlap, the inner cells (times 1: the same float as adding the value), the last
    cell times its overlap; as (ptr, index = 3 x stored column, weight), pixel x's terms being
    ptr[x] .. ptr[x + 1] - 1. Cells past the edge are clamped to it."""
    ptr = np.empty(out_w + 1, np.int64)
    ptr[0] = 0
    for xo in range(out_w):
        x = out_w - 1 - xo if flip else xo
        lo, hi = _F32(x) * sx, _F32(x + 1) * sx
        start, end = int(math.floor(lo)), int(math.ceil(hi))
        ptr[xo + 1] = ptr[xo] + end - start
    index = np.empty(ptr[out_w], np.uint32)
    weight = np.empty(ptr[out_w], np.float32)
    for xo in range(out_w):
        x = out_w - 1 - xo if flip else xo
        lo, hi = _F32(x) * sx, _F32(x + 1) * sx
        start, end = int(math.floor(lo)), int(math.ceil(hi))
        p = ptr[xo]
        for j in range(start, end):
            c = min(in_w - 1, max(0, j))
            index[p] = 3 * (in_w - 1 - c if mirror else c)
            weight[p] = _F32(1)
            p += 1
        weight[ptr[xo]] = _area_cell_scale(start, lo, hi, sx)
        if start + 1 != end:
            weight[p - 1] = _area_cell_scale(end - 1, lo, hi, sx)
    return ptr, index, weight


@numba.njit(**_JIT)
def _area_row(line, in_scale, conv, ptr, index, weight, dst):
    """dst[3x + c] = TF's horizontal area sum of output pixel x, channel c, over the source row whose
    W * 3 values are `line`."""
    _convert(line, in_scale, conv)
    one, two = np.uint32(1), np.uint32(2)
    for x in range(ptr.shape[0] - 1):
        p = ptr[x]
        i, w = index[p], weight[p]
        line0, line1, line2 = conv[i] * w, conv[i + one] * w, conv[i + two] * w
        for q in range(p + 1, ptr[x + 1]):
            i, w = index[q], weight[q]
            line0 += conv[i] * w
            line1 += conv[i + one] * w
            line2 += conv[i + two] * w
        dst[3 * x], dst[3 * x + 1], dst[3 * x + 2] = line0, line1, line2


@numba.njit(**_JIT)
def _area(rows, mirror, in_scale, fout, uout, multiplier, flip):
    """Per output row: for each source row it overlaps (in order), the row's horizontal sums (computed
    once per source row, kept in a ring while later output rows overlap it) times the row's weight,
    accumulated (TF's order of additions per output pixel), then times 1 / (scale_h * scale_w)."""
    in_h, in_w = rows.shape[0], rows.shape[1] // 3
    out_h = max(uout.shape[0], fout.shape[0])
    n = max(uout.shape[1], fout.shape[1])
    out_w = n // 3
    sy, sx = _scale(in_h, out_h), _scale(in_w, out_w)
    norm = _F32(1.0 / (sy * sx))
    ptr, index, weight = _area_taps(out_w, in_w, sx, mirror, flip)
    conv = np.empty(3 * in_w, np.float32)
    ring = int(math.ceil(sy)) + 2  # more than the source rows one output row overlaps
    sums = np.empty((ring, n), np.float32)
    held = np.full(ring, -1, np.int64)  # the source row (unclamped) each slot holds
    total = np.empty(n, np.float32)
    for y in range(out_h):
        lo, hi = _F32(y) * sy, _F32(y + 1) * sy
        total[:] = 0
        for i in range(int(math.floor(lo)), int(math.ceil(hi))):
            slot = i % ring
            if held[slot] != i:
                _area_row(rows[min(in_h - 1, max(0, i))], in_scale, conv, ptr, index, weight, sums[slot])
                held[slot] = i
            row_weight = _area_cell_scale(i, lo, hi, sy)
            line = sums[slot]
            for k in range(n):
                total[k] += line[k] * row_weight
        for k in range(n):
            total[k] = total[k] * norm
        _emit(total, y, fout, uout, multiplier)

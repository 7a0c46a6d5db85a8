"""Skip the entropy decoding outside a crop window: per-image checkpoints and a doctored JPEG stream.

libjpeg-turbo decodes a crop window (fasttrain.data.jpeg.decode.decode_and_crop_jpeg) without IDCT outside
it and stops below it, but it must Huffman-decode every MCU above it and beside it in its rows: on
the bench's photos Huffman decoding is 64% of a full decode, and a resnet window's top is on average
19.5% down the image. This module removes most of that work, exactly (the same pixels), for baseline
JPEGs: 28% of the crop decode's CPU time for resnet windows, 36% for vgg windows on the bench's
baseline photos (bench/bench_jpeg_rows.py; 20% and 25% over all its photos, 10% being progressive).

Scope: sequential Huffman (SOF0/SOF1), 8-bit, one scan holding all components (1 or 3), no restart
interval or a restart after every MCU row (what encoders that restart at all write: all 25 such
photos of the bench's 600). Anything else (progressive, arithmetic, 12-bit, multi-scan, other restart
intervals, CMYK, corrupt or truncated data, default Huffman tables) gets None, and the caller decodes
as before.

Checkpoints (`row_checkpoints`, built once per image, fasttrain.data.jpeg.scan): where the MCUs
r * mcus + c * COLUMN_GROUP start in the entropy-coded data, to the bit, and the DC predictors there
(mcu_h = 8 * max vertical sampling pixel rows per MCU row). fasttrain.data.jpeg.row_index stores them.

Doctored stream (`doctor(jpeg, checkpoints, top, left, h, w)`) for a window whose top lies in MCU
row r0. The first original row kept is f = r0, or f = r0 - 1 when the window starts on row r0's first
line and a component is vertically subsampled: fancy upsampling (jdsample.c h2v2 / h1v2) makes an MCU
row's first output line from the last chroma row above it, and no other output line reads another
MCU row (likewise the row below the window is kept only when the window ends on a row's last line).
With f >= 1 the stream is

    SOI, the kept header segments (DQT, DHT, SOF, DRI, APP0, APP14; APP1-13/15 and COM are dropped,
    libjpeg ignores them) with SOF's height H - shift, shift = (f - 1) * mcu_h, SOS, then the entropy
    data: one synthetic MCU row, then the original data from MCU row f's checkpoint to the end,

so the new image's MCU rows 1, 2, ... are the original's f, f + 1, ..., and new_top = top - shift. The
synthetic MCUs' pixels are never output; a synthetic run must (a) leave each component's DC predictor
at the next checkpoint's value, DC_pred = sum of the DC diffs (JPEG F.2.1.3.1), and (b) be L bits
long with L = that checkpoint's bit (mod 8), so its last bits and the original byte there share one
byte and the rest is copied byte for byte. Every synthetic block is DC diff + EOB (AC symbol 0x00);
(a) puts the difference in the run's first block(s) and (b) adds up to 7 AC coefficients, symbol
(run, size) + size value bits, each adding its code length + size bits. Byte stuffing (0xFF -> 0xFF
0x00) applies to every written byte; the original's stuffed 0x00 after an 0xFF merge byte is dropped.

Column mode (the window narrower than the image): in each kept row only the checkpoint groups that
cover the MCU columns libjpeg's crop decodes stay real (jpeg_crop_scanline widens the window to whole
MCU columns, IDCTs only those and upsamples at their edges as at the image's, so the columns beside
them are entropy-decoded and never read), each group run a bit-spliced copy of the original; the
MCUs between consecutive groups (the rest of one row and the start of the next) are a synthetic run
as above; when the groups do not start at column 0, SOF's width is cut at the last group's right edge
(libjpeg upsamples the window's right edge as an image edge either way) and the runs are only the
MCUs left of the groups. The stream ends after the last kept row, with SOF's height cut there.
Column mode also serves f = 0: no synthetic row on top, shift 0.

With a restart after every MCU row the predictors restart at 0 and every row starts on a byte, right
after marker RST((r - 1) mod 8): row r's checkpoint is that byte, predictors 0. In row mode the
doctored stream then holds k = (f - 1) mod 8 + 1 synthetic rows (blocks of DC + EOB, 1-padded, RST0,
RST1, ... between them) and the original from the marker before row f on, shift = (f - k) * mcu_h, so
that marker's number, (f - 1) mod 8, is the one libjpeg expects after k rows. In column mode every
new row is its own interval, written whole (synthetic runs, the groups, 1-padding, the new image's
own RSTn; DRI set to the new row length).
"""

from __future__ import annotations

import threading

import numba
import numpy as np

from fasttrain.data.jpeg import decode as _jpeg
from fasttrain.data.jpeg.restart import columns_restart, doctor_restart
from fasttrain.data.jpeg.scan import (
    COLUMN_GROUP,
    HEADER_FIELDS,
    MAX_SEGMENTS,
    layout,
    parse_header,
    row_checkpoints,
)
from fasttrain.data.jpeg.synth import bitpos, put, run, scratch, splice, write_header

__all__ = ["decode_and_crop", "decode_window_rows", "doctor", "full_window_region", "row_checkpoints"]


@numba.njit(nogil=True, cache=True)
def _doctor(data, cp, top, left, h, w, out, group):
    """(size, new_top) of the doctored stream written to out (module docstring); size -1 when out of
    scope, -2 - needed bytes when out is too small."""
    hdr = np.zeros(HEADER_FIELDS, np.int64)
    keep = np.zeros((MAX_SEGMENTS, 2), np.int64)
    bits = np.zeros((8, 17), np.int64)
    vals = np.zeros((8, 256), np.int64)
    if not parse_header(data, hdr, keep, bits, vals):
        return -1, 0
    height, width, ns, hmax, vmax, start = hdr[0], hdr[1], hdr[3], hdr[4], hdr[5], hdr[6]
    mcu_h = 8 * vmax
    if h < 0:  # to the bottom
        h = height - top
    if w < 0:  # whole rows
        left, w = 0, width
    # The first original row kept: the window's top row r0, or r0 - 1 too when the window starts on
    # r0's first line and a component is vertically subsampled (fancy upsampling reads the chroma row
    # above it, jdsample.c h2v2 / h1v2_fancy_upsample; no other output row reads another MCU row).
    vsub = False
    for j in range(ns):
        vsub |= ns > 1 and hdr[9 + 4 * j] < vmax
    first = max(top // mcu_h - (top % mcu_h == 0 and vsub), 0)
    rows, mcus, cols, _, _ = layout(hdr, group)
    if cp.shape[0] != rows * cols or cp.shape[1] != 5 or top >= height or top + h > height:
        return -1, 0
    if left < 0 or w < 1 or left + w > width:
        return -1, 0
    if (np.int64(cp[0, 0]) & 0xFFFF) | ((np.int64(cp[0, 1]) & 0xFFFF) << 16) != start * 8:
        return -1, 0  # checkpoints of another image
    p = bitpos(cp, first * cols)
    src, bit = p >> 3, p & 7
    if src < start or src >= data.size:
        return -1, 0
    ecode = np.zeros((8, 256), np.int64)
    elen = np.zeros((8, 256), np.int64)
    for j in range(ns):
        for t in (hdr[10 + 4 * j], hdr[11 + 4 * j]):
            code, k = 0, 0
            for length in range(1, 17):
                for _ in range(bits[t, length]):
                    ecode[t, vals[t, k]], elen[t, vals[t, k]] = code, length
                    code += 1
                    k += 1
                code <<= 1
    # Blocks per component in one MCU row, and the DC plan of each component.
    per = np.ones(ns, np.int64)  # blocks per MCU by component (a 1-component scan's MCU is a block)
    if ns > 1:
        for j in range(ns):
            per[j] = hdr[8 + 4 * j] * hdr[9 + 4 * j]
    else:
        mcus *= hdr[9]  # the synthetic row of a v > 1 gray scan holds v block rows (cols is then 1)
    if hdr[20] and hdr[20] != mcus:
        return -1, 0
    synthetic = 1 if first else 0  # a synthetic MCU row on top, unless the window's rows start at 0
    shift = (first - synthetic) * mcu_h
    mcu_w = 8 if ns == 1 else 8 * hmax
    # Column mode: in the window's rows only the MCU columns libjpeg's crop decodes (jpeg_crop_scanline
    # widens the window to whole MCU columns and upsamples at its edges as at the image's) stay real,
    # widened to whole checkpoint groups; the rest become synthetic MCUs. Rows below the window (but
    # the one whose chroma the window's last line reads) are cut off with SOF's height.
    g0, g1 = 0, cols
    if cols > 1 and _tj_croppable(hdr):
        g0 = (left // mcu_w) // group
        g1 = min(((left + w + mcu_w - 1) // mcu_w + group - 1) // group, cols)
    last = (top + h - 1) // mcu_h
    if (top + h) % mcu_h == 0 and vsub and last + 1 < rows:
        last += 1
    kept = last - first + 1
    need = start + data.size + 16 * (kept + 2) * (mcus * 6 * 9 + 64) + 64
    if out.size < need:
        return -2 - need, 0
    dpred = np.zeros(3, np.int64)
    cur = np.zeros(3, np.int64)
    ws = scratch(hdr, elen)
    if hdr[20] and g0 == 0 and g1 == cols:
        if first < 1:
            return -1, 0
        return doctor_restart(data, cp, top, out, hdr, keep, ecode, elen, first, mcus, per, src, bit)
    if g0 == 0 and g1 == cols:  # whole rows: one synthetic row, then the original to the end
        if first < 1:
            return -1, 0  # nothing to drop
        for j in range(ns):
            dpred[j] = cp[first * cols, 2 + j]
        o = write_header(data, out, hdr, keep, height - shift, width, 0)
        o, acc, nacc = run(out, o, 0, 0, hdr, ecode, elen, per, mcus, dpred, bit, True, ws)
        if o < 0:
            return -1, 0
        o, acc, nacc = splice(out, o, acc, nacc, data, src * 8 + bit, data.size * 8)
        return o, top - shift
    # Checkpoints out of order or outside the data (a damaged sidecar) must not steer the copies.
    low = start * 8
    for r in range(first, last + 1):
        a = bitpos(cp, r * cols + g0)
        b = (
            data.size * 8
            if g1 == cols and r == rows - 1
            else bitpos(cp, r * cols + g1 if g1 < cols else (r + 1) * cols)
        )
        if not low <= a < b <= data.size * 8:
            return -1, 0
        low = b
    new_height = height - shift if last == rows - 1 else (kept + synthetic) * mcu_h
    # The image ends at the last real group's right edge (at or right of libjpeg's crop columns, the
    # window's right edge upsampled as an image edge either way), so no synthetic MCUs right of it;
    # but a row's first group needs a synthetic run before it, to bridge the predictors and bits.
    new_mcus = min(g1 * group, mcus) if g0 else mcus
    new_width = width if new_mcus == mcus else new_mcus * mcu_w
    o = write_header(data, out, hdr, keep, new_height, new_width, new_mcus)
    if hdr[20]:
        return columns_restart(
            data,
            cp,
            out,
            o,
            hdr,
            ecode,
            elen,
            per,
            ws,
            first,
            last,
            cols,
            g0,
            g1,
            group,
            new_mcus,
            synthetic,
            top - shift,
        )
    acc, nacc = np.int64(0), np.int64(0)
    for r in range(first, last + 1):
        begin = r * cols + g0
        for j in range(ns):
            dpred[j] = cp[begin, 2 + j] - cur[j]
        m = (synthetic * new_mcus if r == first else new_mcus - min(g1 * group, new_mcus)) + g0 * group
        if m:
            o, acc, nacc = run(
                out, o, acc, nacc, hdr, ecode, elen, per, m, dpred, bitpos(cp, begin) & 7, True, ws
            )
            if o < 0:
                return -1, 0
        elif dpred[0] or dpred[1] or dpred[2] or nacc != bitpos(cp, begin) & 7:
            return -1, 0
        if g1 == cols and r == rows - 1:  # the window reaches the image's last MCU: copy to the end
            o, acc, nacc = splice(out, o, acc, nacc, data, bitpos(cp, begin), data.size * 8)
            return o, top - shift
        end = r * cols + g1 if g1 < cols else (r + 1) * cols
        o, acc, nacc = splice(out, o, acc, nacc, data, bitpos(cp, begin), bitpos(cp, end))
        for j in range(ns):
            cur[j] = cp[end, 2 + j]
    if new_mcus > g1 * group:  # the rest of the last row: any DC, any length
        dpred[:] = 0
        o, acc, nacc = run(
            out, o, acc, nacc, hdr, ecode, elen, per, new_mcus - g1 * group, dpred, 0, False, ws
        )
        if o < 0:
            return -1, 0
    if nacc:
        o, acc, nacc = put(out, o, acc, nacc, (1 << (8 - nacc)) - 1, 8 - nacc)  # 1-bit padding
    out[o], out[o + 1] = 0xFF, 0xD9
    return o + 2, top - shift


@numba.njit(nogil=True, cache=True)
def _tj_croppable(hdr):
    """True for the samplings TurboJPEG crops (TJSAMP 444, 422, 420, GRAY, 440, 411, 441: luma h x v,
    chroma 1 x 1); it decodes any other whole, and then fancy upsampling at the window's edges reads
    the columns beside it, which must stay real."""
    if hdr[3] == 1:
        return True
    if hdr[12] * hdr[13] != 1 or hdr[16] * hdr[17] != 1:
        return False
    h, v = hdr[8], hdr[9]
    return h * v == 1 or (h == 2 and v <= 2) or (h == 1 and v in (2, 4)) or (h == 4 and v == 1)


_local = threading.local()


def read_only_views(jpeg, checkpoints: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(data, checkpoints) as read-only arrays, as `_doctor` and the fused kernels that call it are
    given them: one compiled kernel for bytes and writable record-buffer views, sidecar (read-only)
    and built checkpoints, the one the loaders' warm-up compiled (a writable one compiles anew)."""
    data = np.frombuffer(jpeg, np.uint8)
    data.flags.writeable = False
    checkpoints = checkpoints.view()
    checkpoints.flags.writeable = False
    return data, checkpoints


def doctor(jpeg, checkpoints: np.ndarray, top: int, left: int = 0, h: int = -1, w: int = -1):
    """(stream, new_top) or None: a JPEG whose window (new_top, left, h, w) decodes as the window
    (top, left, h, w) of `jpeg` (default: whole rows from top down), without the entropy data above
    the window or beside and below it (module docstring); None when there is nothing to drop (f = 0
    and the window spans every checkpoint group) or the tables cannot encode the synthetic MCUs.
    stream is this thread's reused buffer, valid until the thread's next call."""
    data, checkpoints = read_only_views(jpeg, checkpoints)
    out = getattr(_local, "buffer", None)
    if out is None:
        out = _local.buffer = np.empty(1 << 18, np.uint8)
    size, new_top = _doctor(data, checkpoints, top, left, h, w, out, COLUMN_GROUP)
    if size <= -2:
        out = _local.buffer = np.empty(max(-2 - size, 2 * out.size), np.uint8)
        size, new_top = _doctor(data, checkpoints, top, left, h, w, out, COLUMN_GROUP)
    if size < 0:
        return None
    return out[:size], new_top


def decode_and_crop(jpeg: bytes, checkpoints, window, file="", offset: int = 0) -> np.ndarray:
    """decode_and_crop_jpeg(jpeg, window)'s pixels, bit for bit, through a doctored stream when the
    checkpoints allow one (else, or if that decode fails, the usual path reports any problem)."""
    top, left, h, w = window
    doctored = None if checkpoints is None or _jpeg._turbo is None else doctor(jpeg, checkpoints, *window)
    if doctored is not None:
        try:
            return _jpeg._turbo.decode_window(doctored[0], doctored[1], left, h, w)
        except ValueError:
            pass
    return _jpeg.decode_and_crop_jpeg(jpeg, window, file, offset)


def decode_window_rows(jpeg: bytes, checkpoints, window, file="", offset: int = 0):
    """fasttrain.data.jpeg.decode.decode_window_rows(jpeg, window) ((rows, x), the same pixels), through a
    doctored stream when the checkpoints allow one."""
    top, left, h, w = window
    doctored = None if checkpoints is None or _jpeg._turbo is None else doctor(jpeg, checkpoints, *window)
    if doctored is not None:
        try:
            return _jpeg._turbo.decode_rows(doctored[0], doctored[1], left, h, w)
        except ValueError:
            pass
    return _jpeg.decode_window_rows(jpeg, window, file, offset)


def decode_full_window_rows(jpeg: bytes, checkpoints, window, width: int, file="", offset: int = 0):
    """(rows, x) as decode_window_rows (through the checkpoints when given), with decode_jpeg's pixels
    (the whole image's decode) in the window.

    A cropped decode upsamples chroma at its region's left and right edges as at an image edge, so it
    differs from the full decode in those columns of 4:2:x JPEGs. Here the region reaches one column past
    the window on each side where the image has one, which puts those columns outside the window. Rows
    need no margin: libjpeg-turbo decodes the rows around a cropped region, so the window's first and
    last rows see their true chroma neighbours. The Inception seed decodes the whole image and then
    slices its crop; this decodes only the crop (tests/test_transforms.py: equal to decode_jpeg's slice).
    """
    return decode_window_rows(jpeg, checkpoints, full_window_region(window, width), file, offset)


def full_window_region(window, width: int) -> tuple[int, int, int, int]:
    """The region decode_full_window_rows decodes for `window` (top, left, h, w) of a width-wide image:
    one column more on each side where the image has one."""
    top, left, h, w = window
    lo, hi = max(left - 1, 0), min(left + w + 1, width)
    return top, lo, h, hi - lo

"""The entropy-coded layout of a baseline JPEG: a marker parser and a Huffman walk (numba, nogil).

`row_checkpoints(jpeg)` walks every block of the scan (Huffman codes only: no dequantisation, no IDCT;
AC values are skipped, DC diffs summed) and records where MCU rows and groups of COLUMN_GROUP MCUs
start, for fasttrain.data.jpeg.doctor's doctored streams (its docstring gives the scope). The result,
an int16 array (rows * cols, 5): line r * cols + c for MCU c * COLUMN_GROUP of MCU row r (mcu_h = 8 *
max vertical sampling factor pixel rows; cols = ceil(MCUs per row / COLUMN_GROUP), or 1 with restart
for a 1-component scan whose MCU row is v > 1 block rows), see `layout`:

    p = uint16(c[i, 0]) | uint16(c[i, 1]) << 16   the MCU's first entropy-coded bit: byte p >> 3 of the
                                                 file (a data byte, never a stuffed 0x00), bit p & 7
                                                 counted from the most significant bit
    c[i, 2 + j]                                  component j's DC predictor there (scan order; 0 if absent)

With a restart marker after every row, row r >= 1 starts on the byte after RST((r - 1) mod 8) with
predictors 0. The walk follows libjpeg's decode_mcu (jdhuff.c): a code longer than 16 bits, data
running into a marker, a restart marker out of place, or anything but EOI after the last MCU makes the
image out of scope (libjpeg would warn; such a file is decoded without checkpoints). Walking
costs about 0.5 ms for a 62 kB photo (bench/bench_jpeg_rows.py).
"""

from __future__ import annotations

import numba
import numpy as np

MAX_SEGMENTS = 64
# MCUs between checkpoints within a row; passed to the numba code as an argument, because numba's
# cache of a module would keep a constant imported from another one after it changed.
COLUMN_GROUP = 4
HEADER_FIELDS = 32  # header summary fields, see parse_header


@numba.njit(nogil=True, cache=True)
def parse_header(data, hdr, keep, bits, vals):
    """Walk the markers up to the scan. Fills hdr (0 height, 1 width, 2 offset of SOF's height field,
    3 scan components, 4 hmax, 5 vmax, 6 entropy start, 7 kept segments, per scan component i at
    8 + 4 i: h, v, DC table, AC table, 20 restart interval, 21 its offset), keep (start, end) per
    kept segment, bits / vals (tables by class * 4 + id, bits[t, 0] = 1 when defined). False when out
    of scope."""
    n = data.size
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return False
    p, nkeep, nsof = 2, 0, 0
    ids = np.zeros(4, np.int64)
    hv = np.zeros(4, np.int64)
    while True:
        if p >= n or data[p] != 0xFF:
            return False
        while p < n and data[p] == 0xFF:
            p += 1
        if p + 2 >= n:
            return False
        m = data[p]
        start = p - 1
        length = (np.int64(data[p + 1]) << 8) | data[p + 2]
        seg, end = p + 3, p + 1 + length
        if length < 2 or end > n:
            return False
        kept = False
        if m == 0xC0 or m == 0xC1:
            nc = data[seg + 5] if length >= 8 else 0
            if nsof or data[seg] != 8 or (nc != 1 and nc != 3) or length != 8 + 3 * nc:
                return False
            nsof = nc
            hdr[0] = (np.int64(data[seg + 1]) << 8) | data[seg + 2]
            hdr[1] = (np.int64(data[seg + 3]) << 8) | data[seg + 4]
            hdr[2] = seg + 1
            if hdr[0] == 0 or hdr[1] == 0:  # height 0 means a DNL marker follows the scan
                return False
            for i in range(nc):
                ids[i] = data[seg + 6 + 3 * i]
                hv[i] = data[seg + 7 + 3 * i]
                if not (1 <= hv[i] >> 4 <= 4 and 1 <= hv[i] & 15 <= 4):
                    return False
            kept = True
        elif m == 0xC4:
            q = seg
            while q < end:
                tc, th = data[q] >> 4, data[q] & 15
                if tc > 1 or th > 3 or q + 17 > end:
                    return False
                t = tc * 4 + th
                total = 0
                for i in range(16):
                    bits[t, i + 1] = data[q + 1 + i]
                    total += data[q + 1 + i]
                if total > 256 or q + 17 + total > end:
                    return False
                for i in range(total):
                    vals[t, i] = data[q + 17 + i]
                bits[t, 0] = 1
                q += 17 + total
            kept = True
        elif m == 0xDB or m == 0xE0 or m == 0xEE:
            kept = True
        elif m == 0xDD:
            if length != 4:
                return False
            hdr[20] = (np.int64(data[seg]) << 8) | data[seg + 1]  # checked against the row length later
            hdr[21] = seg
            kept = True
        elif (0xE1 <= m <= 0xEF) or m == 0xFE:
            kept = False
        elif m == 0xDA:
            ns = data[seg]
            if nsof == 0 or ns != nsof or length != 6 + 2 * ns:
                return False
            if data[end - 3] != 0 or data[end - 2] != 63 or data[end - 1] != 0:
                return False
            hmax, vmax = 1, 1
            for i in range(nsof):
                hmax = max(hmax, hv[i] >> 4)
                vmax = max(vmax, hv[i] & 15)
            seen = 0
            for j in range(ns):
                cs, tt = data[seg + 1 + 2 * j], data[seg + 2 + 2 * j]
                found = -1
                for i in range(nsof):
                    if ids[i] == cs and not (seen >> i) & 1:
                        found = i
                if found < 0:
                    return False
                seen |= 1 << found
                td, ta = tt >> 4, tt & 15
                if td > 3 or ta > 3 or bits[td, 0] == 0 or bits[4 + ta, 0] == 0:
                    return False  # libjpeg would substitute its default tables: out of scope
                hdr[8 + 4 * j] = hv[found] >> 4
                hdr[9 + 4 * j] = hv[found] & 15
                hdr[10 + 4 * j] = td
                hdr[11 + 4 * j] = 4 + ta
            if ns == 1:  # a single-component scan is not interleaved: its MCU is one block
                hmax, vmax = hdr[8], hdr[9]
            hdr[3], hdr[4], hdr[5], hdr[6] = ns, hmax, vmax, end
            if nkeep >= MAX_SEGMENTS:
                return False
            keep[nkeep, 0], keep[nkeep, 1] = start, end
            hdr[7] = nkeep + 1
            return True
        else:  # SOF2/3/5-15 (progressive, lossless, arithmetic, hierarchical), DAC, DNL, unknown
            return False
        if kept:
            if nkeep >= MAX_SEGMENTS:
                return False
            keep[nkeep, 0], keep[nkeep, 1] = start, end
            nkeep += 1
        p = end


@numba.njit(nogil=True, cache=True)
def _derive(bits, vals, t, look, maxcode, valptr, ecode, elen):
    """Canonical codes of table t (JPEG C.2, libjpeg's jpeg_make_d_derived_tbl checks): a 9-bit lookup
    (len << 8 | symbol, 0 when longer), maxcode / valptr by length, and the encoder's code and length
    per symbol (length 0 = absent). False for a table libjpeg rejects."""
    code, k = 0, 0
    for i in range(256):
        elen[t, i] = 0
    for i in range(512):
        look[t, i] = 0
    for length in range(1, 17):
        count = bits[t, length]
        valptr[t, length] = k - code
        for _ in range(count):
            sym = vals[t, k]
            if t < 4 and sym > 15:
                return False
            ecode[t, sym], elen[t, sym] = code, length
            if length <= 9:
                lo = code << (9 - length)
                for j in range(lo, lo + (1 << (9 - length))):
                    look[t, j] = (length << 8) | sym
            code += 1
            k += 1
        maxcode[t, length] = code - 1 if count else -1
        if code >= (1 << length):  # an all-ones code: libjpeg's "Bogus Huffman table definition"
            return False
        code <<= 1
    return True


@numba.njit(nogil=True, cache=True, inline="always")
def _fill(data, n, pos, acc, nbits, fake):
    """Top the bit buffer up to > 56 bits, unstuffing 0xFF 0x00; at a marker or the file's end feed
    zero bytes (counted in fake) as libjpeg does."""
    while nbits <= 56:
        b = np.int64(data[pos]) if pos < n else 0xFF
        if b == 0xFF:
            if pos + 1 < n and data[pos + 1] == 0:
                pos += 2
            else:
                b = 0
                fake += 8
        else:
            pos += 1
        acc = (acc << 8) | b
        nbits += 8
    return pos, acc, nbits, fake


@numba.njit(nogil=True, cache=True, inline="always")
def _huff(acc, nbits, t, look, maxcode, valptr, vals):
    """(symbol, bits left) of the next code of table t; symbol -1 for a code no table holds."""
    e = look[t, (acc >> (nbits - 9)) & 511]
    if e:
        return e & 255, nbits - (e >> 8)
    length = 10
    code = (acc >> (nbits - 10)) & 1023
    while length <= 16 and code > maxcode[t, length]:
        length += 1
        code = (acc >> (nbits - length)) & ((1 << length) - 1)
    if length > 16:
        return -1, nbits
    return vals[t, valptr[t, length] + code], nbits - length


@numba.njit(nogil=True, cache=True)
def _position(data, pos, nbits, fake):
    """(byte, bit) of the next unconsumed bit; byte -1 when it lies past the real data."""
    real = nbits - fake
    if real <= 0:  # at the end of the real data (a marker follows), or past it
        return (pos, 0) if real == 0 else (-1, 0)
    q = pos
    for _ in range((real + 7) // 8):
        q -= 1
        if data[q] == 0 and q > 0 and data[q - 1] == 0xFF:
            q -= 1  # a stuffed zero: the data byte is the 0xFF before it
    return q, (8 - real % 8) % 8


@numba.njit(nogil=True, cache=True)
def layout(hdr, group):
    """(rows, mcus, cols, block_rows, last_rows): MCU rows, MCUs per row (a 1-component scan's MCU is
    one block, its row block_rows block rows, the last one last_rows), checkpoints per row."""
    height, width, ns, hmax, vmax = hdr[0], hdr[1], hdr[3], hdr[4], hdr[5]
    rows = (height + 8 * vmax - 1) // (8 * vmax)
    if ns == 1:
        mcus, block_rows = (width + 7) // 8, hdr[9]
        last_rows = (height + 7) // 8 - (rows - 1) * block_rows
    else:
        mcus = (width + 8 * hmax - 1) // (8 * hmax)
        block_rows, last_rows = 1, 1
    cols = 1 if block_rows > 1 else (mcus + group - 1) // group
    return rows, mcus, cols, block_rows, last_rows


@numba.njit(nogil=True, cache=True)
def _record(out, i, data, pos, nbits, fake, pred):
    """Checkpoint line i: the next bit's position and the predictors; False if out of range."""
    q, bit = _position(data, pos, nbits, fake)
    if q < 0:
        return False
    p = q * 8 + bit
    out[i, 0], out[i, 1] = np.int16(p & 0xFFFF), np.int16(p >> 16)
    for c in range(3):
        if pred[c] < -32768 or pred[c] > 32767:
            return False
        out[i, 2 + c] = pred[c]
    return True


@numba.njit(nogil=True, cache=True)
def _checkpoints(data, group):
    """(rows * cols, 5) int16 checkpoints (module docstring), or a (0, 5) array when out of scope."""
    none = np.zeros((0, 5), np.int16)
    hdr = np.zeros(HEADER_FIELDS, np.int64)
    keep = np.zeros((MAX_SEGMENTS, 2), np.int64)
    bits = np.zeros((8, 17), np.int64)
    vals = np.zeros((8, 256), np.int64)
    if data.size >= (1 << 29) or not parse_header(data, hdr, keep, bits, vals):
        return none
    look = np.zeros((8, 512), np.int64)
    maxcode = np.zeros((8, 17), np.int64)
    valptr = np.zeros((8, 17), np.int64)
    ecode = np.zeros((8, 256), np.int64)
    elen = np.zeros((8, 256), np.int64)
    for t in range(8):
        if bits[t, 0] and not _derive(bits, vals, t, look, maxcode, valptr, ecode, elen):
            return none
    ns = hdr[3]
    rows, mcus, cols, block_rows, last_rows = layout(hdr, group)
    if hdr[20] and hdr[20] != mcus * block_rows:
        return none  # restarts other than one per MCU row
    out = np.zeros((rows * cols, 5), np.int16)
    pred = np.zeros(3, np.int64)
    n = data.size
    pos, acc, nbits, fake = hdr[6], np.int64(0), np.int64(0), np.int64(0)
    for r in range(rows):
        if hdr[20] and r:  # skip the padding bits and RST(r - 1 mod 8); the predictors restart at 0
            q, bit = _position(data, pos, nbits, fake)
            if q < 0:
                return none
            if bit:
                q += 2 if data[q] == 0xFF else 1
            while q + 2 < n and data[q] == 0xFF and data[q + 1] == 0xFF:
                q += 1
            if q + 2 >= n or data[q] != 0xFF or data[q + 1] != 0xD0 + (r - 1) % 8:
                return none
            pos, acc, nbits, fake = q + 2, np.int64(0), np.int64(0), np.int64(0)
            pred[:] = 0
        for mx in range(mcus * (block_rows if r < rows - 1 else last_rows)):
            if mx % group == 0 and (mx == 0 or cols > 1):
                pos, acc, nbits, fake = _fill(data, n, pos, acc, nbits, fake)
                if not _record(out, r * cols + mx // group, data, pos, nbits, fake, pred):
                    return none
            for i in range(ns):
                dc, ac = hdr[10 + 4 * i], hdr[11 + 4 * i]
                nblocks = 1 if ns == 1 else hdr[8 + 4 * i] * hdr[9 + 4 * i]
                for _ in range(nblocks):
                    if nbits < 32:
                        pos, acc, nbits, fake = _fill(data, n, pos, acc, nbits, fake)
                    s, nbits = _huff(acc, nbits, dc, look, maxcode, valptr, vals)
                    if s < 0:
                        return none
                    if s:
                        v = (acc >> (nbits - s)) & ((1 << s) - 1)
                        nbits -= s
                        pred[i] += v if v >= (1 << (s - 1)) else v - (1 << s) + 1
                    k = 1
                    while k < 64:
                        if nbits < 32:
                            pos, acc, nbits, fake = _fill(data, n, pos, acc, nbits, fake)
                        rs, nbits = _huff(acc, nbits, ac, look, maxcode, valptr, vals)
                        if rs < 0:
                            return none
                        s = rs & 15
                        if s:
                            k += (rs >> 4) + 1
                            nbits -= s
                        elif rs == 0xF0:
                            k += 16
                        else:
                            break
    # The scan must end at EOI, in real data (libjpeg warns on truncation or extraneous bytes).
    q, bit = _position(data, pos, nbits, fake)
    if q < 0:
        return none
    if bit:
        q += 2 if data[q] == 0xFF else 1
    if q + 1 >= n or data[q] != 0xFF:
        return none
    while q < n and data[q] == 0xFF:
        q += 1
    if q >= n or data[q] != 0xD9:
        return none
    return out


def row_checkpoints(jpeg) -> np.ndarray | None:
    """(rows * cols, 5) int16 checkpoints of a baseline JPEG (module docstring), or None when out of scope."""
    out = _checkpoints(np.frombuffer(jpeg, np.uint8), COLUMN_GROUP)
    return out if out.shape[0] else None


def checkpoint_bits(rows: np.ndarray) -> np.ndarray:
    """(N,) int64: each checkpoint line's entropy-coded bit position (module docstring: columns 0 and 1
    hold its low and high 16 bits), for whole arrays of lines (_record writes them one at a time)."""
    return (rows[:, 0].astype(np.int64) & 0xFFFF) | ((rows[:, 1].astype(np.int64) & 0xFFFF) << 16)

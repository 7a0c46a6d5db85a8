"""Doctored streams for JPEGs with a restart marker after every MCU row (fasttrain.data.jpeg.doctor).

Every row is its own restart interval: the predictors restart at 0 and a row starts on a byte, after
marker RST((r - 1) mod 8), so no synthetic run has to reach a predictor or a bit offset across rows;
the markers' numbers must count on without a gap. fasttrain.data.jpeg.doctor's docstring gives both layouts.
"""

from __future__ import annotations

import numba
import numpy as np

from fasttrain.data.jpeg.synth import bitpos, copy_bytes, put, run, splice, write_header


@numba.njit(nogil=True, cache=True)
def doctor_restart(data, cp, top, out, hdr, keep, ecode, elen, first, mcus, per, src, bit):
    """_doctor for a JPEG with a restart marker after every MCU row (module docstring)."""
    height, ns, mcu_h = hdr[0], hdr[3], 8 * hdr[5]
    marker = src - 2
    if bit or data[marker] != 0xFF or data[marker + 1] != 0xD0 + (first - 1) % 8:
        return -1, 0
    k = (first - 1) % 8 + 1  # synthetic rows: the marker before row `first` must stay RST(k - 1 mod 8)
    row_bits = 0
    for j in range(ns):
        dc, ac = hdr[10 + 4 * j], hdr[11 + 4 * j]
        if elen[ac, 0] == 0:
            return -1, 0
        c = 0
        while c < 12 and elen[dc, c] == 0:
            c += 1
        if c == 12:
            return -1, 0
        row_bits += mcus * per[j] * (elen[dc, c] + c + elen[ac, 0])
    need = hdr[6] + k * (2 * (row_bits // 8) + 4) + data.size - marker
    if out.size < need:
        return -2 - need, 0
    shift = (first - k) * mcu_h
    o = write_header(data, out, hdr, keep, height - shift, hdr[1], hdr[20])
    for row in range(k):
        acc, nacc = np.int64(0), np.int64(0)
        for _ in range(mcus):
            for j in range(ns):
                dc, ac = hdr[10 + 4 * j], hdr[11 + 4 * j]
                c = 0
                while elen[dc, c] == 0:
                    c += 1
                for _ in range(per[j]):
                    o, acc, nacc = put(out, o, acc, nacc, ecode[dc, c], elen[dc, c])
                    o, acc, nacc = put(out, o, acc, nacc, (1 << c) - 1, c)  # any DC: it restarts
                    o, acc, nacc = put(out, o, acc, nacc, ecode[ac, 0], elen[ac, 0])
        if nacc:
            o, acc, nacc = put(out, o, acc, nacc, (1 << (8 - nacc)) - 1, 8 - nacc)  # 1-bit padding
        if row < k - 1:
            out[o], out[o + 1] = 0xFF, 0xD0 + row % 8
            o += 2
    copy_bytes(out, o, data, marker, data.size - marker)
    return o + data.size - marker, top - shift


@numba.njit(nogil=True, cache=True)
def columns_restart(
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
    new_top,
):
    """Column mode's entropy data for a JPEG with a restart after every MCU row (after the header at
    out[:o]): each new row one interval, the synthetic row (any DC), then per kept row a synthetic run
    to the first group's predictors, the groups, a synthetic rest (any DC), 1-padding and the next
    RSTn of the new image's own count; the original's markers are not copied. (size, new_top)."""
    rows = cp.shape[0] // cols
    dpred = np.zeros(3, np.int64)
    acc, nacc, interval = np.int64(0), np.int64(0), 0
    for r in range(first - synthetic, last + 1):
        if r >= first:
            a = bitpos(cp, r * cols + g0)
            for j in range(hdr[3]):
                dpred[j] = cp[r * cols + g0, 2 + j]  # from 0: the predictors restarted
            if g0:
                o, acc, nacc = run(
                    out, o, acc, nacc, hdr, ecode, elen, per, g0 * group, dpred, a & 7, True, ws
                )
                if o < 0:
                    return -1, 0
            elif a & 7 or dpred[0] or dpred[1] or dpred[2]:
                return -1, 0
            if g1 == cols and r == rows - 1:  # the image's last MCU: copy to the end (its EOI)
                o, acc, nacc = splice(out, o, acc, nacc, data, a, data.size * 8)
                return o, new_top
            if g1 < cols:
                b = bitpos(cp, r * cols + g1)
            else:  # to the original's marker after the row (its padding bits included)
                b = ((bitpos(cp, (r + 1) * cols) >> 3) - 2) * 8
            if b <= a:
                return -1, 0
            o, acc, nacc = splice(out, o, acc, nacc, data, a, b)
        rest = new_mcus if r < first else new_mcus - min(g1 * group, new_mcus)
        if rest:
            dpred[:] = 0
            o, acc, nacc = run(out, o, acc, nacc, hdr, ecode, elen, per, rest, dpred, 0, False, ws)
            if o < 0:
                return -1, 0
        if nacc:
            o, acc, nacc = put(out, o, acc, nacc, (1 << (8 - nacc)) - 1, 8 - nacc)  # 1-bit padding
        if r < last:
            out[o], out[o + 1] = 0xFF, 0xD0 + interval % 8
            o += 2
            interval += 1
    out[o], out[o + 1] = 0xFF, 0xD9
    return o + 2, new_top
